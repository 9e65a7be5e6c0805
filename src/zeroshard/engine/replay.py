"""Uneven inputs: a rank out of data replays the collectives of its last iteration.

See [Note: join] in join.py: inside ``zeroshard.join()`` a rank that ran out of batches
keeps serving the collectives the others issue — with zero gradients — by replaying the
ledger records of its last real iteration. :class:`JoinReplay` keeps that record and
replays it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import Comm
from ..config import ShardConfig
from .backward import BackwardPass
from .buffers import broadcast_buffers
from .flat import FlatBucket
from .reduction import Reducer
from .stage3 import UnitSchedule

__all__ = ["JoinReplay"]


class JoinReplay:
    """This rank's part in ``join()``: counting the ranks with data at each forward,
    recording the last real iteration's collectives, and replaying them without data."""

    def __init__(self, *, model: nn.Module, config: ShardConfig, comm: Comm, world: Comm,
                 reducer: Reducer, schedule: UnitSchedule, backward: BackwardPass,
                 buckets: list[FlatBucket], device: torch.device) -> None:
        self.model = model
        self.config = config
        self.comm = comm
        self.world = world
        self.reducer = reducer
        self.schedule = schedule
        self.backward = backward
        self.buckets = buckets
        self.device = device
        self.joinable: Any = None  # join.py's ZeroJoinable, once join() was entered
        self.buffer_src = 0  # the rank buffers are broadcast from
        self.clip_this_iter: tuple[float, float] | None = None  # set by clip_grad_norm_
        self._iter_start = 0
        self._last_iter: list = []
        self._last_clip: tuple[float, float] | None = None
        self._replaying = False

    def forward_begins(self) -> None:
        """A forward (not a recompute) begins: inside ``join()`` count the ranks with
        data and mark where this iteration's records start."""
        if self.joinable is None:
            return
        from torch.distributed.algorithms.join import Join

        if Join.notify_join_context(self.joinable) is not None:  # join() is active
            self._count_active(True)
            self._iter_start = len(self.comm.ledger.records)
        else:
            self.buffer_src = 0

    def step_done(self) -> None:
        """After a real step inside ``join()``: keep its records to replay."""
        if self.joinable is not None and not self._replaying:
            self._last_iter = self.comm.ledger.records[self._iter_start :]
            self._last_clip, self.clip_this_iter = self.clip_this_iter, None

    def _count_active(self, active: bool) -> None:
        """How many ranks still have data (gradients are divided by it), and the
        highest of them, whose buffers every rank takes (as DDP's join: rank 0 may have
        run out of data, its statistics stale): one all-reduce of a flag per rank."""
        t = torch.zeros(self.world.size, device=self.device)
        t[self.world.rank] = float(active)
        self.world.all_reduce(t, phase="control", unit="join").wait()
        self.reducer.active_ranks = int(t.sum().item())
        self.buffer_src = int(t.nonzero().max().item())

    def sync_final_buffers(self, is_last_joiner: bool) -> None:
        """At the end of ``join()``: the buffers of the highest rank among the last to
        join, on every rank (DDP's ``_sync_final_model``; weights already agree)."""
        if not self.config.sync_buffers_in_forward or self.world.size == 1:
            return
        t = torch.tensor([float(self.world.rank if is_last_joiner else -1)],
                         device=self.device)
        self.world.all_reduce(t, phase="control", unit="join", op=dist.ReduceOp.MAX).wait()
        broadcast_buffers(self.model, self.world, int(t.item()), phase="control")

    def shadow_iteration(self, optimizer: Any) -> None:
        """One iteration without data: the collectives of the last real one, neutral."""
        if not self._last_iter:
            raise RuntimeError(
                f"rank {self.world.global_rank} ran out of data before finishing one "
                "iteration inside zeroshard.join(); give every rank at least one batch"
            )
        self._count_active(False)
        self._replaying = True
        try:
            with torch.enable_grad():  # the real iteration's forward gathers ran with grad
                self._replay_backward()
            opts = optimizer if isinstance(optimizer, tuple) else (optimizer,)  # several
            if self._last_clip is not None:  # the global norm, whichever clips
                opts[0].clip_grad_norm_(*self._last_clip)
            for o in opts:  # as the active ranks' loop: each optimizer's step in turn
                o.step()
                o.zero_grad()
        finally:
            self._replaying = False

    def _replay_backward(self) -> None:
        schedule = self.schedule
        units = {u.name: u for u in schedule.units}
        buckets: dict[str, list[FlatBucket]] = {}
        for b in self.buckets:
            buckets.setdefault(b.name, []).append(b)
        seen: dict[str, int] = {}
        if units:  # the forward's check point (forward.py, pre_forward), as the others
            self.comm.sync_point("forward", phase="forward")
        broadcast = False
        for r in self._last_iter:
            # Not the replicas' all-reduces, nor the tp ones (a tensor-parallel norm's
            # gradient): a rank's tp peers share its data, so they have all joined too.
            if r.phase not in ("forward", "backward") or r.group in ("replicate", "tp"):
                continue
            if r.op == "broadcast":  # rank 0's buffers (buffers.py)
                if not broadcast:
                    broadcast_buffers(self.model, self.world, self.buffer_src)  # every group's
                broadcast = True
                continue
            if r.op == "all_gather":  # a stage-3 unit: serve our slice to the others
                u = units[r.unit]
                schedule.unshard(u, r.phase)
                u.wait()
                if not u.is_root:
                    schedule.reshard(u)
                continue
            b = buckets[r.unit][seen.get(r.unit, 0)]
            seen[r.unit] = seen.get(r.unit, 0) + 1
            if b.grad is None:
                self.reducer.new_grad(b, zeros=True)
            self.reducer.launch(b)  # stale slots are zeroed: this rank contributes nothing
            self.reducer.drain()
        self.backward.finish()
