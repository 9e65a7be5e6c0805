"""The bench's predicted step times (``--profile``): each zeroshard row traced, priced.

Before the ranks start, the launching process traces every zeroshard configuration on
fake tensors (``trace_step(..., record_ops=True)``: the same model, stage, checkpointing,
precision, micro-batch and sequence as the row, gloo's collectives on a CPU run). The
profile is loaded from ``--profile PATH`` if it was measured here at this world size and
backend; otherwise the ranks calibrate first, on the traced shapes, and the profile is
written to PATH. After the run each row gets ``predicted_step_s`` and
``step_s_over_predicted`` (measured median / predicted). Other systems' rows (DDP, FSDP2,
DeepSpeed) run other engines, whose schedule a zeroshard trace does not follow: they get
no prediction (``null``), and the table says so.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from zeroshard.bench.configs import BenchSettings, ConfigSpec
from zeroshard.timing.model import predict
from zeroshard.timing.profile import Profile

__all__ = ["predictable", "trace_rows", "shapes", "load_or_none", "annotate"]


def predictable(s: BenchSettings, spec: ConfigSpec) -> bool:
    return (spec.system == "zeroshard" and spec.tp == 1 and s.optimizer == "adamw"
            and s.model_factory is None and s.compile is None)


def trace_rows(s: BenchSettings, backend: str = "gloo") -> dict[str, Any]:
    """name -> TracedResult (with ops) for every predictable row."""
    from zeroshard.memory.traced import trace_step

    out = {}
    for spec in s.configs:
        if not predictable(s, spec):
            continue
        extra: dict[str, Any] = {}
        if spec.stage == 3:
            extra.update(reshard_after_forward=spec.reshard_after_forward,
                         quantize_weights=spec.quantize_weights)
        if spec.quantize_grads is not None:
            extra["quantize_grads"] = spec.quantize_grads
        out[spec.name] = trace_step(
            s.model, world_size=s.world_size, stage=spec.stage,
            mixed_precision=s.mixed_precision, micro_batch=s.micro_batch, seq_len=s.seq,
            checkpointing=spec.activation_checkpointing, record_ops=True, lr=s.lr,
            collectives="gloo" if backend == "gloo" else "native", **extra)
    return out


def shapes(traces: dict[str, Any]) -> tuple[tuple, tuple, tuple]:
    """The products, attention kernels and collectives the traces ran (what calibrate
    times exactly)."""
    from zeroshard.timing.calibrate import probes

    p = probes(traces.values())
    return p["gemm"], p["attention"], p["collectives"]


def load_or_none(path: str, s: BenchSettings, backend: str, threads: int) -> Profile | None:
    """The profile at ``path`` if it applies to this run; None (with a warning naming the
    difference) if the ranks must calibrate."""
    if not Path(path).exists():
        return None
    prof = Profile.load(path)
    why = prof.mismatch(backend=backend, world_size=s.world_size, threads=threads)
    if why:
        warnings.warn(f"--profile {path}: measured elsewhere ({'; '.join(why)}): "
                      "recalibrating, and writing the new profile there", stacklevel=2)
        return None
    return prof


def annotate(result: dict[str, Any], traces: dict[str, Any], prof: Profile,
             path: str | None) -> None:
    """Add each row's prediction and the profile's summary to ``result``."""
    for row in result["rows"]:
        r = traces.get(row["name"])
        row["predicted_step_s"] = row["step_s_over_predicted"] = None
        row["predicted"] = None
        if r is None:
            continue
        p = predict(r.ops, r.collectives, prof)
        row["predicted_step_s"] = p.total_s
        row["predicted"] = p.to_dict()
        if row["status"] == "ok":
            row["step_s_over_predicted"] = row["step_s_median"] / p.total_s
    result["profile"] = {"path": path, "backend": prof.backend, "world_size": prof.world_size,
                         "threads": prof.threads, "machine": prof.machine,
                         "calibrate_s": prof.wall_s}
