"""The backward hooks: each gradient's arrival, its bucket's turn to be reduced, and the
end of backward.

One :class:`BackwardPass` per engine owns this: a parameter's gradient reaches
``on_grad`` (a post-accumulate hook on each of its leaves;
a tied parameter's parts are summed by tied.py first). Stage 0 keeps it in the bucket's
buffer as a view; stages 1-2 copy it in; stage 3 leaves it on the parameter until the
unit's post-backward folds the unit into one buffer. Complete buckets go to the reducer
(reduction.py) in a fixed order; the end of backward launches the rest, waits, agrees
with the other ranks on what was used and publishes the gradients (step_grads.py).

[Note: collective order in backward]
Collectives pair up by their order on each rank, so the order of the reductions in
backward must not depend on the data: which parameters a rank used in a step does. In a
mixture-of-experts model one rank routes no token to an expert another rank keeps busy;
an adapter or an auxiliary head runs on some micro-batches only. Launching each bucket
as soon as all its gradients arrived (this engine once did) launched a bucket with such
a parameter early on the rank that used it and at the end of backward on the other: the
ranks reduced different buckets against each other (gloo aborts; NCCL mixes data). So:

* stages 0-2 launch buckets in one fixed order, ``self.buckets`` (reverse registration,
  about the order backward produces gradients), each once it is complete and every
  bucket before it has been launched (``_launch_in_order``), as DDP's reducer does (reduction.py); the
  end of backward launches the rest, in the same order, with zeros for what this rank
  did not produce. A bucket that waits for a parameter this rank will not use holds the
  buckets after it until the end of backward on that rank: less overlap, same result.
* stage 3 reduces all of a unit's buckets at its post-backward, whatever its parameters
  received (zeros for the rest), as FSDP2 does; units without a post-backward signal
  (the root; a unit whose inputs need no gradient) at the end of backward, in order.
  Which units run is the same on every rank (the forward's collective checks refuse
  otherwise, naming the unit), so the order is too.
* gradient parts that arrive after their bucket was reduced (stage 3: a unit's
  parameter used after its post-backward, reentrant checkpointing) are reduced again at
  the end — by every rank, for the buckets *any* rank flagged: the flags travel in the
  one all-reduce of usage flags every synchronised backward ends with
  (``_agree_on_usage``), so what is reduced never depends on one rank's data.

That all-reduce also tells every rank which parameters no rank used: they keep
``grad = None`` and the step skips them exactly as torch's optimizer does, state and
AdamW's ``step`` untouched (chunks.skip_slots, [Note: optimizer chunks]). A parameter
used on some ranks gets DDP's gradient: the others contribute zeros. An MoE step issues
exactly the collectives of a dense step of the same buckets.

[Note: end of backward]
The first gradient hook of a backward queues ``finish`` on the
autograd engine; it runs once backward is done, launches reductions of buckets that
never became complete (parameters unused in this step), waits for all in flight and,
after a synchronised backward, agrees with the other ranks on which parameters were
used ([Note: collective order in backward]) and publishes the gradients to the user
parameters.
Reentrant activation checkpointing runs a backward per region from inside the outer
one; a callback queued from inside ends with that region, so the finish then defers
itself to the outer node's completion (and so on outwards). A parameter used in several
such regions gets its gradient in parts: only the first counts towards its bucket being
complete; at stage 3 later parts are reduced again at the end (the reduced slices add
up); at stages 0-2 a part arriving after its bucket's reduction started is refused with
the fix (tests/test_backward_edges.py).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from ..comm import Comm
from ..config import ShardConfig
from .flat import FlatBucket, FlatParam
from .params import Faces
from .policy import StagePolicy
from .precision import LossScaler
from .reduction import Reducer
from .stage3 import UnitSchedule
from .step_grads import StepGrads
from .storage import same_memory
from .tensor_parallel import TensorParallel
from .tied import TiedGrads
from .units import Unit
from .weak import weakly

__all__ = ["BackwardPass", "accumulate_node"]


def accumulate_node(leaf: torch.Tensor):
    """The AccumulateGrad node of a leaf (created if it has none yet)."""
    with torch.enable_grad():
        return leaf.view_as(leaf).grad_fn.next_functions[0][0]


class BackwardPass:
    """The gradient hooks and the end of backward: per gradient, what happens next
    (stage-3 prefetch, tied parts, the reducer's launches), and at the end the
    launches left, the usage agreement and publication. Its per-backward state is its
    own (``queued``, ``ended``, ``sync``) and the buckets' arrival fields (``ready``,
    ``launched``, ``used``) and each parameter's (``arrived``, ``valid``)."""

    def __init__(self, *, policy: StagePolicy, config: ShardConfig, faces: Faces,
                 buckets: list[FlatBucket], reducer: Reducer, tied: TiedGrads,
                 grads: StepGrads, scaler: LossScaler, tp: TensorParallel | None,
                 world: Comm, device: torch.device, schedule: UnitSchedule) -> None:
        self.policy = policy
        self.config = config
        self.faces = faces
        self.buckets = buckets
        self.reducer = reducer
        self.tied = tied
        self.grads = grads
        self.scaler = scaler
        self.tp = tp
        self.world = world
        self.device = device
        self.schedule = schedule
        self.by_unit = bool(schedule.units)  # stage 3
        self.sync = True  # False inside no_sync(): accumulate locally, no communication
        self.queued = False  # the end of backward is queued on the autograd engine
        self.ended = False  # a backward ended since the last forward
        self._flags: torch.Tensor | None = None  # see _agree_on_usage

    def install(self) -> list:
        """The gradient hooks on every leaf (and tied.py's on their nodes); the handles."""
        slots = [s for b in self.buckets for s in b.slots]
        # Each hook is bound to its parameter and leaf: no lookup on the gradient path.
        # Weakly (here and on the nodes below): autograd holds these hooks in C++, where
        # Python's collector cannot see a cycle back to the engine; strong ones kept every
        # sharded model, its buffers and its process group alive after the script
        # dropped it.
        handles = [leaf.register_post_accumulate_grad_hook(weakly(self.on_grad, s, k))
                   for s in slots for k, leaf in enumerate(s.leaves)]
        # Hooks that prepare a leaf's .grad for accumulation sit on its AccumulateGrad
        # node, not on the tensor: they must not run in torch.autograd.grad(..., params),
        # which reads the gradients without accumulating (a tensor hook runs there too,
        # and dropping the published gradients then left clip_grad_norm_ a norm of 0).
        # A leaf holds its node weakly: the parameter keeps them, or the hooks go with them.
        for s in slots:
            s.nodes = [accumulate_node(leaf) for leaf in s.leaves]
        if self.faces.sharded and not self.faces.swap:  # before the tied hooks below
            handles += [node.register_prehook(weakly(self.drop_published))
                        for s in slots for node in s.nodes]
        handles += [s.nodes[0].register_prehook(weakly(self.tied.before_own_part, s))
                    for s in self.tied.slots]
        return handles

    def drop_published(self, grads: tuple) -> None:
        """Stages 1-2 without mixed precision or offload: the user parameters are the
        compute ones, and their ``.grad`` are DTensor views of the reduced slices. Drop
        them as the next backward reaches its first parameter, before autograd would add
        into one (the sums live in the engine's buffers and are published again at the
        end). Not at the forward: one under ``torch.no_grad()`` (an evaluation between
        backward and step) or with no backward after it must leave the gradients that
        ``clip_grad_norm_`` and the step read, as under DDP."""
        if self.faces.published:
            self.grads.rebase()  # before the published .grad are dropped
            self.faces.unpublish(self.buckets)

    def queue_finish(self) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def on_grad(self, s: FlatParam, k: int, p: torch.Tensor) -> None:
        """Leaf ``k`` of parameter ``s`` (``p``) has its gradient (or a part of it)."""
        if not self.queued:  # the backward's first gradient: nothing added to ours yet
            self.grads.rebase()
        self.queue_finish()
        b, i = s.bucket, s.index
        b.marks.used[i] = 1.0
        self.grads.prepared = False
        # A parameter's gradient can arrive in several parts in one backward: reentrant
        # activation checkpointing (use_reentrant=True) runs a backward per region, each
        # accumulating into .grad. Only the first part counts towards the bucket's
        # readiness; a part arriving after the bucket's reduction has started is reduced
        # again at the end of backward (stage 3) or refused (stages 0-2: it would land
        # in a buffer being reduced).
        heard = s.arrived  # the parameter's leaves heard from in this backward
        first = k not in heard
        was_complete = len(heard) == len(tied := s.leaves)
        heard.add(k)
        completes = first and len(heard) == len(tied)
        if self.sync and b.reduction.launched and not self.by_unit:
            raise RuntimeError(
                f"parameter {b.slots[i].names[0]!r} received a second gradient in one "
                "backward after its bucket's reduction started. Reentrant activation "
                "checkpointing (torch.utils.checkpoint with use_reentrant=True, the "
                "default of HF's gradient_checkpointing_enable()) does this when a "
                "parameter is used in several checkpointed regions. Use "
                "use_reentrant=False (HF: gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False})), or shard "
                "with overlap=False (buckets are then reduced once backward is done)")
        if len(tied) > 1:  # see [Note: tied parameters] in params.py
            if was_complete:  # a late part (reentrant): onto the parameter's own .grad
                p = self.tied.move_part(p, tied[0])
            else:
                held = self.tied.merge_parts(s, p)
                if len(heard) < len(tied):  # other uses still to deliver
                    if self.by_unit:
                        self.schedule.prefetch_backward()
                    return
                p = self.tied.settle(s, held)
        if not self.policy.shard_optimizer:  # stage 0: .grad views the buffer
            if b.grad is None:
                self.reducer.new_grad(b)
            view = b.slot_view(b.grad, i)
            if not same_memory(p.grad, view):  # fresh: we (or the user) set None
                self._stage0_put(s, view, p.grad)
                p.grad = view  # later backwards accumulate into the buffer in place
            s.valid = True
        elif self.by_unit:  # stage 3: autograd's .grad stays until the unit's last one (_fold)
            self.schedule.prefetch_backward()
        elif self.policy.keep_full_grads or self.sync:
            if self.policy.keep_full_grads:
                self.reducer.stash(b)
            if b.grad is None:
                self.reducer.new_grad(b)
            b.put_grad(b.grad, i, self._grads_of([p], s.names[0])[0], add=s.valid)
            s.valid = True
            p.grad = None
        # Inside no_sync() at stages 2-3 the parameter keeps its own (whole) .grad, which
        # autograd accumulates; the first synced backward folds it into the bucket.
        if not self.sync or not completes or b.reduction.launched:
            return
        b.marks.ready += 1
        # Stage 3 reduces a unit at its post-backward, or at the end of backward (see
        # [Note: collective order in backward]); stages 0-2 in bucket order.
        if b.marks.ready == len(b.slots) and self.config.overlap and not self.by_unit:
            self.reducer.launch_in_order()

    def _grads_of(self, leaves: list[torch.Tensor], unit: str
                  ) -> list[torch.Tensor | None]:
        """Leaves' gradients as the engine reduces them (a tensor-parallel face's: its
        local piece's, see TensorParallel.local_grads)."""
        if self.tp is None:
            return [leaf.grad for leaf in leaves]
        return self.tp.local_grads(leaves, unit)

    def _stage0_put(self, s: FlatParam, view: torch.Tensor, grad: torch.Tensor) -> None:
        """Stage 0: a fresh gradient into the parameter's view of the buffer. Without
        mixed precision a fresh ``.grad`` means it was None (zero_grad, or the user):
        it replaces. Under mixed precision the compute ``.grad`` is ours and detached at
        every reduction, and the user's ``.grad`` (fp32, unscaled) is the sum so far,
        which DDP would accumulate into: start from it (edits included), then add."""
        user = s.user
        if not self.faces.swap or user.grad is None:
            view.copy_(grad)
            return
        base = user.grad.detach()
        view.copy_(base * self.scaler.scale if self.scaler.enabled else base)
        view.add_(grad)

    def unit_done(self, u: Unit) -> None:
        """Stage 3: the unit's backward is done and its weights freed (stage3.py): reduce
        its buckets, whatever their parameters received (see [Note: collective order in
        backward]; a missing gradient counts as zeros)."""
        if not self.sync:
            return
        for b in u.trainable:
            if not b.reduction.launched:
                self._fold(b)
                self.reducer.launch(b)

    def _fold(self, b: FlatBucket) -> None:
        """Stage 3: move a unit's gradients, as autograd left them on its parameters, into
        one whole buffer for its reduce-scatter. A unit's buffer is allocated only once its
        last gradient has arrived, as FSDP2 does: early in a unit's backward, where its
        activations are all still alive, the unit holds only the gradients produced so far,
        not a whole unit's worth (the cost: both for a moment at the end, once the unit's
        activations are gone)."""
        self.reducer.new_grad(b)
        self._take_param_grads(b)

    def _take_param_grads(self, b: FlatBucket) -> None:
        """Move gradients autograd left on the bucket's parameters into its buffer, for
        slots the buffer has none for: stage 3 (see _fold), and at stage 2 a parameter
        unused in a synchronised backward that still holds gradients from no_sync()."""
        leaves = [(s, leaf) for s in b.slots for leaf in s.leaves]
        if self.by_unit:  # a unit's: the same on every tp rank (see local_grads)
            grads = self._grads_of([leaf for _, leaf in leaves], b.name)
        else:
            grads = [self._grads_of([leaf], s.names[0])[0] for s, leaf in leaves]
        for (s, leaf), g in zip(leaves, grads):
            i = s.index
            # Stage 0's .grad may be the buffer's own view: already in.
            if g is None or (s.valid and same_memory(g, b.slot_view(b.grad, i))):
                continue
            if not self.policy.shard_optimizer:
                self._stage0_put(s, b.slot_view(b.grad, i), g)
            else:
                if self.policy.keep_full_grads:
                    self.reducer.stash(b)
                b.put_grad(b.grad, i, g, add=s.valid)
            s.valid = True
            leaf.grad = None

    def finish(self) -> None:
        """See [Note: end of backward]."""
        outer = torch._C._current_autograd_node()
        if outer is not None:
            # A reentrant backward (torch.utils.checkpoint with use_reentrant=True runs one
            # per region, from inside the outer backward's node) has ended, not the
            # backward: finish when the outer node is done, in the outer backward.
            outer.register_hook(lambda *_: torch.autograd.Variable._execution_engine
                                .queue_callback(self.finish))
            return
        self.tied.settle_unfinished()
        self.queued = False
        self.ended = True  # see _backward_begins in forward.py
        self.schedule.end_backward()
        self.faces.hold(compute=False)
        if not self.sync:
            self.reducer.rearm()
            for b in self.buckets:
                b.marks.ready = 0
                for s in b.slots:
                    s.arrived.clear()
            return
        self._launch_rest()
        late = self._agree_on_usage()
        reducer = self.reducer
        for b in late:  # parts of gradients that arrived after their unit's reduction
            self._fold(b)  # zeros where this rank has none: every rank reduces it
            reducer.launch(b, phase="late")  # its reduced slice adds to the first one's
        reducer.drain()
        reducer.rearm()
        self.grads.publish()

    def _launch_rest(self) -> None:
        """End of a synchronised backward: launch every bucket not launched yet, in
        order ([Note: collective order in backward]), and wait for all of them."""
        reducer = self.reducer
        for b in self.buckets:
            if not b.reduction.launched:
                if self.by_unit:
                    self._fold(b)  # some parameters got no gradient in this backward
                else:
                    if b.grad is None:  # stage 2, no gradient at all for this bucket
                        reducer.new_grad(b, zeros=True)
                    self._take_param_grads(b)
                reducer.launch(b)
            b.marks.ready = 0
            for s in b.slots:
                s.arrived.clear()
        reducer.next_launch = 0
        reducer.drain()

    def _agree_on_usage(self) -> list[FlatBucket]:
        """End of a synchronised backward: every rank learns which parameters some rank
        produced a gradient for (the others keep ``grad = None``, as under DDP, and the
        step skips them) and, at stage 3, which buckets some rank holds a late gradient
        part for (every rank then reduces those buckets again, so that what is reduced
        never depends on one rank's data). One small all-reduce per synchronised
        backward, as DDP's ``find_unused_parameters``. Returns the late buckets."""
        n = sum(len(b.slots) for b in self.buckets)
        flags = self._flags
        if flags is None:
            flags = self._flags = torch.empty(n + len(self.buckets), device=self.device)
        late = [float(self.by_unit and any(leaf.grad is not None for s in b.slots
                                           for leaf in s.leaves)) for b in self.buckets]
        # Built on the host (where the hooks wrote the flags), one copy to the device.
        flags.copy_(torch.cat([b.marks.used for b in self.buckets] + [torch.tensor(late)]))
        self.world.all_reduce(flags, phase="control", unit="used").wait()
        if is_fake(flags):  # a trace (memory/traced.py) reads no values: all were used
            for b in self.buckets:
                b.marks.unused = set()
            return []
        values = flags.tolist()  # one read, not one per slot
        k = 0
        for b in self.buckets:
            b.marks.unused = {j for j in range(len(b.slots)) if values[k + j] == 0}
            k += len(b.slots)
        return [b for b, f in zip(self.buckets, values[n:]) if f > 0]
