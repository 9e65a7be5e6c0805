"""The multi-process harness itself: results, failures, crashes, hangs and sweeps.

Rank functions live at module level because they are pickled into spawned processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from zeroshard.comm import Comm
from zeroshard.testing import (
    RankError,
    RankTimeout,
    SweepError,
    kept_processes,
    run_ranks,
    sweep,
)


# -- rank functions ------------------------------------------------------------------------
def _all_reduce_rank(rank: int, world_size: int, scale: float) -> tuple[int, float, int]:
    t = torch.full((4,), float(rank) * scale)
    dist.all_reduce(t)
    return rank, t[0].item(), torch.get_num_threads()


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")
    Comm().all_reduce(torch.ones(8))  # blocks: rank 1 never joins


def _hang_on_rank_1(rank: int, world_size: int) -> None:
    pair = dist.new_group([0, 1])  # every rank must create it, even rank 2
    if rank == 0:
        Comm(pair, label="pair").all_reduce(torch.ones(1024), phase="backward", unit="unit")
    elif rank == 1:
        time.sleep(600)
    # rank 2 returns at once: it must be reported as finished


def _exit_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        print("rank 1 about to leave", file=sys.stderr, flush=True)
        os._exit(3)
    Comm().all_reduce(torch.ones(8))


def _square(n: int) -> int:
    if n == 3:
        raise ValueError("three is not allowed")
    return n * n


def _sweep_rank(rank: int, world_size: int, grid: list[dict[str, int]]) -> list[int]:
    return sweep(_square, grid)


def _dirty(rank: int, world_size: int) -> int:
    torch.set_default_dtype(torch.float64)
    os.environ["ZEROSHARD_LEAK"] = "1"
    os.chdir("/")
    torch.set_grad_enabled(False)
    return os.getpid()


def _look(rank: int, world_size: int) -> tuple:
    return (os.getpid(), torch.get_default_dtype(), os.environ.get("ZEROSHARD_LEAK"),
            os.getcwd(), torch.is_grad_enabled())


# -- tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_in_rank_order(world_size: int) -> None:
    results = run_ranks(_all_reduce_rank, world_size, 2.0, timeout=60)
    expected = 2.0 * sum(range(world_size))
    assert results == [(r, expected, 1) for r in range(world_size)]
    assert set(mp.active_children()) <= set(kept_processes())  # nothing else left running


def test_exception_is_reported_quickly() -> None:
    run_ranks(_all_reduce_rank, 2, 1.0, timeout=60)  # ranks started: time the failure alone
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_raise_on_rank_1, 2, timeout=60)
    assert time.monotonic() - start < 20  # rank 0 was blocked in all_reduce: killed, not awaited
    assert info.value.rank == 1
    msg = str(info.value)
    assert msg.startswith("rank 1 of 2 failed: ValueError: boom from rank 1")
    assert "Traceback" in msg and "_raise_on_rank_1" in msg
    assert not isinstance(info.value, RankTimeout)
    assert set(mp.active_children()) <= set(kept_processes())  # nothing else left running


def test_hang_names_the_collective_and_the_stack() -> None:
    run_ranks(_all_reduce_rank, 3, 1.0, timeout=60)  # ranks started: time the hang alone
    start = time.monotonic()
    # 15 s: on a loaded 2-core machine creating the pair's gloo group alone took over 8 s
    with pytest.raises(RankTimeout) as info:
        run_ranks(_hang_on_rank_1, 3, timeout=15.0)
    assert time.monotonic() - start < 30
    assert info.value.unfinished == [0, 1]
    msg = str(info.value)
    rank0, rank1, rank2 = msg.split("\nrank ")[1:]
    assert rank0.startswith("0 did not finish within 15.0 s; waiting in all_reduce(unit, backward")
    assert rank1.startswith("1 did not finish") and "time.sleep(600)" in rank1
    assert rank2 == "2 finished."
    assert set(mp.active_children()) <= set(kept_processes())  # nothing else left running


def test_hard_exit_reports_exit_code_and_output() -> None:
    with pytest.raises(RankError) as info:
        run_ranks(_exit_on_rank_1, 2, timeout=60)
    msg = str(info.value)
    assert info.value.rank == 1
    assert "rank 1 of 2 failed: exited with exit code 3" in msg
    assert "rank 1 about to leave" in msg


def test_sweep_names_the_failing_point() -> None:
    assert sweep(_square, [{"n": 1}, {"n": 2}]) == [1, 4]
    with pytest.raises(RankError) as info:
        run_ranks(_sweep_rank, 1, [{"n": 2}, {"n": 3}], timeout=60)
    assert "SweepError: grid point #1 {'n': 3} failed: ValueError: three is not allowed" in str(
        info.value
    )
    with pytest.raises(SweepError, match="#0 {'n': 3}"):
        sweep(_square, iter([{"n": 3}]))


def test_validation() -> None:
    with pytest.raises(ValueError, match="world_size must be in 1..8"):
        run_ranks(_all_reduce_rank, 9)
    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(lambda rank, world_size: rank, 1)


def test_kept_ranks_start_every_call_as_a_fresh_process_would() -> None:
    pids = run_ranks(_dirty, 2, timeout=60)
    kept = run_ranks(_look, 2, timeout=60)
    assert [k[0] for k in kept] == pids  # the same processes ...
    fresh = run_ranks(_look, 2, timeout=60, fresh=True)
    assert all(f[0] not in pids for f in fresh)
    assert [k[1:] for k in kept] == [f[1:] for f in fresh]  # ... in a fresh one's state
    assert kept[0][1:] == (torch.float32, None, os.getcwd(), True)


def test_a_failed_call_ends_its_ranks() -> None:
    pids = run_ranks(_dirty, 2, timeout=60)
    with pytest.raises(RankError):
        run_ranks(_raise_on_rank_1, 2, timeout=60)
    after = [k[0] for k in run_ranks(_look, 2, timeout=60)]
    assert not set(after) & set(pids)  # a peer may have been stuck: nothing is reused
