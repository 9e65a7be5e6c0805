"""A forward between backward and step (an evaluation) leaves the gradients alone.

Under DDP, ``loss.backward(); with torch.no_grad(): model(x_val); clip_grad_norm_(...);
opt.step()`` clips and steps the training gradients. On main before this test, stages
1-2 (fp32, where the user parameters are the compute ones) dropped the parameters'
``.grad`` at every forward, so that evaluation made ``clip_grad_norm_`` return 0 and
clip nothing: silently not DDP's training. They are now dropped when the next backward
reaches its first parameter (engine._drop_published). Checked at world 2, every stage,
with the evaluation under ``no_grad`` and (stages 0-2) with gradients enabled and no
backward after it, against one process.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import zeroshard
from zeroshard.testing import run_ranks, sweep


def _run(rank: int, world: int, stage: int | None, grad_eval: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    if stage is None:
        optim = torch.optim.SGD(model.parameters(), lr=0.5)
        rank, world = 0, 1
    else:
        units = {"units": lambda m: False} if stage == 3 else {}
        model, optim = zeroshard.shard(model, torch.optim.SGD, stage=stage, lr=0.5, **units)
    norms = []
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        part = slice(rank * 4 // world, (rank + 1) * 4 // world)
        F.cross_entropy(model(x[part]), y[part]).backward()
        with torch.set_grad_enabled(grad_eval):
            model(torch.randn(3, 8, generator=g))  # the evaluation
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        optim.step()
        optim.zero_grad()
    state = zeroshard.full_state_dict(model) if stage is not None else model.state_dict()
    return {"norms": norms, "state": {k: v.detach().clone() for k, v in state.items()}}


# Not stage 3 with gradients enabled: there the root unit's modules hold the gathered
# compute parameters from such a forward until a backward frees them, so torch APIs on
# model.parameters() read those (without gradients) until then. Known, not fixed here.
GRID = [{"stage": s, "grad_eval": e} for s in range(4) for e in (False, True)
        if not (s == 3 and e)]


def _all(rank: int, world: int) -> list:
    return sweep(functools.partial(_run, rank, world), GRID)


def test_an_evaluation_between_backward_and_step_changes_nothing() -> None:
    got = run_ranks(_all, 2, timeout=300)[0]
    ref = _run(0, 1, None, False)
    for point, r in zip(GRID, got):
        for a, b in zip(r["norms"], ref["norms"]):
            assert abs(a - b) <= 1e-5 * b, (point, r["norms"], ref["norms"])
        for k, v in ref["state"].items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k, p=point: f"{p} {k}: {m}")
