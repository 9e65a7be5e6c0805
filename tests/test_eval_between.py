"""A forward between backward and step (an evaluation) leaves the gradients alone.

Under DDP, ``loss.backward(); with torch.no_grad(): model(x_val); clip_grad_norm_(...);
opt.step()`` clips and steps the training gradients. On main before this test, stages
1-2 (fp32, where the user parameters are the compute ones) dropped the parameters'
``.grad`` at every forward, so that evaluation made ``clip_grad_norm_`` return 0 and
clip nothing: silently not DDP's training. They are now dropped when the next backward
reaches its first parameter (BackwardPass.drop_published). With gradients enabled and no
backward after it, stage 3 (and mixed precision at stages 0-2) left the modules holding
the compute parameters (no gradients: the same zero norm) and stage 3 kept the root
unit's weights gathered through the step, so the next forward computed with the old
weights ([Note: between forward and backward] in forward.py). Checked at world 2, every
stage, fp32 and bf16: runs with an evaluation under ``no_grad`` or with gradients equal
the run without one exactly, and fp32 runs equal one process's.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import zeroshard
from zeroshard.testing import run_ranks, sweep


def _run(rank: int, world: int, stage: int | None, evaluate: str | None,
         mp: str | None = None) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    if stage is None:
        optim = torch.optim.SGD(model.parameters(), lr=0.5)
        rank, world = 0, 1
    else:
        units = {"units": lambda m: False} if stage == 3 else {}
        model, optim = zeroshard.shard(model, torch.optim.SGD, stage=stage, lr=0.5,
                                       mixed_precision=mp, **units)
    norms = []
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        part = slice(rank * 4 // world, (rank + 1) * 4 // world)
        F.cross_entropy(model(x[part]).float(), y[part]).backward()
        v = torch.randn(3, 8, generator=g)
        if evaluate is not None:
            with torch.set_grad_enabled(evaluate == "grad"):
                model(v)  # the evaluation
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        optim.step()
        optim.zero_grad()
    state = zeroshard.full_state_dict(model) if stage is not None else model.state_dict()
    return {"norms": norms, "state": {k: v.detach().clone() for k, v in state.items()}}


GRID = [{"stage": s, "evaluate": e, "mp": mp} for s in range(4) for mp in (None, "bf16")
        for e in (None, "no_grad", "grad")]


def _all(rank: int, world: int) -> list:
    return sweep(functools.partial(_run, rank, world), GRID)


def test_an_evaluation_between_backward_and_step_changes_nothing() -> None:
    got = run_ranks(_all, 2, timeout=300)[0]
    ref = _run(0, 1, None, None)
    runs = {tuple(p.values()): r for p, r in zip(GRID, got)}
    for point, r in zip(GRID, got):
        plain = runs[(point["stage"], None, point["mp"])]  # the same without evaluation
        assert r["norms"] == plain["norms"], (point, r["norms"], plain["norms"])
        for k, v in plain["state"].items():
            assert torch.equal(r["state"][k], v), (point, k)
        if point["mp"]:
            continue  # fp32 runs against one process:
        for a, b in zip(r["norms"], ref["norms"]):
            assert abs(a - b) <= 1e-5 * b, (point, r["norms"], ref["norms"])
        for k, v in ref["state"].items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k, p=point: f"{p} {k}: {m}")
