"""From flat buckets to per-parameter 1-D ranges: what a rank owns, in checkpoint terms.

[Note: checkpoint layout]
Inside the engine a rank owns a dim-0 chunk of every parameter of a bucket (see
[Note: flat buckets]); which parameters share a bucket depends on the stage (stages 0-2
cut buckets by bytes, stage 3 by unit) and the chunks and padding on the world size. None of that may leak into the file, or a checkpoint
could only be read back by the layout that wrote it. So every parameter is stored on its
own, *flattened*, under its canonical name (the first name ``named_parameters`` gives
it; tied names are recorded as aliases):

* ``model.<name>`` — its fp32 master weights (the values the optimizer steps), 1-D;
* ``optim.<name>.<key>`` — each per-element optimizer state (AdamW's ``exp_avg``,
  ``exp_avg_sq``), 1-D, same ranges.

A rank's chunk of a parameter is one 1-D range ``[lo, hi)`` of the flattened
parameter, written by that rank only as a ``ShardedTensor`` shard
with its global offset. Loading at another world size or stage asks the checkpoint
(torch.distributed.checkpoint, "DCP") for exactly the 1-D ranges the *new* layout owns,
and DCP reads the overlapping parts of whichever stored chunks hold them. The 16-bit
weights a mixed-precision run computes with are a cast of the master weights, so they
are not stored: loading re-derives them bit for bit.

Stage 0 keeps everything whole on every rank; it still *writes* by the same ranges, so
saving is split across ranks, and reads whole tensors back.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

from ..engine.engine import Engine
from ..engine.flat import FlatBucket, ParamSlot

__all__ = ["ParamEntry", "param_entries", "model_key", "optim_key", "bucket_tensor_views",
           "weights_views", "sharded_1d", "sharded_tensor", "quiet", "global_ranks"]


def global_ranks(group) -> list[int]:
    """Global rank of each rank of ``group`` (``None``: the world), for shard placements."""
    size = dist.get_world_size(group)
    return [r if group is None else dist.get_global_rank(group, r) for r in range(size)]


@contextmanager
def quiet() -> Iterator[None]:
    """Silence DCP's "we are deprecating ShardedTensor" FutureWarning.

    DTensor, its successor, shards a dimension in equal ``ceil(n/N)`` chunks; a
    parameter's pieces here are arbitrary 1-D ranges (wherever bucket slices cut it),
    which is what ``ShardedTensor`` describes and DCP still reads and writes (FSDP1's
    sharded state dicts use it too). Should it go, DTensor over torch's
    ``LocalShardsWrapper`` describes the same ranges.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        yield


def model_key(name: str) -> str:
    return f"model.{name}"


def optim_key(name: str, state: str) -> str:
    return f"optim.{name}.{state}"


@dataclass(frozen=True)
class ParamEntry:
    """One parameter as the checkpoint sees it, plus where it lives in this engine."""

    name: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...]
    param: nn.Parameter
    bucket: FlatBucket | None  # None: a frozen parameter kept whole on every rank
    slot: ParamSlot | None
    trainable: bool
    world: int  # ranks of the sharding group (who writes which piece)
    rank: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def offset(self) -> int:
        return self.slot.offset if self.slot is not None else 0

    def ranges(self) -> list[tuple[int, int, int]]:
        """``(rank, lo, hi)``: every rank's piece, in this parameter's flat coordinates
        (its dim-0 chunk; see [Note: flat buckets]). Stage 0 keeps everything whole on
        every rank and splits only the writing, by the same rule over its ranks."""
        s = self.slot
        assert s is not None
        if s.world == 1 and self.world > 1:
            s = replace(s, world=self.world)
        return [(q, *s.piece(q)) for q in range(s.world) if s.rows_of(q)]

    def piece(self, t: torch.Tensor) -> torch.Tensor | None:
        """This rank's piece of the parameter inside a per-bucket tensor ``t`` — the
        rank's shard (stages >= 1) or the whole bucket (stage 0) — or None."""
        s = self.slot
        assert s is not None
        mine = [(lo, hi) for q, lo, hi in self.ranges() if q == self.rank]
        if not mine:
            return None
        lo, hi = mine[0]
        if s.world == 1:  # a whole bucket
            return t[s.offset + lo : s.offset + hi]
        return t[s.shard_offset : s.shard_offset + hi - lo]

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """The whole flattened parameter inside a full-layout tensor ``t``."""
        return t[self.offset : self.offset + self.numel]


def param_entries(engine: Engine) -> list[ParamEntry]:
    """Every parameter of the engine's model, in ``named_parameters`` order (names are the
    model's; each parameter once, whichever of its faces the modules hold now)."""
    slots: dict[int, tuple[FlatBucket, ParamSlot]] = {}
    for b in engine.all_buckets:
        for s in b.slots:
            slots[id(s.param)] = slots[id(engine.faces.user[id(s.param)])] = (b, s)
    names: dict[int, list[str]] = {}
    params: list[nn.Parameter] = []
    for n, p in engine.model.named_parameters(remove_duplicate=False):
        p = engine.faces.alias_of.get(id(p), p)  # a tied parameter's alias: the parameter
        if id(p) not in names:
            names[id(p)] = []
            params.append(p)
        names[id(p)].append(n)
    out = []
    for p in params:
        b, s = slots.get(id(p), (None, None))
        shape = tuple(s.shape) if s is not None else tuple(p.shape)
        if s is not None and engine.tp is not None:  # the whole parameter's (tp_views.py)
            shape = tuple(engine.tp.global_shape(s.param))
        out.append(ParamEntry(
            name=names[id(p)][0], aliases=tuple(names[id(p)][1:]), shape=shape,
            param=s.param if s is not None else p, bucket=b, slot=s,
            trainable=b.requires_grad if b is not None else p.requires_grad,
            world=engine.comm.size, rank=engine.comm.rank,
        ))
    return out


def bucket_tensor_views(entry: ParamEntry, t: torch.Tensor, *, for_load: bool, group,
                        peers: list[int]) -> torch.Tensor:
    """What DCP should see for ``entry`` given its bucket's tensor ``t`` (master, a state
    tensor, or stage 3's frozen ``shard16``).

    Whole buckets (stage 0) load as plain whole tensors (every rank needs everything);
    everything else is a 1-D ``ShardedTensor`` over the current layout's ranges.
    """
    b = entry.bucket
    assert b is not None
    if for_load and b.world == 1:
        return entry.whole(t)
    return sharded_1d(entry.numel, entry.ranges(), entry.piece(t), entry.rank, peers, group,
                      t.dtype, t.device)


def weights_views(entry: ParamEntry, *, for_load: bool, group, peers: list[int]) -> torch.Tensor:
    """:func:`bucket_tensor_views` of the bucket's master weights (stage 3's frozen
    ``shard16``), which may live inside ``full`` (see [Note: masters inside the weights]
    in engine/chunks.py): each rank's piece is contiguous there, so DCP reads and writes
    them in place."""
    b = entry.bucket
    assert b is not None
    if not b.master_in_full:
        src = b.master.detach() if b.master is not None else b.shard16
        return bucket_tensor_views(entry, src, for_load=for_load, group=group, peers=peers)
    if for_load and b.world == 1:
        return entry.whole(b.full)
    s = entry.slot
    assert s is not None
    mine = [(lo, hi) for q, lo, hi in entry.ranges() if q == entry.rank]
    local = b.master_range(s.shard_offset, s.shard_offset + mine[0][1] - mine[0][0]) \
        if mine else None
    return sharded_1d(entry.numel, entry.ranges(), local, entry.rank, peers, group,
                      b.full.dtype, b.full.device)


def sharded_1d(numel: int, ranges: list[tuple[int, int, int]], local: torch.Tensor | None,
               rank: int, peers: list[int], group, dtype: torch.dtype,
               device: torch.device) -> ShardedTensor:
    """A 1-D ``ShardedTensor`` of ``numel`` elements whose rank ``q`` holds ``[lo, hi)``."""
    shards = [(q, [lo], [hi - lo]) for q, lo, hi in ranges]
    return sharded_tensor([numel], shards, local, rank, peers, group, dtype, device)


def sharded_tensor(size: list[int], shards: list[tuple[int, list[int], list[int]]],
                   local: torch.Tensor | None, rank: int, peers: list[int], group,
                   dtype: torch.dtype, device: torch.device) -> ShardedTensor:
    """A ``ShardedTensor`` whose rank ``q`` holds the block at ``offsets`` of ``sizes``
    (``shards``: ``(q, offsets, sizes)``; ``local``: this rank's block, if any).

    Built from the global layout every rank computes identically, so no collective is
    needed (torch FSDP's ``_create_chunk_sharded_tensor`` does the same).
    """
    where = str(device) if device.type != "cuda" else f"cuda:{device.index or 0}"
    mds = [ShardMetadata(shard_offsets=list(off), shard_sizes=list(sz),
                         placement=f"rank:{peers[q]}/{where}") for q, off, sz in shards]
    props = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata(shards_metadata=mds, size=torch.Size(size),
                                 tensor_properties=props)
    local_shards = []
    for (q, _, sz), md in zip(shards, mds):
        if q == rank:
            assert local is not None and list(local.shape) == list(sz)
            local_shards.append(Shard(local.detach(), md))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, meta, process_group=group)
