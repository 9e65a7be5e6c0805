"""Forward/backward patterns beyond one forward then one backward.

Two forwards then one backward (a chosen/rejected pair, a contrastive loss) trains as one
process does at every stage; at stage 3 it once failed with a DTensor error (the
gathered root held the user parameters after the first forward, see _unshard in
stage3.py). Several backwards through one graph (``retain_graph=True``), or a second
forward's graph backpropagated after the first one's backward, work at stages 0-2; stage
3 frees the units at each backward's end, and refuses the second backward with an error
that says what to do (it once crashed inside autograd on an empty storage).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import zeroshard
from zeroshard.models import GPT2Config, build_model
from zeroshard.testing import run_ranks, sweep

CFG = GPT2Config(n_layers=2, hidden=32, n_heads=2, seq_len=8, vocab=64)


def _data(step: int, r: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 * step + r))


def _ce(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), x.flatten())


def _losses(model, x: torch.Tensor, mode: str) -> list[torch.Tensor]:
    """The losses of one step, each backpropagated on its own."""
    if mode == "two_forwards":
        return [_ce(model(x), x) + _ce(model(x.flip(1)), x.flip(1))]
    if mode == "separate":
        a, b = model(x), model(x.flip(1))
        return [_ce(a, x), _ce(b, x.flip(1))]
    h = model(x)  # "retain": two losses of one graph
    return [_ce(h, x), h.pow(2).mean()]


def _step(model, optim, xs: list[torch.Tensor], mode: str, scale: float) -> None:
    for x in xs:
        losses = _losses(model, x, mode)
        for k, loss in enumerate(losses):
            (loss * scale).backward(retain_graph=k < len(losses) - 1)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optim.step()
    optim.zero_grad()


def _train(rank: int, world: int, stage: int, mode: str) -> dict:
    ref = build_model(CFG, seed=0)  # one process over both ranks' data
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        _step(ref, ref_optim, [_data(step, r) for r in range(world)], mode, 1 / world)
    model, optim = zeroshard.shard(build_model(CFG, seed=0), torch.optim.AdamW, stage=stage,
                                   lr=1e-2)
    try:
        for step in range(3):
            _step(model, optim, [_data(step, rank)], mode, 1.0)
    except RuntimeError as e:
        return {"error": str(e)}
    got = zeroshard.full_state_dict(model)
    return {"diff": max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items())}


GRID = ([{"stage": s, "mode": "two_forwards"} for s in range(4)]
        + [{"stage": s, "mode": m} for m in ("retain", "separate") for s in (2, 3)])


def _all(rank: int, world: int) -> list[dict]:
    return sweep(functools.partial(_train, rank, world), GRID)


@functools.cache
def _results() -> dict[tuple, dict]:
    got = run_ranks(_all, 2, timeout=300)[0]
    return {(p["stage"], p["mode"]): r for p, r in zip(GRID, got)}


@pytest.mark.parametrize("key", [(s, "two_forwards") for s in range(4)]
                         + [(2, "retain"), (2, "separate")])
def test_trains_as_one_process(key: tuple) -> None:
    r = _results()[key]
    assert "error" not in r, r
    assert r["diff"] < 2e-5, r  # fp32 AdamW, 3 steps: re-association only


@pytest.mark.parametrize("mode", ["retain", "separate"])
def test_stage3_refuses_a_second_backward_through_freed_units(mode: str) -> None:
    err = _results()[(3, mode)].get("error", "")
    assert "stage 3 runs one backward per forward" in err and "(loss_a + loss_b)" in err, err
