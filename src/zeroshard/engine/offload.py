"""ZeRO-Offload: what lives in host memory, and the copies between host and device.

[Note: offload]
``offload="optimizer"`` (stages 1-3) keeps each bucket's ``master`` (fp32 weights, which
the optimizer steps) and so the optimizer state and the step itself in host memory; the
device keeps the compute-dtype weights and runs forward and backward. Per step:

* backward: as soon as a bucket's reduction completes, its reduced slice is copied
  device -> host into ``host.grad`` (non-blocking, into pinned memory), while backward
  goes on; at stages 2-3 the device keeps no copy of it (ZeRO-Offload: gradients live
  on the host), at stage 1 it stays inside the whole gradient buffer. ``prepare_grads``
  copies the buckets that had no copy started yet, then synchronises once with the
  device;
* step: on the host (a fused, multi-threaded AdamW by default: api.py);
* after the step: the updated slice is cast on the host (into a pinned compute-dtype
  staging buffer, ``host.weights``, so only 2 bytes per element cross PCIe under a
  16-bit recipe) and copied host -> device (stages 1-2: into the whole buffer, then
  all-gathered; stage 3: into ``shard16``).

``offload="optimizer+params"`` (stage 3 only) also keeps ``shard16`` — the compute-dtype
slice each rank holds between uses — on the host: a unit's gather first copies the slice
host -> device (non-blocking: on the same stream, so ordered before the all-gather that
reads it), and the step writes the updated slice straight into host memory. The device
then holds no model state between uses at all, only the gathered units, the reductions
in flight and activations (DeepSpeed's ZeRO-Infinity offload_param, to CPU).

Where the device *is* the host (a CPU run) nothing moves and nothing is copied; tests
force the copy path there (``_FORCE_HOST_COPIES`` in engine.py) to check it trains bit
for bit like no offload. Host tensors are pinned when CUDA is available, so the copies
can be asynchronous.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable

import torch

from .flat import FlatBucket

__all__ = ["Offload", "host_threads"]


class Offload:
    """The offload mode of one engine, and the host side of its copies."""

    def __init__(self, mode: str | None, device: torch.device, force: bool) -> None:
        self.mode = mode
        # Host and device coincide on a CPU run: nothing to move unless forced (tests).
        self.enabled = mode is not None and (device.type != "cpu" or force)
        self.params = self.enabled and mode == "optimizer+params"
        self.device = device
        self.host = torch.device("cpu")
        # Pinned host memory only serves copies to a CUDA device (and a trace's fake CPU
        # tensors cannot be pinned).
        self._pin = device.type == "cuda" and torch.cuda.is_available()
        if self.enabled and device.type != "cpu":
            host_threads()

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A (pinned) host copy of ``t``; pinned, so copies to the device can overlap."""
        t = t.detach().to(self.host, copy=True)
        return t.pin_memory() if self._pin else t

    def empty_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device=self.host, pin_memory=self._pin)

    def start_grad_copy(self, b: FlatBucket, g: torch.Tensor) -> None:
        """Start copying a reduced slice into the bucket's host buffer (non-blocking)."""
        if b.host.grad is None:
            b.host.grad = self.empty_like(g)
        b.host.grad.copy_(g, non_blocking=True)
        b.host.fresh = True

    def forget_grad(self, b: FlatBucket) -> None:
        """The host buffer no longer holds the bucket's reduced slice (zero_grad, or a
        stash whose sum is formed at the step); it is kept for the next copy."""
        b.host.fresh = False

    def zero_grad(self, b: FlatBucket, dtype: torch.dtype) -> None:
        """A zero host gradient (a step with no backward since ``zero_grad``)."""
        if b.host.grad is None:
            b.host.grad = torch.empty(b.shard_numel, dtype=dtype, device=self.host,
                                      pin_memory=self._pin)
        self.wait_copies()  # nothing in flight reads or writes it
        b.host.grad.zero_()
        b.host.fresh = True

    def upload(self, b: FlatBucket, target: torch.Tensor) -> None:
        """Updated master slice -> the device's compute-dtype slice ``target``. Cast on the
        host first, into a pinned staging buffer, so only the compute dtype's bytes cross
        PCIe, asynchronously (the next step's ``wait_copies`` comes before the staging
        buffer is written again)."""
        src = b.master.detach()
        if src.dtype != target.dtype:
            if b.host.weights is None:
                b.host.weights = self.empty_like(target)
            b.host.weights.copy_(src)
            src = b.host.weights
        target.copy_(src, non_blocking=True)

    def wait_copies(self) -> None:
        """Before the host reads what the device copied: one synchronisation."""
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.current_stream(self.device).synchronize()

    def host_tensors(self, buckets: Iterable[FlatBucket]) -> list[torch.Tensor]:
        """What lives in host memory by design (for the memory tracker)."""
        if not self.enabled:
            return []
        out: list[torch.Tensor] = []
        for b in buckets:
            out += [t for t in (b.master, b.host.grad, b.host.weights) if t is not None]
            if b.master_grad is not None:
                out.append(b.master_grad)
            if self.params and b.shard16 is not None:
                out.append(b.shard16)
        return out


def host_threads() -> int:
    """Give the host optimizer step the cores of this rank's share of the machine.

    torchrun sets ``OMP_NUM_THREADS=1`` for every worker unless told otherwise, which would
    run the host AdamW on one core: offload's bottleneck made several times slower. So
    when torch runs single-threaded, take ``ZEROSHARD_HOST_THREADS`` if set, else the
    usable cores divided by the ranks on this node (``LOCAL_WORLD_SIZE``).
    """
    want = os.environ.get("ZEROSHARD_HOST_THREADS")
    if want is None and torch.get_num_threads() > 1:
        return torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    if want is not None and not (want.isdigit() and int(want) > 0):
        raise ValueError(f"ZEROSHARD_HOST_THREADS={want!r} must be a positive integer (threads "
                         "for the host optimizer step), e.g. 8; or unset it")
    n = int(want) if want else max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if n != torch.get_num_threads():
        warnings.warn(f"zeroshard offload: the host optimizer step runs on {n} threads "
                      f"(torch had {torch.get_num_threads()}); set ZEROSHARD_HOST_THREADS to "
                      "choose", stacklevel=3)
        torch.set_num_threads(n)
    return n
