"""The rank side of the harness: what a rank process runs, fresh or kept in a pool.

A *call* is one ``run_ranks(fn, ...)``: every rank joins a new process group through a
``FileStore`` in the call's directory, runs ``fn``, tears the group down and writes its
outcome (result, or formatted traceback) atomically to ``<calldir>/rank<r>.out``. Its
output (file descriptors 1 and 2, so C++ output and segfault traces too) goes to
``<calldir>/rank<r>.log``.

A fresh rank (:func:`fresh_main`) runs one call and exits with ``os._exit`` (interpreter
teardown with a live group can hang). A pooled rank (:func:`pool_main`) runs call after
call sent over a pipe; see [Note: reused ranks]. Both are forked from the rank server
(rank_start.py), which imported torch and zeroshard once.

[Note: reused ranks]
Starting a rank costs a fork, its set-up and a group, and most distributed tests run for
less than that, so the harness keeps ranks and reuses them. What a call could leave
behind for the next one, and how it is prevented:
* communication state: every call joins a *new* default group over a new store (kept
  until the ranks end: see _store_path) and destroys it (and every subgroup made under it) at its end, so no gloo pair keeps bytes
  of an earlier call and group names start afresh;
* process state a test may change: the environment (each call gets the test process's
  environment of that moment, as a fresh spawn would), the working directory, signal
  handlers, ``sys.path``/``sys.argv``, warning filters and their once-registries, torch's
  default dtype, grad mode, anomaly mode, deterministic mode, thread count, compile
  caches and DTensor's sharding caches (see _clear_dtensor_caches) are restored after
  every call (torch's global RNG is not: a fresh process seeds
  it at random, so no test can rely on its state);
* a call that fails, crashes or times out ends its whole pool: a peer may be blocked in a
  collective with the failed rank, so nothing of that pool is trusted again.
Tests that measure the process itself (peak RSS since start), need it to exit, or depend
on zeroshard's peer watch answering for it (its thread may still be polling an earlier
call's store when the next call's peers ask) ask for ``fresh=True``.
"""

from __future__ import annotations

import gc
import os
import pickle
import shutil
import signal
import sys
import threading
import time
import traceback
import warnings
from typing import Any

__all__ = ["fresh_main", "pool_main", "write_atomic"]

_HARNESS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1",
                                              "SIGUSR2") if hasattr(signal, n))

# The directory of the call this process runs now (the watchdog looks for its dump request).
_CALL: dict[str, str | None] = {"dir": None}


def fresh_main(rank: int, world_size: int, payload: bytes, backend: str, calldir: str,
               env: dict[str, str], timeout: float) -> None:
    """A rank process of its own for one call."""
    _redirect_output(os.path.join(calldir, f"rank{rank}.log"))
    _start_up(rank, world_size, env)
    _CALL["dir"] = calldir
    threading.Thread(target=_watchdog, args=(rank, calldir), daemon=True).start()
    blob, code = _run_call(rank, world_size, payload, backend, calldir, timeout)
    write_atomic(os.path.join(calldir, f"rank{rank}.out"), blob)
    _flush()
    os._exit(code)


def pool_main(rank: int, world_size: int, backend: str, rundir: str, env: dict[str, str],
              conn: Any) -> None:
    """A kept rank: import torch once, then run the calls the test process sends.

    A job is ``(calldir, payload, timeout, environ)``; ``None`` or a closed pipe ends the
    process. After a failed call the rank exits: its pool is not reused.
    """
    _redirect_output(os.path.join(rundir, f"rank{rank}.startup.log"))
    _start_up(rank, world_size, env)
    threading.Thread(target=_watchdog, args=(rank, None), daemon=True).start()
    import torch

    torch.set_num_threads(1)
    baseline = _snapshot()
    gc.freeze()  # see _restore
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        if job is None:
            os._exit(0)
        calldir, payload, timeout, environ = job
        _flush()
        _redirect_output(os.path.join(calldir, f"rank{rank}.log"))
        _set_environ(environ, rank, world_size)
        _CALL["dir"] = calldir
        blob, code = _run_call(rank, world_size, payload, backend, calldir, timeout)
        if code == 0:
            code = _restore(baseline)
        write_atomic(os.path.join(calldir, f"rank{rank}.out"), blob)
        _flush()
        _CALL["dir"] = None
        if code != 0:
            os._exit(code)
        conn.send(code)


def write_atomic(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)  # the test process never reads half a file


# -- one call ------------------------------------------------------------------------------
def _run_call(rank: int, world_size: int, payload: bytes, backend: str, calldir: str,
              timeout: float) -> tuple[bytes, int]:
    start = _cpu_seconds()
    try:
        import datetime

        import torch.distributed as dist

        fn, args, kwargs = pickle.loads(payload)
        store = dist.FileStore(_store_path(calldir), world_size)
        # Collective timeout above ours: the harness, not gloo, decides when a rank hung.
        limit = datetime.timedelta(seconds=timeout + 60)
        dist.init_process_group(backend, rank=rank, world_size=world_size, store=store,
                                timeout=limit)
        # Every rank done connecting before any runs fn: a rank whose fn returns at once
        # tears its group down, and under load a peer still connecting its mesh then
        # failed in init ("Connection closed by peer").
        dist.barrier()
        value = fn(rank, world_size, *args, **kwargs)
        if dist.is_initialized():  # fn may have torn it down itself
            dist.destroy_process_group()
        return pickle.dumps({"status": "ok", "value": value,
                             "cpu": _cpu_seconds() - start}), 0
    except BaseException as e:  # SystemExit and KeyboardInterrupt in fn are failures too
        tb = "".join(traceback.format_exception(e))
        out = failure("error", f"{type(e).__name__}: {e}", tb, time.time())
        return pickle.dumps(out | {"cpu": _cpu_seconds() - start}), 1


def _cpu_seconds() -> float:
    """User + system CPU of this process and its waited-for children (a call's torchrun
    or subprocess): the test process cannot see a rank's, which is the rank server's
    child, not its own (the suite's timing report adds it to the test that made the call)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding decisions and redistribution plans by mesh, and a
    DeviceMesh compares equal to another of the same ranks and names whatever its process
    groups: an earlier call's mesh (its groups destroyed with the call's default group)
    came back out of the cache in a later call, whose collectives then failed with "Could
    not resolve the process group". A fresh process has none of them."""
    import torch
    from torch.distributed.tensor import DTensor, _redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch fast path's
    prop = DTensor._op_dispatcher.sharding_propagator
    prop.propagate_op_sharding.cache_clear()
    prop._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


def _store_path(calldir: str) -> str:
    """Beside the call's directory, not in it: the directory goes when the call ends, the
    store stays while the process may still poll it. zeroshard's peer watch polls the
    store it last bound until the next group binds it, and a FileStore op on a deleted
    path retries its open until the store's timeout (300 s), which kept the watch from
    answering the next call's questions."""
    return calldir.rstrip(os.sep) + ".store"


def failure(status: str, summary: str, detail: str, when: float) -> dict[str, Any]:
    return {"status": status, "summary": summary, "detail": detail, "when": when}


# -- process state -------------------------------------------------------------------------
def _start_up(rank: int, world_size: int, env: dict[str, str]) -> None:
    import faulthandler

    faulthandler.enable()  # segfaults print the Python stack into the log (fd 2)
    _set_environ(dict(os.environ) | env, rank, world_size)  # before torch: OpenMP reads it


def _set_environ(environ: dict[str, str], rank: int, world_size: int) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(_HARNESS_ENV)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))


def _snapshot() -> dict[str, Any]:
    import torch

    return {
        "cwd": os.getcwd(),
        "signals": {s: signal.getsignal(s) for s in _SIGNALS},
        "path": list(sys.path),
        "argv": list(sys.argv),
        "warnings": list(warnings.filters),
        "dtype": torch.get_default_dtype(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }


def _restore(base: dict[str, Any]) -> int:
    """Undo what a call may have changed in this process; 0, or 1 if that failed."""
    try:
        import torch

        os.chdir(base["cwd"])
        for s, handler in base["signals"].items():
            if handler is not None:
                signal.signal(s, handler)
        sys.path[:] = base["path"]
        sys.argv[:] = base["argv"]
        warnings.resetwarnings()  # also forgets which warnings were already shown once
        warnings.filters[:] = base["warnings"]
        torch.set_default_dtype(base["dtype"])
        torch.set_grad_enabled(True)
        torch.autograd.set_detect_anomaly(False)
        torch.use_deterministic_algorithms(base["deterministic"])
        torch.set_num_threads(1)
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        if "torch.distributed.tensor" in sys.modules:
            _clear_dtensor_caches()
        comm = sys.modules.get("zeroshard.comm_wait")
        if comm is not None:
            comm.IN_FLIGHT.clear()
        # Free what the call left in cycles, then freeze the survivors (torch's modules, and
        # whatever the call imported) so that the next call's collection scans only its own
        # objects: a full collection over torch's ~300k objects costs 0.4 s, more than a
        # short test.
        gc.collect()
        gc.freeze()
        return 0
    except Exception:  # noqa: BLE001 - a rank that cannot be cleaned is not reused
        traceback.print_exc()
        return 1


def _redirect_output(path: str) -> None:
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


# -- hangs ---------------------------------------------------------------------------------
def _watchdog(rank: int, owned_dir: str | None) -> None:
    """Report where this rank waits when the test process asks (a ``dump`` file in the
    call's directory); end the rank if the test process dies.

    This works because c10d collectives and ``time.sleep`` release the GIL.
    """
    parent, main_id = os.getppid(), threading.main_thread().ident
    reported = None
    while True:
        if os.getppid() != parent:  # the test process died: do not linger as an orphan
            if owned_dir is not None:
                shutil.rmtree(owned_dir, ignore_errors=True)
            os._exit(1)
        calldir = _CALL["dir"]
        if calldir is not None and calldir != reported and os.path.exists(
                os.path.join(calldir, "dump")):
            write_atomic(os.path.join(calldir, f"rank{rank}.hang"), _where(main_id).encode())
            reported = calldir
        time.sleep(0.1)


def _where(main_id: int | None) -> str:
    comm = sys.modules.get("zeroshard.comm_wait")
    now = time.monotonic()
    waits = [
        f"waiting in {desc} for {now - since:.1f} s"
        for desc, since in list(getattr(comm, "IN_FLIGHT", {}).values())
    ]
    frame = sys._current_frames().get(main_id)  # type: ignore[arg-type]
    stack = traceback.extract_stack(frame) if frame is not None else []
    # Drop the harness's frames: the stack starts at the user's fn.
    skip = max((i + 1 for i, fs in enumerate(stack) if fs.name == "_run_call"), default=0)
    return (
        ("; ".join(waits) or "not in a zeroshard collective")
        + "; main thread stack (most recent call last):\n"
        + "".join(traceback.format_list(stack[skip:]))
    )
