"""Run a function on N CPU processes ("ranks") joined in one torch.distributed group.

Every distributed test in zeroshard goes through :func:`run_ranks`::

    def _sum_of_ranks(rank: int, world_size: int, n: int) -> float:
        t = torch.full((n,), float(rank))
        Comm().all_reduce(t)
        return t[0].item()

    def test_sum_of_ranks() -> None:
        assert run_ranks(_sum_of_ranks, 3, 8) == [3.0, 3.0, 3.0]

How it works
------------
* The test process pickles ``(fn, args, kwargs)`` itself, so a lambda or closure fails at
  once with a hint. Ranks are forked from a server process that imported torch and
  zeroshard once (:mod:`zeroshard.testing.rank_start`), never from the test process: that
  would copy its torch thread pools, locks and pytest state into them.
* Ranks are kept and reused: even forked, a rank must join a group, and most tests run
  for less than a process start-up costs. Each call joins a new process group and leaves the process as it
  found it; a call that fails ends its ranks (see [Note: reused ranks] in rank_main.py and
  rank_pool.py). ``fresh=True`` gives a call processes of its own, for tests that measure
  the process itself (peak RSS); ``ZEROSHARD_TEST_FRESH_RANKS=1`` does so for every call.
* Each rank's file descriptors 1 and 2 go to a log per call, so pytest's capture files are
  not inherited and C++ output and segfault traces are kept; the test process replays the
  logs on its stderr as ``[rank r] ...`` (pytest shows them on failure).
* Each rank sets ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``: CI has 2 cores
  shared by up to 4 ranks, and N ranks x N intra-op threads thrash. A call's group meets
  through a ``FileStore`` in the call's directory: no port to race for, and rank 0
  finishing early does not take the store down (it would with a TCPStore hosted by rank 0).
* Failures and hangs: see :mod:`zeroshard.testing.supervise`. At the first failure every
  other rank is killed at once (they are usually blocked in a collective waiting for the
  rank that failed). At the deadline, counted from the call (start-up excluded), every
  rank's watchdog reports the collective it waits in (recorded in
  ``zeroshard.comm_wait.IN_FLIGHT``) and its main thread's stack, which go into
  :class:`RankTimeout`.

Parameter sweeps: loop inside one call
--------------------------------------
A test over many configurations loops *inside* one call with :func:`sweep`::

    def _parity(rank: int, world_size: int, grid: list[dict]) -> list[float]:
        return sweep(_check_parity, grid)      # calls _check_parity(**point) per point

    def test_parity() -> None:
        grid = [{"stage": s, "dtype": d} for s in (0, 1, 2, 3) for d in ("fp32", "bf16")]
        run_ranks(_parity, 2, grid)

Every rank must walk the same grid in the same order, or collectives pair up wrongly. A
failing point raises :class:`SweepError` naming it; peers blocked in that point are killed.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

from zeroshard.testing.errors import RankError, RankTimeout, SweepError
from zeroshard.testing.rank_main import fresh_main
from zeroshard.testing.rank_pool import pool_for
from zeroshard.testing.rank_start import rank_context
from zeroshard.testing.supervise import replay_logs, supervise

__all__ = ["RankError", "RankTimeout", "SweepError", "run_ranks", "sweep"]

_MAX_WORLD = 8


def sweep(fn: Callable[..., Any], grid: Iterable[dict[str, Any]]) -> list[Any]:
    """Return ``[fn(**point) for point in grid]``; a failure names its grid point."""
    results = []
    for i, point in enumerate(grid):
        try:
            results.append(fn(**point))
        except Exception as e:
            raise SweepError(f"grid point #{i} {point!r} failed: {type(e).__name__}: {e}") from e
    return results


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    fresh: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks.

    ``fn`` must be a module-level function and its arguments and result picklable. Returns
    the results ordered by rank. Raises :class:`RankError` if a rank fails (the earliest
    failure is blamed first: peers of a failed rank often fail *because* of it, e.g. gloo's
    "Connection closed by peer") and :class:`RankTimeout` if the call is not done within
    ``timeout`` seconds (start-up not counted). ``env`` adds variables to the ranks (ranks
    are kept per distinct ``env``, since some are read at import). ``fresh=True`` runs the
    call in processes of its own, started for it and ended after it.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {world_size!r}")
    if not 1 <= world_size <= _MAX_WORLD:
        raise ValueError(f"world_size must be in 1..{_MAX_WORLD} (CPU ranks), got {world_size}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except Exception as e:
        raise TypeError(
            f"run_ranks could not pickle fn={fn!r} or its arguments ({e}); fn must be a "
            "module-level function and args picklable: lambdas, closures and local functions "
            "cannot be sent to spawned processes"
        ) from e
    if fresh or os.environ.get("ZEROSHARD_TEST_FRESH_RANKS") == "1":
        return _run_fresh(payload, world_size, timeout, backend, dict(env or {}))
    return pool_for(world_size, backend, dict(env or {})).run(payload, timeout)


def _run_fresh(payload: bytes, world_size: int, timeout: float, backend: str,
               env: dict[str, str]) -> list[Any]:
    calldir = tempfile.mkdtemp(prefix="zeroshard-ranks-")
    ctx = rank_context()
    procs = [
        ctx.Process(
            target=fresh_main,
            args=(r, world_size, payload, backend, calldir, env, timeout),
            name=f"zeroshard-rank-{r}",
            daemon=False,  # fn may start its own workers; `finally` reaps ranks
        )
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        # Counted from the spawn: these ranks' start-up is part of the call.
        return supervise(procs, calldir, time.monotonic() + timeout, timeout)
    finally:
        for p in procs:  # no-op for ranks that exited; no zombies either way
            if p.pid is not None:
                if p.is_alive():
                    p.kill()
                p.join()
                p.close()
        replay_logs(calldir, world_size)
        shutil.rmtree(calldir, ignore_errors=True)
        if os.path.exists(calldir + ".store"):  # beside the call's directory (rank_main.py)
            os.remove(calldir + ".store")
