"""``save_checkpoint(..., async_save=True)``: the files are written while training goes on.

[Note: asynchronous checkpoints]
A synchronous save of a large model stalls every accelerator for as long as the slowest
rank writes. Here the save is split where torchtitan's and DCP's ``async_save`` split it:

1. on the training thread, everything collective the save needs from the model (the
   layout, the RNG rows, the agreed temporary directory, one all-gather of ``extra``'s
   CRC), then the **staging copy**: each tensor this rank writes copied to host memory —
   its own 1/N of the masters and optimizer state, nothing else (pinned on CUDA, so the
   copy is a DMA the next step overlaps; ``pin_memory=`` says otherwise);
2. on a writer thread, DCP writes the copies and rank 0 commits the directory by renaming
   it once every rank's files are on disk ([Note: atomic checkpoints] in manifest.py).

Every collective of the writer thread runs on a process group of its own (gloo, created
once per model with the model's ``timeout=``): DCP gathers plans and results on it, and a
collective on a group the training loop also uses, issued from another thread, could pair
with the wrong call on a peer — the default group is refused for that reason. With hybrid
sharding the replicas hold the same pieces and replica 0 writes them, as a synchronous save
does: each replica's ranks get a writer group, and every rank's thread then joins one
all-reduce of a failure flag on a group of every rank, so the other replicas' ``wait()``
reports how replica 0's write went. Under tensor parallelism a replica's writers are its
(shard, tp) ranks. A rank that dies during the write leaves its peers waiting in DCP's last
collective until that group's timeout; they then fail, nothing is committed, and the
previous checkpoint stays the latest (``latest_checkpoint``). The new one is complete or
absent, never half there.

One save is in flight at a time: a later save (or ``wait()``) waits for the earlier one.

[Note: the staging copy is kept]
The staging copy is the training thread's whole share of an asynchronous save, and most
of it was the kernel's, not the copy's: 1 GiB copied into new host memory took 2.0-4.3 s
on this machine (a page fault per 4 KiB), into memory already touched 0.2 s. So, as
torchtitan's pinned-memory mode and DCP's caching stagers do, the copies are kept
between saves of the same model (``keep_staging=True``, the default) and the next save
copies into them (each tensor's by its key, where shape and dtype still match; anything
else is allocated anew). The cost is this rank's 1/N of the state held in host memory
from the first asynchronous save on (pinned on CUDA), which is the save's peak anyway;
``keep_staging=False`` frees it once the write is done. Reuse is safe because one save
is in flight at a time: the next save's copy starts after the previous write ended.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..engine.dtensors import dtensor_at_zero
from ..engine.engine import Engine
from .layout import checkpoint_group, global_ranks

__all__ = ["AsyncCheckpoint", "stage", "writer_group", "start", "wait_pending"]

# model engine -> (its replica's writers' group, every rank's group or None); one per model
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model engine -> the save in flight
_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model engine -> its last asynchronous save's staging copies, by key ([Note: the staging
# copy is kept])
_STAGING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class AsyncCheckpoint:
    """The handle ``save_checkpoint(..., async_save=True)`` returns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def done(self) -> bool:
        """Has the write finished (committed or failed)?"""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until the checkpoint is committed and return its path; re-raise the
        write's error (nothing was committed then) on this rank."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the asynchronous save of {str(self.path)!r} is still "
                               f"writing after {timeout} s")
        if self._error is not None:
            raise self._error
        return self.path

    result = wait  # concurrent.futures' name, as DCP's async_save returns a Future

    def _run(self, write: Any) -> None:
        try:
            write()
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self._error = exc
        finally:
            self._done.set()


def writer_group(engine: Engine, group: Any = None) -> tuple[Any, Any]:
    """The writer thread's process groups: (this replica's writers' group, the group of
    every rank of the model, or None without replicas), made once per model over the
    checkpoint groups' ranks, or ``group`` if given (not the default one; not with hybrid
    sharding, whose replicas each need their own). Collective the first time
    (``new_group``: every rank of the job calls it, as every rank calls save)."""
    if group is not None:
        if group is dist.group.WORLD or group == dist.distributed_c10d._get_default_group():
            raise ValueError(
                "save_checkpoint(async_save=True, process_group=<the default group>): the "
                "writer thread's collectives would interleave with the training loop's on "
                "that group and pair with the wrong calls. Pass a group of its own, "
                "dist.new_group(backend='gloo'), or leave process_group=None (zeroshard "
                "makes one)")
        if engine.replicate is not None:
            raise ValueError(
                "save_checkpoint(async_save=True, process_group=...) with hybrid sharding: "
                "each replica's writers need a group of their own, and every rank one to "
                "agree on the outcome; leave process_group=None and zeroshard makes them")
        return group, None
    known = _GROUPS.get(engine)
    if known is not None:
        return known
    ranks = global_ranks(checkpoint_group(engine)[0])
    every = dist.get_world_size()
    # each replica's writers (one list without hybrid sharding), in one order everywhere
    replicas: list[Any] = [None] * every
    dist.all_gather_object(replicas, ranks)
    groups = list(dict.fromkeys(tuple(r) for r in replicas))
    model = sorted({r for g in groups for r in g})
    if len(model) != every:
        raise ValueError(
            f"save_checkpoint(async_save=True): the model is sharded over ranks {model}, not "
            "the whole job, and a group of the writer's own is made by every rank of the "
            "job: pass process_group=dist.new_group(ranks, backend='gloo'), made on every "
            "rank")
    timeout = timedelta(seconds=engine.config.timeout or 1800.0)
    mine = None
    for g in groups:
        made = dist.new_group(ranks=list(g), backend="gloo", timeout=timeout)
        if list(g) == ranks:
            mine = made
    span = (dist.new_group(ranks=model, backend="gloo", timeout=timeout)
            if len(groups) > 1 else None)
    _GROUPS[engine] = (mine, span)
    return mine, span


def _pin(pin_memory: bool | None) -> bool:
    if pin_memory is None:
        return torch.cuda.is_available()
    if pin_memory and not torch.cuda.is_available():
        warnings.warn("save_checkpoint(async_save=True, pin_memory=True): no CUDA device, so "
                      "host memory cannot be pinned; staging in pageable memory instead",
                      stacklevel=3)
        return False
    return bool(pin_memory)


@torch.no_grad()
def stage(engine: Engine, sd: dict[str, Any], pin_memory: bool | None = None,
          keep: bool = True) -> dict[str, Any]:
    """Host copies of every tensor in ``sd`` (a DTensor: of its local piece), so training
    may change the originals while the copies are written. Exactly this rank's bytes: a
    view is copied as the view, not its whole storage. Into the previous save's copies
    where they fit, and kept for the next one if ``keep`` ([Note: the staging copy is
    kept])."""
    pinned = _pin(pin_memory)
    kept: dict[str, torch.Tensor] = _STAGING.pop(engine, {})

    def copy(k: str, t: torch.Tensor) -> torch.Tensor:
        out = kept.get(k)
        if out is None or out.shape != t.shape or out.dtype != t.dtype or (
                out.is_pinned() != pinned):
            out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
        out.copy_(t, non_blocking=pinned)
        return out

    staged: dict[str, Any] = {}
    copies: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if hasattr(v, "to_local"):  # a DTensor: its piece, under the same spec
            copies[k] = copy(k, v.to_local())
            staged[k] = dtensor_at_zero(copies[k], v._spec)
        elif isinstance(v, torch.Tensor):
            staged[k] = copies[k] = copy(k, v)
        else:
            staged[k] = v
    kept.clear()  # copies of keys this save no longer has are freed
    if pinned:
        torch.cuda.synchronize()  # the copies are complete before the writer reads them
    if keep:
        _STAGING[engine] = copies
    return staged


def wait_pending(engine: Engine) -> None:
    """Wait for this model's save in flight, if any (its error is raised by its handle's
    ``wait``, not here: a later save must not fail for an earlier one)."""
    pending = _PENDING.pop(engine, None)
    if pending is not None:
        pending._done.wait()


def start(engine: Engine, path: Path, write: Any) -> AsyncCheckpoint:
    """Run ``write`` (the DCP write and the commit) on a writer thread."""
    handle = AsyncCheckpoint(path)
    thread = threading.Thread(target=handle._run, args=(write,),
                              name=f"zeroshard-save-{path.name}", daemon=True)
    handle._thread = thread
    _PENDING[engine] = handle
    thread.start()
    return handle
