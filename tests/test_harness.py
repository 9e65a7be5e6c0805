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
from zeroshard.testing import RankError, RankTimeout, SweepError, run_ranks, sweep


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


# -- tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_in_rank_order(world_size: int) -> None:
    results = run_ranks(_all_reduce_rank, world_size, 2.0, timeout=60)
    expected = 2.0 * sum(range(world_size))
    assert results == [(r, expected, 1) for r in range(world_size)]
    assert not mp.active_children()


def test_exception_is_reported_quickly() -> None:
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_raise_on_rank_1, 2, timeout=60)
    assert time.monotonic() - start < 20  # rank 0 was blocked in all_reduce: killed, not awaited
    assert info.value.rank == 1
    msg = str(info.value)
    assert msg.startswith("rank 1 of 2 failed: ValueError: boom from rank 1")
    assert "Traceback" in msg and "_raise_on_rank_1" in msg
    assert not isinstance(info.value, RankTimeout)
    assert not mp.active_children()


def test_hang_names_the_collective_and_the_stack() -> None:
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
    assert not mp.active_children()


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
