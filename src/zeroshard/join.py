"""Uneven inputs: ranks that run out of data shadow the others' collectives (torch's Join).

[Note: join]
``torch.distributed.algorithms.join.Join`` runs, on a rank whose loop has ended, the
``main_hook`` of every registered :class:`~torch.distributed.algorithms.join.Joinable`
once per iteration of the ranks still training, until all have finished. The still-active
ranks announce each iteration with ``Join.notify_join_context`` (zeroshard calls it in
the model's forward). zeroshard's hook replays this rank's share of one training
iteration *without data*:

1. an all-reduce of a flag per rank (1: still has data): every rank then divides
   gradients by their count, so the update equals training on the ranks' actual
   batches, and takes the buffers (BatchNorm statistics) of the highest rank still
   training, as DDP's join does (rank 0 may have run out, its statistics stale); when
   the context ends, the buffers of the highest of the last ranks to join go to every
   rank (DDP's final sync);
2. the forward/backward collectives of the last real iteration, in the order the ledger
   recorded them: stage-3 gathers contribute this rank's weight slice (the others need
   it), gradient reductions contribute zeros (and this rank receives the reduced slice it
   owns);
3. the optimizer side as the last iteration did it — ``clip_grad_norm_`` with the same
   arguments if it was called, ``step``, ``zero_grad`` — so this rank still steps the
   slice of the optimizer state it owns and serves the post-step gathers.

Supported: one forward/backward per optimizer step inside the join context (no
gradient accumulation), the same loop body on every rank, and at least one real
iteration on each rank before it runs out of data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

if TYPE_CHECKING:
    from .engine.engine import Engine
    from .engine.optimizer import ShardedOptimizer

__all__ = ["join", "ZeroJoinable"]


class _ShadowHook(JoinHook):
    def __init__(self, joinable: ZeroJoinable) -> None:
        self.joinable = joinable

    def main_hook(self) -> None:
        self.joinable.engine.replay.shadow_iteration(self.joinable.optimizer)

    def post_hook(self, is_last_joiner: bool) -> None:
        self.joinable.engine.active_ranks = None
        self.joinable.engine.replay.sync_final_buffers(is_last_joiner)


class ZeroJoinable(Joinable):
    """The sharded model + optimizer as one participant of torch's Join protocol."""

    def __init__(self, engine: Engine, optimizer: ShardedOptimizer) -> None:
        super().__init__()
        self.engine = engine
        self.optimizer = optimizer

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _ShadowHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.engine.device

    @property
    def join_process_group(self) -> Any:
        return self.engine.world.group


def join(model: nn.Module, optimizer: ShardedOptimizer | tuple, *, enable: bool = True,
         throw_on_early_termination: bool = False) -> Join:
    """A ``Join`` context for uneven inputs (see [Note: join])::

        with zeroshard.join(model, optimizer):
            for x, y in my_rank_batches:          # may be shorter on some ranks
                loss_fn(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()

    With several optimizers, pass the tuple ``shard()`` returned: a rank out of data
    steps each of them in turn, as the loop ``for o in opts: o.step(); o.zero_grad()``.
    """
    from .api import engine_of
    from .engine.optimizer import one_optimizer

    engine = engine_of(model)
    if isinstance(optimizer, (list, tuple)) or getattr(optimizer, "core", None) is not None:
        one_optimizer(optimizer)  # several optimizers: all of them, as shard() returned them
        optimizer = tuple(optimizer)
    replay = engine.replay
    if replay.joinable is None or replay.joinable.optimizer is not optimizer:
        replay.joinable = ZeroJoinable(engine, optimizer)
    return Join([replay.joinable], enable=enable,
                throw_on_early_termination=throw_on_early_termination)
