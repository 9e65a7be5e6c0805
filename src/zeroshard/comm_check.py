"""The collective check: ranks compare what they are about to issue before they issue it.

[Note: divergence]
Two guards turn diverging ranks — one rank evaluating alone, saving a stage-3 state
dict alone, taking another branch — into errors on every rank instead of hangs,
process aborts or silently mixed-up weights:

* ``check`` (on by default): before each collective the group all-gathers a
  48-byte descriptor (step, index within the step, op, unit, phase, element count)
  over a *separate* gloo group and compares. On a mismatch every rank raises
  :class:`CollectiveMismatch` naming the step, the ranks, what each was doing and
  the fix — before issuing the mismatched collective. The descriptors always have
  the same size, so the check itself can never mismatch; a real collective of
  another size could (gloo aborts the process on that, NCCL hangs or mixes data).
  The check group is CPU-side, so on GPUs it does not synchronise the device.
  Cost: one tiny all-gather round trip per collective (measured in docs/porting.md).
* ``timeout`` (seconds): checks wait at most this long (default: ``CHECK_TIMEOUT``),
  then raise :class:`CollectiveTimeout` naming the rank, the collective, its unit
  and phase; set explicitly, every collective is waited on with it too.

[Note: one check per run]
Some collectives come in runs whose order and sizes the layout fixes: a synchronised
backward at stages 0-2 reduces every bucket, in bucket order, each exactly once, and the
step at stages 1-2 gathers every bucket. Once the ranks agree they start the same run of
the same layout, each collective after the first is determined; checking it again only
costs a round trip on the check group (~1 ms a collective on 2 CPU ranks, 2% of
gpt2-small's step at stage 0). So the run's first collective posts one check whose element
count is the whole run's (a different model on one rank still mismatches there), and the
rest post none (:meth:`Comm.run_check`). With ``check_collectives="strict"`` every
collective is checked and waits for its check, as before.
"""

from __future__ import annotations

import time
import warnings
import zlib
from typing import Protocol

import torch
import torch.distributed as dist

from .comm_wait import CollectiveError, CollectiveMismatch, CollectiveTimeout, Pending, StillWaiting
from .peer_watch import ASK_AFTER_S, ASK_EVERY_S, CHECKS_ISSUED, WATCH


class CheckedGroup(Protocol):
    """What a check reads of its communicator (``comm.Comm`` is one)."""

    label: str
    size: int
    global_rank: int
    timeout: float | None
    peers: list[int]  # global ranks, in group order
    unit_names: dict[int, str]  # unit_key(name) -> name, to decode peers' descriptors
    unverified: list[Check]  # posted checks not yet compared

__all__ = ["CHECK_TIMEOUT", "SLOW_CHECK", "OPS", "PHASES", "Check", "CheckedGroup", "issue",
           "make_check_group", "mismatch", "unit_key"]

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier", "all_to_all")
PHASES = ("forward", "backward", "step", "control", "state", "init", "sync", "other",
           "late")

#: Seconds a collective check waits for its peers unless ``timeout`` says otherwise:
#: NCCL's default process-group timeout. A rank that legitimately works alone longer
#: (saving a large checkpoint from rank 0) needs ``timeout=`` raised.
CHECK_TIMEOUT = 600.0
#: Seconds after which a waiting check warns (once) that a peer has not arrived.
SLOW_CHECK = 30.0


def unit_key(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def mismatch(rows: list[list[int]], c: CheckedGroup) -> CollectiveMismatch:
    """The error every rank raises when the descriptors ``rows`` differ."""

    def say(r: list[int]) -> str:
        where = c.unit_names.get(r[3], f"unit #{r[3]}")
        what = "" if r[6] else " without gradients"
        return (f"{OPS[r[2]]}({where}, {PHASES[r[4]]}{what}, {r[5]} elements) as "
                f"collective #{r[1]} of step {r[0]}")

    step = min(r[0] for r in rows)
    lines = [f"rank {c.peers[i]}: {say(r)}" for i, r in enumerate(rows)]
    return CollectiveMismatch(
        f"ranks diverged at step {step}: they issued different collectives "
        f"(group {c.label!r}):\n  " + "\n  ".join(lines) + "\n" + _fix(rows, c.unit_names)
    )


_STATE_UNITS = frozenset({"state_dict", "optimizer.state_dict", "full_state_dict",
                          "save_pretrained"})
_STATE_HINT = ("A rank is taking a state dict alone (rank 0 saving alone, as DDP scripts "
               "do?) while the others train on. With this model it is a collective — NCCL, "
               "tensor parallelism or a whole-parameter optimizer such as Muon (on gloo "
               "without those, one rank may take it alone: [Note: state dicts served]) — so "
               "call model.state_dict() / optimizer.state_dict() on every rank and save on "
               "one (sd = model.state_dict(); if rank == 0: torch.save(sd, path)).")
_EXPORT_HINT = ("zeroshard.hf.save_pretrained and zeroshard.full_state_dict gather the "
                "weights from every rank: call them on every rank (rank 0 writes the files).")


def _state_hint(units: set[str]) -> str:
    return _EXPORT_HINT if units & {"save_pretrained", "full_state_dict"} else _STATE_HINT


_GATHER_UNITS = frozenset({"unshard", "budget", "stream_weights"})
_GATHER_HINT = ("A rank gathered stage-3 weights alone: model.generate(), "
                "zeroshard.gathered(), model.unshard() and zeroshard.stream_weights() gather "
                "from every rank (see docs/generation.md). Call them on every rank — each with "
                "its own prompts if you like; iterate a stream to its end on every rank, "
                "without break — and print or save the result on one.")
_FORWARD_HINT = ("A rank ran a forward pass the others did not (evaluation on one rank?). At "
                 "stage 3 every forward gathers weights from every rank: run forward passes, "
                 "evaluation included, on every rank (each on its own share of the data).")
_BUFFERS_HINT = (
    "A rank ran a forward pass the others did not (evaluation on one rank?). A forward "
    "that follows a training forward broadcasts rank 0's buffers (BatchNorm statistics) "
    "to every rank, as DDP does; but under zeroshard model.module is the sharded model "
    "itself, so unlike DDP's model.module(x) this forward is not local. Run it on every "
    "rank (each on its own share of the data), or shard with forward_sync_buffers=False "
    "(buffers synced at start-up only: each rank then keeps its own) to make forwards "
    "at stages 0-2 local.")
_BUFFER_SIZES_HINT = (
    "The ranks' buffers differ in size (a cache grown lazily to each rank's input "
    "length?), so rank 0's cannot be broadcast to the others; DDP fails here too. Give "
    "the buffer the same shape on every rank (allocate it at its full size), or keep it "
    "out of the broadcast: list its name in model._ddp_params_and_buffers_to_ignore "
    "(set before shard()), or shard with forward_sync_buffers=False.")
_UNIT_HINT = ("A unit ran on some ranks only (layer drop / stochastic depth or early exit "
              "with rank-dependent randomness?): at stage 3 a unit's forward gathers its "
              "weights from every rank and its backward reduces its gradients over every "
              "rank, so every rank must run the same units. Make the same random choice on "
              "every rank (draw it from a generator seeded alike everywhere, or broadcast "
              "it), or use stage 2, where a skipped unit's parameters just get no gradient.")
_UNEVEN_HINT = ("One rank left the training loop while another still trains: if the ranks "
                "have different numbers of batches (uneven data), use zeroshard.join().")
_ORDER_HINT = "Every rank must run the same units in the same order each step."
_TRAINING = frozenset({"forward", "backward", "late"})


def _fix(rows: list[list[int]], names: dict[int, str]) -> str:
    """What to do about a mismatch, from what the ranks were doing."""
    hints = []
    units = {names.get(r[3], "") for r in rows}
    state = units & _STATE_UNITS
    if state:
        hints.append(_state_hint(state))
    phases = [PHASES[r[4]] for r in rows]
    training = [p in _TRAINING for p in phases]
    if state:  # the other ranks are simply training on: the state hint says so
        pass
    elif units & _GATHER_UNITS:
        hints.append(_GATHER_HINT)
    elif units == {"buffers"} and len({r[5] for r in rows}) > 1:
        hints.append(_BUFFER_SIZES_HINT)
    elif "buffers" in units:
        hints.append(_BUFFERS_HINT)
    elif len({r[6] for r in rows}) > 1:  # a forward without gradients on some ranks
        hints.append(_FORWARD_HINT)
    elif all(training) and len(units) > 1:
        hints.append(_UNIT_HINT)
    elif "forward" in phases and not all(training) and not state:
        hints.append(_FORWARD_HINT)
    saving_alone = bool(state) and not state & {"save_pretrained", "full_state_dict"}
    if any(training) and not all(training) and not saving_alone:
        hints.append(_UNEVEN_HINT)
    if _BUFFER_SIZES_HINT not in hints:
        hints.append(_ORDER_HINT)
    return "\n".join(hints)


def _fix_for(unit: str, phase: str, rank: int) -> str:
    """What to do when the peers never reach rank ``rank``'s collective on ``unit``."""
    if unit in _STATE_UNITS:
        return (f"Rank {rank} takes a state dict that the other ranks skipped (or ended "
                "their scripts before). " + _state_hint({unit}))
    if unit in _GATHER_UNITS:
        return _GATHER_HINT
    if phase == "forward":
        return _BUFFERS_HINT if unit == "buffers" else _FORWARD_HINT
    return _ORDER_HINT


# Check groups by their ranks (global), one per set of ranks per process group world:
# creating a gloo group connects every pair of its ranks, which costs more than many
# steps of checks, so sharded models over the same ranks share one (their checks pair up
# in program order, which every rank follows alike).
_CHECK_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def make_check_group(peers: list[int], whole_world: bool) -> dist.ProcessGroup:
    key = tuple(peers)
    group = _CHECK_GROUPS.get(key)
    if group is not None and not _alive(group):
        group = None
    if group is None:
        if whole_world:
            group = dist.new_group(backend="gloo")
        else:
            group = dist.new_group(peers, backend="gloo", use_local_synchronization=True)
        _CHECK_GROUPS[key] = group
        CHECKS_ISSUED[check_key(peers)] = 0  # a new group: its checks pair up from here
    return group


def check_key(peers: list[int]) -> str:
    """The name of the check group over ``peers`` in :data:`CHECKS_ISSUED`."""
    return ",".join(map(str, peers))


def issue(peers: list[int]) -> int:
    """Count one more check issued on the group over ``peers``; its number (from 1)."""
    key = check_key(peers)
    CHECKS_ISSUED[key] = CHECKS_ISSUED.get(key, 0) + 1
    return CHECKS_ISSUED[key]


def _alive(group: dist.ProcessGroup) -> bool:
    """False once the default group it was made under has been destroyed: its size is
    still readable then (it was reused after a re-init, pairing new checks with a dead
    group's pending ones); its ranks are not."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, RuntimeError, ValueError):
        return False
    return True


class Check:
    """One collective's descriptor exchange on the check group (see [Note: divergence])."""

    __slots__ = ("comm", "work", "table", "desc", "unit", "phase", "done", "number")

    def __init__(self, comm: CheckedGroup, work, table: torch.Tensor, desc: str, unit: str,
                 phase: str, number: int) -> None:
        self.comm, self.work, self.table, self.desc = comm, work, table, desc
        self.unit, self.phase = unit, phase
        self.number = number  # of this check on its group, from 1 (issue())
        self.done = False

    def ready(self) -> bool:
        return self.done or self.work.is_completed()

    def verify(self) -> None:
        """Wait for the peers' descriptors (bounded; a warning after ``SLOW_CHECK`` s; an
        error at once if a peer is provably blocked elsewhere, see [Note: asking the
        peers]) and raise on any difference."""
        if self.done:
            return
        c = self.comm
        total = c.timeout or CHECK_TIMEOUT
        start = time.monotonic()
        ask_at, warned = start + ASK_AFTER_S, False
        while not self.work.is_completed():
            waited = time.monotonic() - start
            if waited >= total:
                self._give_up(total)
            if not warned and waited >= SLOW_CHECK:
                warned = True
                warnings.warn(
                    f"rank {c.global_rank} has waited {waited:g} s for its peers in "
                    f"{self.desc} (group {c.label!r}). If only some ranks run it (a stage-3 "
                    "forward or a state dict on rank 0 alone, while the others wait in a "
                    f"barrier), run it on every rank. It gives up after {total:g} s.",
                    stacklevel=3)
            if time.monotonic() >= ask_at:
                self._ask_peers()
                ask_at = time.monotonic() + ASK_EVERY_S
            until = min(ask_at, start + total, *(() if warned else (start + SLOW_CHECK,)))
            try:
                Pending([self.work], self.table, self.desc, c, poll=True,
                        timeout=max(0.01, until - time.monotonic())).wait()
            except StillWaiting:
                continue
            except CollectiveError as e:
                raise CollectiveError(f"{e}\n{self._hint()}") from e.__cause__
        try:
            Pending([self.work], self.table, self.desc, c).wait()  # surfaces a peer's failure
        except CollectiveError as e:
            raise CollectiveError(f"{e}\n{self._hint()}") from e.__cause__
        self.done = True
        if self in c.unverified:
            c.unverified.remove(self)
        rows = self.table.view(c.size, 7).tolist()
        if any(r != rows[0] for r in rows):
            raise mismatch(rows, c)

    def _hint(self) -> str:
        return _fix_for(self.unit, self.phase, self.comm.global_rank)

    def _ask_peers(self) -> dict[int, dict]:
        """Ask the peers where they are; raise if one is blocked in a collective of the
        user's that includes this rank (it can never return: see [Note: asking the
        peers])."""
        c = self.comm
        answers = WATCH.ask([p for p in c.peers if p != c.global_rank], self.desc)
        key = check_key(c.peers)
        stuck = {p: a for p, a in answers.items() if a.get("state") == "foreign" and (
            a.get("ranks") is None or c.global_rank in a["ranks"])
            and a.get("checks", {}).get(key, 0) < self.number}  # not yet issued ours
        if stuck:
            blocked = "; ".join(f"rank {p} is blocked in {a['call']} called at {a['where']}"
                                for p, a in sorted(stuck.items()))
            message = (
                f"ranks diverged (group {c.label!r}): rank {c.global_rank} waits in "
                f"{self.desc}, which every rank must reach, while {blocked}: a collective "
                f"rank {c.global_rank} is not in, so neither can go on.\n" + self._hint())
            WATCH.tell(sorted(stuck), message)
            raise CollectiveMismatch(message)
        return answers

    def _give_up(self, total: float) -> None:
        c = self.comm
        self._ask_peers()  # a peer blocked elsewhere gets the error too
        raise CollectiveTimeout(
            f"rank {c.global_rank} waited {total:g} s in {self.desc} (group {c.label!r}) "
            "and gave up: a peer is not issuing the same collective (diverged, hung or busy "
            "elsewhere). If one rank runs a forward or a stage-3 state dict alone, run it on "
            "every rank; if a rank legitimately works alone this long (saving a large "
            "checkpoint), raise shard(..., timeout=)")
