"""Uneven inputs: a rank out of data replays the collectives of its last iteration.

See [Note: join] in join.py: inside ``zeroshard.join()`` a rank that ran out of batches
keeps serving the collectives the others issue — with zero gradients — by replaying the
ledger records of its last real iteration. This mixin is that part of the
:class:`~zeroshard.engine.engine.Engine`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .buffers import broadcast_buffers
from .flat import FlatBucket

if TYPE_CHECKING:
    from ..comm import Comm
    from ..config import ShardConfig
    from .reduction import Reducer
    from .units import Unit

__all__ = ["JoinReplay"]


class JoinReplay:
    """Mixin of :class:`~zeroshard.engine.engine.Engine`."""

    model: nn.Module
    world: Comm
    comm: Comm
    reducer: Reducer
    device: torch.device
    units: list[Unit]
    buckets: list[FlatBucket]
    compute_dtype: torch.dtype | None
    config: ShardConfig
    _last_iter: list
    _last_clip: tuple[float, float] | None
    _replaying: bool
    _buffer_src: int

    def _count_active(self, active: bool) -> None:
        """How many ranks still have data (gradients are divided by it), and the
        highest of them, whose buffers every rank takes (as DDP's join: rank 0 may have
        run out of data, its statistics stale): one all-reduce of a flag per rank."""
        t = torch.zeros(self.world.size, device=self.device)
        t[self.world.rank] = float(active)
        self.world.all_reduce(t, phase="control", unit="join").wait()
        self.reducer.active_ranks = int(t.sum().item())
        self._buffer_src = int(t.nonzero().max().item())

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
            if self._last_clip is not None:
                optimizer.clip_grad_norm_(*self._last_clip)
            optimizer.step()
            optimizer.zero_grad()
        finally:
            self._replaying = False

    def _replay_backward(self) -> None:
        units = {u.name: u for u in self.units}
        buckets: dict[str, list[FlatBucket]] = {}
        for b in self.buckets:
            buckets.setdefault(b.name, []).append(b)
        seen: dict[str, int] = {}
        if self.units:  # the forward's check point (forward.py, _pre_forward), as the others
            self.comm.sync_point("forward", phase="forward")
        broadcast = False
        for r in self._last_iter:
            # Not the replicas' all-reduces, nor the tp ones (a tensor-parallel norm's
            # gradient): a rank's tp peers share its data, so they have all joined too.
            if r.phase not in ("forward", "backward") or r.group in ("replicate", "tp"):
                continue
            if r.op == "broadcast":  # rank 0's buffers (buffers.py)
                if not broadcast:
                    broadcast_buffers(self.model, self.world, self._buffer_src)  # every group's
                broadcast = True
                continue
            if r.op == "all_gather":  # a stage-3 unit: serve our slice to the others
                u = units[r.unit]
                self._unshard(u, r.phase)
                u.wait()
                if not u.is_root:
                    self._reshard(u)
                continue
            b = buckets[r.unit][seen.get(r.unit, 0)]
            seen[r.unit] = seen.get(r.unit, 0) + 1
            if b.grad is None:
                self.reducer.new_grad(b, zeros=True)
            self.reducer.launch(b)  # stale slots are zeroed: this rank contributes nothing
            self.reducer.drain()
        self._finish_backward()

