"""Gradients the user assigns, and requires_grad flipped after sharding.

``p.grad = None`` makes torch's optimizers skip ``p``; ``p.grad = p.grad * 0.5`` steps the
new tensor (see [Note: assigned gradients] in step_grads.py). zeroshard once stepped its own
reduced gradient in both cases, at every stage (silently). Freezing a parameter after
``shard()`` is honoured where the modules compute with the parameters the user holds
(fp32 stages 0-2) and refused elsewhere (it trained on at stage 3); unfreezing one that
was frozen at shard time is refused everywhere (it has no optimizer state).
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


def _edit(model: nn.Module, mode: str, step: int) -> None:
    first, _, last, _ = list(model.parameters())
    if mode == "none":
        first.grad = None
    elif mode == "scaled":
        last.grad = last.grad * 0.5
    elif mode == "whole" and step:  # a plain tensor of the parameter's shape
        last.grad = torch.full(tuple(last.shape), 0.01)
    elif mode == "freeze" and step == 1:
        first.requires_grad_(False)


def _train(rank: int, stage: int | None, mode: str, optim: str = "sgd") -> dict:
    model = _model()
    cls, lr = (torch.optim.SGD, 0.5) if optim == "sgd" else (torch.optim.AdamW, 1e-2)
    if mode == "unfreeze":
        model[0].bias.requires_grad_(False)
    if stage is None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        opt = cls([p for p in model.parameters() if p.requires_grad], lr=lr)
        model = DDP(model, find_unused_parameters=mode == "freeze")
    else:
        units = {"units": lambda m: False} if stage == 3 else {}
        model, opt = zeroshard.shard(model, cls, stage=stage, lr=lr, **units)
    g = torch.Generator().manual_seed(rank)
    norms = []
    try:
        for step in range(3):
            if mode == "unfreeze" and step == 1:
                model.module[0].bias.requires_grad_(True)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            F.mse_loss(model(x), y).backward()
            _edit(model, mode, step)
            if mode != "whole":  # torch's clipping refuses a mix of DTensor and tensor .grad
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
            opt.step()
            opt.zero_grad()
    except RuntimeError as e:
        return {"error": str(e)}
    state = model.module.state_dict() if stage is None else zeroshard.full_state_dict(model)
    return {"norms": norms, "state": {k: v.detach().clone() for k, v in state.items()}}


GRID = ([{"stage": s, "mode": m, "optim": o} for m in ("none", "scaled") for o in ("sgd", "adamw")
         for s in (None, 0, 1, 2, 3)]
        + [{"stage": s, "mode": "whole"} for s in (None, 0, 1, 3)]
        + [{"stage": s, "mode": "freeze"} for s in (None, 1, 3)]
        + [{"stage": s, "mode": "unfreeze"} for s in (0, 1)])


def _all(rank: int, world: int) -> list[dict]:
    return sweep(functools.partial(_train, rank), GRID)


@functools.cache
def _results() -> dict[tuple, dict]:
    got = run_ranks(_all, 2, timeout=300)[0]
    return {tuple(p.values()): r for p, r in zip(GRID, got)}


def _same_as_ddp(key: tuple) -> None:
    r = _results()
    ddp, got = r[(None, *key[1:])], r[key]
    assert "error" not in got, got
    torch.testing.assert_close(got["norms"], ddp["norms"], rtol=1e-5, atol=0)
    for k, v in ddp["state"].items():
        torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("mode", ["none", "scaled"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_assigned_grads_reach_the_step_as_under_ddp(stage: int, mode: str, optim: str) -> None:
    _same_as_ddp((stage, mode, optim))


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_whole_tensor_assigned_to_a_sharded_grad_steps_as_under_ddp(stage: int) -> None:
    _same_as_ddp((stage, "whole"))


def test_freezing_after_shard_is_honoured_or_refused() -> None:
    _same_as_ddp((1, "freeze"))  # the modules compute with the user's parameters
    assert "requires_grad=True when the model was sharded" in _results()[(3, "freeze")].get(
        "error", ""), _results()[(3, "freeze")]
    for stage in (0, 1):
        err = _results()[(stage, "unfreeze")].get("error", "")
        assert "has no optimizer state" in err, err
