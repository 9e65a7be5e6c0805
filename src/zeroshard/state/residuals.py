"""Quantised gradients' error-feedback residuals in checkpoints.

[Note: residuals in checkpoints]
What the residuals correct is their sum over ranks: each rank adds its own into the
gradient it sends, and the reduce-scatter sums every rank's. So a save reduce-scatters
each bucket's residuals (hop 1's, the whole bucket, plus hop 2's, placed at the slices they
belong to; float32, plain) and writes each rank's slice of the sum as a parameter-shaped
DTensor piece ("qgres.<name>"), sharded as the optimizer state is; a load at any world
size, stage or node layout reads each rank's piece back and puts it where that rank adds
its own slice — the sum over ranks is the saved one, and the next reduction carries it.
A checkpoint with residuals loaded where error feedback is off drops them, and one without
them loaded where it is on starts them at zero, each saying so. Not with hybrid sharding
(replicas keep residuals of their own; their quantised hops run only where a shard group
spans nodes).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..engine.engine import Engine
from .layout import ParamEntry, bucket_view, param_entries

__all__ = ["residual_key", "collect_residuals", "residual_targets", "install_residuals"]


def residual_key(name: str) -> str:
    return f"qgres.{name}"


def _hop(engine: Engine) -> Any:
    hop = engine.two_hop
    if hop is None or not hop.error_feedback or engine.replicate is not None:
        return None
    return hop


def collect_residuals(engine: Engine) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Collective: each bucket's residuals summed over the ranks, this rank's slice, as
    views per parameter; and the parameters' names for the manifest."""
    hop = _hop(engine)
    if hop is None or not hop.residuals:
        return {}, []
    slices: dict[int, torch.Tensor] = {}
    for b in engine.buckets:
        if b.index in hop.residuals:
            mine = hop.contribution(b.index, b.padded_numel, b.device)
            slices[b.index] = engine.comm.reduce_scatter(
                mine, phase="state", unit=b.name).wait().clone()
    kept = [e for e in _entries(engine) if e.bucket.index in slices]
    sd = {residual_key(e.name): bucket_view(engine, e, slices[e.bucket.index]) for e in kept}
    return sd, sorted(e.name for e in kept)


def _entries(engine: Engine) -> list[ParamEntry]:
    return [e for e in param_entries(engine) if e.trainable and e.bucket is not None]


def residual_targets(engine: Engine, names: list[str], path: str
                     ) -> tuple[dict[str, torch.Tensor], dict[int, torch.Tensor]]:
    """Where a load puts the residuals a checkpoint holds (``names``): per parameter a view
    of its bucket's slice (zeros until read); nothing, with a warning, where this model
    keeps none."""
    if not names:
        return {}, {}
    if _hop(engine) is None:
        warnings.warn(
            f"checkpoint {path!r} holds quantised gradients' error-feedback residuals; this "
            "model keeps none (quantize_grads with grad_error_feedback=True, over several "
            "nodes, no hybrid sharding): they are dropped", UserWarning, stacklevel=3)
        return {}, {}
    wanted = set(names)
    slices: dict[int, torch.Tensor] = {}
    sd = {}
    for e in _entries(engine):
        if e.name not in wanted:
            continue
        b = e.bucket
        if b.index not in slices:
            slices[b.index] = torch.zeros(b.shard_numel, dtype=torch.float32, device=b.device)
        sd[residual_key(e.name)] = bucket_view(engine, e, slices[b.index])
    return sd, slices


def install_residuals(engine: Engine, slices: dict[int, torch.Tensor], path: str) -> None:
    """After a load: each read slice becomes this rank's hop-1 residual at its own slice
    (it adds it into the gradient it keeps exact), the rest zero."""
    hop = _hop(engine)
    if hop is None:
        return
    if not slices:
        if hop.residuals:
            warnings.warn(
                f"checkpoint {path!r} holds no error-feedback residuals: they restart at "
                "zero (written without quantize_grads' error feedback)", UserWarning,
                stacklevel=3)
        hop.residuals.clear()
        return
    hop.residuals.clear()
    for b in engine.buckets:
        if b.index in slices:
            hop.install(b.index, engine.comm.rank, slices[b.index], b.padded_numel)
