"""Owner balance of a whole-parameter optimizer (Muon) for a model shape: what ``zeroshard
plan --muon`` prints (see [Note: whole-parameter updates] in engine/whole.py).

Owners are balanced by the update's work (Newton–Schulz, ∝ m·n·min(m, n)), not by bytes:
where a model's matrices differ in shape the two disagree, and the work decides. The
plan shows both, as the largest rank's share over the mean: work for step time, bytes
for the optimizer state a rank holds (Muon's momentum) and the whole parameter and
gradient it assembles at the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..engine.whole import assign_owners, newton_schulz_cost
from ..models.config import ModelConfig

if TYPE_CHECKING:
    from .planner import Plan

__all__ = ["MuonTrace", "OwnerBalance", "matrix_shapes", "owner_balance", "trace_muon"]


@dataclass(frozen=True)
class OwnerBalance:
    ranks: int
    matrices: int
    work_ratio: float  # the busiest rank's Newton–Schulz work over the mean
    bytes_ratio: float  # the rank owning the most elements, over the mean
    max_elements: int  # elements the rank owning the most owns
    largest: tuple[int, int]  # the largest matrix's shape (the bound's "one parameter")
    share: float  # the busiest rank's fraction of all the work (DDP + Muon: 1.0)


def matrix_shapes(config: ModelConfig) -> list[torch.Size]:
    """The 2-D parameters of ``config``'s model (built on the meta device: no memory)."""
    from ..models import build_model

    with torch.device("meta"):
        model = build_model(config)
    return [p.shape for p in model.parameters() if p.ndim == 2]


def owner_balance(shapes: list[torch.Size], ranks: int) -> OwnerBalance:
    owner = assign_owners(shapes, ranks, newton_schulz_cost)
    work, size = [0] * ranks, [0] * ranks
    for s, q in zip(shapes, owner):
        work[q] += newton_schulz_cost(s)
        size[q] += s.numel()
    total_work, total = sum(work), sum(size)
    big = max(shapes, key=lambda s: s.numel())
    return OwnerBalance(
        ranks=ranks, matrices=len(shapes),
        work_ratio=max(work) * ranks / total_work if total_work else 1.0,
        bytes_ratio=max(size) * ranks / total if total else 1.0,
        max_elements=max(size), largest=(big[0], big[1]),
        share=max(work) / total_work if total_work else 0.0)


@dataclass(frozen=True)
class MuonTrace:
    """One plan row traced with Muon over the hidden matrices and AdamW over the rest."""

    gpus: int
    stage: int
    peak_bytes: int  # the device peak per rank, the owners' step included
    optim_bytes: int  # optimizer state per rank after the step
    adamw_peak_bytes: int | None  # the same row traced with AdamW alone (--traced)


def trace_muon(p: Plan, progress: Callable[[str], None] | None = None) -> list[MuonTrace]:
    """``zeroshard plan --muon --traced``: every data-parallel row without checkpointing
    or offload traced with Muon + AdamW (``zeroshard.bench.muon.muon_optimizers``, the
    bench's split) — the engine's real step on fake tensors, so the owner's transient
    whole parameters, gradients and exchange buffers and Newton–Schulz's working set are
    in the peak (memory/traced.py; tests/test_traced.py checks it against measured peaks)."""
    import functools

    from ..bench.muon import muon_optimizers
    from .traced import _PRECISION, trace_step

    build = functools.partial(muon_optimizers, lr=1e-3)
    out = []
    for row in p.rows:
        if (row.activation_checkpointing != "none" or row.offload or row.offload_params
                or row.hybrid or p.tp > 1):
            continue
        r = trace_step(p.config, world_size=row.gpus, stage=row.stage,
                       mixed_precision=_PRECISION[p.recipe.name], micro_batch=p.micro_batch,
                       seq_len=p.seq_len, optimizers=build)
        if progress is not None:
            progress(f"traced N={row.gpus} stage {row.stage} with Muon + AdamW: {r.wall_s:.1f} s")
        out.append(MuonTrace(gpus=row.gpus, stage=row.stage, peak_bytes=r.device_peak_bytes,
                             optim_bytes=r.current["optim"],
                             adamw_peak_bytes=row.traced_peak_bytes))
    return out
