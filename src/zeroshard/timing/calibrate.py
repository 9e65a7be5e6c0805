"""``zeroshard calibrate``: microbenchmarks where the run happens, into a :class:`Profile`.

[Note: calibrating]
Every rank of the group runs the same microbenchmarks at the same time, each started
after a barrier, so the numbers carry what training meets: ranks sharing cores, memory
bandwidth and links. Each timing is the median of ``repeats`` runs after one warm-up
(the medians are what ``zeroshard bench`` reports, so the two compare), and each rank's
median is averaged over the ranks (all-reduce) so every rank writes the same profile.
No training step of any model runs: matrix products, attention kernels, elementwise and
copy kernels, the optimizer update and the collectives, each alone — the step is
*predicted* from them (timing/model.py), never fitted to the steps it is judged on.
What is measured and how it is read: [Note: a calibration profile] in profile.py.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .profile import Profile, machine

__all__ = ["calibrate", "probes", "GRID", "MEMORY_SIZES", "COLLECTIVE_SIZES"]

#: Matrix products every profile has, for shapes no trace asked for (read by FLOPs).
GRID = [(1, s, s, s) for s in (64, 128, 256, 512, 1024, 2048)]
#: Bytes (read + written) of the memory-bound probes.
MEMORY_SIZES = (16 * 2**10, 256 * 2**10, 4 * 2**20, 32 * 2**20)
#: Bytes of the whole tensor of the collective probes.
COLLECTIVE_SIZES = (64 * 2**10, 1 * 2**20, 8 * 2**20, 64 * 2**20)
_CHUNK = 2**18  # the engine's optimizer chunk (engine/chunks.py: CHUNK)
#: [Note: one timing spans the scheduler's slices]
#: Each timing loops its op for about this long. Where ranks outnumber cores (world 4 on
#: 2 cores) a rank timing one 3 ms product alone is often the only one running after the
#: barrier (the others wait for a core, and start their clocks only once they run), so
#: it measured an uncontended core: world 4 predicted 1.3-1.5x too fast. Over a few
#: scheduler slices the ranks share the cores as training does.
SPAN_S = 0.03


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class _Timer:
    """Median seconds of ``fn`` over ``repeats`` (after a warm-up), started together on
    every rank, averaged over the ranks."""

    def __init__(self, group: dist.ProcessGroup | None, repeats: int, device: torch.device
                 ) -> None:
        self.group, self.repeats, self.device = group, repeats, device

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], Any], inner: int | None = None) -> float:
        """``inner``: calls per timing; None sizes it to ~``SPAN_S`` (see [Note: one
        timing spans the scheduler's slices])."""
        fn()
        self._sync()
        if inner is None:
            t0 = time.perf_counter()
            fn()
            self._sync()
            inner = max(1, min(1000, math.ceil(SPAN_S / max(time.perf_counter() - t0, 1e-7))))
            inner = int(self.agree(float(inner)))
        times = []
        for _ in range(self.repeats):
            if self.group is not False and dist.is_initialized():
                dist.barrier(group=self.group)
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            self._sync()
            times.append((time.perf_counter() - t0) / inner)
        return self.mean(statistics.median(times))

    def agree(self, x: float) -> float:
        """The largest ``x`` over the ranks (every rank loops as often)."""
        if self.group is False or not dist.is_initialized():
            return x
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def mean(self, x: float) -> float:
        if self.group is False or not dist.is_initialized():
            return x
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return float(t.item()) / dist.get_world_size(self.group)


def _gemm(timer: _Timer, key: tuple, device: torch.device) -> float:
    b, m, n, k, dtype, a_t, b_t = key
    dt = _dtype(dtype)

    def operand(rows: int, cols: int, transposed: int) -> torch.Tensor:
        shape = (b,) if b > 1 else ()
        if transposed:
            return torch.randn(*shape, cols, rows, device=device, dtype=dt).transpose(-1, -2)
        return torch.randn(*shape, rows, cols, device=device, dtype=dt)

    x, w = operand(m, k, a_t), operand(k, n, b_t)
    fn = (lambda: torch.bmm(x, w)) if b > 1 else (lambda: torch.mm(x, w))
    return timer(fn)


def _attention(timer: _Timer, key: tuple, device: torch.device) -> float:
    direction, b, h, s, skv, d, dtype, causal = key
    dt = _dtype(dtype)
    q = torch.randn(b, h, s, d, device=device, dtype=dt, requires_grad=True)
    k = torch.randn(b, h, skv, d, device=device, dtype=dt, requires_grad=True)
    v = torch.randn(b, h, skv, d, device=device, dtype=dt, requires_grad=True)

    def fwd() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))

    with torch.no_grad():
        t_fwd = timer(fwd)
    if direction == "fwd":
        return t_fwd
    out = fwd()
    grad = torch.randn_like(out)

    def both() -> None:
        torch.autograd.grad(fwd(), (q, k, v), grad)

    return max(timer(both) - t_fwd, t_fwd)


def _memory_probes(device: torch.device) -> dict[str, Callable[[int], tuple[Callable, int]]]:
    """class -> (bytes wanted -> (fn, bytes it reads + writes))."""
    f32 = torch.float32

    def vec(nbytes: int, parts: int) -> int:
        return max(1, nbytes // (4 * parts))

    def elementwise(nb: int):  # type: ignore[no-untyped-def]
        n = vec(nb, 3)
        a, b = torch.randn(n, device=device), torch.randn(n, device=device)
        return (lambda: torch.add(a, b)), 12 * n

    def copy(nb: int):  # type: ignore[no-untyped-def]
        n = vec(nb, 2)
        a, b = torch.randn(n, device=device), torch.empty(n, device=device)
        return (lambda: b.copy_(a)), 8 * n

    def transcendental(nb: int):  # type: ignore[no-untyped-def]
        n = vec(nb, 2)
        a = torch.randn(n, device=device)
        return (lambda: F.gelu(a, approximate="tanh")), 8 * n

    def rows(nb: int, parts: int, width: int = 512) -> torch.Tensor:
        n = vec(nb, parts)
        return torch.randn(max(1, n // width), width, device=device, dtype=f32)

    def norm(nb: int):  # type: ignore[no-untyped-def]
        x = rows(nb, 2)
        return (lambda: F.layer_norm(x, (x.shape[-1],))), 8 * x.numel()

    def softmax(nb: int):  # type: ignore[no-untyped-def]
        x = rows(nb, 2, 256)
        return (lambda: torch.log_softmax(x, -1)), 8 * x.numel()

    def reduction(nb: int):  # type: ignore[no-untyped-def]
        x = rows(nb, 1)
        return (lambda: x.sum(0)), 4 * x.numel()

    def index(nb: int):  # type: ignore[no-untyped-def]
        x = rows(nb, 2)
        idx = torch.randint(0, x.shape[0], (x.shape[0],), device=device)
        return (lambda: F.embedding(idx, x)), 8 * x.numel()

    return {"elementwise": elementwise, "copy": copy, "transcendental": transcendental,
            "norm": norm, "softmax": softmax, "reduction": reduction, "index": index}


def _first_touch_s_per_byte(timer: _Timer, device: torch.device) -> float:
    """Writing memory just allocated, beyond writing memory already touched: the page
    faults (and zeroing) of pages the process takes from the system."""
    if device.type != "cpu":
        return 0.0
    n = 16 * 2**20  # 64 MiB: above glibc's mmap threshold, so fresh pages every time
    warm = torch.empty(n)
    t_warm = timer(lambda: warm.fill_(1.0))
    t_fresh = timer(lambda: torch.empty(n).fill_(1.0))
    return max(0.0, t_fresh - t_warm) / (4 * n)


def _optimizer_s_per_element(timer: _Timer, device: torch.device, elements: int) -> float:
    """AdamW's step as the engine runs it on CPU: ≤256K-element chunks (engine/chunks.py)."""
    n = max(1, elements // _CHUNK)
    params = [torch.nn.Parameter(torch.randn(_CHUNK, device=device)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type != "cpu" or None)
    return timer(opt.step) / (n * _CHUNK)


def probes(traces: Iterable[Any]) -> dict[str, tuple]:
    """What :func:`calibrate` should time exactly for these traces (``trace_step(...,
    record_ops=True)`` results): their products, attention kernels and collectives (op,
    group size, bytes of the whole tensor), as the engine issues them."""
    from zeroshard.step_ops import StepOps

    gemm: set = set()
    att: set = set()
    coll: set = set()
    for r in traces:
        ops = StepOps.from_dict(r.ops)
        gemm |= ops.gemm_shapes()
        att |= ops.attention_shapes()
        for c in r.collectives:
            if c["phase"] in ("forward", "backward", "step") and c["op"] in _OPS:
                size = c["logical_bytes"] // 2 if c["op"] == "all_reduce" else c["logical_bytes"]
                coll.add((c["op"], c["group_size"], size))
    return {"gemm": tuple(sorted(gemm)), "attention": tuple(sorted(att)),
            "collectives": tuple(sorted(coll))}


_OPS = ("all_reduce", "reduce_scatter", "all_gather")


def _collectives(group: dist.ProcessGroup | None, device: torch.device, repeats: int,
                 sizes: Iterable[int], exact: Iterable[tuple[str, int, int]] = ()
                 ) -> dict[str, dict[str, list[list[float]]]]:
    """Each op at ``sizes``, and the (op, group size, bytes) of ``exact`` that are of this
    group's size: a grid misses gloo's turns (its reduce changes algorithm at 2N MiB
    slices: 8 MiB 1.5 GB/s, 12 MiB 1.1), the engine's own sizes do not."""
    from zeroshard.comm import Comm

    comm = Comm(group, label="calibrate")
    n = comm.size
    timer = _Timer(group, repeats, device)
    want = {op: sorted({max(n, b // 4 // n * n) for b in sizes}) for op in _OPS}
    for op, g, nbytes in exact:
        if g == n and op in want:
            want[op] = sorted({*want[op], max(n, nbytes // 4 // n * n)})
    out: dict[str, list[list[float]]] = {}
    for op in _OPS:
        issue = getattr(comm, op)
        out[op] = []
        for numel in want[op]:
            full = torch.zeros(numel, device=device)
            out[op].append([4 * numel, timer(lambda f=issue, t=full: f(t).wait())])
    return {op: {str(n): pts} for op, pts in out.items()}


def _overlap(group: dist.ProcessGroup | None, device: torch.device, repeats: int) -> float:
    """The fraction of an all-reduce's time hidden by matrix products running beside it."""
    from zeroshard.comm import Comm

    if dist.get_world_size(group) == 1:
        return 1.0
    comm = Comm(group, label="calibrate")
    timer = _Timer(group, repeats, device)
    buf = torch.zeros(4 * 2**20, device=device)  # 16 MiB, a gradient bucket's size
    t_comm = timer(lambda: comm.all_reduce(buf).wait())
    a, b = torch.randn(512, 512, device=device), torch.randn(512, 512, device=device)
    reps = max(1, int(t_comm / max(timer(lambda: torch.mm(a, b)), 1e-6)))

    def compute() -> None:
        for _ in range(reps):
            torch.mm(a, b)

    def both() -> None:
        work = comm.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    t_compute = timer(compute)
    t_both = timer(both)
    hidden = (t_comm + t_compute - t_both) / min(t_comm, t_compute)
    return min(1.0, max(0.0, hidden))


def calibrate(*, gemm: Iterable[tuple] = (), attention: Iterable[tuple] = (),
              collectives: Iterable[tuple[str, int, int]] = (),
              group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu",
              repeats: int = 5, quick: bool = False,
              progress: Callable[[str], None] | None = None) -> Profile:
    """Measure this machine (every rank of ``group`` must call it; a single process
    without a process group measures compute only). ``gemm``/``attention``/
    ``collectives``: what to time exactly (:func:`probes` of the traces). ``quick``:
    fewer sizes and repeats (tests). See [Note: calibrating]."""
    device = torch.device(device)
    start = time.perf_counter()
    say = progress or (lambda _m: None)
    distributed = dist.is_available() and dist.is_initialized()
    repeats = 3 if quick else repeats
    timer = _Timer(group if distributed else False, repeats, device)  # type: ignore[arg-type]
    prof = Profile(backend=str(dist.get_backend(group)) if distributed else "none",
                   world_size=dist.get_world_size(group) if distributed else 1,
                   threads=torch.get_num_threads(), machine=machine())
    shapes = {tuple(k) for k in gemm}
    dtypes = {k[4] for k in shapes} or {"float32"}
    grid = GRID[:4] if quick else GRID
    shapes |= {(*g, dt, 0, 0) for g in grid for dt in dtypes}
    say(f"matrix products: {len(shapes)} shapes")
    prof.gemm = [[*key, _gemm(timer, key, device)] for key in sorted(shapes)]
    prof.attention = [[*key, _attention(timer, key, device)]
                      for key in sorted({tuple(k) for k in attention})]
    say("memory-bound kernels")
    sizes = MEMORY_SIZES[1:3] if quick else MEMORY_SIZES
    for cls, probe in _memory_probes(device).items():
        pts = []
        for nb in sizes:
            fn, real = probe(nb)
            pts.append([real, timer(fn)])
        prof.memory[cls] = pts
    prof.first_touch_s_per_byte = _first_touch_s_per_byte(timer, device)
    view = torch.randn(16, 16, device=device)
    prof.view_s = timer(lambda: view.view(256), 1000)
    say("optimizer step")
    prof.optimizer_s_per_element["AdamW"] = _optimizer_s_per_element(
        timer, device, 2**21 if quick else 2**23)
    if distributed:
        say("collectives")
        csizes = COLLECTIVE_SIZES[:3] if quick else COLLECTIVE_SIZES
        prof.collectives = _collectives(group, device, repeats, csizes,
                                        [tuple(c) for c in collectives])
        prof.overlap = _overlap(group, device, repeats)
    prof.wall_s = timer.mean(time.perf_counter() - start) if distributed else (
        time.perf_counter() - start)
    return prof
