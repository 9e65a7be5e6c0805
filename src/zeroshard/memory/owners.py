"""Owner balance of a whole-parameter optimizer (Muon) for a model shape: what ``zeroshard
plan --muon`` prints (see [Note: whole-parameter updates] in engine/whole.py).

Owners are balanced by the update's work (Newton–Schulz, ∝ m·n·min(m, n)), not by bytes:
where a model's matrices differ in shape the two disagree, and the work decides. The
plan shows both, as the largest rank's share over the mean: work for step time, bytes
for the optimizer state a rank holds (Muon's momentum) and the whole parameter and
gradient it assembles at the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..engine.whole import assign_owners, newton_schulz_cost
from ..models.config import ModelConfig

if TYPE_CHECKING:
    from .planner import Plan

__all__ = ["MuonState", "MuonTrace", "OwnerBalance", "matrix_shapes", "muon_shapes", "muon_states",
           "owner_balance", "trace_muon"]


@dataclass(frozen=True)
class OwnerBalance:
    ranks: int
    matrices: int
    work_ratio: float  # the busiest rank's Newton–Schulz work over the mean
    bytes_ratio: float  # the rank owning the most elements, over the mean
    max_elements: int  # elements the rank owning the most owns
    largest: tuple[int, int]  # the largest matrix's shape (the bound's "one parameter")
    share: float  # the busiest rank's fraction of all the work (DDP + Muon: 1.0)


def muon_shapes(config: ModelConfig) -> tuple[list[torch.Size], int]:
    """The shapes of the matrices Muon steps in ``config``'s model, and the elements AdamW
    steps: the recipe's split (``zeroshard.bench.muon.muon_split``: the hidden matrices
    for Muon; embeddings, head, norms and biases for AdamW), built on the meta device."""
    from ..bench.muon import muon_split
    from ..models import build_model

    with torch.device("meta"):
        model = build_model(config)
    hidden, rest = muon_split(model)
    return [p.shape for p in hidden], sum(p.numel() for p in rest)


def matrix_shapes(config: ModelConfig) -> list[torch.Size]:
    """The matrices Muon steps in ``config``'s model (see :func:`muon_shapes`)."""
    return muon_shapes(config)[0]


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


# [Note: Muon's model state, priced]
# With Muon over the hidden matrices (Ψ_m elements) and AdamW over the rest (Ψ_a), one
# rank's optimizer state is, at a stage that shards it over n ranks (n = 1 at stage 0):
#   fp32 masters (16-bit recipes)    4·Ψ/n      — flat, row-sharded like any parameter's
#   AdamW's two moments              8·Ψ_a/n    — flat
#   Muon's momentum                  4·Ψ_own    — whole, on the owner alone
# where Ψ_own is the elements of the matrices the rank owns (the busiest rank's here:
# owner_balance's max_elements; Ψ_m at stage 0, where every rank steps every matrix).
# The step adds a transient on top (the owner's whole matrices and gradients for one
# bucket, the exchange buffers, Newton–Schulz's working set): traced, not priced here
# (``plan --muon --traced``; tests/test_traced.py holds traces to measured peaks).


@dataclass(frozen=True)
class MuonState:
    """One (N, stage) row's model state per device with Muon + AdamW, beside AdamW's."""

    gpus: int
    stage: int
    hybrid: str | None  # "R x G" (sharded over G), as the plan row; None: over all N
    optim_bytes: int  # masters + AdamW moments + the busiest owner's Muon momentum
    adamw_optim_bytes: int  # the plan row's (AdamW over every parameter)
    model_state_bytes: int  # params + grads + optim_bytes
    adamw_model_state_bytes: int


def muon_optim_bytes(shapes: list[torch.Size], rest: int, *, stage: int, n: int,
                     recipe: Any) -> int:
    """One rank's optimizer state with Muon over ``shapes`` and AdamW over ``rest``
    elements at ``stage`` sharded over ``n`` (see [Note: Muon's model state, priced])."""
    from ..engine.policy import StagePolicy

    psi_m = sum(s.numel() for s in shapes)
    psi = psi_m + rest
    k = n if StagePolicy(stage).shard_optimizer else 1
    owned = psi_m if k == 1 else owner_balance(shapes, k).max_elements
    masters = 4 * math.ceil(psi / k) if recipe.master_in_optim else 0
    return masters + 8 * math.ceil(rest / k) + 4 * owned


def muon_states(p: Plan) -> list[MuonState]:
    """Every (N, stage[, hybrid]) of ``p`` that a whole-parameter optimizer runs at (no
    tp, no offload: both refused with Muon), once each: model state per device."""
    shapes, rest = muon_shapes(p.config)
    out, seen = [], set()
    for row in p.rows:
        key = (row.gpus, row.stage, row.hybrid)
        if key in seen or row.offload or row.offload_params or p.tp > 1:
            continue
        seen.add(key)
        n = row.gpus if row.hybrid is None else int(row.hybrid.split("x")[1])
        optim = muon_optim_bytes(shapes, rest, stage=row.stage, n=n, recipe=p.recipe)
        out.append(MuonState(
            gpus=row.gpus, stage=row.stage, hybrid=row.hybrid, optim_bytes=optim, adamw_optim_bytes=row.optim_bytes,
            model_state_bytes=row.model_state_bytes - row.optim_bytes + optim,
            adamw_model_state_bytes=row.model_state_bytes))
    return out
