"""Hybrid sharding at 2 replicas x 2 shards (4 CPU ranks): parity and exact traffic."""

from __future__ import annotations

import functools

import pytest
import torch
from _training import rel_diffs, train_reference, train_sharded

import zeroshard
from zeroshard.testing import run_ranks, sweep

GRID = [{"stage": s} for s in (1, 2, 3)] + [{"stage": 3, "reshard_after_forward": False}]


def _hybrid(rank: int, world: int, stage: int, **opts) -> dict:
    state = train_sharded(rank, world, stage=stage, hybrid=(2, 2), **opts)
    return {"state": state}


def _traffic(rank: int, world: int, stage: int, **opts) -> dict:
    from _training import loader, loss_of, make_model

    model, optim = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=stage,
                                   lr=1e-3, hybrid=(2, 2), **opts)
    engine = zeroshard.engine_of(model)
    x, y = next(loader("gpt2-tiny", rank, world))
    loss_of(model, x, y).backward()
    optim.step()
    recs = [r for r in engine.comm.ledger.last_step()
            if r.phase in ("forward", "backward", "step")]
    return {
        "by_group": engine.comm.ledger.by("group", recs),
        "padded": sum(b.padded_numel for b in engine.buckets),
        "units": [(u.is_root, sum(b.padded_numel for b in u.buckets)) for u in engine.units],
        "group_sizes": (engine.comm.size, engine.replicate.size),
    }


def _save(rank: int, world: int) -> dict:
    """Replica 0 writes a checkpoint; every rank returns once it is committed, and when
    one of replica 0's writers fails, every rank of every replica raises — synchronous
    saves and asynchronous ones (at wait())."""
    import os
    import tempfile

    from _training import make_model
    from torch.distributed.checkpoint import FileSystemWriter

    from zeroshard.state import CheckpointError, save_checkpoint

    model, optim = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=2,
                                   lr=1e-3, hybrid=(2, 2))
    engine = zeroshard.engine_of(model)
    root = os.path.join(tempfile.gettempdir(), f"hybrid-save-{os.getppid()}")
    out = {"replica": engine.replicate.rank}
    save_checkpoint(os.path.join(root, "good"), model, optim)
    out["committed_on_return"] = os.path.exists(os.path.join(root, "good"))
    original = FileSystemWriter.write_data

    def fail(self, plan, planner):
        if engine.replicate.rank == 0 and engine.comm.rank == 1:
            raise OSError("disk full (simulated)")
        return original(self, plan, planner)

    FileSystemWriter.write_data = fail
    try:
        save_checkpoint(os.path.join(root, "bad"), model, optim)
        out["bad"] = "returned"
    except CheckpointError as e:
        out["bad"] = str(e)
    try:  # asynchronous: every rank's wait() learns the outcome of replica 0's write
        save_checkpoint(os.path.join(root, "bad-async"), model, optim, async_save=True).wait()
        out["bad_async"] = "returned"
    except (CheckpointError, OSError) as e:
        out["bad_async"] = str(e)
    finally:
        FileSystemWriter.write_data = original
    handle = save_checkpoint(os.path.join(root, "good-async"), model, optim, async_save=True)
    out["good_async"] = str(handle.wait()) == os.path.join(root, "good-async")
    return out


def _all(rank: int, world: int) -> list:
    parity = sweep(functools.partial(_hybrid, rank, world), GRID)
    traffic = sweep(functools.partial(_traffic, rank, world), GRID)
    return [parity, traffic, _save(rank, world)]


@functools.cache
def _results() -> list:
    return run_ranks(_all, 4, timeout=600)


def test_hybrid_2x2_matches_single_process() -> None:
    ref = train_reference()
    # the batch summed in as many parts as the 4 ranks sum it (see tests/test_parity.py)
    yard = rel_diffs(train_reference(split=4), ref)
    for point, r in zip(GRID, _results()[0][0]):
        for name, dev in rel_diffs(r["state"], ref).items():
            # bound as in tests/test_parity.py (re-association yardstick)
            assert dev <= max(1e-5, 3 * yard[name]), (point, name, dev, yard[name])


def test_hybrid_traffic_per_group_equals_formula() -> None:
    c = 4  # fp32
    for point, r in zip(GRID, _results()[0][1]):
        shard_size, replicas = r["group_sizes"]
        assert (shard_size, replicas) == (2, 2)
        by = r["by_group"]
        # cross-group: one all-reduce of this rank's Ψ/G slice per bucket: 2 · Ψ/G
        assert by["replicate"]["logical_bytes"] == 2 * c * r["padded"] // shard_size, point
        blocks = sum(n for root, n in r["units"] if not root)
        root = sum(n for is_root, n in r["units"] if is_root)
        if point["stage"] < 3:
            intra = 2 * c * r["padded"]
        elif point.get("reshard_after_forward", True):
            intra = c * (3 * blocks + 2 * root)
        else:
            intra = c * (2 * blocks + 2 * root)
        assert by["shard"]["logical_bytes"] == intra, (point, by)
        assert "world" not in by  # nothing else crosses nodes in forward/backward/step


def _bad(rank: int, world: int, case: str) -> str:
    import os

    from _training import make_model

    if case == "local":
        os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=3,
                        hybrid=(1, 2) if case == "local" else (3, 1))
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("case,pattern", [
    ("product", "covers 3 ranks but the world has 2"),
    ("local", "would span nodes"),
])
def test_hybrid_bad_layouts(case: str, pattern: str) -> None:
    for msg in run_ranks(_bad, 2, case, timeout=60):
        assert pattern in msg, msg


def test_every_replica_waits_for_replica_0s_save_and_learns_its_failure() -> None:
    for r in _results():
        assert r[2]["committed_on_return"], r[2]
        assert "nothing was committed" in r[2]["bad"], r[2]
        assert "nothing was committed" in r[2]["bad_async"], r[2]
        assert r[2]["good_async"], r[2]
    assert sorted(r[2]["replica"] for r in _results()) == [0, 0, 1, 1]
