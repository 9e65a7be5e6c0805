"""``zeroshard bench --optimizer muon``: the optimizers every configuration trains with, and
the naive sharded Muon it is compared with.

Every system gets the same two optimizers, built the same way on its (unwrapped) model:
torch's Muon (lr 0.02, its defaults otherwise) over the hidden matrices — the 2-D
parameters outside the embeddings and the head — and AdamW (``--lr``) over the rest,
as Muon recipes train (Moonlight; KellerJordan/Muon). ``naive-muon`` is sharded Muon as
Megatron's distributed optimizer and Moonlight's ZeRO-1 Muon run it: zeroshard stage 1's
layout and ``Comm`` layer, but every rank all-gathers each bucket's full reduced
gradient, runs Newton–Schulz on every matrix with torch's Muon (the same function) and
keeps its own rows — the orthogonalisation repeated on every rank, where zeroshard's
owner scheme ([Note: whole-parameter updates] in engine/whole.py) runs it once per matrix
in the job.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["MUON_LR", "make_naive", "muon_optimizers", "muon_split"]

MUON_LR = 0.02


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The recipe's split of ``model``'s parameters: (the hidden matrices Muon steps —
    the 2-D parameters outside the embeddings and the head —, the rest, for AdamW).
    The planner prices the same split (memory/owners.py)."""
    embeds = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
              for p in m.parameters()}
    head = getattr(model, "lm_head", None)
    heads = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    hidden = [p for p in model.parameters()
              if p.ndim == 2 and id(p) not in embeds and id(p) not in heads]
    rest = [p for p in model.parameters() if not any(p is q for q in hidden)]
    return hidden, rest


def muon_optimizers(model: nn.Module, lr: float) -> tuple[torch.optim.Optimizer, ...]:
    """(Muon over the hidden matrices, AdamW over the rest) on ``model``'s parameters."""
    hidden, rest = muon_split(model)
    if not hidden:
        raise ValueError("--optimizer muon: the model has no hidden 2-D matrices for Muon")
    return (torch.optim.Muon(hidden, lr=MUON_LR), torch.optim.AdamW(rest, lr=lr))


def make_naive(core: Any) -> None:
    """Turn a stage-1 zeroshard Muon's owner step into the naive one (see the module doc):
    every rank holds every matrix whole and steps all of them. ``core``: the optimizer
    ``shard(model, muon)`` returned, or the core of ``shard(model, (muon, adamw))``'s."""
    from zeroshard.engine.composite import CompositeOptimizer
    from zeroshard.engine.whole import _placeholder

    engine, whole, inner = core.engine, core.whole, core.optim
    whole.tensors = {s: nn.Parameter(_placeholder(s)) for s in whole.owner}
    whole.work_done = []
    part = inner.parts[core.whole_part] if isinstance(inner, CompositeOptimizer) else inner
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": list(whole.tensors.values())} for g in part.param_groups]
    if isinstance(inner, CompositeOptimizer):
        inner.parts[core.whole_part] = torch.optim.Muon(groups)
        inner.state._owner = None  # the parts' groups changed: route the state afresh
    else:
        core.optim = torch.optim.Muon(groups)

    @torch.no_grad()
    def step_all(optimizer: Any, b: Any, slots: list) -> None:
        grad = engine.gather_shard(b, b.master_grad, phase="step")  # the full gradient
        for s in slots:  # stage 1 keeps whole weights: they are the masters' values
            t = whole.tensors[s]
            t.data = b.slot_view(b.full, s.index).detach().clone()
            t.grad = b.slot_view(grad, s.index)
        optimizer.step()
        whole.work_done += [s.shape for s in slots]
        for s in slots:  # each rank keeps its rows
            lo, hi = s.piece(b.rank)
            b.master_range(s.shard_offset, s.shard_offset + hi - lo).copy_(
                whole.tensors[s].data.reshape(-1)[lo:hi])
        whole._release(slots)

    def step(optimizer: Any, unused: dict) -> None:
        for b, slots in whole.plans:
            step_all(optimizer, b, slots)

    whole.step = step
