"""``torch.autograd.grad`` with respect to the parameters, between backward and step.

It reads gradients without accumulating them, so the gradients ``loss.backward()`` left
must survive it, as under DDP. At fp32 stages 1-2 the engine drops its published DTensor
``.grad`` just before autograd accumulates into a parameter; that hook once sat on the
tensor, where ``autograd.grad`` runs it too: the gradients vanished, ``clip_grad_norm_``
returned 0 and clipped nothing (silently). Now it sits on the AccumulateGrad node. Where
the model computes with tensors other than the parameters you hold (stage 3, mixed
precision) ``autograd.grad`` of them raises torch's "not used in the graph", as under
FSDP2.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroshard
from zeroshard.testing import run_ranks, sweep


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _train(rank: int, stage: int | None, mixed_precision: str | None = None) -> dict:
    model = _model()
    if stage is None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model = DDP(model)
    else:
        units = {"units": lambda m: False} if stage == 3 else {}
        model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=stage, lr=1e-2,
                                       mixed_precision=mixed_precision, **units)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    norms, penalty_grads = [], []
    for _ in range(2):
        F.mse_loss(model(x), y).backward()
        try:
            grads = torch.autograd.grad(model(x).pow(2).mean(), list(model.parameters()))
        except RuntimeError as e:
            return {"error": str(e)}
        penalty_grads.append([t.detach().clone() for t in grads])
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        optim.step()
        optim.zero_grad()
    state = model.module.state_dict() if stage is None else zeroshard.full_state_dict(model)
    return {"norms": norms, "penalty_grads": penalty_grads,
            "state": {k: v.detach().clone() for k, v in state.items()}}


def _all(rank: int, world: int) -> list[dict]:
    grid = [{"stage": s} for s in (None, 0, 1, 2, 3)] + [{"stage": 1, "mixed_precision": "bf16"}]
    return sweep(functools.partial(_train, rank), grid)


@functools.cache
def _results() -> list[dict]:
    return run_ranks(_all, 2, timeout=180)[0]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gradients_survive_autograd_grad_as_under_ddp(stage: int) -> None:
    ddp, got = _results()[0], _results()[1 + stage]
    assert got["norms"][0] > 0.1, got["norms"]  # the backward's gradient, not nothing
    torch.testing.assert_close(got["norms"], ddp["norms"], rtol=1e-5, atol=0)
    for mine, theirs in zip(got["penalty_grads"], ddp["penalty_grads"]):  # local, as DDP's
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for k, v in ddp["state"].items():
        torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-6)


def test_autograd_grad_of_parameters_the_model_does_not_compute_with_raises() -> None:
    for got in _results()[4:]:  # stage 3; stage 1 under bf16
        assert "not have been used in the graph" in got.get("error", ""), got
