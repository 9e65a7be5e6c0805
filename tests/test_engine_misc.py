"""Unused parameters, LR schedulers, and stage 2's bounded gradient memory in backward."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import zeroshard
from zeroshard.data import SyntheticLanguage, TokenLoader
from zeroshard.models import GPT2Config, build_model
from zeroshard.testing import run_ranks, sweep


class _Branchy(nn.Module):
    """``spare`` is never used: its gradient stays None on every rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.spare = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)


def _unused(rank: int, world: int, stage: int, move: bool = False) -> dict:
    model, optim = zeroshard.shard(_Branchy(), torch.optim.AdamW, stage=stage, lr=1e-2,
                                   weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    mb = 8 // world
    for step in range(3):
        x, y = _batches(step)
        if move and step:
            # Accelerate's prepare_model for evaluation (the HF Trainer's evaluate()):
            # torch copies every tensor moved from cpu to cpu:0 (issue #65).
            model.to(torch.device("cpu", 0))
            with torch.no_grad():
                model(x)
        F.cross_entropy(model(x[rank * mb:(rank + 1) * mb]), y[rank * mb:(rank + 1) * mb]).backward()
        optim.step()
        optim.zero_grad()
        sched.step()
    return {"state": zeroshard.full_state_dict(model), "lr": optim.param_groups[0]["lr"]}


def _all_unused(rank: int, world: int) -> list:
    return sweep(functools.partial(_unused, rank, world),
                 [{"stage": s, "move": m} for s in range(4) for m in (False, True)])


def test_unused_parameter_untouched_and_scheduler_works() -> None:
    """... and ``model.to(torch.device("cpu", 0))`` between steps (a copy of every
    parameter) followed by an evaluation forward trains as before: the parameters go back
    to the engine's buffers ([Note: parameters given new storage])."""
    ref = _Branchy()
    spare_before = {k: v.clone() for k, v in ref.spare.state_dict().items()}
    optim = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    for step in range(3):
        x, y = _batches(step)
        F.cross_entropy(ref(x), y).backward()
        optim.step()
        optim.zero_grad()
        sched.step()
    for r in run_ranks(_all_unused, 2, timeout=120)[0]:
        assert r["lr"] == 1e-2 * 0.5**3
        for k, v in spare_before.items():
            assert torch.equal(r["state"][f"spare.{k}"], v)  # no weight decay, no update
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6)


CFG = GPT2Config(n_layers=6, hidden=128, n_heads=4, seq_len=32, vocab=256)


def _stage2_grad_peak(rank: int, world: int) -> dict:
    model = build_model(CFG)
    bucket = 64 * 1024
    model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=2, lr=1e-3,
                                   bucket_bytes=bucket)
    engine = zeroshard.engine_of(model)
    x, y = next(TokenLoader(SyntheticLanguage(256, 32), global_batch=4, rank=rank,
                            world_size=world))
    tracker = zeroshard.memory_tracker(model, optim)
    with tracker:
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    return {
        "buffers": engine.peak_grad_buffer_bytes,
        "grads_after": tracker.current()["grads"],
        "grad_shards": sum(b.reduction.shard.numel() * 4 for b in engine.buckets),
        "largest_bucket": max(b.padded_numel for b in engine.buckets) * 4,
        "largest_param": max(p.numel() for p in model.parameters()) * 4,
        "whole": sum(b.padded_numel for b in engine.buckets) * 4,
        "n_buckets": len(engine.buckets),
    }


def test_stage2_never_holds_all_gradients_in_backward() -> None:
    """Whole-bucket gradients alive at once ≤ _MAX_PENDING (2) in flight + 1 filling
    (the engine's count; fewer when reductions finish early), and the tracker's peak
    agrees: nothing else grows."""
    for r in run_ranks(_stage2_grad_peak, 2, timeout=120):
        assert r["n_buckets"] > 6, r
        assert r["largest_bucket"] <= r["buffers"] <= 3 * r["largest_bucket"], r
        assert r["buffers"] < r["whole"] / 2, r
        # at the end of backward: the reduced slices, nothing of the whole buckets
        assert r["grads_after"] == r["grad_shards"], r


def test_stage2_frees_a_finished_reduction_at_the_next_gradient() -> None:
    """A bucket whose reduction has finished is completed (its whole buffer freed) when
    the next gradient arrives, not when the in-flight limit or the end of backward next
    waits for it. On one rank every reduction finishes at once, so one whole bucket is
    alive at a time (before: 3, the in-flight limit's 2 + the one filling)."""
    r = run_ranks(_stage2_grad_peak, 1, timeout=120)[0]
    assert r["n_buckets"] > 6, r
    assert r["buffers"] <= r["largest_bucket"], r



def _dropped(stage: int, tied: bool) -> bool:
    """Whether the engine is still alive after the script drops the model and optimizer."""
    import gc
    import weakref

    model = _Branchy()
    if tied:  # a parameter with two homes (tied.py's hooks)
        model.spare.weight = model.blocks[0].weight
    model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=stage, lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    engine = weakref.ref(zeroshard.engine_of(model))
    del model, optim
    gc.collect()
    return engine() is not None


DROPPED = [{"stage": s, "tied": t} for s in range(4) for t in (False, True)]


def _dropped_all(rank: int, world: int) -> list[bool]:
    return sweep(_dropped, DROPPED)


def test_a_dropped_model_is_freed() -> None:
    """A sharded model the script drops is collected with its engine (weights, buffers,
    the process group it refers to): autograd holds the engine's gradient hooks in C++,
    where the collector could not see the cycle, so every model ever sharded in a process
    stayed alive (a notebook re-running its cell, a sweep over configurations)."""
    for alive in run_ranks(_dropped_all, 2, timeout=120):
        assert not any(alive), list(zip(DROPPED, alive))
