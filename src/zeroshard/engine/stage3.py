"""Stage 3's hooks: gather and free each unit around its forward and backward.

The lifecycle itself is [Note: unit lifecycle] and the schedule [Note: prefetch], both in
units.py; this mixin is the part of the :class:`~zeroshard.engine.engine.Engine` that
runs them from module hooks.

[Note: compile]
The engine's forward hooks (root and unit, pre and post) are excluded from
``torch.compile`` (``torch.compiler.disable``), as FSDP2 excludes its own: gathers,
frees, the parameter swap and the collective checks are Python bookkeeping over
communication, which a graph cannot hold, and a trace through them would recompile at
every step (the ledger and the check counters change). So a compiled block is one graph
of the block's own code; the hooks run eagerly just outside it, at the unit boundary
(one graph break before and one after each hooked module when the whole model is
compiled). The compute parameters a compiled block reads are always the same
``nn.Parameter`` objects (only their storage is refilled), so guards hold across steps.
The hooks are wrapped where the engine registers them, not decorated here:
``torch.compiler.disable`` imports ``torch._dynamo`` (~3 s), which ``import zeroshard``
would otherwise pay in every process, compiled or not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .units import Unit, UnitState

if TYPE_CHECKING:
    from ..comm import Comm
    from ..config import ShardConfig
    from .params import Faces

__all__ = ["Stage3Hooks", "in_backward"]


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's backward is done.

    Its backward runs when the gradient w.r.t. the unit's inputs is complete, i.e. after
    every node inside the unit (every reader of its weights), and — unlike a hook on the
    input tensor — strictly before hooks on the previous unit's output fire, so a unit is
    freed before the next one's prefetch starts (FSDP2's RegisterPostBackwardFunction).
    """

    @staticmethod
    def forward(ctx, callback, *inputs):  # type: ignore[override]
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ctx.callback()
        return (None, *grads)


def in_backward() -> bool:
    """True while the autograd engine runs (e.g. a checkpoint recomputing a forward)."""
    return torch._C._current_graph_task_id() != -1



class Stage3Hooks:
    """Mixin of :class:`~zeroshard.engine.engine.Engine` (its attributes: ``comm``,
    ``config``, ``units``, ``unsharded_bytes`` ...)."""

    comm: Comm
    config: ShardConfig
    faces: Faces
    units: list[Unit]
    unsharded_bytes: int
    peak_unsharded_bytes: int
    _order: list[Unit]
    _recording: bool
    _fwd_cursor: int
    _bwd_cursor: int
    _prefetch_due: bool
    _post_backward: Callable[[Unit], None]

    def _unshard(self, u: Unit, phase: str) -> None:
        if u.state is not UnitState.SHARDED:
            # Gathered already (the root from forward to backward), but after a forward
            # with gradients its modules hold the user parameters ([Note: between forward
            # and backward] in forward.py): a second forward before the backward computes
            # with the gathered ones again.
            self.faces.show(u.buckets, compute=True)
            return
        u.unshard(self.comm, phase, async_op=self.config.overlap)
        self.faces.show(u.buckets, compute=True)
        self.unsharded_bytes += u.unsharded_bytes
        self.peak_unsharded_bytes = max(self.peak_unsharded_bytes, self.unsharded_bytes)

    def _reshard(self, u: Unit) -> None:
        if u.state is not UnitState.SHARDED:
            u.reshard()
            self.faces.show(u.buckets, compute=False)
            self.unsharded_bytes -= u.unsharded_bytes

    def _prefetch(self, order: list[Unit], start: int) -> None:
        for u in order[start : start + self.config.prefetch]:
            self._unshard(u, "backward" if u.in_backward else "forward")

    def _unit_pre_forward(self, u: Unit, args: tuple) -> None:
        if u.in_backward or in_backward():  # recomputation (activation checkpointing)
            self._unshard(u, "backward")
            u.wait()
            return
        if self._recording:
            self._order.append(u)
        self._fwd_cursor += 1
        self._unshard(u, "forward")
        # Wait (copy out, free the gather buffer) before prefetching the next unit, so
        # never more than one gather buffer beside the gathered units ([Note: prefetch]).
        u.wait()
        self._prefetch(self._order, self._fwd_cursor)
        u.inputs_hooked = u.backward_done = False
        if torch.is_grad_enabled():
            args = self._hook_inputs(u, args)
        return args

    def _hook_inputs(self, u: Unit, args: tuple) -> tuple:
        """Route the unit's inputs through :class:`_PostBackward` (see its docstring)."""
        flat, spec = tree_flatten(args)
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return args
        u.inputs_hooked = True
        outs = _PostBackward.apply(lambda: self._post_backward(u), *(flat[i] for i in idx))
        for i, t in zip(idx, outs):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _unit_post_forward(self, u: Unit, output):
        if u.in_backward or in_backward():
            # A recompute's graph only regenerates saved tensors; the hooks registered in
            # the original forward free the unit once its backward is done.
            return output
        grad = torch.is_grad_enabled()
        if self.config.reshard_after_forward or not grad:
            self._reshard(u)
        if grad:
            call = [False]  # one forward call of the unit; its outputs share the flag
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g, u=u, c=call: self._unit_pre_backward(u, c, g))
        return output

    def _unit_pre_backward(self, u: Unit, call: list[bool], grad: torch.Tensor) -> torch.Tensor:
        u.in_backward = True
        self._queue_finish()
        self._unshard(u, "backward")  # no-op if kept or prefetched
        u.wait()
        if not call[0]:  # first output of this call to get its gradient: advance schedule
            call[0] = True
            self._bwd_cursor += 1
            # The next units' gathers start with this unit's first parameter gradient
            # (prefetch_backward), not now: by then the unit's last layer has run its
            # backward and freed what it saved, and the gathers still overlap the rest.
            self._prefetch_due = True
        return grad

    def prefetch_backward(self) -> None:
        """Start the gathers of the next ``prefetch`` units of backward, once per unit
        (called by the engine's gradient hook; see [Note: prefetch])."""
        if not self._prefetch_due:
            return
        self._prefetch_due = False
        backward_order = self._order[::-1]
        for v in backward_order[self._bwd_cursor : self._bwd_cursor + self.config.prefetch]:
            v.in_backward = True
            self._unshard(v, "backward")

