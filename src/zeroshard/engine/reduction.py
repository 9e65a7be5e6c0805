"""The gradient pipeline's collectives: whole-bucket gradient buffers, their reduction in
flight, and the reduced slices the step reads.

Arrival (which bucket is complete, in what order it may go) is the backward hooks' job
(backward.py, [Note: collective order in backward]); this file owns what happens from a
bucket's launch on: the buffer's allocation and accounting, the reduce-scatter (or, at
stage 0, all-reduce) in flight, its completion into ``reduction.shard`` / the whole buffer /
the host, and the bound on how many whole buffers exist at once. The buffers themselves
are described in [Note: buffer lifetimes] in engine.py.
"""

from __future__ import annotations

from collections import deque

import torch

from ..comm import Comm
from ..config import ShardConfig
from .flat import FlatBucket
from .offload import Offload
from .policy import StagePolicy
from .quantized_grads import TwoHop
from .storage import same_memory, shares

__all__ = ["Reducer"]

# Stages 2-3: reductions allowed in flight before backward waits for the oldest; bounds
# the number of whole-bucket gradient buffers alive at once. Stage 3's buckets are whole
# units, so it allows one, as FSDP2 does (a unit's reduce-scatter overlaps the next
# unit's backward).
_MAX_PENDING = 2
_MAX_PENDING_UNITS = 1


class Reducer:
    """Launches, tracks and completes the reduction of each bucket's gradient."""

    def __init__(self, *, policy: StagePolicy, config: ShardConfig, comm: Comm,
                 replicate: Comm | None, offloader: Offload, dp_size: int,
                 buckets: list[FlatBucket], by_unit: bool, two_hop: TwoHop | None = None,
                 ) -> None:
        self.policy = policy
        self.config = config
        self.comm = comm
        self.replicate = replicate  # hybrid sharding: reduced slices are summed over it
        self.two_hop = two_hop  # quantize_grads: [Note: quantised gradients]
        self.offloader = offloader
        self.dp_size = dp_size
        self.buckets = buckets  # the launch order (stages 0-2)
        self.compute_dtype = config.compute_dtype
        self.by_unit = by_unit
        self.limit = _MAX_PENDING_UNITS if by_unit else _MAX_PENDING
        # Stages 0-2: a synchronised backward reduces every bucket in order, one check
        # for all of them ([Note: one check per run] in comm_check.py).
        self.run_numel = sum(b.padded_numel for b in buckets)
        self.pending: deque[FlatBucket] = deque()  # launched, not yet completed
        self.next_launch = 0  # stages 0-2: the next bucket to launch, in order
        self.active_ranks: int | None = None  # ranks with data this step, inside join()
        # Whole-bucket gradient bytes (``b.grad``) alive now and at most (tests, plans).
        self.grad_buffer_bytes = 0
        self.peak_grad_buffer_bytes = 0

    # -- dtypes and layouts -----------------------------------------------------------------
    def reduce_dtype_of(self, b: FlatBucket) -> torch.dtype:
        return self.config.reduce_dtype or self.compute_dtype or b.dtype

    def in_place(self, b: FlatBucket) -> bool:
        """Stage 1: the reduced slice stays in the whole buffer (see [Note: buffer
        lifetimes] in engine.py) unless it is reduced in another dtype."""
        return (self.policy.keep_full_grads and self.policy.shard_optimizer
                and self.reduce_dtype_of(b) == (self.compute_dtype or b.dtype))

    def stash(self, b: FlatBucket) -> None:
        """Stage 1: move a reduced slice out of the way before the buffer is reused."""
        if not b.reduction.reduced:
            return
        own = b.shard_of(b.grad)
        b.reduction.shard = own.clone() if b.reduction.shard is None else b.reduction.shard.add_(own)
        b.reduction.reduced = False

    # -- whole buffers ----------------------------------------------------------------------
    def new_grad(self, b: FlatBucket, zeros: bool = False) -> None:
        """Allocate the bucket's whole gradient buffer (compute dtype, gathered layout),
        counting the most alive at once (``peak_grad_buffer_bytes``)."""
        self.complete_done()
        self.drop_grad(b)
        make = torch.zeros if zeros else torch.empty
        b.grad = make(b.padded_numel, dtype=self.compute_dtype or b.dtype, device=b.device)
        self.grad_buffer_bytes += b.grad.untyped_storage().nbytes()
        self.peak_grad_buffer_bytes = max(self.peak_grad_buffer_bytes, self.grad_buffer_bytes)

    def drop_grad(self, b: FlatBucket) -> None:
        if b.grad is not None:
            self.grad_buffer_bytes -= b.grad.untyped_storage().nbytes()
            b.grad = None

    def forget(self, b: FlatBucket) -> None:
        """zero_grad: nothing reduced since is kept — the whole buffer, the reduced slice
        (and its host copy's freshness)."""
        b.reduction.shard = None
        self.drop_grad(b)
        b.reduction.reduced = False
        self.offloader.forget_grad(b)

    def rearm(self) -> None:
        """A new backward may launch every bucket again (the end of the last one, or of
        one inside ``no_sync()``)."""
        for b in self.buckets:
            b.reduction.launched = False

    # -- launch -----------------------------------------------------------------------------
    def launch_in_order(self) -> None:
        """Stages 0-2: launch the complete buckets at the head of the launch order
        (``self.buckets``), never one ahead of an incomplete one: see [Note: collective
        order in backward] in backward.py."""
        order = self.buckets
        while self.next_launch < len(order):
            b = order[self.next_launch]
            if not b.reduction.launched:
                if b.marks.ready < len(b.slots):
                    return
                self.launch(b)
            self.next_launch += 1

    def launch(self, b: FlatBucket, phase: str = "backward") -> None:
        """Start reducing a bucket's gradient (average over ranks)."""
        src = b.grad
        assert src is not None
        if not self.policy.shard_optimizer:
            # Stage 0's .grad are views of the buffer being reduced: detach them, so a late
            # part of a gradient (see BackwardPass.on_grad) arrives as a new tensor and is refused
            # instead of being added into the buffer in flight. publish_grads restores them.
            for s in b.slots:
                s.param.grad = None
        if self.policy.keep_full_grads:
            self.stash(b)
        for s in b.slots:
            if not s.valid:  # no gradient since the last reduction: contributes zeros
                b.grad_region(src, s.index).zero_()
        rdtype = self.reduce_dtype_of(b)
        buf = src if src.dtype == rdtype else src.to(rdtype)
        if self.predivide(rdtype):
            buf.div_(self.divisor())
        checks = ({} if self.by_unit or phase != "backward" else
                  self.comm.run_check(b is self.buckets[0], self.run_numel))
        if self.policy.reduce_op == "all_reduce":
            pending = self.comm.all_reduce(buf, phase=phase, unit=b.name,
                                           async_op=self.config.overlap, **checks)
        elif self.two_hop is not None and self.two_hop.applies(buf):
            pending = self.two_hop.launch(buf, b.index, phase=phase, unit=b.name)
        else:
            pending = self.comm.reduce_scatter(buf, phase=phase, unit=b.name,
                                               async_op=self.config.overlap, **checks)
        b.reduction.pending = (pending, buf)
        b.reduction.launched = True
        self.pending.append(b)
        if not self.policy.keep_full_grads and len(self.pending) > self.limit:
            self.complete(self.pending.popleft())

    def divisor(self) -> int:
        """Ranks whose gradients are averaged: all, or those with data inside join()."""
        return self.active_ranks or self.dp_size

    def predivide(self, dtype: torch.dtype) -> bool:
        """Average before summing where a sum could overflow (fp16) and at stage 0 (whose
        result is the whole gradient anyway); otherwise divide only the reduced slice."""
        return dtype == torch.float16 or self.policy.reduce_op == "all_reduce"

    # -- completion -------------------------------------------------------------------------
    def drain(self) -> None:
        """Wait for every reduction in flight, oldest first."""
        while self.pending:
            self.complete(self.pending.popleft())

    def complete_done(self) -> None:
        """Stages 2-3, before a new whole buffer is allocated: complete the reductions
        that have finished, oldest first, so their whole buffers are freed first rather
        than when the in-flight limit or the end of backward next waits for them (on
        gpt2-small a finished bucket's buffer beside the next one was most of stage 2's
        peak above its floor). Only here: completing keeps the reduced slice (a copy, 1/N
        of the bucket, where it views the whole buffer), and that transient must not land
        on a gradient's arrival, which can be backward's largest moment (a tied table's
        second part). Not with hybrid sharding: there completing issues a collective (the
        replicas' all-reduce), which must not depend on when each rank polls."""
        if self.policy.keep_full_grads or self.replicate is not None:
            return
        while self.pending and self.pending[0].reduction.pending[0].done():
            self.complete(self.pending.popleft())

    def complete(self, b: FlatBucket) -> None:
        pending, buf = b.reduction.pending
        out = pending.wait()
        b.reduction.pending = None
        if self.policy.reduce_op == "all_reduce":
            if buf is not b.grad:  # reduced in another dtype: keep the reduced values
                b.grad.copy_(buf)
            # Every slot now holds the average on every rank, also where this rank had
            # no gradient: a later backward before the step adds to it (accumulation).
            for s in b.slots:
                s.valid = True
            return
        if self.replicate is not None:  # hybrid: sum the slice over the replicas too
            self.replicate.all_reduce(out, phase="backward", unit=b.name).wait()
        divisor = None if self.predivide(buf.dtype) else self.divisor()
        if (b.reduction.shard is None and not self.in_place(b) and not self.offloader.enabled
                and shares(out, buf)):
            # The first reduction since zero_grad, a view of the whole buffer freed below:
            # keep a copy, divided on the way (one pass over the slice, not two).
            b.reduction.shard = out.clone() if divisor is None else out.div(divisor)
            self._release(b)
            return
        if divisor is not None:
            out.div_(divisor)  # 1/N of the work of dividing the whole bucket
        if self.in_place(b):
            own = b.shard_of(b.grad)
            if not same_memory(out, own):
                own.copy_(out)
            b.reduction.reduced = True
            if self.offloader.enabled:
                self._start_host_copy(b)
        elif self.offloader.enabled:
            self._add_to_host(b, out)
        elif b.reduction.shard is None:  # the first reduction since zero_grad: keep its result
            b.reduction.shard = out
        else:
            b.reduction.shard.add_(out)
        self._release(b)

    def _release(self, b: FlatBucket) -> None:
        """After a reduction: the whole buffer's slots are stale (stage 1 keeps it)."""
        for s in b.slots:  # see [Note: buffer lifetimes] in engine.py
            s.valid = False
        if self.policy.keep_full_grads:
            for s in b.slots:
                s.param.grad = None  # the next gradient is copied in, not added
        else:
            self.drop_grad(b)

    def _start_host_copy(self, b: FlatBucket) -> None:
        """Offload, stage 1: start copying the reduced slice (inside the whole gradient
        buffer) to the host now. A later reduction before the step (accumulation) copies
        again."""
        if b.reduction.shard is not None:  # a stash: the sum is formed at the step
            self.offloader.forget_grad(b)
            return
        self.offloader.start_grad_copy(b, self.reduced_slice(b))

    def _add_to_host(self, b: FlatBucket, out: torch.Tensor) -> None:
        """Offload, stages 2-3: the reduced slice goes to the host at once (non-blocking,
        overlapping the rest of backward); the device keeps no copy. A second reduction
        before the step (accumulation without no_sync) adds on the host, synchronously."""
        if b.host.fresh:
            self.offloader.wait_copies()  # the first slice's copy into host.grad has landed
            b.host.grad.add_(out.to(b.host.grad.device))
        else:
            self.offloader.start_grad_copy(b, out)

    def reduced_slice(self, b: FlatBucket) -> torch.Tensor:
        """This rank's reduced slice of the bucket's gradient (zeros if no backward ran
        since zero_grad), in the reduce dtype."""
        if b.reduction.shard is None and (not self.in_place(b) or b.grad is None):
            # no backward since zero_grad: a zero gradient
            b.reduction.shard = torch.zeros(b.shard_numel, dtype=self.reduce_dtype_of(b),
                                       device=b.device)
        if not self.in_place(b) or b.grad is None:
            return b.reduction.shard
        own = b.shard_of(b.grad)
        if not b.reduction.reduced and b.reduction.shard is None:  # no backward since zero_grad
            own.zero_()
            b.reduction.reduced = True
        if b.reduction.shard is None:
            return own
        self.stash(b)  # accumulated over several synced backwards: sum in the stash
        return b.reduction.shard
