"""The data-parallel engine: buffers, backward hooks, gradient reduction, post-step gather.

[Note: buffer lifetimes]
Per bucket (see [Note: flat buckets] in flat.py), on every rank:

* ``full`` — compute-dtype weights, whole (stages 0-2: allocated at shard time, lives
  forever; stage 3: see units.py). Parameters are views into it.
* ``master`` — what the optimizer steps, in fp32 under mixed precision. Stage 0: whole.
  Stages >= 1: this rank's slice only. Without mixed precision it *is* a view of
  ``full`` (no copy); with it, a separate fp32 tensor.
* ``grad`` — compute-dtype gradients, whole. Stages 0-1: allocated at shard time and
  kept; parameters' ``.grad`` are views into it so autograd accumulates in place. Stage 2:
  allocated by the first gradient of the bucket in backward and freed as soon as its
  reduction completes, so at most ``_MAX_PENDING`` + 1 whole buckets exist at once.
* ``grad_shard`` — stages >= 1: this rank's reduced slice in the reduce dtype, kept until
  the step. It is separate from ``grad`` because a native reduce-scatter leaves the other
  ranks' slices of ``grad`` unreduced; accumulating the next micro-batch on top of them
  would be wrong, so ``grad`` is zeroed after every reduction and the reduced slices sum
  up in ``grad_shard`` instead (DeepSpeed's stage 1 keeps the same partition buffer).

[Note: end of backward]
The first gradient hook of a backward queues :meth:`Engine._finish_backward` on the
autograd engine; it runs once backward is done, launches reductions of buckets that
never became complete (parameters unused in this step) and waits for all in flight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from ..comm import Comm, Pending
from ..config import ShardConfig
from .flat import FlatBucket, cut_buckets
from .policy import StagePolicy
from .precision import LossScaler

__all__ = ["Engine"]

# Stage 2: reductions allowed in flight before backward waits for the oldest; bounds the
# number of whole-bucket gradient buffers alive at once.
_MAX_PENDING = 2


def _named_params(model: nn.Module) -> list[tuple[tuple[str, ...], nn.Parameter]]:
    """Unique parameters in registration order, each with every name it is known by."""
    names: dict[int, list[str]] = {}
    order: list[nn.Parameter] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in names:
            names[id(p)] = []
            order.append(p)
        names[id(p)].append(name)
    return [(tuple(names[id(p)]), p) for p in order]


class Engine:
    """Drives buckets through forward, backward and step according to a StagePolicy."""

    def __init__(self, model: nn.Module, config: ShardConfig, comm: Comm) -> None:
        self.model = model
        self.config = config
        self.comm = comm
        self.policy = StagePolicy(config.stage)
        self.compute_dtype = config.compute_dtype
        self.sync = True  # False inside no_sync(): accumulate locally, no communication
        self.scaler = LossScaler(
            config.init_scale, config.growth_factor, config.backoff_factor,
            config.growth_interval, enabled=config.mixed_precision == "fp16",
        )
        named = _named_params(model)
        self.frozen = [p for _, p in named if not p.requires_grad]
        trainable = [(n, p) for n, p in named if p.requires_grad]
        # Reverse registration order approximates the order backward produces gradients.
        self.buckets: list[FlatBucket] = cut_buckets(
            list(reversed(trainable)), config.bucket_bytes, comm.size, comm.rank
        )
        self._slot_of: dict[int, tuple[FlatBucket, int]] = {}
        for b in self.buckets:
            for i, s in enumerate(b.slots):
                self._slot_of[id(s.param)] = (b, i)
        self._pending: deque[FlatBucket] = deque()
        self._backward_queued = False
        self._grads_prepared = False
        self._overflow = False
        for b in self.buckets:
            self._materialize(b)
        self._handles = [
            s.param.register_post_accumulate_grad_hook(self._on_grad)
            for b in self.buckets for s in b.slots
        ]
        self._handles.append(model.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._post_forward))

    # -- set-up -----------------------------------------------------------------------------
    def reduce_dtype_of(self, b: FlatBucket) -> torch.dtype:
        return self.config.reduce_dtype or self.compute_dtype or b.dtype

    def _materialize(self, b: FlatBucket) -> None:
        """Allocate a bucket's buffers; every rank starts from rank 0's weights (as DDP)."""
        flat = b.flatten()
        self.comm.broadcast(flat, 0, phase="init", unit=b.name)
        compute = self.compute_dtype or b.dtype
        full = flat if compute == flat.dtype else flat.to(compute)
        b.full = full
        b.point_params_at(full)
        master_src = flat if self.compute_dtype is None else flat.float()
        if self.policy.shard_optimizer:
            master_src = b.shard_of(master_src)
            if self.compute_dtype is not None:
                master_src = master_src.clone()  # keep only the slice alive
        b.master = nn.Parameter(master_src)
        b.used = torch.zeros(len(b.slots), dtype=torch.float32, device=b.device)
        if self.policy.keep_full_grads:
            b.grad = torch.zeros(b.padded_numel, dtype=compute, device=b.device)
            b.grad_views(b.grad)
        if self.policy.shard_optimizer:
            b.grad_shard = torch.zeros(
                b.shard_numel, dtype=self.reduce_dtype_of(b), device=b.device
            )

    # -- forward hooks ------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.compute_dtype is None:
            return None
        cast = self._cast_floating
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    def _cast_floating(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(self.compute_dtype)
        return x

    def _post_forward(self, module: nn.Module, args, output):
        if self.scaler.enabled and torch.is_grad_enabled():
            # Scaling the gradient that enters the model equals scaling the loss (backward
            # is linear) and keeps the plain ``loss.backward()`` API. If the model returns a
            # scalar (a loss computed inside), scale only that: its gradient already flows
            # through the other outputs.
            leaves = [t for t in tree_flatten(output)[0]
                      if isinstance(t, torch.Tensor) and t.requires_grad]
            scalars = [t for t in leaves if t.dim() == 0]
            for t in scalars or leaves:
                t.register_hook(self._scale_grad)
        return output

    def _scale_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.scaler.scale

    # -- backward ---------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        b, i = self._slot_of[id(p)]
        b.used[i] = 1.0
        self._grads_prepared = False
        slot = b.slots[i]
        if self.policy.keep_full_grads:
            view = b.grad[slot.offset : slot.offset + slot.numel].view(slot.shape)
            if p.grad.data_ptr() != view.data_ptr():  # the user set .grad to None
                view.copy_(p.grad)
                p.grad = view
        elif self.sync:
            if b.grad is None:
                b.grad = torch.zeros(b.padded_numel, dtype=p.dtype, device=b.device)
            b.grad[slot.offset : slot.offset + slot.numel].view(slot.shape).add_(p.grad)
            p.grad = None
        # Inside no_sync() at stage 2 the parameter keeps its own (whole) .grad, which
        # autograd accumulates; the first synced backward folds it into the bucket.
        if not self.sync:
            return
        b.ready += 1
        if b.ready == len(b.slots) and self.config.overlap:
            self._launch(b)

    def _launch(self, b: FlatBucket) -> None:
        """Start reducing a bucket's gradient (average over ranks)."""
        src = b.grad
        assert src is not None
        rdtype = self.reduce_dtype_of(b)
        buf = src if src.dtype == rdtype else src.to(rdtype)
        buf.div_(self.comm.size)  # pre-divide, as DDP does, to keep 16-bit sums in range
        if self.policy.reduce_op == "all_reduce":
            pending = self.comm.all_reduce(buf, phase="backward", unit=b.name,
                                           async_op=self.config.overlap)
        else:
            pending = self.comm.reduce_scatter(buf, phase="backward", unit=b.name,
                                               async_op=self.config.overlap)
        b.pending = (pending, buf)
        self._pending.append(b)
        if not self.policy.keep_full_grads and len(self._pending) > _MAX_PENDING:
            self._complete(self._pending.popleft())

    def _complete(self, b: FlatBucket) -> None:
        pending, buf = b.pending
        out = pending.wait()
        b.pending = None
        if self.policy.reduce_op == "all_reduce":
            if buf is not b.grad:  # reduced in another dtype: keep the reduced values
                b.grad.copy_(buf)
            return
        b.grad_shard.add_(out)
        if self.policy.keep_full_grads:
            b.grad.zero_()  # see [Note: buffer lifetimes]
        else:
            b.grad = None

    def _finish_backward(self) -> None:
        """See [Note: end of backward]."""
        self._backward_queued = False
        if not self.sync:
            for b in self.buckets:
                b.ready = 0
            return
        for b in self.buckets:
            if b.pending is None and b.ready < len(b.slots):
                if b.grad is None:  # stage 2, no gradient at all for this bucket
                    b.grad = torch.zeros(b.padded_numel, dtype=self.compute_dtype or b.dtype,
                                         device=b.device)
                self._launch(b)
            b.ready = 0
        while self._pending:
            self._complete(self._pending.popleft())

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication (see docs/stages.md)."""
        prev, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = prev

    # -- step ------------------------------------------------------------------------------
    def master_params(self) -> list[nn.Parameter]:
        return [b.master for b in self.buckets]

    def prepare_grads(self) -> bool:
        """Give every master its fp32, unscaled gradient; return True if any overflowed.

        Idempotent until the next backward.
        """
        if self._grads_prepared:
            return self._overflow
        for b in self.buckets:
            g = b.grad if self.policy.reduce_op == "all_reduce" else b.grad_shard
            if g.dtype == b.master.dtype and not self.scaler.enabled:
                b.master.grad = g
            else:
                b.master.grad = g.to(b.master.dtype)
                if self.scaler.enabled:
                    b.master.grad.div_(self.scaler.scale)
        self._overflow = False
        if self.scaler.enabled:
            bad = torch.zeros(1, device=self.buckets[0].device)
            for b in self.buckets:
                bad += (~torch.isfinite(b.master.grad)).any().float()
            self.comm.all_reduce(bad, phase="control", unit="overflow").wait()
            self._overflow = bool(bad.item() > 0)
        self._grads_prepared = True
        return self._overflow

    def grad_norm(self, norm_type: float) -> torch.Tensor:
        """The global gradient norm, equal to clip_grad_norm_'s on the unsharded model."""
        self.prepare_grads()
        grads = [b.master.grad for b in self.buckets]
        device = grads[0].device
        sharded = self.policy.shard_optimizer
        if norm_type == float("inf"):
            local = torch.stack([g.abs().max() for g in grads]).max().float()
            if sharded:
                self.comm.all_reduce(local, phase="control", unit="grad_norm",
                                     op=dist.ReduceOp.MAX).wait()
            return local
        local = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            local += g.float().pow(norm_type).sum()
        if sharded:
            self.comm.all_reduce(local, phase="control", unit="grad_norm").wait()
        return local.pow(1.0 / norm_type)

    def scale_grads(self, coef: torch.Tensor) -> None:
        for b in self.buckets:
            b.master.grad.mul_(coef.to(b.master.grad.dtype))

    def unused_slots(self) -> list[tuple[FlatBucket, int, int]]:
        """Master ranges (bucket, lo, hi) of parameters no rank produced a gradient for."""
        flags = torch.cat([b.used for b in self.buckets])
        self.comm.all_reduce(flags, phase="control", unit="used").wait()
        out: list[tuple[FlatBucket, int, int]] = []
        k = 0
        for b in self.buckets:
            unused = {id(s.param) for j, s in enumerate(b.slots) if flags[k + j] == 0}
            k += len(b.slots)
            if not unused:
                continue
            if self.policy.shard_optimizer:
                out += [(b, lo, hi) for s, lo, hi in b.slots_in_shard() if id(s.param) in unused]
            else:
                out += [(b, s.offset, s.offset + s.numel) for s in b.slots if id(s.param) in unused]
        return out

    def after_step(self) -> None:
        """Return updated weights to the compute buffers (and to every rank)."""
        for b in self.buckets:
            target = b.shard_of(b.full) if self.policy.shard_optimizer else b.full
            if target.data_ptr() != b.master.data_ptr():
                target.copy_(b.master.detach())
            if self.policy.gather_after_step:
                self.comm.all_gather(b.full, phase="step", unit=b.name).wait()
            # the gloo path reuses ``full`` as the all-reduce buffer: restore views
        self.comm.ledger.mark_step()

    def zero_grad(self) -> None:
        for b in self.buckets:
            if b.grad is not None and self.policy.keep_full_grads:
                b.grad.zero_()
            if b.grad_shard is not None:
                b.grad_shard.zero_()
            b.master.grad = None
            b.used.zero_()
        if not self.policy.keep_full_grads:
            for b in self.buckets:
                for s in b.slots:
                    s.param.grad = None
        self._grads_prepared = False

    def skip_step(self) -> None:
        self.zero_grad()
        self.comm.ledger.mark_step()

    # -- state --------------------------------------------------------------------------
    def full_master(self, b: FlatBucket) -> torch.Tensor:
        """The whole fp32 (master-precision) flat weights of a bucket, on every rank."""
        if not self.policy.shard_optimizer:
            return b.master.detach()
        if b.master.data_ptr() == b.shard_of(b.full).data_ptr():
            return b.full  # fp32 without mixed precision: already whole and current
        full = torch.empty(b.padded_numel, dtype=b.master.dtype, device=b.device)
        self.comm.all_gather_into(full, b.master.detach(), phase="state", unit=b.name)
        return full

    def memory_sources(self) -> Callable[[], dict[str, list[torch.Tensor]]]:
        """Tensors by category, for the memory tracker (names match memory.Category)."""

        def sources() -> dict[str, list[torch.Tensor]]:
            params, grads, optim = [], [], []
            for b in self.buckets:
                params.append(b.full)
                grads += [t for t in (b.grad, b.grad_shard) if t is not None]
                if b.master.data_ptr() != b.full.data_ptr() and (
                    b.master.data_ptr() != b.shard_of(b.full).data_ptr()
                ):
                    optim.append(b.master)
                if b.master.grad is not None:
                    grads.append(b.master.grad)
            params += self.frozen
            return {"params": params, "grads": grads, "optim": optim}

        return sources
