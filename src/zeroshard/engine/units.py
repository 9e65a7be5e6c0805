"""Stage 3: units whose weights live as 1/N slices and are gathered around their compute.

[Note: unit lifecycle]
A :class:`Unit` is a module (by default each block of the model's ``nn.ModuleList``; the
rest of the model forms the root unit) whose parameters live in flat buckets
(see [Note: flat buckets]). Between uses each rank keeps only its slice (``shard16``, in the
compute dtype). Around the unit's compute:

    forward:  pre-hook  -> unshard (all-gather; maybe already prefetched) and wait for it,
                           then prefetch the next unit; hook the inputs
              post-hook -> reshard (free) if reshard_after_forward, and hook the outputs
    backward: output-gradient hook -> unshard again if freed, wait
              first parameter gradient -> prefetch the next unit
              input-gradient hook (post-backward) -> reshard: every node that read the
              weights has run; then, once all its parameters' gradients have arrived
              (autograd leaves them on the parameters until then), copy them into one
              whole buffer and reduce-scatter it (without inputs that need gradients:
              once all gradients arrived, or at the end of backward if the unit has
              frozen weights, which no gradient tracks)

An all-gather fills a transient buffer in the gathered (rank-major) layout, which
``wait`` copies out into ``full`` (parameter-major, see [Note: flat buckets]) and frees.
On gloo, where an all-gather runs as N broadcasts, this rank's slice is broadcast from
``shard16`` where it lives and the buffer holds only the other ranks' slices ((N-1)/N of
one); the copy-out reads this rank's chunks from ``shard16``
(:meth:`Comm.all_gather_from`): a slice-sized copy less per gather
(benchmarks/tp-results.txt). The optimizer step first finishes any gather still in
flight (a forward that raised after a prefetch), so nothing writes ``shard16`` while it is sent
(``Engine.settle_gathers``). ``full`` is allocated once and its *storage* is resized to
zero to free it (``untyped_storage().resize_(0)``) and back to refill it, as FSDP does:
tensors autograd saved in forward (views of the weights, such as a transposed weight)
keep pointing at the same storage, which holds the right values again by the time
backward reads them. While sharded, the modules hold the user parameters (DTensor slices
of the masters, see [Note: parameters the user sees] in params.py), so user code that
touches them outside forward sees the true shapes and values, never freed memory.

The root unit is gathered at the root's forward and kept until the end of backward, since
the head is the first thing backward needs (FSDP2 treats its root the same way); it is
freed at the end of backward, or at the end of forward under ``torch.no_grad()``.

[Note: prefetch]
The first forward records the order units run in. Afterwards, entering unit i starts
the all-gathers of units i+1 … i+prefetch (asynchronously) once unit i's own gather is
done, and unit i's first parameter gradient in backward starts those of units
i-1 … i-prefetch. So at most ``prefetch`` gathers are in flight beyond the unit
computing, and unsharded weights never exceed (prefetch + 1) units + the root (+ units
kept by reshard_after_forward=False).

Why these moments (each measured: tests/test_peaks.py, docs/bench.md): a step's peak
is early in backward, where every activation is still alive. There, each unit holds
only what it must: its weights, one gather in flight (the unit's own gather buffer is
freed before the next one is started), the gradients produced so far (no whole-unit
buffer until the unit's backward is over and its weights are freed, FSDP2's order), and
the backward prefetch waits for the unit's first gradient, by which time its last layer
has freed what it saved. On the default bench this puts stage 3's peak 2.4% under
FSDP2's (reshard after forward).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from ..comm import Comm, Pending
from .auto_units import units_by_size, units_hint
from .flat import FlatBucket, cut_buckets
from .quantize import dequantize, quantize
from .secondary import secondary_to_full

__all__ = ["Unit", "UnitState", "build_units", "UnitSpec"]

UnitSpec = Sequence[nn.Module] | Callable[[nn.Module], bool] | None


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


class Unit:
    """One module's buckets and where they are in the gather/free cycle."""

    def __init__(self, name: str, module: nn.Module, buckets: list[FlatBucket],
                 is_root: bool) -> None:
        self.name = name
        self.module = module
        self.buckets = buckets
        self.is_root = is_root
        self.state = UnitState.SHARDED
        self.pending: list[Pending] = []
        self.in_backward = False  # prefetched for, or running, its backward
        self.inputs_hooked = False  # post-backward is signalled by its input gradients
        self.backward_done = False  # that signal came, in the current backward
        # (k, position in the block) while gathering from the secondary shards
        self.from_secondary: tuple[int, int] | None = None
        # the quantisation of the gather in flight and each bucket's own packed slice
        self.quantized: str | None = None
        self._own: list[torch.Tensor] = []
        # the quantisation of the weights ``full`` holds (None: exact), and of those the
        # secondary shard keeps ([Note: quantised weights] in quantize.py)
        self.holds: str | None = None
        self.secondary_holds: str | None = None

    @property
    def has_secondary(self) -> bool:
        """Its forward left a secondary shard ([Note: the secondary shard] in secondary.py)."""
        return bool(self.buckets) and all(b.secondary is not None for b in self.buckets)

    def drop_secondary(self) -> None:
        for b in self.buckets:
            b.secondary = None

    @property
    def trainable(self) -> list[FlatBucket]:
        return [b for b in self.buckets if b.requires_grad]

    @property
    def unsharded_bytes(self) -> int:
        return sum(b.padded_numel * b.full.element_size() for b in self.buckets)

    def unshard(self, comm: Comm, phase: str, async_op: bool,
                quantized: str | None = None) -> None:
        """Start gathering the whole weights (no-op unless sharded); ``quantized``: as
        int8 or fp8 blocks ([Note: quantised weights] in quantize.py)."""
        if self.state is not UnitState.SHARDED:
            return
        if quantized is not None and comm.size > 1:
            self._unshard_quantized(comm, phase, async_op, quantized)
            return
        for b in self.buckets:
            if comm.decompose and b.shard16.device == b.device and b.world > 1:
                # gloo: this rank's slice is broadcast from shard16 itself; only the
                # others' are received (see [Note: unit lifecycle]).
                b.gathering = torch.empty((b.world - 1) * b.shard_numel, dtype=b.full.dtype,
                                          device=b.device)
                self.pending.append(comm.all_gather_from(
                    b.shard16, b.gathering, phase=phase, unit=self.name, async_op=async_op))
                continue
            gathered = torch.empty(b.padded_numel, dtype=b.full.dtype, device=b.device)
            # From the host with offload="optimizer+params": non-blocking, on the stream
            # the all-gather waits for (see [Note: offload] in offload.py).
            b.shard_of(gathered).copy_(b.shard16, non_blocking=True)
            b.gathering = gathered
            self.pending.append(comm.all_gather(gathered, phase=phase, unit=self.name,
                                                async_op=async_op))
        self.state = UnitState.GATHERING

    def _unshard_quantized(self, comm: Comm, phase: str, async_op: bool, kind: str) -> None:
        for b in self.buckets:
            own = quantize(b.shard16.to(b.device, non_blocking=True), kind)
            p = own.numel()
            self._own.append(own)
            if comm.decompose:  # gloo: own broadcast from where it lives
                b.gathering = torch.empty((b.world - 1) * p, dtype=torch.uint8,
                                          device=b.device)
                self.pending.append(comm.all_gather_from(
                    own, b.gathering, phase=phase, unit=self.name, async_op=async_op))
                continue
            b.gathering = torch.empty(b.world * p, dtype=torch.uint8, device=b.device)
            b.gathering[b.rank * p:][:p].copy_(own)
            self.pending.append(comm.all_gather(b.gathering, phase=phase, unit=self.name,
                                                async_op=async_op))
        self.quantized = kind
        self.state = UnitState.GATHERING

    def unshard_secondary(self, block: Comm, phase: str, async_op: bool) -> None:
        """Start gathering the whole weights from the secondary shards of this rank's
        ``block`` (k ranks; see [Note: the secondary shard] in secondary.py)."""
        if self.state is not UnitState.SHARDED:
            return
        k, j = block.size, block.rank
        for b in self.buckets:
            own = b.secondary
            if block.decompose:  # gloo: own broadcast from where it lives, as unshard()
                b.gathering = torch.empty((k - 1) * own.numel(), dtype=own.dtype,
                                          device=own.device)
                self.pending.append(block.all_gather_from(
                    own, b.gathering, phase=phase, unit=self.name, async_op=async_op))
                continue
            b.gathering = torch.empty(k * own.numel(), dtype=own.dtype, device=own.device)
            b.gathering[j * own.numel():][:own.numel()].copy_(own)
            self.pending.append(block.all_gather(b.gathering, phase=phase, unit=self.name,
                                                 async_op=async_op))
        self.from_secondary = (k, j)
        self.quantized = self.secondary_holds  # the values the forward computed with
        self.state = UnitState.GATHERING

    def wait(self) -> None:
        """Finish the gathers and copy the weights out into ``full`` (the compute
        parameters' storage, refilled here: see [Note: flat buckets])."""
        for p in self.pending:
            p.wait()
        self.pending.clear()
        if self.state is not UnitState.GATHERING:
            return
        for i, b in enumerate(self.buckets):
            full = b.full
            full.untyped_storage().resize_(b.padded_numel * full.element_size())
            if self.quantized is not None and self.from_secondary is None:  # every slice
                own = self._own[i]
                rows = list(b.gathering.view(-1, own.numel()).unbind(0))
                if len(rows) < b.world:
                    rows.insert(b.rank, own)
                for q, row in enumerate(rows):
                    b.shard_to_full(dequantize(row, self.quantized, b.shard_numel,
                                               full.dtype), full, rank=q)
            elif self.from_secondary is not None:
                k, j = self.from_secondary
                members = list(b.gathering.view(-1, b.secondary.numel()).unbind(0))
                if len(members) < k:  # all_gather_from: this rank's is its secondary
                    members.insert(j, b.secondary)
                secondary_to_full(b, members, full)
            elif b.gathering.numel() == b.padded_numel:
                b.gathered_to_full(b.gathering, full)
            else:  # all_gather_from: this rank's slice is shard16
                b.slices_to_full(b.shard16, b.gathering, full)
            b.gathering = None
        self.holds = self.quantized
        self.from_secondary = self.quantized = None
        self._own = []
        self.state = UnitState.UNSHARDED

    def reshard(self) -> None:
        """Free the gathered weights; the slices stay."""
        if self.state is UnitState.SHARDED:
            return
        self.wait()
        for b in self.buckets:
            b.full.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED


def _unit_modules(model: nn.Module, spec: UnitSpec, rank: int = 0) -> list[nn.Module]:
    if spec is None:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
        if not lists:
            by_size = units_by_size(model, rank)  # see [Note: units by size]
            if by_size:
                return by_size
            raise ValueError(
                f"stage 3 found no nn.ModuleList of layers in {type(model).__name__} to use "
                "as units (the default), and too few parameter-holding modules to choose "
                f"two by size; pass units=, e.g. {units_hint(model)}, or a predicate "
                "(units=lambda m: False keeps the whole model as one unit)"
            )
        return list(lists[0])
    if callable(spec) and not isinstance(spec, nn.Module):
        return [m for m in model.modules() if m is not model and spec(m)]
    mods = list(spec)
    inside = set(model.modules())
    if not mods:
        raise ValueError("units= is empty; pass submodules (e.g. list(model.blocks)) or None")
    for m in mods:
        if not isinstance(m, nn.Module) or m not in inside:
            raise ValueError(
                f"units= contains {type(m).__name__}, which is not a submodule of the model; "
                "pass submodules of the model being sharded (e.g. list(model.blocks))"
            )
        if m is model:
            raise ValueError("units= must not contain the model itself; it is the root unit")
    return mods


def _check_disjoint(mods: list[nn.Module], names: dict[nn.Module, str]) -> None:
    for a in mods:
        for sub in a.modules():
            if sub is not a and any(sub is b for b in mods):
                raise ValueError(
                    f"units= overlap: {names[sub]!r} is inside {names[a]!r}; pass "
                    "units that do not contain each other (e.g. only the blocks)"
                )


def build_units(
    model: nn.Module, spec: UnitSpec, world: int, rank: int,
) -> list[Unit]:
    """Units in model order, the root last; each parameter owned by exactly one unit.

    A parameter reachable from two units (tied weights) is owned by their common parent,
    which for non-nested units is the root.
    """
    names = {m: n for n, m in model.named_modules()}
    mods = _unit_modules(model, spec, rank)
    _check_disjoint(mods, names)
    from ..checkpointing import region_size

    for m in mods:
        if region_size(m) > 1:
            raise ValueError(
                f"unit {names[m]!r} shares a 'sqrt' checkpoint segment with other "
                "blocks; at stage 3 a checkpoint region must not span several units. Use "
                "'full', 'every-k' or 'selective' checkpointing with stage 3"
            )
    owner: dict[nn.Parameter, int] = {}  # parameter -> index of the unit that owns it
    pnames: dict[nn.Parameter, list[str]] = {}  # in model order
    for n, p in model.named_parameters(remove_duplicate=False):
        pnames.setdefault(p, []).append(n)
    root = len(mods)
    for i, m in enumerate(mods):
        for p in m.parameters():
            owner[p] = i if owner.get(p, i) == i else root
    for p in pnames:
        owner.setdefault(p, root)
    units: list[Unit] = []
    index = 0
    for i, m in enumerate([*mods, model]):
        mine = [(tuple(names_of), p) for p, names_of in pnames.items() if owner[p] == i]
        name = names[m] or "root"
        buckets: list[FlatBucket] = []
        for trainable in (True, False):
            group = [(n, p) for n, p in mine if p.requires_grad == trainable]
            # One bucket per dtype: the unit's whole weights move in one collective each.
            for b in cut_buckets(group, 2**62, world, rank, index, f"{name}/"):
                b.requires_grad = trainable
                b.name = name if trainable else f"{name}(frozen)"
                buckets.append(b)
            index += len(buckets)
        # The root unit always exists, with no parameters if the units hold them all: the
        # engine gathers it around the whole forward (forward.py's root hooks), which must
        # not fall to the last unit.
        if buckets or m is model:
            units.append(Unit(name, m, buckets, is_root=m is model))
    return units


def iter_buckets(units: Iterable[Unit]) -> Iterable[FlatBucket]:
    for u in units:
        yield from u.buckets
