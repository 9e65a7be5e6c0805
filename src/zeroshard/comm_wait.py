"""Waiting for a collective: :class:`Pending`, its timeout, and the errors a wait raises.

Every collective of :class:`~zeroshard.comm.Comm` returns a ``Pending``; ``wait()``
verifies the collective's descriptor check first (comm_check.py), then waits (bounded by
``timeout``), and names the collective, its group and the fix when a peer is gone or late.
"""

from __future__ import annotations

import ctypes
import datetime
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch


class Waited(Protocol):
    """What a wait reads of its communicator (``comm.Comm`` is one)."""

    timeout: float | None


class Grouped(Waited, Protocol):
    """A communicator whose groups an error strands (``comm.Comm``)."""

    group: Any
    check_group: Any


class Verified(Protocol):
    """A collective's descriptor check (``comm_check.Check``)."""

    def ready(self) -> bool: ...

    def verify(self) -> None: ...

__all__ = ["Pending", "CollectiveError", "CollectiveTimeout", "CollectiveMismatch"]

# What each thread is blocked in, readable from other threads so a watchdog (the test
# harness's) can say where a rank hung: thread id -> (description, since).
IN_FLIGHT: dict[int, tuple[str, float]] = {}


@contextmanager
def waiting_in(desc: str) -> Iterator[None]:
    IN_FLIGHT[threading.get_ident()] = (desc, time.monotonic())
    try:
        yield
    finally:
        IN_FLIGHT.pop(threading.get_ident(), None)


# [Note: stranded groups]
# After a divergence, timeout or lost peer, a collective may stay in flight forever on a
# gloo worker thread (a broadcast whose peer issued something else). Destroying such a
# process group blocks: ~ProcessGroupGloo waits for its work queue, so freeing the
# group — when the script drops its sharded model and the collector takes it (the
# engine is collectable: engine/weak.py), or at exit — would hang the process. So the
# errors below, once made, strand every group a live Comm holds (and the default group):
# one reference each that is never released, not even at interpreter exit. A process
# that saw no error frees its groups normally (a check's poll of a slow peer raises
# StillWaiting, which strands nothing).
_COMMS: weakref.WeakSet[Grouped] = weakref.WeakSet()
_STRANDED: set[int] = set()


def track(comm: Grouped) -> None:
    """Count ``comm`` among those whose groups an error strands."""
    _COMMS.add(comm)


def _strand() -> None:
    import torch.distributed as dist

    groups = [g for c in list(_COMMS) for g in (c.group, c.check_group)]
    if dist.is_available() and dist.is_initialized():
        groups.append(dist.distributed_c10d._get_default_group())
    for g in groups:
        if g is not None and id(g) not in _STRANDED:
            _STRANDED.add(id(g))
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(g))


class _CommFailure(RuntimeError):
    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        try:
            _strand()
        except Exception:  # never hide the error being raised
            pass


class StillWaiting(Exception):
    """One poll of a wait ran out (``Pending(poll=True)``); the caller waits on. Not a
    failure: nothing is stranded."""


class CollectiveError(_CommFailure):
    """A collective failed because a peer is no longer running (it exited or crashed)."""


class CollectiveTimeout(_CommFailure):
    """A collective did not complete within ``ShardConfig.timeout`` (see [Note:
    divergence] in comm_check.py)."""


class CollectiveMismatch(_CommFailure):
    """Ranks issued different collectives at the same point (see [Note: divergence] in
    comm_check.py)."""


class Pending:
    """A collective that may still be running; ``wait()`` blocks and returns its output.

    With collective checks on, its descriptor check is verified first: a divergence is
    reported before the result is used, and before waiting on peers that will never
    issue this collective."""

    __slots__ = ("_work", "_out", "_desc", "_comm", "_timeout", "_check", "_then", "_poll")

    def __init__(self, work: list | None, out: torch.Tensor, desc: str,
                 comm: Waited | None = None, timeout: float | None = None,
                 check: Verified | None = None, then: Callable[[], None] | None = None,
                 poll: bool = False) -> None:
        self._poll = poll  # a timeout is one poll of a longer wait: StillWaiting
        self._then = then  # runs once the work is done (copying packed pieces out)
        self._work = work
        self._out = out
        self._desc = desc
        self._comm = comm
        self._timeout = timeout
        self._check = check

    def done(self) -> bool:
        """Whether ``wait()`` would return at once (the collective, and its descriptor
        check if any, have completed on this rank)."""
        if self._check is not None and not self._check.ready():
            return False
        return not self._work or all(w.is_completed() for w in self._work)

    def wait(self) -> torch.Tensor:
        if self._check is not None:
            self._check.verify()
            self._check = None
        if self._work:
            timeout = self._timeout or (self._comm.timeout if self._comm is not None else None)
            with waiting_in(self._desc):
                start = time.monotonic()
                for w in self._work:
                    if timeout is None:
                        w.wait()
                        continue
                    left = max(0.0, timeout - (time.monotonic() - start))
                    try:
                        w.wait(timeout=datetime.timedelta(seconds=left))
                    except RuntimeError as e:
                        c = self._comm
                        if "timed out" not in str(e).lower():
                            raise CollectiveError(
                                f"rank {c.global_rank}: {self._desc} (group {c.label!r}) "
                                "failed: a peer is no longer running (its script ended, it "
                                "left the process group, or it crashed: see its log). "
                                f"Underlying error: {e}"
                            ) from e
                        if self._poll:
                            raise StillWaiting from e
                        raise CollectiveTimeout(
                            f"rank {c.global_rank} waited {timeout:g} s in {self._desc} "
                            f"(group {c.label!r}) and gave up: a peer is not issuing the "
                            "same collective (diverged, hung or busy elsewhere). If one "
                            "rank runs a forward or a stage-3 state dict alone, run it on "
                            "every rank; if a rank legitimately works alone this long "
                            "(saving a large checkpoint), raise shard(..., timeout=)"
                        ) from e
        self._work = None
        if self._then is not None:
            self._then()
            self._then = None
        return self._out
