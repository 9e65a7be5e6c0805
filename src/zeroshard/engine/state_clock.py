"""Which state a rank holds: a count of the changes made to its shards, for state dicts
served to a rank that asks alone (see [Note: state dicts served] in shard_server.py).

[Note: the state clock]
Every change to the sharded state — an optimizer step, a load — runs inside
``clock.change()``, on every rank alike, so after the same calls every rank's ``version``
is the same number. A rank's server answers a request for version v only while its own
version is v and no change is running, and holds off changes while it serves (``hold``):
the shards it sends are the state after the same step as the asking rank's, never a
half-stepped one. A rank already past v (the asker took its state dict between backward
and ``optimizer.step()``, where a peer may already have stepped) is an error, not a mixed
answer. Cost when nobody asks: a lock taken and released around each step.

Every rank taking a state dict at once (the usual all-rank call) has one more hazard: a
rank done with its own reads may change its shards (a stage-3 step is local; so is a
load) while a slower peer has yet to read them. So a rank that took a state dict at its
current version, and has issued no collective since (a collective would mean its peers
are past the point where they would have asked), waits before its next change until
each peer has read this version too — at most ``PEERS_WAIT_S``: a peer that never asks (a
rank-0-only save) is not waited for longer, and one that asks later gets the error above.
Loads start with a collective ([Note: state dicts served]), so a load after a rank-0-only
save never waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["StateClock", "Ahead", "PEERS_WAIT_S"]

#: Longest a change waits for peers to read the version this rank read (see the Note).
PEERS_WAIT_S = 10.0


class Ahead(RuntimeError):
    """This rank's state has moved past the version asked for."""


class StateClock:
    def __init__(self) -> None:
        self.version = 0
        self._changing = False
        self._serving = 0
        self._cv = threading.Condition()
        # This rank's last state dict: (version, collectives issued when it ended).
        self._asked: tuple[int, int] | None = None
        self._read_by: dict[int, set[int]] = {}  # version -> peers done reading it
        self.peers: set[int] = set()  # global ranks that may read this rank's shards
        self.issued: Any = lambda: 0  # the engine's count of collectives issued
        self.changed: Any = lambda: None  # called after each change (the server unpins)

    def asked(self) -> None:
        """This rank has read its peers' shards at the current version (main thread)."""
        self._asked = (self.version, self.issued())

    def read_by(self, peer: int, version: int) -> None:
        """``peer`` is done reading this rank's shards at ``version`` (server thread)."""
        with self._cv:
            self._read_by.setdefault(version, set()).add(peer)
            for v in [v for v in self._read_by if v < self.version - 1]:
                del self._read_by[v]
            self._cv.notify_all()

    def all_read(self) -> bool:
        """Whether every peer has read this rank's shards at its current version."""
        with self._cv:
            return self.peers <= self._read_by.get(self.version, set())

    @contextmanager
    def change(self) -> Iterator[None]:
        """Around a change to the shards (the main thread): waits while a peer is served
        (and briefly for peers still to read the version this rank read; see the Note)."""
        with self._cv:
            if self._asked == (self.version, self.issued()):
                deadline = time.monotonic() + PEERS_WAIT_S
                while not self.peers <= self._read_by.get(self.version, set()):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
            while self._serving:
                self._cv.wait()
            self._changing = True
        try:
            yield
        finally:
            with self._cv:
                self._changing = False
                self.version += 1
                self._cv.notify_all()
            self.changed()

    def hold(self, version: int, timeout: float) -> int:
        """Wait until this rank holds ``version`` with no change running, then hold changes
        off until :meth:`release`. Returns the version held; raises :class:`Ahead` if the
        rank is past it (or is changing it), TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                if self.version > version or (self.version == version and self._changing):
                    raise Ahead(f"at version {self.version}{' (changing)' if self._changing else ''}")
                if self.version == version and not self._changing:
                    self._serving += 1
                    return version
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"at version {self.version}")
                self._cv.wait(min(left, 1.0))

    def release(self) -> None:
        with self._cv:
            self._serving = max(0, self._serving - 1)
            self._cv.notify_all()
