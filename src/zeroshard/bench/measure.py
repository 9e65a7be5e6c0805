"""Instruments for one step: a collective byte counter, the peak RSS, and timing.

[Note: timed steps and measured steps are different steps]
The memory tracker is a ``TorchDispatchMode``: every op goes through Python, which slows
a step several times. So a configuration is never timed with it on. After its warm-up and
timed steps each configuration runs one *measured* step with the tracker (and, for
systems without a ledger, the collective counter) active; its throughput comes only from
the plain timed steps before. Both kinds are real training steps on the shared data, so
every configuration takes the same number of optimizer steps on the same batches. The
measured step must not be one of the first two: DDP rebuilds its gradient buckets in its
second step, and zeroshard's stage 2 allocates its gradient stash then, so a second step
measures more (or other) bytes than every later one. With the defaults (two warm-up steps,
five timed) it is the eighth.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_flatten

from zeroshard.memory.tracker import MemoryTracker

__all__ = ["CommCounter", "RssSampler", "StepMemory", "measured_step", "release_memory", "rss",
           "sync", "timed_step"]


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0]
               if isinstance(t, torch.Tensor))


class CommCounter(TorchDispatchMode):
    """Counts the c10d collectives dispatched while active, in the ledger's logical bytes.

    ``ProcessGroup`` methods (what DDP's reducer, ZeroRedundancyOptimizer and FSDP2 call)
    go through the dispatcher as ``c10d::*`` ops, so a dispatch mode sees them with their
    tensors. Logical bytes follow [Note: logical vs wire bytes] in comm.py: an all-reduce
    of S bytes counts 2S, an all-gather or reduce-scatter counts its full (unsharded)
    tensor, a broadcast S. Barriers and point-to-point ops are not counted. Of DTensor's
    functional collectives (``_c10d_functional::*``, tensor parallelism) the three a
    Colwise/Rowwise/SequenceParallel plan issues count the same way:
    ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``; others (in-place,
    ``_out``, coalesced, all-to-all) are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.logical_bytes = 0
        self.calls = 0
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        packet = func.overloadpacket
        name = getattr(packet, "_qualified_op_name", "")
        if name.startswith("c10d::"):
            self._count(packet.__name__, args)
        elif name.startswith("_c10d_functional::"):  # DTensor's (tensor parallelism)
            self._count_functional(packet.__name__, args)
        return func(*args, **(kwargs or {}))

    def _count_functional(self, op: str, args: tuple) -> None:
        if op == "all_gather_into_tensor":  # (shard, group_size, group_name)
            nbytes = _nbytes(args[0]) * int(args[1])
        elif op == "reduce_scatter_tensor":  # (full, reduce_op, group_size, group_name)
            nbytes = _nbytes(args[0])
        elif op == "all_reduce":  # (tensor, reduce_op, group_name)
            nbytes = 2 * _nbytes(args[0])
        else:
            return
        self._add(op, nbytes)

    def _count(self, op: str, args: tuple) -> None:
        if "allreduce" in op:
            nbytes = 2 * _nbytes(args[0])
        elif "allgather" in op:
            nbytes = _nbytes(args[0])  # outputs: the gathered (full) tensor
        elif "reduce_scatter" in op:
            nbytes = _nbytes(args[1])  # inputs: the full tensor before scattering
        elif "broadcast" in op:
            nbytes = _nbytes(args[0])
        else:
            return
        self._add(op, nbytes)

    def _add(self, op: str, nbytes: int) -> None:
        self.logical_bytes += nbytes
        self.calls += 1
        self.by_op[op] = self.by_op.get(op, 0) + nbytes


def rss() -> int:
    """This process's resident set size now, in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _reset_high_water_mark() -> bool:
    """Linux >= 4.0: writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _high_water_mark() -> int:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib * 1024


def release_memory(*, collect: bool = True) -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim``).

    glibc keeps freed memory in its arenas: chunks under the mmap threshold (which grows
    up to 32 MiB as large blocks are freed) stay resident after ``free``. Without a trim,
    a configuration that has been dropped still counts in the process's RSS until some
    other allocation happens to reuse its pages. Never called between timed steps (the
    pages would have to be faulted in again)."""
    import gc

    if collect:
        gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        pass


class RssSampler:
    """Highest resident set size of the process while the block runs.

    Exact where the kernel lets a process reset its RSS high-water mark (Linux): VmHWM is
    reset on entry and read on exit, at no cost to the step. Elsewhere a thread samples
    the RSS every ``interval_s`` (it can miss a short peak, and competes with the step
    for the interpreter lock).
    """

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s, self.peak, self.exact = interval_s, 0, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self.peak = rss()
        self.exact = _reset_high_water_mark()
        if not self.exact:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.exact:
            try:
                self.peak = max(self.peak, _high_water_mark())
            except (OSError, StopIteration, ValueError):
                self.exact = False
        else:
            self._stop.set()
            self._thread.join()
        self.peak = max(self.peak, rss())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(step: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor,
               device: torch.device, time_optimizer: bool = False
               ) -> tuple[float, float, float]:
    """Run one step; return (seconds, local loss, seconds from the optimizer step's start
    to the end — the runner's ``mark("step")``; 0 unless ``time_optimizer``, which waits
    for the device there once). Ranks are aligned by the caller."""
    marks: dict[str, float] = {}

    def mark(phase: str) -> None:
        if phase == "step":
            sync(device)
            marks[phase] = time.perf_counter()

    sync(device)
    t0 = time.perf_counter()
    loss = step(x, y, mark=mark) if time_optimizer else step(x, y)
    value = float(loss)  # waits for the device
    sync(device)
    end = time.perf_counter()
    return end - t0, value, end - marks.get("step", end)


def optimizer_matmul_seconds(step: Callable[..., torch.Tensor], x: torch.Tensor,
                             y: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """One step under torch.profiler: the seconds this rank spends in matrix products
    inside optimizer steps (CPU time; kernel time on CUDA). With Muon these are its
    Newton–Schulz iterations — AdamW's step runs none — so ``--optimizer muon`` reports
    them as Newton–Schulz's share of the step. The profiled step is an extra one: its
    own time is not among the timed steps'. Returns (seconds, the step's local loss)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with profile(activities=activities) as prof:
        loss = float(step(x, y))
        sync(device)
    total = 0.0
    for ev in prof.events():
        if ev.name in ("aten::mm", "aten::addmm") and _in_optimizer_step(ev):
            total += (ev.device_time_total if cuda else ev.cpu_time_total) / 1e6
    return total, loss


def _in_optimizer_step(ev: Any) -> bool:
    parent = ev.cpu_parent
    while parent is not None:
        if parent.name.startswith("Optimizer.step#"):
            return True
        parent = parent.cpu_parent
    return False


@dataclass
class StepMemory:
    """What one measured step saw on this rank."""

    peak: dict[str, int] = field(default_factory=dict)
    """Bytes by category at the moment the tracked total was highest, plus ``total``."""
    timeline: dict[str, Any] = field(default_factory=dict)
    """Bytes by category over the step (``MemoryTracker.timeline``), phases marked."""
    rss_bytes: int = 0
    cuda_peak_bytes: int | None = None
    comm_bytes: int | None = None
    comm_calls: int | None = None
    loss: float = float("nan")


def measured_step(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  tracker: MemoryTracker, x: torch.Tensor, y: torch.Tensor,
                  device: torch.device, *, count_comm: bool) -> StepMemory:
    """One step under the memory tracker (and the collective counter when asked)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    counter = CommCounter() if count_comm else None
    tracker.record_timeline()
    with RssSampler() as rss, tracker:
        if counter is not None:
            with counter:
                loss = step(x, y, mark=tracker.mark)
        else:
            loss = step(x, y, mark=tracker.mark)
        value = float(loss)
        sync(device)
    out = StepMemory(loss=value, rss_bytes=rss.peak)
    out.peak = {c.value: v for c, v in tracker.peak().items()}
    out.peak["total"] = tracker.peak_total()
    out.timeline = tracker.timeline()
    if device.type == "cuda":
        out.cuda_peak_bytes = int(torch.cuda.max_memory_allocated(device))
    if counter is not None:
        out.comm_bytes, out.comm_calls = counter.logical_bytes, counter.calls
    return out
