"""The gradients the optimizer step reads: formed from the reduced slices, published on
the user parameters, adopted back where the user assigned ``.grad``, clipped, cleared.

Backward leaves each bucket's reduced slice (``reduction.shard``, the stage-1 whole buffer or
the host copy; see reduction.py). Before the step every master gets its fp32, unscaled
``master_grad`` from it (``prepare``), and the user parameters' ``.grad`` become views of
that (``publish``; [Note: parameters the user sees] in params.py).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..comm import Comm
from .chunks import set_master_grad
from .flat import FlatBucket
from .offload import Offload
from .params import Faces
from .policy import StagePolicy
from .precision import LossScaler
from .reduction import Reducer
from .storage import same_memory
from .tensor_parallel import TensorParallel
from .tied import TiedGrads

__all__ = ["StepGrads"]


class StepGrads:
    """Forms, publishes, adopts, measures and clears the masters' gradients."""

    def __init__(self, *, policy: StagePolicy, comm: Comm, world: Comm, device: torch.device,
                 buckets: list[FlatBucket], faces: Faces, reducer: Reducer,
                 offloader: Offload, scaler: LossScaler, tied: TiedGrads,
                 tp: TensorParallel | None = None) -> None:
        self.policy = policy
        self.tp = tp  # tensor parallelism: tp ranks hold other pieces (tensor_parallel.py)
        self.comm = comm
        self.world = world
        self.device = device
        self.buckets = buckets
        self.faces = faces
        self.reducer = reducer
        self.offloader = offloader
        self.scaler = scaler
        self.tied = tied
        self.prepared = False  # master_grad formed since the last backward
        self.overflow = False
        self.used_flags: torch.Tensor | None = None  # see gather_used_flags

    def publish(self) -> None:
        """Form the masters' fp32 gradients and show them on the user parameters (None
        for those no rank produced one for, see _agree_on_usage in backward.py)."""
        self.prepare()
        for b in self.buckets:
            self.faces.publish_grads(b, b.marks.unused)

    def adopt_user_grads(self) -> None:
        """Before the step (and zeroshard's own clipping): take in ``.grad`` the user
        assigned since the gradients were published.

        [Note: assigned gradients]
        The optimizer steps the engine's ``master_grad``, and each parameter's ``.grad``
        is a view of its part, so in-place edits (``p.grad.mul_``, torch's clipping) reach
        the step. Torch also lets a script *assign* ``.grad``: ``p.grad = None`` makes
        torch's optimizers skip the parameter, ``p.grad = p.grad * 0.5`` steps the new
        tensor. Both once went unseen (the step used the reduced gradient: silently
        wrong, at every stage). Now a new tensor's values (a DTensor like the published
        one, or the whole gradient, of which this rank takes its rows) are copied into
        ``master_grad`` and ``.grad`` views it again; ``None`` marks the parameter unused on
        this rank, so where every rank cleared it the step skips it as torch does, its
        optimizer state and AdamW's ``step`` untouched (as for a parameter no rank used,
        see chunks.skip_slots).

        With no backward since the last step or zero_grad (nothing published), an
        assigned ``.grad`` is stepped too and the parameters left at None are skipped: a
        script that computes gradients itself does this, and so does torch — DCP's
        ``get_state_dict`` builds a fresh optimizer's state before ``dcp.load`` fills it
        (``_init_optim_state``: zero ``.grad`` on every parameter, one step at lr=0).
        Ignoring it left that state empty: the resumed run went on with fresh Adam
        moments, silently."""
        published = self.faces.published
        for b in self.buckets:
            for i, s in enumerate(b.slots):
                g = s.user.grad
                target = (b.local(b.master_grad, i) if self.faces.sharded
                          else b.slot_view(b.master_grad, i))
                if g is None:
                    if published:  # torch's optimizers skip it: so does the step (unused)
                        b.marks.used[i] = 0.0
                        target.zero_()
                    continue
                local = self._local_grad(b, i, g)
                if same_memory(local, target):
                    continue
                target.copy_(local)
                b.marks.used[i] = 1.0  # stepped, as torch steps a parameter with a .grad
                self.faces.publish_slot(b, i)

    def rebase(self) -> None:
        """As a backward begins after another (no ``zero_grad`` between): the next one must
        add to the gradients as the user left them.

        [Note: gradients edited between backwards]
        Under torch, ``p.grad = None`` between two backwards makes the second one start
        ``p``'s gradient afresh, ``p.grad = p.grad * 0.5`` or ``p.grad.mul_(0.5)`` makes it
        add to the halved one — what one optimizer's ``zero_grad()`` does when several
        share a model (a GAN's generator and discriminator), or a script scaling the
        gradients of the first micro-batches. The engine's backward adds into its own
        accumulator (the reduced slices, or stage 0's whole buffer), which still held the
        old sum wherever ``.grad`` is not that accumulator itself (stages 1-3 with the
        gradient assigned; mixed precision, where ``.grad`` views an fp32 copy): the
        second backward silently added to it (measured: 0.04 from DDP's weights after 2
        steps). So here what the user left (zeros for None: the parameter is unused until
        a gradient reaches it again) is adopted into ``master_grad`` and written back into
        the accumulator, in its dtype and loss scale (with offload at stages 2-3 the host
        copy, which later reductions add to). Stage 0 with the user parameters computing
        needs none of it (their ``.grad`` is the accumulator, and autograd starts a fresh
        one where it is None)."""
        if not self.faces.published:
            return
        if not self.faces.sharded and not self.faces.swap:
            return
        self.adopt_user_grads()
        whole = self.policy.reduce_op == "all_reduce"  # stage 0: the whole-layout buffer
        # offload at stages 2-3: later reductions add on the host (Reducer._add_to_host)
        on_host = self.offloader.enabled and not self.policy.keep_full_grads
        for b in self.buckets:
            acc = (b.grad if whole else (b.host.grad if b.host.fresh else None) if on_host
                   else self.reducer.reduced_slice(b))
            if acc is None or b.master_grad is None:
                continue
            for i in range(len(b.slots)):
                into = b.slot_view(acc, i) if whole else b.local(acc, i)
                value = (b.slot_view(b.master_grad, i) if not self.faces.sharded
                         else b.local(b.master_grad, i))
                if not same_memory(into, value):
                    into.copy_(value * self.scaler.scale if self.scaler.enabled else value)

    def _local_grad(self, b: FlatBucket, i: int, g: torch.Tensor) -> torch.Tensor:
        """This rank's part of a gradient the user assigned to slot ``i``'s parameter."""
        from torch.distributed.tensor import DTensor

        s = b.slots[i]
        name = s.names[0]
        shape = self.tp.global_shape(s.param) if self.tp is not None else s.shape
        if tuple(g.shape) != tuple(shape):
            raise ValueError(
                f"the .grad assigned to parameter {name!r} has shape {tuple(g.shape)}, the "
                f"parameter {tuple(shape)}: assign a gradient shaped like the parameter")
        if isinstance(g, DTensor):
            want = s.spec.placements
            if tuple(g.placements) != tuple(want) or g.device_mesh != self.faces.mesh:
                raise ValueError(
                    f"the .grad assigned to parameter {name!r} is a DTensor placed as "
                    f"{g.placements} on another mesh or layout than the parameter's "
                    f"{want}: build it from the parameter's own .grad "
                    "(e.g. p.grad * 0.5), or assign a whole (non-DTensor) tensor")
            return g._local_tensor  # not to_local(): an autograd op, per slot and step
        if not self.faces.sharded:
            return g
        if self.tp is not None:  # this tp rank's piece first
            g = self.tp.local_piece(s.param, g)
        lo, hi = s.piece(b.rank)
        return g.detach().reshape(-1)[lo:hi].view(s.local_shape(b.rank))

    def prepare(self) -> bool:
        """Give every master its fp32, unscaled gradient; return True if any overflowed.

        Idempotent until the next backward.
        """
        if self.prepared:
            return self.overflow
        grads = []
        reducer = self.reducer
        for b in self.buckets:
            if self.offloader.enabled:  # copies started in backward; the rest go now
                if not b.host.fresh and reducer.in_place(b):
                    self.offloader.start_grad_copy(b, reducer.reduced_slice(b))
                elif not b.host.fresh:  # no backward since zero_grad: a zero gradient
                    self.offloader.zero_grad(b, reducer.reduce_dtype_of(b))
                grads.append(b.host.grad)
                continue
            if self.policy.reduce_op == "all_reduce" and b.grad is None:
                reducer.new_grad(b, zeros=True)  # no backward since zero_grad
            grads.append(b.grad if self.policy.reduce_op == "all_reduce"
                         else reducer.reduced_slice(b))
        if self.offloader.enabled:
            self.offloader.wait_copies()
        for b, g in zip(self.buckets, grads):
            if g.dtype == b.master_dtype and not self.scaler.enabled:
                set_master_grad(b, g)
            else:
                # A copy even where the dtypes agree: ``g`` is the accumulator later
                # backwards add (scaled) gradients to, so it must stay scaled.
                set_master_grad(b, g.to(b.master_dtype, copy=True))
                if self.scaler.enabled:
                    b.master_grad.div_(self.scaler.scale)
        self.overflow = False
        if self.scaler.enabled:
            bad = torch.zeros(1, device=b.master_grad.device)
            for b in self.buckets:
                bad += (~torch.isfinite(b.master_grad)).any().float()
            bad = bad.to(self.device)  # collectives run on the device (NCCL needs it)
            self.world.all_reduce(bad, phase="control", unit="overflow").wait()
            if self.tp is not None:  # every tp rank skips the step, or none does
                self.tp.comm.all_reduce(bad, phase="control", unit="overflow").wait()
            self.overflow = bool(bad.item() > 0)
        self.prepared = True
        return self.overflow

    def norm(self, norm_type: float) -> torch.Tensor:
        """The global gradient norm, equal to clip_grad_norm_'s on the unsharded model."""
        self.prepare()
        self.adopt_user_grads()
        grads = [b.master_grad for b in self.buckets]
        device = grads[0].device
        sharded = self.policy.shard_optimizer
        if norm_type == float("inf"):
            local = torch.stack([g.abs().max() for g in grads]).max().float().to(self.device)
            for c in self._norm_comms(sharded):
                c.all_reduce(local, phase="control", unit="grad_norm",
                             op=dist.ReduceOp.MAX).wait()
            return local.to(device)
        # fp32 at least, as torch sums a norm in the gradients' dtype (a float64 model's
        # norm in float32 was 2e-8 off DDP's)
        acc = functools.reduce(torch.promote_types, [g.dtype for g in grads], torch.float32)
        local = torch.zeros((), dtype=acc, device=device)
        for g in self._counted_once(grads):
            local += g.to(acc).pow(norm_type).sum()
        local = local.to(self.device)  # offloaded grads live on the host
        for c in self._norm_comms(sharded):
            c.all_reduce(local, phase="control", unit="grad_norm").wait()
        return local.pow(1.0 / norm_type).to(device)

    def _norm_comms(self, sharded: bool) -> list[Comm]:
        """Who sums a norm: the sharding group (replicas hold equal slices), then tp."""
        return ([self.comm] if sharded else []) + ([self.tp.comm] if self.tp else [])

    def _counted_once(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients this rank counts in a global norm: all of them, or under tensor
        parallelism the pieces of tp-sharded parameters and, on tp rank 0 only, those
        of parameters every tp rank holds whole."""
        if self.tp is None:
            return grads
        out = []
        for b, g in zip(self.buckets, grads):
            out += [g[lo:hi] for s, lo, hi in b.slots_in_shard()
                    if self.tp.counted_once(s.param)]
        return out

    def scale(self, coef: torch.Tensor) -> None:
        for b in self.buckets:
            b.master_grad.mul_(coef.to(b.master_grad.dtype))

    def gather_used_flags(self) -> torch.Tensor:
        """Every rank's "got a gradient" flags, summed, in one persistent buffer (a new
        tensor per step would be held for a while by the collective library)."""
        flags = self.used_flags
        if flags is None:
            flags = self.used_flags = torch.empty(sum(len(b.slots) for b in self.buckets),
                                                  device=self.device)
        flags.copy_(torch.cat([b.marks.used for b in self.buckets]))  # host flags: one copy
        self.world.all_reduce(flags, phase="control", unit="used").wait()
        return flags

    def unused_slots(self, flags: list[float]) -> list[tuple[FlatBucket, set[int]]]:
        """Per bucket, the slots whose summed flag (``flags``, see gather_used_flags) is
        0: parameters no rank produced a gradient for (or whose ``.grad`` every rank set
        to None). The step skips them (chunks.skip_slots)."""
        out: list[tuple[FlatBucket, set[int]]] = []
        k = 0
        for b in self.buckets:
            unused = {j for j in range(len(b.slots)) if flags[k + j] == 0}
            k += len(b.slots)
            if unused:
                out.append((b, unused))
        return out

    def zero(self, set_to_none: bool = True) -> None:
        """Clear every gradient. ``set_to_none=True``: free the gradient buffers (the next
        backward allocates them; see [Note: buffer lifetimes] in engine.py). False, as
        torch: the parameters' ``.grad`` stay, as zeros (stage 0: the buffer's views;
        otherwise the masters' gradients)."""
        self.clear()
        if set_to_none:
            return
        for b in self.buckets:
            if not self.policy.shard_optimizer and not self.faces.swap:
                self.reducer.new_grad(b, zeros=True)
                b.grad_views(b.grad)
                continue
            set_master_grad(b, torch.zeros(b.shard_numel, dtype=b.master_dtype,
                                           device=b.master_device))
            self.faces.publish_grads(b)

    def clear(self) -> None:
        """Free every gradient buffer (see [Note: buffer lifetimes] in engine.py); the next
        backward allocates them again."""
        for b in self.buckets:
            self.reducer.forget(b)
            set_master_grad(b, None)
            b.marks.used.zero_()
            for s in b.slots:
                s.valid = False
            self.faces.clear_grads(b)
        self.tied.earlier.clear()
        self.prepared = False
