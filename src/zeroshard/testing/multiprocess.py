"""Run a function on N fresh CPU processes ("ranks") joined in one torch.distributed group.

Every distributed test in zeroshard goes through :func:`run_ranks`::

    def _sum_of_ranks(rank: int, world_size: int, n: int) -> float:
        t = torch.full((n,), float(rank))
        Comm().all_reduce(t)
        return t[0].item()

    def test_sum_of_ranks() -> None:
        assert run_ranks(_sum_of_ranks, 3, 8) == [3.0, 3.0, 3.0]

How it works
------------
* The parent pickles ``(fn, args, kwargs)`` itself, so a lambda or closure fails at once with
  a hint, and starts the ranks with the *spawn* start method: fork would copy the parent's
  torch thread pools, locks and pytest state into the children.
* Each child redirects file descriptors 1 and 2 to ``rank<r>.log`` in a private temp dir, so
  pytest's capture files are not inherited and C++ output and segfault traces are kept. The
  parent replays the logs on its own stderr as ``[rank r] ...`` (pytest shows them on failure).
* Each child sets ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``: CI has 2 cores shared
  by up to 4 ranks, and N ranks x N intra-op threads thrash. It joins the group through a
  ``FileStore`` in the temp dir: no port to race for, and rank 0 finishing early does not take
  the store down (it would with a TCPStore hosted by rank 0).
* A child writes its outcome (result, or formatted traceback) atomically to ``rank<r>.out``
  and exits with ``os._exit`` (interpreter teardown with a live group can hang). The parent
  waits on the process sentinels; at the first failure it kills every other rank at once,
  since they are usually blocked in a collective waiting for the rank that failed.
* Hangs: each child runs a daemon watchdog thread. At the deadline the parent creates a
  ``dump`` file; each watchdog then writes what its rank waits in (the collective recorded in
  ``zeroshard.comm._IN_FLIGHT_GLOBAL`` and for how long) and its main thread's stack to
  ``rank<r>.hang``, which go into :class:`RankTimeout`. This works because c10d collectives
  and ``time.sleep`` release the GIL. A watchdog also ends its rank if the parent dies.

Parameter sweeps: spawn once, loop inside
-----------------------------------------
Starting ranks costs 2-3 s each (interpreter, torch import, group init), so a test over many
configurations loops *inside* one group with :func:`sweep`::

    def _parity(rank: int, world_size: int, grid: list[dict]) -> list[float]:
        return sweep(_check_parity, grid)      # calls _check_parity(**point) per point

    def test_parity() -> None:
        grid = [{"stage": s, "dtype": d} for s in (0, 1, 2, 3) for d in ("fp32", "bf16")]
        run_ranks(_parity, 2, grid)

Every rank must walk the same grid in the same order, or collectives pair up wrongly. A
failing point raises :class:`SweepError` naming it; peers blocked in that point are killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from multiprocessing.connection import wait
from typing import Any

__all__ = ["RankError", "RankTimeout", "SweepError", "run_ranks", "sweep"]

_MAX_WORLD = 8
_DUMP_GRACE_S = 2.0  # how long the parent waits for watchdog reports after the deadline
_TAIL_LINES = 20


class RankError(RuntimeError):
    """A rank raised, crashed or exited early. ``rank`` is the one blamed first."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class RankTimeout(RankError):
    """The group did not finish in time. ``unfinished`` lists the ranks still running."""

    def __init__(self, message: str, unfinished: list[int]) -> None:
        super().__init__(message, unfinished[0] if unfinished else -1)
        self.unfinished = unfinished


class SweepError(RuntimeError):
    """A grid point of :func:`sweep` failed; the original exception is ``__cause__``."""


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
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` fresh processes.

    ``fn`` must be a module-level function and its arguments and result picklable. Returns
    the results ordered by rank. Raises :class:`RankError` if a rank fails (the earliest
    failure is blamed first: peers of a failed rank often fail *because* of it, e.g. gloo's
    "Connection closed by peer") and :class:`RankTimeout` if the group is not done within
    ``timeout`` seconds, counted from the spawn. ``env`` adds variables to the children.
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
    rundir = tempfile.mkdtemp(prefix="zeroshard-ranks-")
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_child_main,
            args=(r, world_size, payload, backend, rundir, dict(env or {}), timeout),
            name=f"zeroshard-rank-{r}",
            daemon=False,  # fn may start its own workers; `finally` reaps ranks
        )
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        return _supervise(procs, rundir, time.monotonic() + timeout, timeout)
    finally:
        for p in procs:  # no-op for ranks that exited; no zombies either way
            if p.pid is not None:
                if p.is_alive():
                    p.kill()
                p.join()
                p.close()
        _replay_logs(rundir, world_size)
        shutil.rmtree(rundir, ignore_errors=True)


# -- parent side ---------------------------------------------------------------------------
def _supervise(procs: list[Any], rundir: str, deadline: float, timeout: float) -> list[Any]:
    n = len(procs)
    done: dict[int, dict[str, Any]] = {}
    while len(done) < n:
        live = {p.sentinel: r for r, p in enumerate(procs) if r not in done}
        left = deadline - time.monotonic()
        if left <= 0:
            _raise_timeout(procs, rundir, timeout)
        for sentinel in wait(list(live), timeout=left):
            r = live[sentinel]
            procs[r].join()
            done[r] = _outcome(rundir, r, procs[r].exitcode)
        if any(o["status"] != "ok" for o in done.values()):
            _raise_failure(procs, rundir, done)
    return [done[r]["value"] for r in range(n)]


def _outcome(rundir: str, rank: int, exitcode: int | None) -> dict[str, Any]:
    """What rank ``rank`` left behind: status "ok" | "error" | "died" | "running"."""
    try:
        with open(os.path.join(rundir, f"rank{rank}.out"), "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        pass
    except Exception as e:
        return _failure("error", f"could not unpickle its result: {e!r}", "", time.time())
    if exitcode is None:
        return {"status": "running"}
    how = (
        f"was killed by signal {signal.Signals(-exitcode).name} (exit code {exitcode})"
        if exitcode < 0
        else f"exited with exit code {exitcode}"
    )
    # Date a death by the log's last write (a segfault trace, the last print), not by when we
    # noticed it: peers' "Connection reset by peer" errors are stamped when they happen.
    log = os.path.join(rundir, f"rank{rank}.log")
    when = os.path.getmtime(log) if os.path.exists(log) else time.time()
    summary = f"{how} without raising a Python exception (os._exit, crash or kill)"
    tail = f"last lines of its output:\n{_tail(rundir, rank)}"
    return _failure("died", summary, tail, min(when, time.time()))


def _failure(status: str, summary: str, detail: str, when: float) -> dict[str, Any]:
    return {"status": status, "summary": summary, "detail": detail, "when": when}


def _raise_failure(procs: list[Any], rundir: str, done: dict[int, dict[str, Any]]) -> None:
    for p in procs:  # stop peers now: they may be blocked in a collective with the failed rank
        if p.is_alive():
            p.kill()
    outs = {r: done.get(r) or _outcome(rundir, r, None) for r in range(len(procs))}
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


def _raise_timeout(procs: list[Any], rundir: str, timeout: float) -> None:
    # Ask every watchdog for a report, give them a moment, then kill whatever is still there.
    open(os.path.join(rundir, "dump"), "w").close()
    running = [r for r, p in enumerate(procs) if p.is_alive()]
    grace_end = time.monotonic() + _DUMP_GRACE_S
    hang = [os.path.join(rundir, f"rank{r}.hang") for r in running]
    while time.monotonic() < grace_end and not all(os.path.exists(h) for h in hang):
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    lines, unfinished = [], []
    for r, p in enumerate(procs):
        o = _outcome(rundir, r, None if r in running else p.exitcode)
        if o["status"] == "ok":
            lines.append(f"rank {r} finished.")
        elif o["status"] == "running":
            unfinished.append(r)
            lines.append(
                f"rank {r} did not finish within {timeout:.1f} s; {_hang_report(rundir, r)}"
            )
        else:
            lines.append(f"rank {r} failed: {o['summary']}\n{o['detail'].rstrip()}")
    head = f"ranks {', '.join(map(str, unfinished))} of {len(procs)} did not finish within {timeout:.1f} s"
    raise RankTimeout(head + "\n" + "\n".join(lines), unfinished)


def _read(rundir: str, name: str) -> str | None:
    try:
        with open(os.path.join(rundir, name), errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _hang_report(rundir: str, rank: int) -> str:
    report = _read(rundir, f"rank{rank}.hang")
    if report is None:
        report = "no watchdog report (still starting up, or a C call held the GIL); last "
        report += f"lines of its output:\n{_tail(rundir, rank)}"
    return report.rstrip()


def _tail(rundir: str, rank: int) -> str:
    text = _read(rundir, f"rank{rank}.log")
    if text is None:  # it died in spawn's bootstrap, before _child_main ran
        return "  (none: it died before the harness ran; look in the parent's stderr)"
    return "\n".join("  " + line for line in text.splitlines()[-_TAIL_LINES:]) or "  (no output)"


def _replay_logs(rundir: str, world_size: int) -> None:
    for r in range(world_size):
        for line in (_read(rundir, f"rank{r}.log") or "").splitlines():
            sys.stderr.write(f"[rank {r}] {line}\n")


# -- child side ----------------------------------------------------------------------------
def _child_main(
    rank: int,
    world_size: int,
    payload: bytes,
    backend: str,
    rundir: str,
    env: dict[str, str],
    timeout: float,
) -> None:
    log = os.open(os.path.join(rundir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    import faulthandler

    faulthandler.enable()  # segfaults print the Python stack into the log
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(env)  # before torch is imported, so OpenMP sees it
    threading.Thread(target=_watchdog, args=(rundir, rank), daemon=True).start()
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        fn, args, kwargs = pickle.loads(payload)
        store = dist.FileStore(os.path.join(rundir, "store"), world_size)
        # Collective timeout above ours: the harness, not gloo, decides when a rank hung.
        limit = datetime.timedelta(seconds=timeout + 60)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, store=store, timeout=limit
        )
        value = fn(rank, world_size, *args, **kwargs)
        dist.destroy_process_group()
        blob = pickle.dumps({"status": "ok", "value": value})
        code = 0
    except BaseException as e:  # SystemExit and KeyboardInterrupt in fn are failures too
        tb = "".join(traceback.format_exception(e))
        blob = pickle.dumps(_failure("error", f"{type(e).__name__}: {e}", tb, time.time()))
        code = 1
    _write_atomic(os.path.join(rundir, f"rank{rank}.out"), blob)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _watchdog(rundir: str, rank: int) -> None:
    parent, main_id = os.getppid(), threading.main_thread().ident
    request = os.path.join(rundir, "dump")
    while not os.path.exists(request):
        if os.getppid() != parent:  # the parent died: do not linger as an orphan
            shutil.rmtree(rundir, ignore_errors=True)
            os._exit(1)
        time.sleep(0.1)
    comm = sys.modules.get("zeroshard.comm")
    now = time.monotonic()
    waits = [
        f"waiting in {desc} for {now - since:.1f} s"
        for desc, since in list(getattr(comm, "_IN_FLIGHT_GLOBAL", {}).values())
    ]
    frame = sys._current_frames().get(main_id)  # type: ignore[arg-type]
    stack = traceback.extract_stack(frame) if frame is not None else []
    # Drop the spawn bootstrap and this harness: the stack starts at the user's fn.
    skip = max((i + 1 for i, fs in enumerate(stack) if fs.name == "_child_main"), default=0)
    report = (
        ("; ".join(waits) or "not in a zeroshard collective")
        + "; main thread stack (most recent call last):\n"
        + "".join(traceback.format_list(stack[skip:]))
    )
    _write_atomic(os.path.join(rundir, f"rank{rank}.hang"), report.encode())


def _write_atomic(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)  # the parent never reads half a file
