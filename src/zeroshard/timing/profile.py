"""A calibration profile: what this machine measured, and the prices read from it.

[Note: a calibration profile]
:func:`zeroshard.timing.calibrate` times microbenchmarks where it runs, on every rank of
the process group at once (the ranks share the machine's cores and memory bandwidth as
they do in training), and keeps the medians here:

* ``gemm`` — seconds of each matrix product shape ``(b, m, n, k, dtype, a_t, b_t)`` asked
  for (the model's shapes, from a trace), plus a small grid that unknown shapes are read
  from by their FLOPs;
* ``attention`` — seconds of the fused attention kernel, forward and backward, per shape;
* ``memory`` — per memory-bound class (step_ops.py's ``MEMORY_CLASSES`` + ``elementwise``),
  seconds at four sizes (bytes read + written, from a few KiB to tens of MiB): small ops
  cost their dispatch, large ones their bytes;
* ``optimizer`` — seconds per element of the engine's AdamW step (≤256K-element chunks,
  as engine/chunks.py steps them on CPU);
* ``collectives`` — seconds of the engine's own all-reduce, reduce-scatter and all-gather
  (``zeroshard.comm.Comm``, so gloo's decomposition included) at four sizes;
* ``overlap`` — the fraction of a collective's time that compute running beside it hides
  (measured: a gradient-sized all-reduce in flight during a loop of matrix products);
* ``view_s`` — one dispatched op that moves no data.

Prices between measured sizes are interpolated in log-log (time against bytes or FLOPs);
beyond the largest size time grows in proportion, below the smallest it stays.
The profile records where it was measured (machine, backend, world size, threads, torch
version): :meth:`Profile.mismatch` says what differs from a run that wants to use it.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["Profile", "PROFILE_VERSION", "interpolate", "machine"]

PROFILE_VERSION = 1


def machine() -> dict[str, Any]:
    """What identifies the place a profile was measured."""
    device = "cpu"
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    return {"host_cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count() or 1, "device": device,
            "torch": torch.__version__.split("+")[0]}


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    """y at ``x`` from (x, y) points, log-log between them; proportional beyond the
    largest x, constant below the smallest."""
    pts = sorted(points)
    if not pts:
        raise ValueError("no points to interpolate")
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1] * x / pts[-1][0]
    i = bisect.bisect_left([p[0] for p in pts], x)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))


@dataclass
class Profile:
    """Measured prices (seconds); see [Note: a calibration profile]."""

    backend: str
    world_size: int
    threads: int
    machine: dict[str, Any]
    gemm: list[list[Any]] = field(default_factory=list)
    """[b, m, n, k, dtype, a_t, b_t, seconds]"""
    attention: list[list[Any]] = field(default_factory=list)
    """[dir, b, h, s, s_kv, d, dtype, causal, seconds]"""
    memory: dict[str, list[list[float]]] = field(default_factory=dict)
    """class -> [[bytes, seconds], ...]"""
    optimizer_s_per_element: dict[str, float] = field(default_factory=dict)
    collectives: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)
    """op -> group size (str) -> [[bytes of the whole tensor, seconds], ...]"""
    overlap: float = 0.0
    first_touch_s_per_byte: float = 0.0
    view_s: float = 0.0
    wall_s: float = 0.0
    version: int = PROFILE_VERSION

    # --- prices -------------------------------------------------------------------
    def gemm_s(self, key: tuple) -> float:
        for row in self.gemm:
            if tuple(row[:7]) == tuple(key):
                return float(row[7])
        b, m, n, k, dtype = key[:5]
        flops = 2.0 * b * m * n * k
        same = [(2.0 * r[0] * r[1] * r[2] * r[3], r[7]) for r in self.gemm if r[4] == dtype]
        if not same:
            raise KeyError(f"the profile has no {dtype} matrix products; calibrate with "
                           f"dtype {dtype}")
        return interpolate(same, flops)

    def attention_s(self, key: tuple) -> float:
        for row in self.attention:
            if tuple(row[:8]) == tuple(key):
                return float(row[8])
        direction, b, h, s, skv, d, dtype = key[:7]
        flops = 4.0 * b * h * s * skv * d
        same = [(4.0 * r[1] * r[2] * r[3] * r[4] * r[5], r[8]) for r in self.attention
                if r[0] == direction and r[6] == dtype]
        if not same:  # priced as the matrix products it is: 2 (fwd) or 5 (bwd) of s x s
            per = self.gemm_s((b * h, s, skv, d, dtype, 0, 1))
            return per * (2 if direction == "fwd" else 5)
        return interpolate(same, flops)

    def memory_s(self, cls: str, nbytes: int) -> float:
        pts = self.memory.get(cls) or self.memory["elementwise"]
        return interpolate([(b, s) for b, s in pts], max(nbytes, 1))

    def collective_s(self, op: str, nbytes: int, group_size: int) -> float:
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        by_size = self.collectives.get(op, {})
        if not by_size:
            raise KeyError(f"the profile has no {op} timings")
        pts = by_size.get(str(group_size))
        if pts is None:  # another group size: scale the nearest by its (N-1)/N traffic
            near = min(by_size, key=lambda g: abs(int(g) - group_size))
            g = int(near)
            scale = ((group_size - 1) / group_size) / ((g - 1) / g)
            return interpolate([(b, s) for b, s in by_size[near]], nbytes) * scale
        return interpolate([(b, s) for b, s in pts], nbytes)

    # --- where it was measured --------------------------------------------------------
    def mismatch(self, *, backend: str, world_size: int, threads: int | None = None
                 ) -> list[str]:
        """What differs between where this profile was measured and a run with these
        settings (empty: it applies)."""
        out = []
        if self.version != PROFILE_VERSION:
            out.append(f"profile version {self.version} (this zeroshard reads {PROFILE_VERSION})")
        if self.backend != backend:
            out.append(f"backend {self.backend!r} (the run's is {backend!r})")
        if self.world_size != world_size:
            out.append(f"world size {self.world_size} (the run's is {world_size})")
        here = machine()
        for k in ("host_cpu", "cores", "device", "torch"):
            if self.machine.get(k) != here[k]:
                out.append(f"{k} {self.machine.get(k)!r} (here {here[k]!r})")
        if threads is not None and self.threads != threads:
            out.append(f"{self.threads} threads per rank (the run's is {threads})")
        return out

    # --- files --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read the calibration profile {str(path)!r}: {exc}; "
                             "write one with `zeroshard calibrate --out PATH`") from exc
        if not isinstance(d, dict) or "collectives" not in d or "memory" not in d:
            raise ValueError(f"{str(path)!r} is not a zeroshard calibration profile "
                             "(no 'collectives'/'memory'); write one with `zeroshard calibrate`")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})
