"""Flat, padded buffers: the unit of communication.

[Note: flat buckets]
A :class:`FlatBucket` is a contiguous run of parameters of one dtype laid end to end in a
single 1-D buffer, padded with zeros so its length divides evenly by the data-parallel
degree N. Rank r owns elements ``[r*S, (r+1)*S)`` of every bucket, S = padded/N. One
collective serves the whole bucket, so there are no per-parameter copies around the
collective (FSDP paper §3.2). Each parameter keeps its identity (the same
``nn.Parameter`` object, so tied weights and user references survive); only its
``.data`` is pointed at a view of the buffer.

Stages 0-2 cut buckets by size in reverse registration order (the order backward
produces gradients, as DDP does), so reducing a bucket can start while backward still
runs. Stage 3 cuts one bucket per unit (a transformer block, or the root). Sharding per
bucket rather than per model (Megatron's distributed optimizer does the same) means a
rank's optimizer shard is the union of its slices of each bucket, and every bucket can be
reduced the moment it is complete.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from torch import nn

__all__ = ["ParamSlot", "FlatBucket", "cut_buckets"]


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside its bucket (names: every name it is known by)."""

    names: tuple[str, ...]
    param: nn.Parameter
    shape: torch.Size
    offset: int

    @property
    def numel(self) -> int:
        return self.shape.numel()


class FlatBucket:
    """One flat padded buffer's layout plus the tensors that hold it on this rank.

    Buffer lifetimes (who allocates, who frees) are documented on the engine that drives
    the bucket; this class only knows the layout and the slicing arithmetic.
    """

    def __init__(
        self, index: int, name: str, slots: list[ParamSlot], world: int, rank: int,
        requires_grad: bool = True,
    ) -> None:
        if not slots:
            raise ValueError(f"bucket {name!r} has no parameters")
        dtypes = {s.param.dtype for s in slots}
        if len(dtypes) != 1:
            raise ValueError(f"bucket {name!r} mixes dtypes {sorted(map(str, dtypes))}")
        self.index = index
        self.name = name
        self.slots = slots
        self.dtype: torch.dtype = dtypes.pop()
        self.device = slots[0].param.device
        self.world = world
        self.rank = rank
        self.requires_grad = requires_grad
        self.numel = sum(s.numel for s in slots)
        self.padded_numel = -(-self.numel // world) * world
        self.shard_numel = self.padded_numel // world
        # Filled in by the engine.
        self.full: torch.Tensor | None = None  # compute-dtype flat parameters
        self.grad: torch.Tensor | None = None  # compute-dtype flat gradients (full)
        self.grad_shard: torch.Tensor | None = None  # reduce-dtype reduced slice
        self.master: nn.Parameter | None = None  # what the optimizer steps, in chunks:
        self.chunks: list[nn.Parameter] = []  # views of master (see engine/chunks.py)
        self.chunk_ranges: list[tuple[int, int]] = []
        self.chunk_groups: list[int] = []  # optimizer parameter group of each chunk
        self.flat_state: dict[str, torch.Tensor] = {}  # per-element optimizer state, flat
        self.flat_views: dict[str, tuple[torch.Tensor, ...]] = {}  # ... and its chunks
        self.shard16: torch.Tensor | None = None  # stage 3: compute-dtype slice kept
        self.host_grad: torch.Tensor | None = None  # offload: pinned host copy of the slice
        self.host_fresh = False  # offload: host_grad already holds the reduced slice
        self.host_weights: torch.Tensor | None = None  # offload: pinned compute-dtype staging
        self.pending = None  # an in-flight reduction (comm.Pending)
        self.ready = 0  # parameters whose gradient arrived this backward
        self.launched = False  # its reduction was started this backward
        self.reduced = False  # stage 1: this rank's slice of ``grad`` holds a reduced value
        # Per slot: does ``grad`` hold this parameter's current gradient? Stale slots are
        # overwritten by the next gradient (a copy, not an add into zeros) or zeroed before
        # a reduction, so buffers never need a memset between steps.
        self.valid = [False] * len(slots)
        self.used: torch.Tensor | None = None  # per-slot "got a gradient" flags

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def shard_range(self) -> tuple[int, int]:
        lo = self.rank * self.shard_numel
        return lo, lo + self.shard_numel

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        lo, hi = self.shard_range
        return full[lo:hi]

    def flatten(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new padded flat copy of the parameters' current values."""
        flat = torch.zeros(self.padded_numel, dtype=dtype or self.dtype, device=self.device)
        for s in self.slots:
            flat[s.offset : s.offset + s.numel].copy_(s.param.detach().reshape(-1))
        return flat

    def slot_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        s = self.slots[i]
        return flat[s.offset : s.offset + s.numel].view(s.shape)

    def views(self, flat: torch.Tensor) -> Iterable[tuple[ParamSlot, torch.Tensor]]:
        for s in self.slots:
            yield s, flat[s.offset : s.offset + s.numel].view(s.shape)

    def point_params_at(self, flat: torch.Tensor) -> None:
        """Make every parameter a view into ``flat`` (keeps each Parameter's identity)."""
        for s, view in self.views(flat):
            s.param.data = view

    def replace_meta_params(self, model: nn.Module, flat: torch.Tensor) -> None:
        """Swap meta parameters for real ones viewing ``flat``, under every name.

        A meta tensor's ``.data`` cannot be pointed at real memory, so each parameter is
        replaced by a new ``nn.Parameter`` — set on every module that holds it, keeping
        tied weights tied.
        """
        for i, (s, view) in enumerate(list(self.views(flat))):
            # Not nn.Parameter(view): that would share ``flat``'s version counter, so
            # every later write into the buffer (a gather) would look to autograd like an
            # in-place change of a saved weight. ``.data`` aliases memory only.
            new = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device),
                               requires_grad=s.param.requires_grad)
            new.data = view
            for name in s.names:
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, new)
            self.slots[i] = replace(s, param=new)
        self.device = flat.device

    def point_params_at_nothing(self) -> None:
        """Stage 3, while sharded: parameters are empty, so a stray read sees no weights
        rather than freed memory (FSDP1 does the same)."""
        empty = torch.empty(0, dtype=self.full.dtype, device=self.device)
        for s in self.slots:
            s.param.data = empty

    def grad_views(self, flat: torch.Tensor) -> None:
        for s, view in self.views(flat):
            s.param.grad = view

    def slots_in_shard(self) -> Iterable[tuple[ParamSlot, int, int]]:
        """(slot, lo, hi) for each parameter overlapping this rank's slice, in shard coords."""
        lo, hi = self.shard_range
        for s in self.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                yield s, a - lo, b - lo


def cut_buckets(
    params: list[tuple[tuple[str, ...], nn.Parameter]], bucket_bytes: int, world: int,
    rank: int, start_index: int = 0, name_prefix: str = "bucket",
) -> list[FlatBucket]:
    """Cut ``params`` (in the order given) into size-bounded, single-dtype buckets.

    A parameter larger than ``bucket_bytes`` gets a bucket of its own.
    """
    buckets: list[FlatBucket] = []
    slots: list[ParamSlot] = []
    size = 0

    def close() -> None:
        nonlocal slots, size
        if slots:
            i = start_index + len(buckets)
            buckets.append(FlatBucket(i, f"{name_prefix}{i}", slots, world, rank))
        slots, size = [], 0

    for names, p in params:
        nbytes = p.numel() * p.element_size()
        if slots and (size + nbytes > bucket_bytes or p.dtype != slots[0].param.dtype):
            close()
        offset = sum(s.numel for s in slots)
        slots.append(ParamSlot(names, p, p.shape, offset))
        size += nbytes
    close()
    return buckets
