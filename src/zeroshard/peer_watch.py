"""What a rank's peers are doing while it waits for them in a collective check.

[Note: asking the peers]
A collective check (see [Note: divergence] in comm_check.py) that a peer never joins can only
time out: the waiting rank cannot tell a slow peer from one that is blocked somewhere it
will never leave. The commonest case is a DDP habit, ``if rank == 0:
torch.save(model.state_dict(), path)`` followed by ``dist.barrier()``: at stage 3 the
state dict is a collective, so rank 0 waits in its check for rank 1, while rank 1 waits
in the barrier for rank 0. Neither moves; after the timeout rank 0 fails, and rank 1 gets
gloo's "Connection closed by peer ... typically caused by a remote worker crashing" — no
word of the state dict, and nothing crashed.

So each process runs one watch thread. It reads nothing of the training loop; it polls
one counter in the process group's store (``POLL_S``; one store request per second per
rank) for alarms. A rank that has waited ``ASK_AFTER_S`` in a check posts an *ask*; every
peer's watch answers with where its main thread is, read from its Python stack
(``sys._current_frames``): inside zeroshard's collectives (it will reach the check, or is
already there), blocked in a ``torch.distributed`` collective of the user's own (which
function, called from where, over which ranks), or running other code (busy; it may still
come). A peer blocked in a collective whose group includes the waiting rank, and that has
not yet issued the waiting rank's check (each answer says how many checks its rank has
issued on each check group: ``CHECKS_ISSUED``), can never return — the waiting rank is
here, not there — so the waiting rank raises
:class:`~zeroshard.comm.CollectiveMismatch` at once, naming both places and the fix, and
posts a *verdict* to the blocked peers. Their watch prints the same error and ends its
process (exit status 1): its main thread waits in a collective that can no longer
complete (the waiting rank has left for its error), so every rank still alive ends with
an error that says what to do. A peer in a collective over other ranks only, or busy, is
waited for as before.

Ending the process is the one design that needs no help from the blocked thread. The
alternatives were tried or weighed: raising in the main thread from outside (CPython's
asynchronous-exception call, or a signal handler) surfaces only once the collective
returns, and gloo returns only when the peer's process ends or the process group times
out (minutes); aborting the process group does not release it either (tried: gloo's
``ProcessGroup.abort()`` returns, the barrier waits on until the peer's process ends). It
is what torch does itself
when a NCCL collective fails (``TORCH_NCCL_ASYNC_ERROR_HANDLING``: the watchdog tears the
process down), and what a launcher does next anyway (torchrun ends the other ranks of a
job whose rank failed). What it costs: the blocked rank's ``finally`` blocks do not run —
it was blocked in a collective, where none of them could have run either.

Collectives torch issues itself count too: ``p.full_tensor()`` on a stage-3 parameter
(DTensor's functional all-gather over the parameter's mesh) on rank 0 alone, while rank 1
goes on to its next step, is seen as rank 0 blocked in ``DTensor.full_tensor()``: rank 1
raises, rank 0 is ended by its watch.

The watch never ends a process unless a peer's check is provably stuck; when the store
is unreachable it does nothing, and checks behave as without it.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

#: Seconds between two looks at the alarm counter.
POLL_S = 1.0
#: Seconds a check waits before asking what its peers are doing, and between asks.
ASK_AFTER_S = 2.0
ASK_EVERY_S = 15.0
#: Seconds a rank waits for answers (or acknowledgements) after posting.
ANSWER_WAIT_S = 3.0 * POLL_S

#: Checks this process has issued, per check group (comm_check.py keys them by the
#: group's ranks). An answer carries them: a peer blocked in a collective of its own has
#: not stranded a waiting rank whose check it already issued — the exchange is under
#: way, only slow (seen under load: gloo's thread had not yet run on the waiting rank).
CHECKS_ISSUED: dict[str, int] = {}

_PREFIX = "zeroshard/watch/"
_COUNT = "alarms"

#: ``torch.distributed`` functions that block until other ranks call them too.
_COLLECTIVES = frozenset({
    "barrier", "monitored_barrier", "all_reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "all_gather_object", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter",
    "scatter_object_list", "send", "recv", "send_object_list", "recv_object_list",
})


def main_thread_state() -> dict[str, Any]:
    """Where this process's main thread is: ``{"state": "zeroshard"}``, ``{"state":
    "foreign", "call": ..., "where": ..., "ranks": [...] | None}`` (a torch.distributed
    collective; ranks None = the default group) or ``{"state": "running", "where": ...}``;
    each with ``"checks"``, a copy of :data:`CHECKS_ISSUED`."""
    return {**_main_thread_state(), "checks": _issued()}


def _issued() -> dict[str, int]:
    for _ in range(3):  # the main thread may add a key while this thread copies
        try:
            return dict(CHECKS_ISSUED)
        except RuntimeError:
            continue
    return {}


def _main_thread_state() -> dict[str, Any]:
    main = threading.main_thread().ident
    frame = sys._current_frames().get(main)  # type: ignore[arg-type]
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    # innermost first
    if any(f.f_globals.get("__name__", "").startswith("zeroshard.comm") for f in frames):
        return {"state": "zeroshard"}
    dist_frames = [i for i, f in enumerate(frames)
                   if f.f_globals.get("__name__", "").startswith("torch.distributed")]
    collective = next((frames[i] for i in dist_frames
                       if frames[i].f_code.co_name in _COLLECTIVES), None)
    user = next((f for f in frames
                 if not f.f_globals.get("__name__", "").startswith("torch")), None)
    where = f"{user.f_code.co_filename}:{user.f_lineno}" if user is not None else "?"
    if collective is None:
        return _dtensor_state(frames, where)
    call = f"torch.distributed.{collective.f_code.co_name}()"
    outer = next((frames[i] for i in reversed(dist_frames)
                  if frames[i].f_code.co_name != "wrapper"), collective)
    if outer is not collective:  # e.g. inside torch.distributed.checkpoint.save
        call += f" (inside {outer.f_globals.get('__name__')}.{outer.f_code.co_name})"
    ranks = None
    group = collective.f_locals.get("group")
    if isinstance(group, dist.ProcessGroup) and group is not dist.GroupMember.WORLD:
        try:
            ranks = dist.get_process_group_ranks(group)
        except (RuntimeError, ValueError):
            ranks = None
    return {"state": "foreign", "call": call, "where": where, "ranks": ranks}


def _dtensor_state(frames: list[Any], where: str) -> dict[str, Any]:
    """A main thread blocked in a collective torch issues for a DTensor (``p.full_tensor()``
    on a stage-3 parameter, ``redistribute``): waiting in a functional collective, under
    a DTensor method. Its ranks are those of the mesh dimensions the call moves data over
    (``full_tensor``: every dimension not ``Replicate``; ``redistribute``: those whose
    placement changes; on a 1-D mesh, the mesh) — on a hybrid ``(replicate, shard)`` mesh
    ``full_tensor()`` gathers over the shard dimension only, this rank's shard group."""
    waiting = any(f.f_globals.get("__name__", "") == "torch.distributed._functional_collectives"
                  and f.f_code.co_name in _FUNCTIONAL_WAITS for f in frames)
    api = next((f for f in reversed(frames)  # the outermost DTensor method
                if f.f_globals.get("__name__", "").startswith("torch.distributed.tensor")
                and f.f_code.co_name in ("full_tensor", "redistribute")), None)
    if not waiting or api is None:
        return {"state": "running", "where": where}
    ranks = _dtensor_ranks(api)
    if not ranks:
        return {"state": "running", "where": where}
    call = (f"DTensor.{api.f_code.co_name}() (torch's collective over ranks {ranks}: every "
            "one of them must run it, e.g. p.full_tensor() of a stage-3 parameter)")
    return {"state": "foreign", "call": call, "where": where, "ranks": ranks}


def _dtensor_ranks(api: Any) -> list[int]:
    """The ranks a DTensor's ``full_tensor()`` / ``redistribute(...)`` (the frame ``api``)
    exchanges data with: the union of this rank's groups on the mesh dimensions it moves
    over. Empty if they cannot be told (then the peer counts as running)."""
    me = api.f_locals.get("self")
    mesh = getattr(me, "device_mesh", None)
    try:
        placements = tuple(me.placements)
        target = api.f_locals.get("placements") if api.f_code.co_name == "redistribute" else None
        if target is not None and len(tuple(target)) == len(placements):
            dims = [d for d, (p, t) in enumerate(zip(placements, tuple(target))) if p != t]
        else:
            dims = [d for d, p in enumerate(placements) if not p.is_replicate()]
        if mesh.ndim == 1:
            return [int(r) for r in mesh.mesh.flatten().tolist()] if dims else []
        ranks: set[int] = set()
        for d in dims:
            ranks.update(dist.get_process_group_ranks(mesh.get_group(d)))
        return sorted(ranks)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return []


#: Where a functional collective (DTensor's) blocks: waiting for its result.
_FUNCTIONAL_WAITS = frozenset({"wait_tensor", "wait", "_maybe_wrap_tensor"})


class _Watch:
    """The process's watch thread and the store it polls (see [Note: asking the peers])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._store: Any = None
        self._rank = -1
        self._seen = 0
        self._error: type[BaseException] = RuntimeError
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the waiting rank's side ------------------------------------------------------------
    def bind(self, error: type[BaseException]) -> None:
        """Watch the current default group's store; ``error`` names the class of the
        error a verdict reports (the waiting rank raised it)."""
        try:
            store = dist.PrefixStore(_PREFIX, dist.distributed_c10d._get_default_store())
            seen = store.add(_COUNT, 0)
        except Exception:  # no store (fake groups, custom init): no watch
            return
        with self._lock:
            self._store, self._rank, self._seen, self._error = (
                store, dist.get_rank(), seen, error)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="zeroshard-peer-watch",
                                            daemon=True)
            self._thread.start()
            atexit.register(self.close)

    def ask(self, peers: list[int], desc: str) -> dict[int, dict[str, Any]]:
        """Ask ``peers`` (global ranks) where their main threads are; the answers that
        came within ``ANSWER_WAIT_S``."""
        store = self._store
        if store is None:
            return {}
        try:
            n = self._post(store, {"kind": "ask", "from": self._rank, "desc": desc})
            keys = {p: f"answer/{n}/{p}" for p in peers if p != self._rank}
            end = time.monotonic() + ANSWER_WAIT_S
            while time.monotonic() < end and not store.check(list(keys.values())):
                time.sleep(0.05)
            return {p: json.loads(store.get(k)) for p, k in keys.items() if store.check([k])}
        except Exception:
            return {}

    def tell(self, ranks: list[int], message: str) -> None:
        """Tell ``ranks`` (blocked for good) of the error ``message``, which ends their
        processes, and wait (at most ``ANSWER_WAIT_S``) until their watches have it."""
        store = self._store
        if store is None or not ranks:
            return
        try:
            n = self._post(store, {"kind": "verdict", "to": ranks, "message": message})
            keys = [f"ack/{n}/{r}" for r in ranks]
            end = time.monotonic() + ANSWER_WAIT_S
            while time.monotonic() < end and not store.check(keys):
                time.sleep(0.05)
        except Exception:
            return

    @staticmethod
    def _post(store: Any, alarm: dict[str, Any]) -> int:
        n = store.add(_COUNT, 1)
        store.set(f"alarm/{n}", json.dumps(alarm))
        return n

    # -- every rank's side ----------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            with self._lock:
                store, seen = self._store, self._seen
            if store is None:
                continue
            try:
                count = store.add(_COUNT, 0)
                while seen < count and store.check([f"alarm/{seen + 1}"]):
                    seen += 1
                    self._handle(store, seen, json.loads(store.get(f"alarm/{seen}")))
            except Exception:  # the store went away (the group was destroyed): idle
                with self._lock:
                    if self._store is store:
                        self._store = None
                continue
            with self._lock:
                if self._store is store:
                    self._seen = seen

    def _handle(self, store: Any, n: int, alarm: dict[str, Any]) -> None:
        if alarm["kind"] == "ask" and alarm["from"] != self._rank:
            store.set(f"answer/{n}/{self._rank}", json.dumps(main_thread_state()))
        elif alarm["kind"] == "verdict" and self._rank in alarm["to"]:
            self._end(store, n, alarm["message"])

    def _end(self, store: Any, n: int, message: str) -> None:
        """A peer found this rank's main thread blocked in a collective it is not in, and
        raised: print its error and end this process ([Note: asking the peers])."""
        state = main_thread_state()
        where = (f"is blocked in {state['call']} (called at {state['where']}), which"
                 if state["state"] == "foreign" else "was blocked in a collective that")
        print(f"zeroshard: rank {self._rank}: {self._error.__name__}: {message}\n"
              f"zeroshard: rank {self._rank}: a peer reported a divergence, and this rank "
              f"{where} cannot return now that the peer has stopped waiting: ending this "
              "process (exit code 1). Run that call on every rank.",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        try:
            store.set(f"ack/{n}/{self._rank}", "1")
        finally:
            os._exit(1)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * POLL_S)


WATCH = _Watch()
