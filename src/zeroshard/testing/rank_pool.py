"""Kept ranks: groups of rank processes started once and reused by later calls.

One pool per (world size, backend, extra environment), at most ``_MAX_KEPT_RANKS``
processes kept in all (the least recently used pool goes first). A pool whose call failed
or timed out is killed (see [Note: reused ranks] in rank_main.py); so is one whose rank
grew past ``_MAX_RANK_RSS`` (memory a test left behind, or an allocator that keeps it).
Start-up is not counted in a call's timeout: under load, importing torch alone can take
longer than a short test's budget.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from multiprocessing.connection import wait
from typing import Any

from zeroshard.testing.errors import RankError
from zeroshard.testing.rank_main import pool_main
from zeroshard.testing.rank_start import rank_context
from zeroshard.testing.supervise import replay_logs, supervise

__all__ = ["RankPool", "close_all", "kept_processes", "pool_for"]

_MAX_KEPT_RANKS = 8
_MAX_RANK_RSS = 3 << 30
_START_TIMEOUT_S = 300.0

_POOLS: OrderedDict[tuple[Any, ...], RankPool] = OrderedDict()


class RankPool:
    """``world_size`` kept rank processes, each joined to the test process by a pipe."""

    def __init__(self, world_size: int, backend: str, env: dict[str, str]) -> None:
        self.world_size, self.env = world_size, dict(env)
        self.rundir = tempfile.mkdtemp(prefix="zeroshard-pool-")
        ctx = rank_context()
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        for r in range(world_size):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=pool_main, args=(r, world_size, backend, self.rundir,
                                                    self.env, theirs),
                            name=f"zeroshard-kept-rank-{r}",
                            daemon=False)  # fn may start its own workers
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(ours)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for r, (p, conn) in enumerate(zip(self.procs, self.conns)):
            ready = wait([conn, p.sentinel], timeout=max(0.0, deadline - time.monotonic()))
            try:
                ok = conn in ready and conn.recv() == "ready"
            except (EOFError, OSError):
                ok = False
            if not ok:
                log = os.path.join(self.rundir, f"rank{r}.startup.log")
                tail = open(log, errors="replace").read()[-4000:] if os.path.exists(log) else ""
                self.close()
                raise RankError(f"rank {r} of {self.world_size} did not start within "
                                f"{timeout:.0f} s (exit code {p.exitcode}); its output:\n{tail}",
                                r)

    def healthy(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs) and all(
            _rss(p.pid) < _MAX_RANK_RSS for p in self.procs)

    def run(self, payload: bytes, timeout: float) -> list[Any]:
        """One call on these ranks; the pool is closed if it fails or times out."""
        calldir = tempfile.mkdtemp(prefix="call-", dir=self.rundir)
        environ = dict(os.environ) | self.env  # what a fresh spawn would inherit now
        deadline = time.monotonic() + timeout
        ok = False
        try:
            for conn in self.conns:
                conn.send((calldir, payload, timeout, environ))
            results = supervise(self.procs, calldir, deadline, timeout, self.conns)
            ok = True
            return results
        finally:
            if not ok:
                self.close()
                forget(self)
            replay_logs(calldir, self.world_size)
            shutil.rmtree(calldir, ignore_errors=True)

    def close(self) -> None:
        for p in self.procs:
            if p.pid is not None:
                if p.is_alive():
                    p.kill()
                p.join()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        shutil.rmtree(self.rundir, ignore_errors=True)


def pool_for(world_size: int, backend: str, env: dict[str, str]) -> RankPool:
    """A started pool for these settings: the kept one if it is healthy, else a new one."""
    key = (world_size, backend, tuple(sorted(env.items())))
    pool = _POOLS.pop(key, None)
    if pool is not None and not pool.healthy():
        pool.close()
        pool = None
    if pool is None:
        while _POOLS and sum(p.world_size for p in _POOLS.values()) + world_size > _MAX_KEPT_RANKS:
            _POOLS.popitem(last=False)[1].close()
        pool = RankPool(world_size, backend, env)
        pool.wait_ready(_START_TIMEOUT_S)
    _POOLS[key] = pool  # most recently used last
    return pool


def forget(pool: RankPool) -> None:
    """Drop a closed pool from the registry."""
    for key, p in list(_POOLS.items()):
        if p is pool:
            del _POOLS[key]


def kept_processes() -> list[Any]:
    """The processes of every kept pool (tests check nothing else is left running)."""
    return [p for pool in _POOLS.values() for p in pool.procs]


def close_all() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()
    _stop_rank_server()


def _stop_rank_server() -> None:
    """Stop the rank server (rank_start.py) and wait for it, as multiprocessing's own
    tests do: it reaps the ranks it forked, so waiting for it hands their CPU time up to
    this process and to ``time`` of the whole run. Left running, it ends once this
    process has gone, unwaited, and the ranks' CPU is lost from every rusage above it
    (``time make test`` counted a third of the suite's CPU)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is not None and getattr(server, "_forkserver_pid", None) is not None:
        server._stop()


# Before multiprocessing's own exit handler (registered earlier, so run later), which
# would otherwise wait forever for these non-daemonic processes.
atexit.register(close_all)


def _rss(pid: int | None) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
