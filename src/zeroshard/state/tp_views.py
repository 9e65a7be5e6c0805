"""Sharded checkpoints of tensor-parallel models: what each rank writes and reads, in the
checkpoint's global coordinates.

[Note: tensor-parallel checkpoints]
A checkpoint stores every parameter flattened and whole ([Note: checkpoint layout] in
layout.py), so a tensor-parallel run must write its pieces at their places in the *whole*
parameter, and the pieces of all ranks must tile it exactly once (DCP's ShardedTensor
refuses overlaps and gaps). The ranks of one replica — shard rank q, tp rank t, group
rank q·tp + t — write and read together; with hybrid sharding (a replicate dimension)
replica 0 writes and every replica reads. For a parameter of global shape (R, ...) with
rows of C elements, whose dp chunks are ``torch.chunk``'s (ParamSlot):

* replicated over tp (norms, parameters outside the plan): the dp chunks of the whole
  parameter, written by tp rank 0; read by tp rank 0, then broadcast over tp;
* ``Shard(0)`` (column-wise weights): tp rank t holds rows [t·c, t·c + r_t) (c =
  ceil(R/tp)), and its dp chunk q of those is one contiguous range of the whole;
  written and read in place by its owner;
* ``Shard(1)`` of a 2-D weight (row-wise): a dp chunk is a block of rows × some columns,
  not a range. The tp ranks of one dp chunk gather its whole rows (an all-gather over
  tp) and write ``torch.chunk``'s share of those rows each; reading, each reads its share
  of the whole rows, all-gathers them over tp and keeps its columns.

The file is the same as a run without tensor parallelism writes, so either loads the
other at any stage, dp size or tp degree. Every tp collective here is issued per
parameter in ``named_parameters`` order, the same on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..engine.tensor_parallel import chunk_range
from .layout import ParamEntry, sharded_1d
from .manifest import CheckpointError

if TYPE_CHECKING:
    from ..engine.engine import Engine

__all__ = ["TpViews", "checkpoint_group"]


def checkpoint_group(engine: Engine) -> tuple[Any, int, int, list[int], bool]:
    """(group, rank in it, size, global rank of each member, whether it writes): who saves
    and loads a checkpoint together — the sharding group, or under tensor parallelism a
    replica's (shard, tp) ranks — and whether this rank's group is the one that writes
    (replica 0: replicas hold the same pieces)."""
    from .layout import global_ranks

    writes = engine.replicate is None or engine.replicate.rank == 0
    tp = engine.tp
    if tp is None:
        c = engine.comm
        return c.group, c.rank, c.size, global_ranks(c.group), writes
    rank = engine.comm.rank * tp.size + tp.rank
    return tp.ckpt_group, rank, len(tp.ckpt_peers), tp.ckpt_peers, writes


class TpViews:
    """Builds the DCP objects of a tensor-parallel engine's parameters and the fix-ups a
    load needs after ``dcp.load`` (see [Note: tensor-parallel checkpoints])."""

    def __init__(self, engine: Engine) -> None:
        assert engine.tp is not None
        self.engine, self.tp = engine, engine.tp
        self.dp, self.q = engine.comm.size, engine.comm.rank
        self.group, self.rank, _, self.peers, _ = checkpoint_group(engine)
        self._after: list[Callable[[], None]] = []

    # -- the layout ---------------------------------------------------------------------
    def _kind(self, e: ParamEntry) -> tuple[str, tuple[int, ...]]:
        spec = self.tp.spec(e.slot.param)
        if spec is None or spec.placement.is_replicate():
            return "replicate", tuple(e.slot.shape)
        dim = spec.placement.dim
        if dim == 0:
            return "rows", tuple(spec.shape)
        if dim == 1 and len(spec.shape) == 2:
            return "cols", tuple(spec.shape)
        raise CheckpointError(
            f"parameter {e.name!r}: save_checkpoint lays out tensor-parallel pieces of dim "
            f"0, or of dim 1 of a matrix; this one is Shard({dim}) of shape "
            f"{tuple(spec.shape)}. Save whole state dicts instead (docs/tensor-parallel.md)")

    def _pieces(self, e: ParamEntry) -> list[tuple[int, int, int]]:
        """(group rank, lo, hi) of every writer, tiling the flattened whole parameter."""
        kind, shape = self._kind(e)
        rows = shape[0] if shape else 1
        row = math.prod(shape) // rows if rows else 0
        T, out = self.tp.size, []
        for q in range(self.dp):
            for t in range(T):
                if kind == "replicate":
                    if t:
                        continue
                    start, n = chunk_range(rows, q, self.dp)
                elif kind == "rows":
                    t0, rt = chunk_range(rows, t, T)
                    start, n = chunk_range(rt, q, self.dp)
                    start += t0
                else:  # cols: tp rank t's share of the dp chunk's whole rows
                    s0, m = chunk_range(rows, q, self.dp)
                    start, n = chunk_range(m, t, T)
                    start += s0
                if n:
                    out.append((q * T + t, start * row, (start + n) * row))
        return out

    def _local(self, e: ParamEntry, t: torch.Tensor) -> torch.Tensor:
        """This rank's dp piece of its tp piece inside a shard-layout tensor, flat."""
        s = e.slot
        n = s.rows_of(e.bucket.rank) * s.row
        return t[s.shard_offset : s.shard_offset + n]

    def _whole_rows(self, e: ParamEntry, local: torch.Tensor) -> torch.Tensor:
        """Shard(1): the dp chunk's whole rows, gathered over tp (collective)."""
        from torch.distributed.tensor import DTensor, Shard

        shape = self._kind(e)[1]
        n = e.slot.rows_of(e.bucket.rank)
        piece = self._on_device(local.view(n, e.slot.shape[1]))
        dt = DTensor.from_local(piece, self.tp.tp_mesh, (Shard(1),), run_check=False,
                                shape=(n, shape[1]), stride=(shape[1], 1))
        return dt.full_tensor().to(local.device)

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """Collectives run on the engine's device (NCCL needs it); offloaded masters and
        state live on the host."""
        return t if t.device == self.engine.device else t.to(self.engine.device)

    def _mine(self, pieces: list[tuple[int, int, int]]) -> tuple[int, int] | None:
        return next(((lo, hi) for r, lo, hi in pieces if r == self.rank), None)

    def _sharded(self, e: ParamEntry, pieces, local: torch.Tensor | None, like: torch.Tensor):
        numel = math.prod(self._kind(e)[1])
        return sharded_1d(numel, pieces, local, self.rank, self.peers, self.group, like.dtype,
                          like.device)

    # -- save and load ------------------------------------------------------------------
    def save(self, e: ParamEntry, t: torch.Tensor):
        """What DCP writes for ``e`` from the shard-layout tensor ``t`` (a master, a state
        tensor, or stage 3's frozen slice)."""
        kind, _ = self._kind(e)
        pieces, local = self._pieces(e), self._local(e, t.detach())
        if kind == "cols":
            whole = self._whole_rows(e, local)
            start, n = chunk_range(whole.shape[0], self.tp.rank, self.tp.size)
            local = whole[start : start + n].reshape(-1)
        mine = self._mine(pieces)
        return self._sharded(e, pieces, local if mine else None, t)

    def load(self, e: ParamEntry, t: torch.Tensor):
        """DCP's target for ``e`` into shard-layout tensor ``t``; what it cannot read in
        place runs in :meth:`finish` (in this same order on every rank)."""
        kind, shape = self._kind(e)
        pieces, local = self._pieces(e), self._local(e, t.detach())
        mine = self._mine(pieces)
        if kind == "rows":
            return self._sharded(e, pieces, local if mine else None, t)
        if kind == "replicate":
            self._after.append(lambda: self._broadcast(local))
            return self._sharded(e, pieces, local if mine else None, t)
        read = torch.empty(mine[1] - mine[0] if mine else 0, dtype=t.dtype, device=t.device)
        self._after.append(lambda: self._columns(e, shape, read, local))
        return self._sharded(e, pieces, read if mine else None, t)

    def _broadcast(self, local: torch.Tensor) -> None:
        if local.numel():  # the same on every tp rank (the same dp chunk)
            src = dist.get_global_rank(self.tp.comm.group, 0)
            buf = self._on_device(local)
            dist.broadcast(buf, src=src, group=self.tp.comm.group)
            if buf is not local:
                local.copy_(buf)

    def _columns(self, e: ParamEntry, shape: tuple[int, ...], read: torch.Tensor,
                 local: torch.Tensor) -> None:
        from torch.distributed.tensor import DTensor, Shard

        n, cols = e.slot.rows_of(e.bucket.rank), shape[1]
        dt = DTensor.from_local(self._on_device(read.view(read.numel() // cols, cols)),
                                self.tp.tp_mesh, (Shard(0),), run_check=False,
                                shape=(n, cols), stride=(cols, 1))
        whole = dt.full_tensor()
        width = e.slot.shape[1]  # this tp rank's columns: DTensor's Shard(1) chunk
        lo = chunk_range(cols, self.tp.rank, self.tp.size)[0]
        local.view(n, width).copy_(whole[:, lo : lo + width])

    def frozen_save(self, p: torch.Tensor) -> torch.Tensor:
        """A frozen tensor-parallel parameter kept out of buckets (a DTensor): whole."""
        return p.detach().full_tensor().reshape(-1)

    def frozen_load(self, p: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import distribute_tensor

        whole = torch.empty(p.shape, dtype=p.dtype, device=p.device)

        def place() -> None:
            piece = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
            p.detach().to_local().copy_(piece.to_local())

        self._after.append(place)
        return whole.view(-1)

    def finish(self) -> None:
        """After ``dcp.load``: broadcasts and column gathers, in the order queued."""
        with torch.no_grad():
            for fn in self._after:
                fn()
        self._after.clear()
