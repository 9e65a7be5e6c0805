"""``save_checkpoint(..., async_save=True)`` (issue #64, item 3; [Note: asynchronous
checkpoints] in zeroshard/state/async_save.py).

World 2, gpt2-tiny, AdamW:

* training goes on while the checkpoint is written, and the checkpoint holds the state of
  the moment of the call (the staging copy), bit for bit, at stages 0-3 and bf16;
* the staging copy is this rank's bytes only (the tensors' sizes are asserted);
* a rank that fails or dies during the write: nothing is committed, the previous
  checkpoint stays the latest and loads (the writer's own group times out on the
  survivors, so they end);
* the default group as the writer's, and pinning without CUDA, are refused / warned.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _training import loader, loss_of, make_model

import zeroshard
from zeroshard.state import (
    AsyncCheckpoint,
    CheckpointError,
    full_optimizer_state,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    step_dir,
)
from zeroshard.testing import RankError, run_ranks, sweep


def _setup(stage: int, mp: str | None = None, seed: int = 0, timeout: float | None = None):
    return zeroshard.shard(make_model("gpt2-tiny", seed=seed), torch.optim.AdamW,
                           stage=stage, mixed_precision=mp, lr=1e-2, weight_decay=0.1,
                           timeout=timeout)


def _steps(model, optim, data, n: int) -> None:
    for _ in range(n):
        x, y = next(data)
        loss_of(model, x, y).backward()
        optim.step()
        optim.zero_grad()


def _state(model, optim) -> tuple[dict, dict]:
    return zeroshard.full_state_dict(model), full_optimizer_state(model, optim)


def _same(got: tuple[dict, dict], want: tuple[dict, dict]) -> bool:
    (gw, go), (ww, wo) = got, want
    return gw.keys() == ww.keys() and all(torch.equal(gw[k], ww[k]) for k in ww) and all(
        torch.equal(torch.as_tensor(go[n][k]), torch.as_tensor(wo[n][k]))
        for n in wo for k in wo[n])


def _while_training(rank: int, world: int, root: str, stage: int, mp: str | None) -> dict:
    from zeroshard.state import save as saving

    model, optim = _setup(stage, mp)
    data = loader("gpt2-tiny", rank, world)
    _steps(model, optim, data, 2)
    want = _state(model, optim)
    staged_bytes, staged_at = [], []
    original = saving.stage

    def counting(engine, sd, pin_memory=None, keep=True):  # what the staging copy holds
        out = original(engine, sd, pin_memory, keep)
        locals_ = [v.to_local() if hasattr(v, "to_local") else v for v in out.values()
                   if isinstance(v, torch.Tensor)]
        staged_bytes.append(sum(t.nbytes for t in locals_))
        staged_at.append({t.data_ptr() for t in locals_ if t.numel()})
        return out

    saving.stage = counting
    try:
        path = step_dir(root, stage * 10 + (mp is not None))
        handle = save_checkpoint(path, model, optim, extra={"step": 2}, async_save=True)
        assert isinstance(handle, AsyncCheckpoint)
        _steps(model, optim, data, 2)  # training goes on; the masters change under the write
        assert handle.wait() == path and handle.done()
        moved = _state(model, optim)
        # the next save copies into the first one's host memory ([Note: the staging copy
        # is kept]) and is the moment of its own call; keep_staging=False lets it go
        path2 = step_dir(root, 100 + stage * 10 + (mp is not None))
        handle = save_checkpoint(path2, model, optim, extra={"step": 4}, async_save=True,
                                 keep_staging=False)
        _steps(model, optim, data, 1)
        handle.wait()
    finally:
        saving.stage = original
    engine = zeroshard.engine_of(model)
    fresh, fresh_optim = _setup(stage, mp, seed=5)
    extra = load_checkpoint(path, fresh, fresh_optim)
    equal = _same(_state(fresh, fresh_optim), want)
    extra2 = load_checkpoint(path2, fresh, fresh_optim)
    own = sum(b.shard_numel if engine.policy.shard_optimizer else b.padded_numel
              for b in engine.buckets) * 4  # fp32 masters, this rank's
    return {"equal": equal, "step": extra["step"], "moved": not _same(moved, want),
            "staged": staged_bytes[0], "own": own,
            "reused": staged_at[0] == staged_at[1] and len(staged_at[0]) > 0,
            "second": _same(_state(fresh, fresh_optim), moved) and extra2["step"] == 4,
            "released": engine not in saving_kept()}


def saving_kept():
    from zeroshard.state import async_save

    return async_save._STAGING


def _all(rank: int, world: int, root: str) -> list[dict]:
    cases = [{"stage": 0, "mp": None}, {"stage": 1, "mp": None}, {"stage": 2, "mp": "bf16"},
             {"stage": 3, "mp": None}, {"stage": 3, "mp": "bf16"}]
    out = sweep(_while_training, [{"rank": rank, "world": world, "root": root, **c}
                                  for c in cases])
    dist.barrier()
    return out


def test_training_goes_on_and_the_checkpoint_is_the_moment_of_the_call(tmp_path) -> None:  # noqa: ANN001
    for results in run_ranks(_all, 2, str(tmp_path), timeout=300):
        for r in results:
            assert r["equal"] and r["step"] == 2 and r["moved"], r
            assert r["reused"] and r["second"] and r["released"], r
            # this rank's masters (fp32), its two Adam moments, a few RNG and extra bytes:
            # 3 x its 1/N at stages 1-3 (stage 0: everything, whole), nothing more
            assert 3 * r["own"] <= r["staged"] <= 3 * r["own"] + 64 * 1024, r


@pytest.mark.slow
def test_at_world_4_the_staging_copy_is_this_ranks_quarter(tmp_path) -> None:  # noqa: ANN001
    """Stage 3 at world 4: each rank stages 3 x its own master bytes (a quarter of the
    model state's), and the checkpoint is the moment of the call."""
    results = run_ranks(_while_training, 4, str(tmp_path), 3, None, timeout=300)
    whole = sum(p.numel() for p in make_model("gpt2-tiny").parameters()) * 4
    for r in results:
        assert r["equal"] and r["moved"], r
        assert 3 * r["own"] <= r["staged"] <= 3 * r["own"] + 64 * 1024, r
        assert r["own"] <= whole / 4 * 1.1, (r["own"], whole)  # padding only


def _dies_writing(rank: int, world: int, root: str, how: str) -> str:
    from torch.distributed.checkpoint import FileSystemWriter

    model, optim = _setup(3, timeout=5.0)
    data = loader("gpt2-tiny", rank, world)
    _steps(model, optim, data, 2)
    save_checkpoint(step_dir(root, 2), model, optim, async_save=True).wait()
    good = _state(model, optim)
    if rank == 0:
        torch.save(good, Path(root) / "good.pt")
    _steps(model, optim, data, 2)
    original = FileSystemWriter.write_data

    def write_then_fail(self, plan, planner):
        fut = original(self, plan, planner)
        fut.wait()  # this rank's shard files are on disk now
        if rank == 1:
            if how == "kill":
                os._exit(1)  # the writer thread's process dies; rank 0 waits, then ends
            raise OSError("disk full (simulated)")
        return fut

    FileSystemWriter.write_data = write_then_fail
    try:
        handle = save_checkpoint(step_dir(root, 4), model, optim, async_save=True)
        _steps(model, optim, data, 1)  # training goes on meanwhile
        with pytest.raises(CheckpointError, match="nothing was committed"):
            handle.wait()
    finally:
        FileSystemWriter.write_data = original
    return "failed as expected"


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_rank_failing_or_dying_mid_write_leaves_the_previous_checkpoint(
        tmp_path: Path, how: str) -> None:
    if how == "raise":
        assert run_ranks(_dies_writing, 2, str(tmp_path), how, timeout=120) == [
            "failed as expected"] * 2
    else:
        with pytest.raises(RankError, match="exit code 1"):
            run_ranks(_dies_writing, 2, str(tmp_path), how, timeout=120)
    partial = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert partial and not (partial[0] / "zeroshard.json").exists()
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 2)
    want = torch.load(tmp_path / "good.pt", weights_only=True)
    got = run_ranks(_load_latest, 1, str(tmp_path), timeout=120)[0]
    assert _same(got, want)


def _load_latest(rank: int, world: int, root: str) -> tuple[dict, dict]:
    model, optim = _setup(3, seed=7)
    load_checkpoint(latest_checkpoint(root), model, optim)
    return _state(model, optim)


def _refusals(rank: int, world: int, root: str) -> list[str]:
    import warnings

    model, optim = _setup(2)
    out = []
    try:
        save_checkpoint(step_dir(root, 1), model, optim, async_save=True,
                        process_group=dist.group.WORLD)
    except ValueError as e:
        out.append(str(e))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_checkpoint(step_dir(root, 2), model, optim, async_save=True,
                        pin_memory=True).wait()
    out += [str(w.message) for w in caught if "pinned" in str(w.message)]
    return out


def test_the_default_group_is_refused_and_pinning_without_cuda_falls_back(tmp_path) -> None:  # noqa: ANN001
    said = run_ranks(_refusals, 2, str(tmp_path), timeout=120)[0]
    assert "process_group=<the default group>" in said[0] and "dist.new_group" in said[0]
    assert "staging in pageable memory instead" in said[1]
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 2)


def _checksummed_as_written(rank: int, world: int, root: str) -> bool:
    """The shard files' CRCs come from the writer's stream (no read-back: save.py's
    file_record refuses them here), and the load's own verification accepts them."""
    from zeroshard.state import save as saving

    original = saving.file_record

    def no_read_back(path):  # noqa: ANN001, ANN202
        assert not Path(path).name.startswith("__"), f"{path} read back to checksum it"
        return original(path)

    model, optim = _setup(1)
    data = loader("gpt2-tiny", rank, world)
    _steps(model, optim, data, 1)
    want = _state(model, optim)
    saving.file_record = no_read_back
    try:
        save_checkpoint(step_dir(root, 1), model, optim)
        save_checkpoint(step_dir(root, 2), model, optim, async_save=True).wait()
    finally:
        saving.file_record = original
    fresh, fresh_optim = _setup(3, seed=4)
    load_checkpoint(step_dir(root, 2), fresh, fresh_optim)  # verify=True: every CRC read
    return _same(_state(fresh, fresh_optim), want)


def test_files_are_checksummed_as_they_are_written(tmp_path) -> None:  # noqa: ANN001
    assert run_ranks(_checksummed_as_written, 2, str(tmp_path), timeout=120) == [True, True]
