"""The time model: a traced step's ops and collectives, priced by a calibration profile.

[Note: the time model]
A step's time is predicted from what it executes, not from a FLOP count and a guessed
MFU. A trace (memory/traced.py with ``record_ops``) gives every op of one steady-state
step by phase ([Note: ops of a step] in step_ops.py) and every collective the engine
issued (its ledger). Each op is priced from the profile ([Note: a calibration profile]):

    compute = Σ gemm + Σ attention + Σ memory-bound (by class and bytes)
              + optimizer elements × s/element + views × view_s

and each collective at its measured time for its kind, size and group, plus a latency for
each backend call beyond the calibrated collective's (a pieced all-gather: one broadcast
per large parameter). What the engine's
schedule lets hide: gradient reductions issued during backward, and stage 3's gathers
issued ahead of their unit (prefetch), run beside compute; the profile's ``overlap`` is
the fraction of a collective's time such compute hides where this machine runs both (on
a CPU the collective's own threads take cores from compute, so little hides; on a GPU
most). What never hides: the collective the end of backward waits for last (its
compute is done), stage 3's first gather of a phase (nothing runs before it), and the
optimizer phase's collectives (stages 1-2's post-step all-gather):

    exposed = Σ never-hidden + (1 − overlap) · Σ overlappable
    step    = compute + exposed
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from zeroshard.step_ops import StepOps

from .profile import Profile

__all__ = ["StepTime", "predict"]


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one training step on one rank."""

    total_s: float
    compute_s: float
    comm_s: float
    """Every collective's time, hidden or not."""
    exposed_comm_s: float
    by_phase: dict[str, float] = field(default_factory=dict)
    """Compute by phase (forward, backward, step)."""
    by_class: dict[str, float] = field(default_factory=dict)
    """Compute by op class (gemm, attention, optimizer, elementwise, ...)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _op_s(profile: Profile, cls: str, key: tuple) -> float:
    if cls == "gemm":
        return profile.gemm_s(key)
    if cls == "attention":
        return profile.attention_s(key)
    if cls == "optimizer":
        return key[0] * profile.optimizer_s_per_element["AdamW"]
    if cls == "view":
        return profile.view_s
    if cls == "alloc":
        return key[0] * profile.first_touch_s_per_byte
    return profile.memory_s(cls, key[0])


def _collective_s(profile: Profile, r: dict[str, Any]) -> float:
    op = r["op"] if r["op"] in profile.collectives else "all_gather"
    # logical bytes: 2S for an all-reduce, S (the whole tensor) otherwise
    size = r["logical_bytes"] // 2 if r["op"] == "all_reduce" else r["logical_bytes"]
    n = r["group_size"]
    t = profile.collective_s(op, size, n)
    # calls beyond the ones the calibrated collective made (1, or N where gloo
    # decomposes): each a latency, the smallest probe's per call
    base = n if r.get("impl") in ("broadcast", "reduce") else 1
    extra = r.get("calls", 1) - base
    if extra > 0:
        smallest = min(profile.collectives[op].get(str(n), [[0, 0.0]]), default=[0, 0.0])
        t += extra * smallest[1] / base
    return t


def _never_hidden(records: Sequence[dict[str, Any]]) -> set[int]:
    """Indices of the collectives nothing runs beside: each compute phase's first and
    last, and every one of the optimizer phase."""
    out: set[int] = set()
    for phase in ("forward", "backward"):
        idx = [i for i, r in enumerate(records) if r["phase"] == phase]
        if idx:
            out |= {idx[0], idx[-1]}
    out |= {i for i, r in enumerate(records) if r["phase"] not in ("forward", "backward")}
    return out


def predict(ops: StepOps | dict[str, list], collectives: Sequence[dict[str, Any]],
            profile: Profile) -> StepTime:
    """Seconds of the traced step on the profiled machine; see [Note: the time model]."""
    if not isinstance(ops, StepOps):
        ops = StepOps.from_dict(ops)
    by_phase: dict[str, float] = {}
    by_class: dict[str, float] = {}
    for phase, cls, key, n in ops.items():
        s = n * _op_s(profile, cls, key)
        by_phase[phase] = by_phase.get(phase, 0.0) + s
        by_class[cls] = by_class.get(cls, 0.0) + s
    compute = sum(by_phase.values())
    records = [r for r in collectives if r["phase"] in ("forward", "backward", "step")]
    times = [_collective_s(profile, r) for r in records]
    alone = _never_hidden(records)
    exposed = sum(t if i in alone else t * (1.0 - profile.overlap)
                  for i, t in enumerate(times))
    return StepTime(total_s=compute + exposed, compute_s=compute, comm_s=sum(times),
                    exposed_comm_s=exposed, by_phase=by_phase, by_class=by_class)
