"""Whole-parameter optimizers on flat shards: each parameter is updated whole, by one
owner rank.

[Note: whole-parameter updates]
An elementwise optimizer steps the flat master chunks (chunks.py). Muon cannot: its
update orthogonalises the whole momentum matrix (Newton–Schulz); neither can Adafactor
(second moments factored over whole rows and columns) nor LAMB/LARS (whole-tensor trust
ratios). So each parameter such an optimizer holds is *owned* by one rank of the
sharding group, and at the step:

1. every rank sends its rows of each parameter's master and reduced gradient to the
   parameter's owner (one all-to-all per bucket);
2. the owner assembles them — rank order is row order, see [Note: flat buckets] — into
   the whole master and gradient of the tensor the user's torch optimizer holds for the
   parameter (shaped like it; its state, Muon's momentum, lives on the owner alone) and
   steps the optimizer, unmodified;
3. the owner sends each rank its rows of the new value (one all-to-all per bucket), which
   land in the masters; the usual refresh (the post-step all-gather, or stage 3's next
   forward) takes them from there.

The owner sees exactly the reduced gradient and master every DDP rank holds, so the
update is the single-process one, bit for bit; but Newton–Schulz runs once per matrix in
the job instead of once per rank. Where the optimizer is not sharded (stage 0) every
rank holds whole masters and gradients already and owns every parameter, stepping them
in place, as DDP + Muon does.

Owners are chosen once, from shapes alone (so every rank agrees without talking): the
costliest parameter first, each to the rank with the least work so far (longest
processing time first), so no rank's share exceeds 1/N of the whole plus one parameter.
The cost is the update's work: for Muon the Newton–Schulz flops, ∝ m·n·min(m, n) of an
(m, n) matrix; for the others the element count. :func:`balance` reports the work and
the bytes each rank owns (they disagree where shapes differ; the work decides).

Bytes, per step and whole-owned parameter of B bytes: the flat path's reduce-scatter and
all-gather as for any parameter, plus (N-1)/N·B of master and (N-1)/N·B of gradient to
the owner and (N-1)/N·B of new values back (the ledger's ``all_to_all`` records, phase
``step``). Transient memory on the owner, per bucket: its owned parameters' whole master
and gradient, plus the send and receive buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import Comm, Pending
from .flat import FlatBucket, FlatParam
from .optimizer_spec import DIVIDES_ITSELF, WholePlan

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["WholeUpdates", "assign_owners", "newton_schulz_cost", "numel_cost", "whole_updates"]

Cost = Callable[[torch.Size], int]


def newton_schulz_cost(shape: torch.Size) -> int:
    """Muon's work on an (m, n) matrix: its Newton–Schulz iterations multiply (k, k) and
    (k, K) matrices, k = min(m, n), K = max(m, n): ∝ m·n·min(m, n)."""
    m = shape[0] if len(shape) else 1
    n = shape.numel() // m if m else 0
    return m * n * min(m, n)


def numel_cost(shape: torch.Size) -> int:
    return shape.numel()


def assign_owners(shapes: list[torch.Size], ranks: int, cost: Cost) -> list[int]:
    """An owner rank per shape: costliest first, each to the least-loaded rank (ties:
    fewer bytes owned, then the lower rank). Deterministic: every rank computes the same."""
    work = [0] * ranks
    size = [0] * ranks
    owner = [0] * len(shapes)
    order = sorted(range(len(shapes)), key=lambda i: (-cost(shapes[i]), i))
    for i in order:
        q = min(range(ranks), key=lambda r: (work[r], size[r], r))
        owner[i] = q
        work[q] += cost(shapes[i])
        size[q] += shapes[i].numel()
    return owner


class WholeUpdates:
    """The owner-rank step of [Note: whole-parameter updates] for ``slots`` (the stepped
    parameters of ``buckets``), over ``comm`` (the sharding group) or, when the optimizer
    is not sharded, over this rank alone."""

    def __init__(self, buckets: list[FlatBucket], slots: set[FlatParam], comm: Comm,
                 sharded: bool, cost: Cost, per_bucket: bool = True,
                 groups: frozenset[int] = frozenset()) -> None:
        self.comm = comm
        self.per_bucket = per_bucket  # see step()
        self.groups = groups  # the user's groups stepped whole
        self.size = comm.size if sharded else 1
        self.rank = comm.rank if sharded else 0
        self.cost = cost
        self.plans = [(b, [s for s in b.slots if s in slots]) for b in buckets]
        self.plans = [(b, ss) for b, ss in self.plans if ss]
        every = [s for _, ss in self.plans for s in ss]
        owners = assign_owners([s.shape for s in every], self.size, cost)
        self.owner: dict[FlatParam, int] = dict(zip(every, owners))
        self.to_owner = {b: [[s for s in ss if self.owner[s] == q] for q in range(self.size)]
                         for b, ss in self.plans}
        # What the torch optimizer holds for each parameter this rank owns: shaped like
        # it (Muon checks ndim at construction) but holding no memory between steps.
        self.tensors: dict[FlatParam, nn.Parameter] = {
            s: nn.Parameter(_placeholder(s), requires_grad=True)
            for s in every if self.owner[s] == self.rank}
        self.work_done: list[torch.Size] = []  # shapes stepped here (tests count the work)
        self.started = False  # stepped (or loaded) once: see whole_state.whole_state_view

    # -- what the optimizer is built over ------------------------------------------------
    def optimizer_groups(self, groups: list[list[str]], options: list[dict[str, Any]],
                         every: bool = False) -> list[dict[str, Any]]:
        """Torch param-group dicts: group i's owned tensors with ``options[i]`` (every
        group on every rank, empty where this rank owns none of its parameters).
        ``every``: placeholders for every whole parameter instead (a probe build)."""
        tensors = ({s: _placeholder(s) for s in self.owner} if every else self.tensors)
        by_name = {n: s for s in tensors for n in s.names}
        return [{**opts, "params": [tensors[by_name[n]] for n in names if n in by_name]}
                for names, opts in zip(groups, options)]

    def balance(self) -> dict[str, list[int]]:
        """Per rank: the work (``cost``) and elements of the parameters it owns."""
        work, size = [0] * self.size, [0] * self.size
        for s, q in self.owner.items():
            work[q] += self.cost(s.shape)
            size[q] += s.numel
        return {"work": work, "numel": size}

    # -- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer,
             unused: dict[FlatBucket, set[int]]) -> None:
        """Steps every whole-owned parameter (see [Note: whole-parameter updates]) —
        and, in the same ``optimizer.step()``, the flat chunks of any elementwise groups
        (a mixed optimizer); ``unused``: per bucket, slots no rank produced a gradient for
        (skipped, as torch skips a parameter whose grad is None).

        With ``per_bucket`` (an optimizer known to keep no state beyond each parameter's:
        torch's Muon and Adafactor), the optimizer steps once per bucket, pipelined one
        deep: the next bucket's rows travel to the owners while this one steps, and this
        one's new rows go back while the next steps; a rank with less work in one bucket
        gets on with the next (the owners are balanced over the whole model, not per
        bucket), and the owner holds one bucket's whole parameters at a time. Otherwise
        (a user's optimizer, which may count its steps per group) it steps once, over
        every bucket's whole parameters. Every rank posts the exchanges in one order."""
        self.started = True
        if not self.per_bucket:
            self._step_once(optimizer, unused)
            return
        if self.size == 1:
            for b, slots in self.plans:
                self._hold_local(b, slots, unused.get(b, set()))
                self._run(optimizer, slots)
            return
        inbound = self._send_rows(*self.plans[0]) if self.plans else None
        outbound = None
        for k, (b, slots) in enumerate(self.plans):
            arrived = inbound
            if k + 1 < len(self.plans):
                inbound = self._send_rows(*self.plans[k + 1])
            values = self._hold_owned(b, slots, arrived, unused.get(b, set()))
            self._run(optimizer, slots)
            if outbound is not None:
                self._take_rows(*outbound)
            outbound = self._return_rows(b, slots, values)
        if outbound is not None:
            self._take_rows(*outbound)

    def _step_once(self, optimizer: torch.optim.Optimizer,
                   unused: dict[FlatBucket, set[int]]) -> None:
        """Every bucket's rows to the owners, one ``optimizer.step()``, rows back."""
        if self.size == 1:
            for b, slots in self.plans:
                self._hold_local(b, slots, unused.get(b, set()))
            self._run(optimizer, [s for _, ss in self.plans for s in ss], always=True)
            return
        inbound = [self._send_rows(b, slots) for b, slots in self.plans]
        values = [self._hold_owned(b, slots, arrived, unused.get(b, set()))
                  for (b, slots), arrived in zip(self.plans, inbound)]
        self._run(optimizer, [s for _, ss in self.plans for s in ss], always=True)
        outbound = [self._return_rows(b, slots, v) for (b, slots), v in zip(self.plans, values)]
        for out in outbound:
            self._take_rows(*out)

    def _hold_local(self, b: FlatBucket, slots: list[FlatParam], skip: set[int]) -> None:
        """Whole masters and gradients on this rank: the tensors view them (the step
        updates them in place)."""
        for s in slots:
            t = self.tensors[s]
            t.data = b.master_range(s.shard_offset, s.shard_offset + s.numel).view(s.shape)
            g = b.master_grad
            t.grad = (None if g is None or s.index in skip
                      else g[s.shard_offset : s.shard_offset + s.numel].view(s.shape))

    def _by_owner(self, b: FlatBucket) -> list[list[FlatParam]]:
        """Per rank q, the bucket's whole parameters q owns (fixed at construction)."""
        return self.to_owner[b]

    @staticmethod
    def _parts(b: FlatBucket) -> int:
        """What travels to the owner per row: master and gradient, or the gradient alone
        where every rank holds the whole masters already (stages 1-2 in full precision:
        the masters are the weights' own chunks, ``master_in_full``)."""
        return 1 if b.master_in_full else 2

    def _send_rows(self, b: FlatBucket, slots: list[FlatParam]) -> tuple[Pending, list[int]]:
        """Start sending this rank's rows of master (unless the owner holds them: see
        _parts) and gradient to their owners."""
        n, me, k = self.size, self.rank, self._parts(b)
        dtype, device, grad = b.master_dtype, b.master_device, b.master_grad
        send = []
        for group in self._by_owner(b):
            for s in group:
                lo, hi = s.shard_offset, s.shard_offset + s.rows_of(me) * s.row
                if k == 2:
                    send.append(b.master_range(lo, hi))
                send.append(grad[lo:hi].to(dtype) if grad is not None
                            else torch.zeros(hi - lo, dtype=dtype, device=device))
        mine = [s for s in slots if self.owner[s] == me]
        in_splits = [sum(k * s.rows_of(me) * s.row for s in group)
                     for group in self._by_owner(b)]
        out_splits = [sum(k * s.rows_of(r) * s.row for s in mine) for r in range(n)]
        out = torch.empty(sum(out_splits), dtype=dtype, device=device)
        pending = self.comm.all_to_all(
            out, _cat(send, dtype, device), out_splits, in_splits, unit=b.name,
            total=k * sum(s.numel for s in slots), phase="step", async_op=True)
        return pending, in_splits

    def _hold_owned(self, b: FlatBucket, slots: list[FlatParam],
                    arrived: tuple[Pending, list[int]], skip: set[int]
                    ) -> dict[FlatParam, torch.Tensor]:
        """Assemble the owned parameters' whole master and gradient from every rank's
        rows (rank order is row order) into the tensors the optimizer steps; their
        values (what goes back)."""
        mine = [s for s in slots if self.owner[s] == self.rank]
        out = arrived[0].wait()
        dtype, device, parts = b.master_dtype, b.master_device, self._parts(b)
        values = {s: torch.empty(s.numel, dtype=dtype, device=device) for s in mine}
        grads = {s: torch.empty(s.numel, dtype=dtype, device=device) for s in mine}
        if parts == 1:  # the whole masters are here, in the weights (see _parts)
            for s in mine:
                values[s].copy_(b.slot_view(b.full, s.index).reshape(-1))
        at = 0
        for r in range(self.size):
            for s in mine:
                lo, hi = s.piece(r)
                k = hi - lo
                if parts == 2:
                    values[s][lo:hi].copy_(out[at : at + k])
                grads[s][lo:hi].copy_(out[at + (parts - 1) * k : at + parts * k])
                at += parts * k
        for s in mine:
            t = self.tensors[s]
            t.data = values[s].view(s.shape)
            t.grad = (None if s.index in skip or b.master_grad is None
                      else grads[s].view(s.shape))
        return values

    def _return_rows(self, b: FlatBucket, slots: list[FlatParam],
                     values: dict[FlatParam, torch.Tensor]
                     ) -> tuple[FlatBucket, list[FlatParam], Pending]:
        """Start sending each rank its rows of the new values."""
        n, me = self.size, self.rank
        mine = [s for s in slots if self.owner[s] == me]
        dtype, device = b.master_dtype, b.master_device
        back = [values[s][slice(*s.piece(r))] for r in range(n) for s in mine]
        out_splits = [sum(s.rows_of(me) * s.row for s in group)
                      for group in self._by_owner(b)]
        in_splits = [sum(s.rows_of(r) * s.row for s in mine) for r in range(n)]
        got = torch.empty(sum(out_splits), dtype=dtype, device=device)
        pending = self.comm.all_to_all(got, _cat(back, dtype, device), out_splits, in_splits,
                                       total=sum(s.numel for s in slots), unit=b.name,
                                       phase="step", async_op=True)
        return b, slots, pending

    def _take_rows(self, b: FlatBucket, slots: list[FlatParam], pending: Pending) -> None:
        """This rank's rows of the new values, into its masters."""
        got = pending.wait()
        at = 0
        for group in self._by_owner(b):
            for s in group:
                lo, hi = s.shard_offset, s.shard_offset + s.rows_of(self.rank) * s.row
                b.master_range(lo, hi).copy_(got[at : at + hi - lo])
                at += hi - lo

    def _run(self, optimizer: torch.optim.Optimizer, slots: list[FlatParam],
             always: bool = False) -> None:
        """One ``optimizer.step()`` over the tensors of ``slots`` this rank holds with a
        gradient (torch skips the others), then let go of them. ``always``: step even
        with none of them (a mixed optimizer's flat chunks step in the same call)."""
        held = [s for s in slots if s in self.tensors and self.tensors[s].grad is not None]
        if held or always:
            before = _default_group_calls() if self.size > 1 else None
            optimizer.step()
            if before is not None and _default_group_calls() != before:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step() issued a torch.distributed collective "
                    f"of its own while stepping the parameters this rank owns: it "
                    f"{DIVIDES_ITSELF}. This step's weights are wrong; restart from a "
                    "checkpoint")
            self.work_done += [s.shape for s in held]
        self._release(slots)

    def _release(self, slots: list[FlatParam]) -> None:
        for s in slots:
            t = self.tensors.get(s)
            if t is not None:
                t.grad = None
                t.data = _placeholder(s)


def _default_group_calls() -> int | None:
    """Collectives issued on the default process group so far (its sequence number);
    None where the backend does not count them. zeroshard's exchanges are posted before
    and after ``optimizer.step()``, never during it, and its checks use a group of their
    own (comm_check.py): a change across the step is the optimizer's own collective (see
    [Note: optimizers that divide the work themselves] in optimizer_spec.py)."""
    try:
        return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
    except (RuntimeError, AttributeError, ValueError):
        return None


def _placeholder(s: FlatParam) -> torch.Tensor:
    """A tensor shaped like ``s``'s parameter holding one element of memory."""
    return torch.zeros((), dtype=s.bucket.master_dtype, device=s.bucket.master_device
                       ).expand(s.shape)


def _cat(pieces: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return (torch.cat([p.reshape(-1) for p in pieces]) if pieces
            else torch.empty(0, dtype=dtype, device=device))


def whole_updates(engine: Engine, group_of: dict[str, int], plan: WholePlan
                  ) -> WholeUpdates:
    """The owner step for the parameters of the whole-parameter groups of ``plan``
    (optimizer_spec.whole_plan); refuses what it does not support yet."""
    if engine.tp is not None:
        raise NotImplementedError(
            "a whole-parameter optimizer (Muon, Adafactor, whole_params=True) with tensor "
            "parallelism is not supported: each tp rank holds a piece of every matrix, and "
            "the update needs it whole. Use an elementwise optimizer (AdamW) with tp, or "
            "shard without tp")
    if engine.offload:
        raise NotImplementedError(
            "a whole-parameter optimizer (Muon, Adafactor, whole_params=True) with offload= "
            "is not supported yet: drop offload=, or use an elementwise optimizer (AdamW)")
    slots = {s for b in engine.buckets for s in b.slots
             if group_of.get(s.names[0], 0) in plan.groups}
    cost = newton_schulz_cost if plan.cost == "newton_schulz" else numel_cost
    return WholeUpdates(engine.buckets, slots, engine.comm,
                        sharded=engine.policy.shard_optimizer, cost=cost,
                        per_bucket=plan.per_bucket, groups=plan.groups)
