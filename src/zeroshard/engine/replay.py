"""Uneven inputs: a rank out of data replays the collectives of its last iteration.

See [Note: join] in join.py: inside ``zeroshard.join()`` a rank that ran out of batches
keeps serving the collectives the others issue — with zero gradients — by replaying the
ledger records of its last real iteration. This mixin is that part of the
:class:`~zeroshard.engine.engine.Engine`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .buffers import broadcast_buffers
from .flat import FlatBucket

if TYPE_CHECKING:
    from ..comm import Comm
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
    _last_iter: list
    _last_clip: tuple[float, float] | None
    _replaying: bool

    def _count_active(self, mine: int) -> None:
        t = torch.tensor([float(mine)], device=self.device)
        self.world.all_reduce(t, phase="control", unit="join").wait()
        self.reducer.active_ranks = int(t.item())

    def shadow_iteration(self, optimizer: Any) -> None:
        """One iteration without data: the collectives of the last real one, neutral."""
        if not self._last_iter:
            raise RuntimeError(
                f"rank {self.world.global_rank} ran out of data before finishing one "
                "iteration inside zeroshard.join(); give every rank at least one batch"
            )
        self._count_active(0)
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
                    broadcast_buffers(self.model, self.world)  # every group's, in order
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

