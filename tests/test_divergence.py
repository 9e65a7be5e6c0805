"""Diverging ranks end in a clear error or a correct result, never a hang.

Every test here finishes in bounded time on its own: the engine's ``timeout`` and
``check_collectives`` options do the work, not the harness's watchdog.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
from _training import loader, loss_of, make_model, rel_diffs

import zeroshard
from zeroshard.comm import CollectiveMismatch, CollectiveTimeout
from zeroshard.testing import run_ranks, sweep

STEPS = 4  # rank 0 has 4 batches, rank 1 has 3


def _uneven(rank: int, world: int, stage: int, clip: float | None = None) -> dict:
    model, optim = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=stage,
                                   lr=1e-2, weight_decay=0.1, timeout=60)
    data = loader("gpt2-tiny", rank, world)
    batches = [next(data) for _ in range(STEPS - rank)]
    with zeroshard.join(model, optim):
        for x, y in batches:
            loss_of(model, x, y).backward()
            if clip is not None:
                optim.clip_grad_norm_(clip)
            optim.step()
            optim.zero_grad()
    return zeroshard.full_state_dict(model)


GRID = [{"stage": s} for s in (0, 1, 2, 3)] + [{"stage": 3, "clip": 0.05}, {"stage": 1, "clip": 0.05}]


def _all_uneven(rank: int, world: int) -> list:
    return sweep(functools.partial(_uneven, rank, world), GRID)


def _reference(clip: float | None) -> dict:
    """Steps 0-2 on both ranks' batches, step 3 on rank 0's batch alone."""
    model = make_model("gpt2-tiny")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = loader("gpt2-tiny", 0, 1)
    for step in range(STEPS):
        x, y = next(data)
        if step == STEPS - 1:
            half = x.shape[0] // 2
            x, y = x[:half], y[:half]
        loss_of(model, x, y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optim.step()
        optim.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_join_trains_on_the_actual_batches() -> None:
    results = run_ranks(_all_uneven, 2, timeout=300)
    for point, r0, r1 in zip(GRID, *results):
        ref = _reference(point.get("clip"))
        for name in ref:
            assert torch.equal(r0[name], r1[name]), (point, name)  # ranks agree
        for name, dev in rel_diffs(r0, ref).items():
            assert dev < 5e-3, (point, name, dev)  # see test_parity for the key-bias noise


def _no_join(rank: int, world: int, stage: int) -> str:
    model, optim = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=stage,
                                   lr=1e-2, timeout=30, check_collectives=True)
    data = loader("gpt2-tiny", rank, world)
    try:
        for _ in range(STEPS - rank):
            x, y = next(data)
            loss_of(model, x, y).backward()
            optim.step()
            optim.zero_grad()
        zeroshard.full_state_dict(model)  # rank 1 gets here while rank 0 still trains
    except CollectiveMismatch as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("stage", [2, 3])
def test_uneven_without_join_is_a_clear_error_on_every_rank(stage: int) -> None:
    start = time.monotonic()
    msgs = run_ranks(_no_join, 2, stage, timeout=120)
    assert time.monotonic() - start < 60
    for msg in msgs:
        assert "ranks diverged at step 3" in msg, msg  # 0-based: the 4th step
        assert "rank 0:" in msg and "rank 1:" in msg and "full_state_dict" in msg, msg
        assert "zeroshard.join()" in msg


class _Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model("gpt2-tiny")
        self.blocks = self.inner.blocks
        self.skip_first = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        m = self.inner
        x = m.tok_emb(idx) + m.pos_emb(torch.arange(idx.shape[1]))
        for i, block in enumerate(self.blocks):
            if i == 0 and self.skip_first:
                continue  # a data-dependent skip, taken on one rank only
            x = block(x)
        return m.lm_head(m.norm_f(x))


def _branch(rank: int, world: int) -> str:
    model, optim = zeroshard.shard(_Branchy(), torch.optim.AdamW, stage=3, lr=1e-2,
                                   timeout=30, check_collectives=True)
    data = loader("gpt2-tiny", rank, world)
    try:
        for step in range(3):
            model.skip_first = rank == 1 and step == 2
            x, y = next(data)
            loss_of(model, x, y).backward()
            optim.step()
            optim.zero_grad()
    except CollectiveMismatch as e:
        return str(e)
    return "no error"


def test_different_branch_names_step_and_unit() -> None:
    msgs = run_ranks(_branch, 2, timeout=120)
    for msg in msgs:
        # Forward still matches (prefetch gathered blocks.0 on both ranks); the first
        # differing collective is in backward: rank 0 gathers blocks.0 again, rank 1
        # (which never ran it) is already reducing blocks.1.
        assert "ranks diverged at step 2" in msg, msg
        assert "rank 0: all_gather(inner.blocks.0, backward" in msg, msg
        assert "rank 1: reduce_scatter(inner.blocks.1, backward" in msg, msg


def _hang(rank: int, world: int) -> str:
    model, optim = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=3,
                                   lr=1e-2, timeout=3)
    x, y = next(loader("gpt2-tiny", rank, world))
    if rank == 1:
        time.sleep(5)  # busy elsewhere, not in any collective (longer than the timeout)
        return "slept"
    start = time.monotonic()
    try:
        loss_of(model, x, y).backward()
    except CollectiveTimeout as e:
        return f"{time.monotonic() - start:.1f}|{e}"
    return "no error"


def test_collective_timeout_names_rank_unit_and_phase() -> None:
    waited, msg = run_ranks(_hang, 2, timeout=60)[0].split("|", 1)
    assert float(waited) < 6, waited
    assert "rank 0 waited 3 s in all_gather(" in msg and "forward" in msg, msg
