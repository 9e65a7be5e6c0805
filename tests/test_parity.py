"""Sharded training equals unsharded training on the same global batch (fp32).

One group of ranks is spawned per world size; every configuration of the grid's make-test
part (FAST) runs inside it, those of its make-slow part (REST) in another (see
zeroshard.testing.sweep). Bound, per parameter: 1e-5 in ||delta|| / ||reference||, or 3x
the larger of two measured yardsticks where that is larger: what torch DDP reaches on the
same batches (per model), and what single-process torch reaches when it merely sums the same batch in
as many parts as the run does, ranks x micro-batches, at least two (same maths, other rounding;
see train_reference). Both are measured here and
printed. The yardsticks matter for parameters whose true gradient is zero, such as the
key bias (softmax ignores a constant added to every key): their gradient is pure
rounding noise, which Adam turns into whole-lr steps of either sign.
"""

from __future__ import annotations

import functools

import pytest
from _training import rel_diffs, train_ddp, train_reference, train_sharded

from zeroshard.testing import run_ranks, sweep

FREEZE = "blocks.0.norm1.weight"
PRESETS = ("gpt2-tiny", "llama-tiny")  # DDP runs on each: the yardstick per model

GRID: list[dict] = [
    *({"stage": s} for s in (0, 1, 2, 3)),
    *({"stage": s, "clip": 0.05} for s in (0, 1, 2, 3)),
    *({"stage": s, "accum": 2} for s in (0, 1, 2, 3)),
    *({"stage": s, "accum": 2, "use_no_sync": False} for s in (0, 1, 2, 3)),
    {"stage": 1, "accum": 2, "use_no_sync": False, "clip": 0.05},
    *({"stage": s, "opt": "sgd"} for s in (1, 2, 3)),
    *({"stage": s, "freeze": FREEZE} for s in (0, 1, 2, 3)),
    {"stage": 3, "reshard_after_forward": False},
    {"stage": 3, "prefetch": 0},
    {"stage": 3, "prefetch": 2, "overlap": False},
    {"stage": 2, "overlap": False, "bucket_bytes": 4096},
    {"stage": 1, "reduce_dtype": "fp32", "bucket_bytes": 10_000},
    *({"stage": s, "preset": "llama-tiny"} for s in (0, 2, 3)),
    {"stage": 3, "preset": "llama-tiny", "freeze": "blocks.1.mlp.up_proj.weight"},
]
# make test runs these 13 points: every stage, every option value (the combined points
# whole), accumulation with and without no_sync at stages 0-3 between them, clipping
# unsharded (stage 0) and sharded; make slow runs the other 18 (ids "<world>-rest").
FAST: list[dict] = [
    {"stage": 0, "clip": 0.05},
    {"stage": 0, "accum": 2},
    {"stage": 1, "accum": 2, "use_no_sync": False, "clip": 0.05},
    {"stage": 1, "freeze": FREEZE},
    {"stage": 1, "reduce_dtype": "fp32", "bucket_bytes": 10_000},
    {"stage": 2, "accum": 2, "use_no_sync": False},
    {"stage": 2, "opt": "sgd"},
    {"stage": 2, "overlap": False, "bucket_bytes": 4096},
    {"stage": 3, "accum": 2},
    {"stage": 3, "reshard_after_forward": False},
    {"stage": 3, "prefetch": 0},
    {"stage": 3, "prefetch": 2, "overlap": False},
    {"stage": 3, "preset": "llama-tiny", "freeze": "blocks.1.mlp.up_proj.weight"},
]
REST: list[dict] = [p for p in GRID if p not in FAST]
assert all(p in GRID for p in FAST)


def _all(rank: int, world: int, grid: list[dict]) -> list:
    results = sweep(functools.partial(train_sharded, rank, world), grid)
    ddp = {p: train_ddp(rank, world, preset=p) for p in PRESETS}
    return [results, ddp] if rank == 0 else []


@functools.cache
def _reference(key: tuple) -> dict:
    return train_reference(**dict(key))


@pytest.mark.parametrize("world,grid", [
    *(pytest.param(w, FAST, id=f"{w}") for w in (1, 2, 3)),
    *(pytest.param(w, REST, id=f"{w}-rest", marks=pytest.mark.slow) for w in (1, 2, 3)),
])
def test_stages_match_unsharded_training(world: int, grid: list[dict]) -> None:
    """FAST at [1]/[2]/[3]; its slow twin, the rest of GRID, at [1-rest]/[2-rest]/[3-rest]."""
    results, ddps = run_ranks(_all, world, grid, timeout=600)[0]
    ddp = {p: rel_diffs(d, _reference((("preset", p),))) for p, d in ddps.items()}
    failures = []
    worst_ratio, worst_dev = 0.0, 0.0
    for point, got in zip(grid, results):
        ref_key = {k: v for k, v in point.items() if k in ("preset", "opt", "clip", "freeze")}
        ref_key.setdefault("preset", "gpt2-tiny")
        ref = _reference(tuple(sorted(ref_key.items())))
        # The same batch summed in as many parts as this run sums it (ranks x micro-batches):
        # the same re-association, so the rounding this run may show.
        split = max(2, world * point.get("accum", 1))
        yard = rel_diffs(_reference(tuple(sorted({**ref_key, "split": split}.items()))), ref)
        for name, dev in rel_diffs(got, ref).items():
            bound = max(1e-5, 3 * yard[name], 3 * ddp[ref_key["preset"]].get(name, 0.0))
            worst_ratio = max(worst_ratio, dev / bound)
            worst_dev = max(worst_dev, dev)
            if dev > bound:
                failures.append(f"{point} {name}: {dev:.2e} > bound {bound:.1e}")
    d = ddp["gpt2-tiny"]
    print(f"world {world}: DDP worst {max(d.values()):.2e} (median "
          f"{sorted(d.values())[len(d) // 2]:.1e}); zeroshard worst {worst_dev:.2e}, "
          f"worst deviation/bound {worst_ratio:.2f}")
    assert not failures, "\n".join(failures)
