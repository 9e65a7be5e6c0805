"""The test process's side of a call: wait for the ranks, and say what went wrong.

The test process waits on each rank's process sentinel (and, for kept ranks, its pipe).
At the first failure it kills every other rank at once, since they are usually blocked in
a collective waiting for the rank that failed, and blames the earliest failure (peers of a
failed rank often fail *because* of it, e.g. gloo's "Connection closed by peer"). A rank
that *died* (its process ended without a Python error) first leaves the others
``_DIED_GRACE_S`` to report: their collectives with it fail at once, and a rank ended by
zeroshard's peer watch dies just before the peer that ended it raises (see [Note: asking
the peers] in peer_watch.py), whose error the test wants too. At the
deadline it asks every rank's watchdog where it waits (a ``dump`` file in the call's
directory), gives them a moment, and kills whatever is left.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
from multiprocessing.connection import wait
from typing import Any

from zeroshard.testing.errors import RankError, RankTimeout
from zeroshard.testing.rank_main import failure

__all__ = ["rank_cpu_seconds", "replay_logs", "supervise"]

_DUMP_GRACE_S = 2.0  # how long the test process waits for watchdog reports after the deadline
_DIED_GRACE_S = 2.0  # how long the other ranks may still report after one died
_TAIL_LINES = 20

# CPU seconds the ranks of this process's calls reported (rank_main._cpu_seconds), for the
# test suite's timing report: ranks are the rank server's children, so neither this
# process's rusage nor `time` of the whole run sees them.
_RANK_CPU = [0.0]


def rank_cpu_seconds() -> float:
    """CPU seconds used by the ranks of every call this process has supervised so far."""
    return _RANK_CPU[0]


def supervise(procs: list[Any], calldir: str, deadline: float, timeout: float,
              conns: list[Any] | None = None) -> list[Any]:
    """The ranks' results in rank order, once every rank reported (its pipe, if it has one)
    or exited; raises :class:`RankError` / :class:`RankTimeout`."""
    n = len(procs)
    done: dict[int, dict[str, Any]] = {}
    grace: float | None = None  # when the others' time to report ends, after a death
    while len(done) < n:
        live: dict[Any, int] = {p.sentinel: r for r, p in enumerate(procs) if r not in done}
        if conns is not None:
            live.update({conns[r]: r for r in range(n) if r not in done})
        if grace is not None and time.monotonic() >= grace:
            _raise_failure(procs, calldir, done)
        left = min(deadline, grace if grace is not None else deadline) - time.monotonic()
        if left <= 0 and grace is None:
            _raise_timeout(procs, calldir, timeout)
        for ready in wait(list(live), timeout=left):
            r = live[ready]
            if r in done:
                continue
            exitcode = None
            if conns is not None and ready is conns[r]:
                try:
                    conns[r].recv()
                except (EOFError, OSError):  # it died after writing its outcome
                    procs[r].join()
                    exitcode = procs[r].exitcode
            else:
                procs[r].join()
                exitcode = procs[r].exitcode
            done[r] = _outcome(calldir, r, exitcode)
            _RANK_CPU[0] += done[r].get("cpu", 0.0)
        statuses = {o["status"] for o in done.values()}
        if "error" in statuses:
            _raise_failure(procs, calldir, done)
        if "died" in statuses and grace is None:
            grace = min(deadline, time.monotonic() + _DIED_GRACE_S)
    if grace is not None:
        _raise_failure(procs, calldir, done)
    return [done[r]["value"] for r in range(n)]


def replay_logs(calldir: str, world_size: int) -> None:
    """Each rank's output on the test process's stderr as ``[rank r] ...`` (pytest shows it
    on failure)."""
    for r in range(world_size):
        for line in (_read(calldir, f"rank{r}.log") or "").splitlines():
            sys.stderr.write(f"[rank {r}] {line}\n")


def _outcome(calldir: str, rank: int, exitcode: int | None) -> dict[str, Any]:
    """What rank ``rank`` left behind: status "ok" | "error" | "died" | "running"."""
    try:
        with open(os.path.join(calldir, f"rank{rank}.out"), "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        pass
    except Exception as e:
        return failure("error", f"could not unpickle its result: {e!r}", "", time.time())
    if exitcode is None:
        return {"status": "running"}
    how = (
        f"was killed by signal {signal.Signals(-exitcode).name} (exit code {exitcode})"
        if exitcode < 0
        else f"exited with exit code {exitcode}"
    )
    # Date a death by the log's last write (a segfault trace, the last print), not by when we
    # noticed it: peers' "Connection reset by peer" errors are stamped when they happen.
    log = os.path.join(calldir, f"rank{rank}.log")
    when = os.path.getmtime(log) if os.path.exists(log) else time.time()
    summary = f"{how} without raising a Python exception (os._exit, crash or kill)"
    tail = f"last lines of its output:\n{_tail(calldir, rank)}"
    return failure("died", summary, tail, min(when, time.time()))


def _raise_failure(procs: list[Any], calldir: str, done: dict[int, dict[str, Any]]) -> None:
    for p in procs:  # stop peers now: they may be blocked in a collective with the failed rank
        if p.is_alive():
            p.kill()
    outs = {r: done.get(r) or _outcome(calldir, r, None) for r in range(len(procs))}
    failed = sorted((o["when"], r) for r, o in outs.items() if o["status"] in ("error", "died"))
    first = failed[0][1]
    o = outs[first]
    msg = f"rank {first} of {len(procs)} failed: {o['summary']}\n{o['detail'].rstrip()}"
    others = [f"rank {r}: {outs[r]['summary']}" for _, r in failed[1:]]
    if others:
        msg += "\nother ranks also failed (often as a consequence):\n  " + "\n  ".join(others)
    stopped = [str(r) for r, o in outs.items() if o["status"] == "running"]
    if stopped:
        msg += f"\nranks stopped after the failure: {', '.join(stopped)}"
    raise RankError(msg, first)


def _raise_timeout(procs: list[Any], calldir: str, timeout: float) -> None:
    # Ask every watchdog for a report, give them a moment, then kill whatever is still there.
    open(os.path.join(calldir, "dump"), "w").close()
    unfinished_now = [r for r, p in enumerate(procs)
                      if not os.path.exists(os.path.join(calldir, f"rank{r}.out"))]
    grace_end = time.monotonic() + _DUMP_GRACE_S
    hang = [os.path.join(calldir, f"rank{r}.hang") for r in unfinished_now if procs[r].is_alive()]
    while time.monotonic() < grace_end and not all(os.path.exists(h) for h in hang):
        time.sleep(0.05)
    alive = [p.is_alive() for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    lines, unfinished = [], []
    for r, p in enumerate(procs):
        o = _outcome(calldir, r, None if alive[r] else p.exitcode)
        if o["status"] == "ok":
            lines.append(f"rank {r} finished.")
        elif o["status"] == "running":
            unfinished.append(r)
            lines.append(
                f"rank {r} did not finish within {timeout:.1f} s; {_hang_report(calldir, r)}"
            )
        else:
            lines.append(f"rank {r} failed: {o['summary']}\n{o['detail'].rstrip()}")
    head = (f"ranks {', '.join(map(str, unfinished))} of {len(procs)} did not finish within "
            f"{timeout:.1f} s")
    raise RankTimeout(head + "\n" + "\n".join(lines), unfinished)


def _read(calldir: str, name: str) -> str | None:
    try:
        with open(os.path.join(calldir, name), errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _hang_report(calldir: str, rank: int) -> str:
    report = _read(calldir, f"rank{rank}.hang")
    if report is None:
        report = "no watchdog report (still starting up, or a C call held the GIL); last "
        report += f"lines of its output:\n{_tail(calldir, rank)}"
    return report.rstrip()


def _tail(calldir: str, rank: int) -> str:
    text = _read(calldir, f"rank{rank}.log")
    if text is None:  # it died in spawn's bootstrap, before the harness ran
        return "  (none: it died before the harness ran; look in the test process's stderr)"
    return "\n".join("  " + line for line in text.splitlines()[-_TAIL_LINES:]) or "  (no output)"
