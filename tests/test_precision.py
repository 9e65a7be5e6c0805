"""Mixed precision: bf16 parity with the same recipe run unsharded; fp16 loss scaling.

The unsharded bf16 recipe: a bf16 copy of the model computes forward and backward, its
gradients are cast to fp32 and stepped by AdamW on fp32 master weights, which are cast
back to bf16 (what zeroshard does, minus sharding). Sharded runs additionally sum bf16
gradients across ranks, so they round differently; the bound is per parameter
max(2e-3, 3x the deviation of the unsharded recipe itself when it sums the batch in two
halves) — the same yardstick as tests/test_parity.py, measured here.
"""

from __future__ import annotations

import functools

import pytest
import torch
from _training import STEPS, Bf16Recipe, loader, loss_of, make_model, rel_diffs

import zeroshard
from zeroshard.testing import run_ranks, sweep

PRESETS = ("gpt2-tiny", "llama-tiny")


def _bf16_reference(preset: str, split: int = 1) -> dict[str, torch.Tensor]:
    recipe = Bf16Recipe(make_model(preset), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    data = loader(preset, 0, 1)
    for _ in range(STEPS):
        for x, y in data.micro_batches(split):
            (loss_of(recipe.model, x, y) / split).backward()
        recipe.step()
    return recipe.weights()


def _bf16_sharded(rank: int, world: int, preset: str, stage: int) -> dict:
    model = make_model(preset)
    model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=stage, lr=1e-2,
                                   weight_decay=0.1, mixed_precision="bf16")
    data = loader(preset, rank, world)
    for _ in range(STEPS):
        x, y = next(data)
        loss_of(model, x, y).backward()
        optim.step()
        optim.zero_grad()
    full = zeroshard.full_state_dict(model)
    return {n: full[n] for n, _ in model.named_parameters()}


def _bf16_all(rank: int, world: int, grid: list[dict]) -> list:
    return sweep(functools.partial(_bf16_sharded, rank, world), grid)


def _points(pairs: list[tuple[str, int]]) -> list[dict]:
    """Grid points from (preset, stage) pairs."""
    return [{"preset": p, "stage": s} for p, s in pairs]


GPT2, LLAMA = PRESETS
# (preset, stage) per world. The default run keeps every stage at each world, the presets
# alternating between the worlds so that each (preset, stage) runs at one of them, plus
# stage 0 of both presets at world 1 (the bit-exact check) and stage 3 of both at world
# 2 (gathered parameters over 2 ranks). The rest: make slow.
BF16 = {1: _points([(GPT2, 0), (LLAMA, 0), (LLAMA, 1), (GPT2, 2), (LLAMA, 3)]),
        2: _points([(LLAMA, 0), (GPT2, 1), (LLAMA, 2), (GPT2, 3), (LLAMA, 3)])}
BF16_MORE = {w: [q for q in _points([(p, s) for p in PRESETS for s in (0, 1, 2, 3)])
                 if q not in BF16[w]] for w in (1, 2)}


@functools.cache
def _bf16_references() -> tuple[dict, dict]:
    """Each preset's unsharded recipe and its yardstick (the same split in two halves)."""
    refs = {p: _bf16_reference(p) for p in PRESETS}
    yards = {p: rel_diffs(_bf16_reference(p, split=2), refs[p]) for p in PRESETS}
    return refs, yards


def _check_bf16(world: int, grid: list[dict]) -> None:
    results = run_ranks(_bf16_all, world, grid, timeout=300)[0]
    refs, yards = _bf16_references()
    failures, worst = [], 0.0
    for point, got in zip(grid, results):
        preset = point["preset"]
        for name, dev in rel_diffs(got, refs[preset]).items():
            bound = max(2e-3, 3 * yards[preset][name])
            worst = max(worst, dev / bound)
            if world == 1 and point["stage"] == 0:
                bound = 1e-6  # the same operations in the same order: equal
            if dev > bound:
                failures.append(f"{point} {name}: {dev:.2e} > {bound:.1e}")
    print(f"world {world}: worst deviation/bound {worst:.2f}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_matches_unsharded_recipe(world: int) -> None:
    """bf16 at every stage and both presets (BF16[world]) within the bound of the
    unsharded recipe; twin: test_bf16_matches_unsharded_recipe_more_configurations."""
    _check_bf16(world, BF16[world])


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_bf16_matches_unsharded_recipe_more_configurations(world: int) -> None:
    """The same bound for the other (preset, stage) points (BF16_MORE[world]); twin:
    test_bf16_matches_unsharded_recipe."""
    _check_bf16(world, BF16_MORE[world])


def _fp16_overflow(rank: int, world: int, stage: int) -> dict:
    model = make_model("gpt2-tiny")
    model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=stage, lr=1e-2,
                                   mixed_precision="fp16", init_scale=2.0**10)
    data = loader("gpt2-tiny", rank, world)
    before = zeroshard.full_state_dict(model)
    x, y = next(data)
    # Only rank 1 overflows: 1e30 times the gradient is inf in fp16. Every rank must skip.
    boost = 1e30 if rank == world - 1 else 1.0
    (loss_of(model, x, y) * boost).backward()
    optim.step()
    optim.zero_grad()
    after_skip = zeroshard.full_state_dict(model)
    scale_after_skip = optim.loss_scale
    losses = []
    for _ in range(5):
        x, y = next(data)
        loss = loss_of(model, x, y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    after = zeroshard.full_state_dict(model)
    return {
        "unchanged": all(torch.equal(before[k], after_skip[k]) for k in before),
        "finite": all(torch.isfinite(v).all().item() for v in after.values()),
        "scale": scale_after_skip,
        "trained": any(not torch.equal(before[k], after[k]) for k in before),
        "losses": losses,
        "skipped": zeroshard.engine_of(model).scaler.skipped_steps,
    }


def _fp16_all(rank: int, world: int) -> list:
    return sweep(functools.partial(_fp16_overflow, rank, world),
                 [{"stage": s} for s in (0, 1, 2, 3)])


def test_fp16_overflow_skips_step_and_halves_scale() -> None:
    for ranks in zip(*run_ranks(_fp16_all, 2, timeout=300)):
        for r in ranks:
            assert r["unchanged"], "an overflowing step changed parameters"
            assert r["scale"] == 2.0**9, r["scale"]
            assert r["skipped"] == 1, r
            assert r["finite"] and r["trained"], r
            assert all(torch.isfinite(torch.tensor(r["losses"])))


FROZEN = "blocks.0.attn.q_proj.weight"


def _frozen_start(rank: int, world: int, stage: int) -> dict:
    """Ranks built with different seeds: every rank starts from rank 0's weights, frozen
    parameters and buffers included (as DDP), and frozen weights compute in bf16."""
    model = make_model("llama-tiny", seed=rank, freeze=FROZEN)
    model.register_buffer("scale", torch.full((3,), float(rank)))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=stage, lr=1e-2,
                                   mixed_precision="bf16")
    x, y = next(loader("llama-tiny", rank, world))
    loss_of(model, x, y).backward()  # a bf16 forward through the frozen fp32-born weight
    optim.step()
    return {"start": start, "after": zeroshard.full_state_dict(model),
            "frozen_dtype": model.get_parameter(FROZEN).dtype, "scale": model.scale.clone()}


def _frozen_all(rank: int, world: int) -> list:
    return sweep(functools.partial(_frozen_start, rank, world), [{"stage": s} for s in range(4)])


def test_ranks_start_from_rank0_frozen_params_and_buffers_in_bf16() -> None:
    ranks = run_ranks(_frozen_all, 2, timeout=240)
    for stage, (r0, r1) in enumerate(zip(*ranks)):
        assert torch.equal(r1["scale"], r0["start"]["scale"]), stage  # buffer from rank 0
        want = r0["start"][FROZEN].to(torch.bfloat16).float()
        for r in (r0, r1):
            assert r["frozen_dtype"] == torch.bfloat16, stage
            assert torch.equal(r["after"][FROZEN], want), stage  # rank 0's, untouched
        for name in r0["after"]:
            assert torch.equal(r0["after"][name], r1["after"][name]), (stage, name)
