"""The compute weights re-derived from the masters: after a step, a load, or a user's
in-place edit of a parameter.

The optimizer steps the masters (fp32 slices, a host copy, or this rank's chunks of the
whole weights: [Note: buffer lifetimes] in engine.py); forward reads ``full`` (stages
0-2) or ``shard16`` (stage 3, gathered per unit by units.py). This file moves the values
from the first to the second: a copy (stages 0 and 3), or at stages 1-2 every rank's
updated slice to every rank (an all-gather; on gloo one broadcast per rank's piece).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..comm import Comm
from .flat import FlatBucket
from .offload import Offload
from .params import Faces
from .policy import StagePolicy
from .storage import same_memory

__all__ = ["WeightRefresh"]


class WeightRefresh:
    """Re-derives compute weights; remembers which masters it derived them from."""

    def __init__(self, *, policy: StagePolicy, comm: Comm, offloader: Offload,
                 faces: Faces, buckets: list[FlatBucket]) -> None:
        self.policy = policy
        self.comm = comm
        self.offloader = offloader
        self.faces = faces
        self.buckets = buckets
        self.run_numel = sum(b.padded_numel for b in buckets)  # [Note: one check per run]
        # Told which buckets' compute weights were re-derived (the engine connects stage
        # 3's schedule: resident gathered copies of them are stale).
        self.on_refresh: Callable[[list[FlatBucket]], None] = lambda buckets: None
        # Buckets whose masters were handed out as views (torch's DCP API: [Note: sharded
        # state dicts for torch's DCP API]) -> their version when last derived from.
        self.watched: dict[FlatBucket, int] = {}

    @torch.no_grad()
    def refresh(self, *, phase: str, buckets: list[FlatBucket] | None = None) -> None:
        """Re-derive the compute weights from the masters (after a step or a load, or
        for ``buckets`` whose masters the user edited; see refresh_edited)."""
        pending = []
        offload = self.offloader.enabled
        whole = buckets is None  # every bucket, in order: one check for the run
        for b in self.buckets if buckets is None else buckets:
            # ([Note: one check per run] in comm_check.py)
            checks = self.comm.run_check(b is self.buckets[0], self.run_numel) if whole else {}
            if self.policy.shard_params:
                if offload and not self.offloader.params:
                    self.offloader.upload(b, b.shard16)
                elif not same_memory(b.shard16, b.master):
                    b.shard16.copy_(b.master.detach())
                continue
            if not self.policy.gather_after_step:  # stage 0: the whole master
                if not same_memory(b.full, b.master):
                    b.full.copy_(b.master.detach())
                continue
            if self.comm.decompose and not offload:
                # gloo: the updated slice into this rank's chunks of ``full`` (nothing to
                # do where the optimizer stepped them in place), every rank's chunk of
                # every parameter broadcast straight into place: no gathered buffer, no
                # copy-out; all buckets in flight at once.
                if not b.master_in_full:
                    b.shard_to_full(b.master.detach(), b.full)
                pending.append(self.comm.all_gather_pieces(
                    b.full, b.rank_pieces(b.full), phase=phase, unit=b.name, async_op=True,
                    **checks))
                continue
            # Stages 1-2: the updated slice into a gathered buffer, all-gather, copy out.
            gathered = torch.empty(b.padded_numel, dtype=b.full.dtype, device=b.device)
            target = b.shard_of(gathered)
            if offload:
                self.offloader.upload(b, target)
            elif b.master_in_full:  # this rank's chunks of ``full``, already stepped
                b.shard_from_full(b.full, out=target)
            else:
                target.copy_(b.master.detach())
            self.comm.all_gather(gathered, phase=phase, unit=b.name, **checks).wait()
            b.gathered_to_full(gathered, b.full)
            del gathered
        for p in pending:
            p.wait()
        self.note_edits(self.buckets if buckets is None else buckets)
        for b in self.buckets if buckets is None else buckets:
            if b in self.watched:
                self.watched[b] = _version(b)
        self.on_refresh(self.buckets if buckets is None else buckets)

    def watch(self, buckets: list[FlatBucket]) -> None:
        """Views of these buckets' masters were handed out (a sharded state dict that
        ``dcp.load`` may write into): re-derive them before a forward if they change. For
        the model's life: torch's recipe steps a fresh optimizer (``_init_optim_state``)
        between handing the views out and loading into them."""
        for b in buckets:
            if b in self.buckets:  # trainable (frozen stage-3 slices are read directly)
                # An entry already there keeps its version: a dcp.load into the earlier
                # views that nothing has re-derived yet must stay seen (refresh() moves it).
                self.watched.setdefault(b, _version(b))

    def stale_watched(self) -> list[FlatBucket]:
        """Watched buckets written through their handed-out views since last derived, in
        the buckets' order (the same on every rank: the refresh may be collective)."""
        if not self.watched:  # (before every forward: nothing handed out, nothing to do)
            return []
        return [b for b in self.buckets if b in self.watched and _version(b) != self.watched[b]]

    def note_edits(self, buckets: list[FlatBucket]) -> None:
        """Remember the user parameters' versions the compute weights now derive from."""
        if self.faces.swap:
            for b in buckets:
                b.edits_seen = self.faces.edits(b)

    def refresh_edited(self) -> None:
        """Before a forward: re-derive the compute weights of buckets whose masters
        changed since they were last derived — the user edited a parameter in place
        (``p.mul_()``, an EMA copy-in) where the user parameters are the masters (mixed
        precision, stage 3, offload). Under DDP the next forward sees such an edit; here
        the compute weights are a copy of (or gathered from) the masters, so they are
        refreshed. Edits are seen as a change of the user parameters' version counters
        (the optimizer steps the masters' chunks, which leaves those alone). At stages
        1-2 the refresh is an all-gather: every rank must make the same edit, as DDP's
        replicas must."""
        # Masters written through handed-out views (dcp.load into a sharded state dict).
        stale = self.stale_watched()
        if self.faces.swap:  # else the modules' parameters are the compute weights
            stale += [b for b in self.buckets
                      if self.faces.edits(b) != b.edits_seen and b not in stale]
        if stale:
            self.refresh(phase="forward", buckets=[b for b in self.buckets if b in stale])


def _version(b: FlatBucket) -> int:
    """The version counter the masters' views share (inside ``full`` at stages 1-2, fp32)."""
    return (b.master if b.master is not None else b.full)._version
