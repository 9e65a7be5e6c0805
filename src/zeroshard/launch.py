"""Start ranks the way torchrun does, from inside a command — or reuse torchrun's.

Without ``RANK``/``WORLD_SIZE`` in the environment, :func:`run_ranks_local` does what
``torchrun --standalone --nproc-per-node N`` does, in-process: torch's elastic agent
(``torch.distributed.launcher.api.elastic_launch``) with a c10d rendezvous on a free
local port spawns N ranks running ``fn(*args)`` and returns rank 0's result. Under
torchrun the current process *is* a rank and runs ``fn`` directly. ``fn`` initialises
its own process group from the environment (``init_process_group(backend)``).

[Note: forked ranks]
A spawned rank is a new interpreter importing torch, ``torch._dynamo`` (DTensor imports
it) and zeroshard: ~2.5 s of CPU per rank on our 2-core machines before it runs a line of
``fn``, paid by every rank of every ``zeroshard bench``/``train``/``demo`` run. The ranks
are forked instead from multiprocessing's *forkserver*: one clean server process imports
those modules once (:mod:`zeroshard.launch_preload`), never runs an op and never touches
CUDA, and each rank forks from it in ~0.1 s, as ``torch.multiprocessing`` recommends
over plain ``fork``. A forked rank starts with the server's environment, not the
launching process's as it is now (a later launch from the same process may have changed
it): each rank first restores the launching process's environment plus the variables
the elastic agent sets for it, by name (``launch_preload.restore_parent_env``; a variable
the server's imports set stays where the caller has none), ``tempfile``'s folder and its
thread count. What a rank does not take from the caller: file descriptors — its stdout
and stderr are the server's, i.e. the first launch's (a later launch from a process that
redirected fd 1 meanwhile still writes to the old one) — and settings torch or zeroshard
read once at import.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import socket
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["free_port", "rank_cpu_seconds", "run_ranks_local", "under_torchrun"]

#: What the rank server imports before it forks any rank (see [Note: forked ranks]).
_PRELOAD = ["zeroshard.launch_preload"]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    """A local TCP port free now, for a store another process will listen on (the tests'
    torchrun commands; run_ranks_local lets the agent's store bind port 0 itself).

    Not one the kernel hands out itself (``bind(0)``): those come from the ephemeral range
    that every outgoing connection (gloo's, a store client's) also takes its source port
    from, and a rendezvous whose port was taken so in the meantime waits a minute for a
    store that is not there (seen with several test workers starting ranks at once).
    Ports below that range are chosen at random and checked; off Linux, ``bind(0)``.
    """
    low = _ephemeral_low()
    for _ in range(64 if low and low > 2048 else 0):
        port = _RNG.randrange(1024, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Not the ``random`` module's generator: a test that seeds it would make every worker
#: of the suite try the same ports.
_RNG = random.SystemRandom()


def _ephemeral_low() -> int | None:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


#: CPU seconds the forked ranks of this process's launches used (each reports its own):
#: they are the server's children, invisible to this process's rusage.
_RANK_CPU = [0.0]


def rank_cpu_seconds() -> float:
    """CPU (user + system) used so far by the ranks this process launched, e.g. for the
    test suite's timing (tests/_timing.py)."""
    return _RANK_CPU[0]


def run_ranks_local(fn: Callable[..., Any], world_size: int, *args: Any,
                    name: str = "zeroshard") -> Any:
    """Rank 0's ``fn(*args)`` (None on other torchrun ranks)."""
    if under_torchrun():
        return fn(*args)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # the agent's store binds a free port itself
        run_id=f"{name}-{uuid.uuid4().hex[:8]}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="forkserver",
    )
    # The ranks share this machine's cores; one OpenMP pool per rank would oversubscribe.
    threads = max(1, (os.cpu_count() or 1) // world_size)
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = old or str(threads)
    # Takes effect when the server starts; one already running (the test harness's, which
    # imports launch_preload too) is reused.
    mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    try:
        results = elastic_launch(config, _ForkedRank(fn, dict(os.environ)))(*args)
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    # A rank whose fn called sys.exit(0) returns None (torch's record()), not our pair.
    _RANK_CPU[0] += sum(r.cpu for r in results.values() if isinstance(r, _RankResult))
    first = results[0]
    return first.value if isinstance(first, _RankResult) else first


class _ForkedRank:
    """``fn`` run in a rank forked from the server, in the launching process's environment
    (a module-level class: the elastic agent pickles it to the server)."""

    def __init__(self, fn: Callable[..., Any], env: dict[str, str]) -> None:
        self.fn, self.env = fn, env
        # The agent names the entry point in its logs and errors.
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(self, *args: Any) -> Any:
        import torch

        from zeroshard.launch_preload import restore_parent_env

        restore_parent_env(self.env)
        # OpenMP read OMP_NUM_THREADS when the server imported torch; this rank's is the
        # one the agent passed.
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
        value = self.fn(*args)
        t = os.times()
        return _RankResult(value, t.user + t.system + t.children_user + t.children_system)


class _RankResult(NamedTuple):
    value: Any
    cpu: float  # this rank's CPU seconds (see rank_cpu_seconds)
