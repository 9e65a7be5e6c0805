"""Whole per-parameter optimizer state, the optimizer's counterpart of ``full_state_dict``.

Useful to inspect or compare state across world sizes and stages (the checkpoint tests
do): ``{name: {"exp_avg": full fp32 tensor shaped like the parameter, "step": ...}}``.
Collective; memory: one whole bucket of one state at a time on every rank, plus the
result (the whole optimizer state, so use it on models that fit).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..api import engine_of
from ..engine.chunks import bucket_state, slot_scalars
from ..engine.whole_state import whole_state_by_name
from .layout import one_optimizer, param_entries

__all__ = ["full_optimizer_state"]


@torch.no_grad()
def full_optimizer_state(model: nn.Module,
                         optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """``{canonical parameter name: {state key: value}}`` on every rank (CPU tensors).

    Per-element state (shaped like the flat master) comes back whole and shaped like the
    parameter, with the parameter's own scalar state (AdamW's ``step``); a parameter never
    stepped has no entry, as in torch. Under tensor parallelism the whole is gathered over
    tp too, per parameter in ``named_parameters`` order (tp ranks may cut buckets
    differently, so their bucket orders differ).
    """
    engine = engine_of(model)
    optimizer = one_optimizer(optimizer)
    inner = getattr(optimizer, "optim", optimizer)
    out: dict[str, dict[str, Any]] = {}
    pieces: dict[str, list[str]] = {}  # each parameter's per-element keys
    entries = param_entries(engine)
    for b in engine.buckets:
        state = bucket_state(inner.state, b)
        flat: dict[str, torch.Tensor] = {}  # per-element state, whole padded bucket
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape == (b.shard_numel,):
                flat[k] = v
                if engine.policy.shard_optimizer:
                    flat[k] = engine.gather_shard(b, v.detach(), phase="state")
        for e in entries:
            if e.bucket is not b:
                continue
            own = slot_scalars(inner.state, b, b.slots.index(e.slot))
            if own is None:
                continue
            out[e.name] = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                           for k, v in own.items()}
            s = e.slot  # this rank's tp piece (the whole parameter without tp)
            out[e.name].update((k, v[s.offset : s.offset + s.numel].view(s.shape))
                               for k, v in flat.items())
            pieces[e.name] = list(flat)
    for e in entries:  # the same order on every rank
        for k in pieces.get(e.name, ()):
            v = out[e.name][k]
            if engine.tp is not None:
                v = engine.tp.whole(e.slot.param, v)
            out[e.name][k] = v.cpu().clone()
    whole = getattr(optimizer, "whole", None)
    if whole is not None:  # a whole-parameter optimizer's parameters, from their owners
        out.update(whole_state_by_name(whole, inner, engine.device))
        out = {e.name: out[e.name] for e in entries if e.name in out}  # torch's order
    return out
