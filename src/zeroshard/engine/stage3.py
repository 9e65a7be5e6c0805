"""Stage 3's hooks: gather and free each unit around its forward and backward.

The lifecycle itself is [Note: unit lifecycle] and the schedule [Note: prefetch], both in
units.py; :class:`UnitSchedule` runs them from module hooks.

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

[Note: resident units]
A unit is freed after its forward (or its backward), unless it is *resident*:
* **held** (``self.held``): ``model.unshard()``, ``zeroshard.gathered()`` and the
  ``generate()`` wrapper (gather.py) gather units and keep them until released; forwards
  and backwards in between find them gathered and issue no gathers for them;
* **idle** (``self.idle``): kept after a forward without gradients because
  ``reshard_after_forward`` is False — FSDP2's semantics in every mode, so that
  generation's next token reuses them; freed by the unit's next backward, a step,
  ``model.reshard()`` or ``set_reshard_after_forward(True)``.
Outside its own forward and backward a resident unit's modules hold the user parameters
(DTensors) as any unit's do: only the gathered memory stays. Resident copies never go
stale silently: a step frees every unit (``Engine.after_step``), and a load or an edit
of the masters frees the resident units holding them (``drop_stale``, told by
refresh.py); held ones are gathered again, from the new values, at the next forward.
A unit whose backward is still to run (``self.awaiting``) keeps the weights its graph
saved. Which units to hold is chosen the same way on every rank, and they are gathered
in unit order, so the collectives match.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..comm import Comm
from ..config import ShardConfig
from .params import Faces
from .secondary import keep_secondary
from .units import Unit, UnitState

__all__ = ["UnitSchedule", "in_backward"]


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


class UnitSchedule:
    """Stage 3's schedule over all units: which are gathered, the order they ran in
    (recorded by the first forward), the prefetch cursors, and the gathered bytes.

    Module hooks call it (the engine registers them); it tells its listener two things
    through callables given to :meth:`connect`: a backward has reached a unit (the
    backward pass queues its end), and a unit's backward is done (the backward pass
    reduces its buckets). It calls nothing else outside the units and the faces.
    """

    def __init__(self, units: list[Unit], comm: Comm, config: ShardConfig,
                 faces: Faces, secondary: Comm | None = None) -> None:
        self.units = units
        self.comm = comm
        self.secondary = secondary  # [Note: the secondary shard] in secondary.py
        self.config = config
        self.faces = faces
        self.order: list[Unit] = []  # the units in the order the first forward ran them
        self.recording = True
        self.fwd_cursor = 0
        self.bwd_cursor = 0
        self.prefetch_due = False
        self.root_kept = False  # the root was gathered when this forward began
        # Free each unit after its forward (FSDP2's set_reshard_after_forward sets it).
        self.reshard_after_forward = config.reshard_after_forward
        self.unsharded_bytes = 0
        self.peak_unsharded_bytes = 0
        # [Note: resident units]
        self.held: set[Unit] = set()  # gathered until released (unshard(), gathered())
        self.idle: set[Unit] = set()  # kept after a forward without gradients
        self.awaiting: set[Unit] = set()  # ran a forward with gradients, backward not yet
        self._backward_reached: Callable[[], None] = lambda: None
        self._unit_done: Callable[[Unit], None] = lambda u: None

    def connect(self, backward_reached: Callable[[], None],
                unit_done: Callable[[Unit], None]) -> None:
        self._backward_reached = backward_reached
        self._unit_done = unit_done

    @property
    def root(self) -> Unit:
        return self.units[-1]

    # -- gather and free --------------------------------------------------------------------
    def unshard(self, u: Unit, phase: str, async_op: bool | None = None) -> None:
        kind = self._quantised(u, phase)
        if (u.state is UnitState.UNSHARDED and u.holds != kind and u not in self.held
                and u is not self.root and self.config.quantize_weights is not None):
            # Gathered with other values than this pass computes with (exact weights a
            # gathered() or unshard() left between a quantised forward and its
            # backward): gathered again, so backward reads what forward read. Not the
            # root: a backward reads its weights before any hook could gather them
            # ([Note: resident units]); it keeps what its forward gathered.
            self.reshard(u, force=True)
        if u.state is not UnitState.SHARDED:
            # Gathered already (the root from forward to backward), but after a forward
            # with gradients its modules hold the user parameters ([Note: between forward
            # and backward] in forward.py): a second forward before the backward computes
            # with the gathered ones again.
            self.faces.show(u.buckets, compute=True)
            return
        async_op = self.config.overlap if async_op is None else async_op
        if phase == "backward" and self.secondary is not None and u.has_secondary:
            u.unshard_secondary(self.secondary, phase, async_op)
        else:
            u.unshard(self.comm, phase, async_op=async_op, quantized=kind)
        self.faces.show(u.buckets, compute=True)
        self.unsharded_bytes += u.unsharded_bytes
        self.peak_unsharded_bytes = max(self.peak_unsharded_bytes, self.unsharded_bytes)

    def reshard(self, u: Unit, force: bool = False) -> None:
        """Free a unit's gathered weights — unless it is resident ([Note: resident
        units]) and not ``force``d: then the modules get the user parameters back."""
        if u.state is UnitState.SHARDED:
            return
        if not force and (u in self.held or u in self.idle):
            u.wait()
            self.faces.show(u.buckets, compute=False)
            return
        self.idle.discard(u)
        u.reshard()
        self.faces.show(u.buckets, compute=False)
        self.unsharded_bytes -= u.unsharded_bytes

    def reshard_resident(self) -> None:
        """``model.reshard()``: free every gathered unit, resident ones included, except
        those whose backward is still to run — their graph saved views of the gathered
        weights (the root's are read before any hook could gather them again); they are
        freed after their backward, as any unit."""
        self.held.clear()
        self.idle.clear()
        for u in self.units:
            u.wait()
            if u not in self.awaiting:
                self.reshard(u, force=True)

    def reshard_all(self, force: bool = True) -> None:
        if force:
            self.awaiting.clear()
        for u in self.units:
            u.wait()
            self.reshard(u, force=force)
            if force:
                u.drop_secondary()

    def _quantised(self, u: Unit, phase: str) -> str | None:
        """[Note: quantised weights]: the quantisation a gather of ``u`` for ``phase``
        uses — training passes only (gradients on, the module in training mode, or a
        backward), never a held unit's."""
        kind = self.config.quantize_weights
        if kind is None or u in self.held:
            return None
        training = phase == "backward" or in_backward() or (
            torch.is_grad_enabled() and u.module.training)
        return kind if training else None

    def _secondary_k(self) -> int | None:
        """k while forwards keep secondary shards (an int reshard_after_forward)."""
        k = self.reshard_after_forward
        return k if self.secondary is not None and not isinstance(k, bool) else None

    # -- resident units ---------------------------------------------------------------------
    def hold(self, units: list[Unit], async_op: bool = False) -> list[Unit]:
        """Gather ``units`` and keep them gathered until :meth:`release`; returns those
        newly held. Between steps only (the engine checks)."""
        new = [u for u in units if u not in self.held]
        self.held.update(new)
        for u in new:  # every gather in flight at once, then waited in order
            self.unshard(u, "forward", async_op=True)
            self.faces.show(u.buckets, compute=False)  # outside forward: the user's
        if not async_op:
            for u in new:
                u.wait()
        return new

    def release(self, units: list[Unit] | None = None) -> None:
        """Stop holding ``units`` (all if None) and free them."""
        for u in list(self.held) if units is None else units:
            self.held.discard(u)
            if u not in self.awaiting:
                self.reshard(u)

    def all_resident(self) -> bool:
        """Every unit gathered and kept (held or idle): a forward now gathers nothing."""
        return all(u.state is not UnitState.SHARDED and (u in self.held or u in self.idle)
                   for u in self.units)

    def in_use(self) -> list[Unit]:
        """Units gathered for a forward or a backward in progress (resident ones that
        are only kept are not)."""
        return [u for u in self.units if u.state is not UnitState.SHARDED and (
            u in self.awaiting or (u not in self.held and u not in self.idle))]

    def free_idle(self) -> None:
        """Free units kept after forwards without gradients (reshard_after_forward is
        True again)."""
        for u in list(self.idle):
            self.idle.discard(u)
            self.reshard(u)

    def drop_stale(self, buckets: list) -> None:
        """The masters of ``buckets`` changed (a step, a load, an edit): resident units
        holding them are freed, to be gathered again from the new values by the next
        forward that needs them. A unit whose backward is still to run keeps the weights
        its graph saved."""
        stale = set(buckets)
        for u in self.units:
            if any(b in stale for b in u.buckets):
                u.drop_secondary()  # never stale: built again by the next forward
            if u.state is not UnitState.SHARDED and u not in self.awaiting and (
                    u in self.held or u in self.idle) and any(b in stale for b in u.buckets):
                u.wait()
                self.reshard(u, force=True)

    def settle(self) -> None:
        """Finish gathers still in flight (see Engine.settle_gathers)."""
        for u in self.units:
            if u.pending:
                u.wait()

    def show_gathered(self, compute: bool) -> None:
        """Which face the modules of the gathered units hold."""
        for u in self.units:
            if u.state is not UnitState.SHARDED:
                self.faces.show(u.buckets, compute=compute)

    def _prefetch(self, order: list[Unit], start: int) -> None:
        for u in order[start : start + self.config.prefetch]:
            self.unshard(u, "backward" if u.in_backward else "forward")

    # -- the root, around the whole forward -------------------------------------------------
    def root_pre_forward(self) -> None:
        """Gather the root (kept from a forward with gradients whose backward has not run
        yet, see forward.py) and prefetch the first units."""
        self.fwd_cursor = 0
        self.root_kept = self.root in self.awaiting and self.root.state is not UnitState.SHARDED
        if self.held:  # held units a step or a load freed: gathered again, in unit order
            for u in self.units:
                if u in self.held and u.state is UnitState.SHARDED and u is not self.root:
                    self.unshard(u, "forward")
        self.unshard(self.root, "forward")
        self.root.wait()
        self._prefetch(self.order, 0)

    def root_post_forward(self) -> None:
        self.recording = False
        if torch.is_grad_enabled():
            if not in_backward():
                self.awaiting.add(self.root)
                self.idle.discard(self.root)
            return
        if self.root_kept and not in_backward():
            # A forward without gradients between a forward with gradients and its
            # backward (TRL DPO's reference pass with the adapters disabled): that graph
            # saved views of the root's gathered weights, which the backward reads before
            # any unit hook could gather them again; keep them, and hand the modules back
            # the user parameters.
            self.faces.show(self.root.buckets, compute=False)
        else:
            self._after_forward_without_grad(self.root)

    def _after_forward_without_grad(self, u: Unit) -> None:
        """No backward follows: free the unit, unless it is resident, or
        ``reshard_after_forward`` is False (FSDP2's semantics in every mode: the weights
        stay for the next forward, generation's next token)."""
        if not self.reshard_after_forward and u.state is not UnitState.SHARDED:
            self.idle.add(u)
        self.reshard(u)

    # -- a unit's hooks ---------------------------------------------------------------------
    def pre_forward(self, u: Unit, args: tuple) -> tuple | None:
        if u.in_backward or in_backward():  # recomputation (activation checkpointing)
            self.unshard(u, "backward")
            u.wait()
            return None
        if self.recording:
            self.order.append(u)
        self.fwd_cursor += 1
        self.unshard(u, "forward")
        # Wait (copy out, free the gather buffer) before prefetching the next unit, so
        # never more than one gather buffer beside the gathered units ([Note: prefetch]).
        u.wait()
        self._prefetch(self.order, self.fwd_cursor)
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
        outs = _PostBackward.apply(functools.partial(self._post_backward, u),
                                  *(flat[i] for i in idx))
        for i, t in zip(idx, outs):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def post_forward(self, u: Unit, output):
        if u.in_backward or in_backward():
            # A recompute's graph only regenerates saved tensors; the hooks registered in
            # the original forward free the unit once its backward is done.
            return output
        grad = torch.is_grad_enabled()
        if not grad:
            self._after_forward_without_grad(u)
        elif self.reshard_after_forward:
            if self._secondary_k() and u not in self.held:
                for b in u.buckets:
                    keep_secondary(b, self._secondary_k())
                u.secondary_holds = u.holds
            self.reshard(u)
        if grad:
            self.awaiting.add(u)
            self.idle.discard(u)  # freed after its backward, as any unit
            call = [False]  # one forward call of the unit; its outputs share the flag
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g, u=u, c=call: self._pre_backward(u, c, g))
        return output

    def _pre_backward(self, u: Unit, call: list[bool], grad: torch.Tensor) -> torch.Tensor:
        u.in_backward = True
        self._backward_reached()
        self.unshard(u, "backward")  # no-op if kept or prefetched
        u.wait()
        if not call[0]:  # first output of this call to get its gradient: advance schedule
            call[0] = True
            self.bwd_cursor += 1
            # The next units' gathers start with this unit's first parameter gradient
            # (prefetch_backward), not now: by then the unit's last layer has run its
            # backward and freed what it saved, and the gathers still overlap the rest.
            self.prefetch_due = True
        return grad

    def _post_backward(self, u: Unit) -> None:
        """Every node that read the unit's weights has run (see _PostBackward): free the
        weights, then let the backward pass reduce the unit's buckets, so the whole
        gradient buffer is never allocated beside the whole weights (FSDP2's order)."""
        u.backward_done = True
        self.awaiting.discard(u)
        self.reshard(u)
        u.drop_secondary()
        self._unit_done(u)

    def prefetch_backward(self) -> None:
        """Start the gathers of the next ``prefetch`` units of backward, once per unit
        (called by the gradient hook; see [Note: prefetch])."""
        if not self.prefetch_due:
            return
        self.prefetch_due = False
        backward_order = self.order[::-1]
        for v in backward_order[self.bwd_cursor : self.bwd_cursor + self.config.prefetch]:
            v.in_backward = True
            self.unshard(v, "backward")

    def end_backward(self) -> None:
        """Every unit freed, the backward cursor back at the start."""
        self.bwd_cursor = 0
        self.prefetch_due = False
        self.awaiting.clear()
        for u in self.units:
            u.in_backward = False
            self.reshard(u)
            u.drop_secondary()
