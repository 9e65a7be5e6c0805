"""From flat buckets to per-parameter DTensors: what a rank owns, in checkpoint terms.

[Note: checkpoint layout]
Inside the engine a rank owns a dim-0 chunk of every parameter of a bucket (see
[Note: flat buckets]); which parameters share a bucket depends on the stage (stages 0-2
cut buckets by bytes, stage 3 by unit) and the chunks and padding on the world size. None
of that may leak into the file, or a checkpoint could only be read back by the layout
that wrote it. So every parameter is stored on its own, in its own shape, under its
canonical name (the first name ``named_parameters`` gives it; tied names are recorded as
aliases):

* ``model.<name>`` — its fp32 master weights (the values the optimizer steps);
* ``optim.<name>.<key>`` — each per-element optimizer state (AdamW's ``exp_avg``,
  ``exp_avg_sq``), shaped like the parameter.

A rank's chunk of a parameter is ``torch.chunk``'s, so it *is* the local tensor of a
DTensor ``Shard(0)`` (the user parameters are those DTensors, see [Note: parameters the
user sees] in engine/params.py): DCP writes each rank's piece at its offset, as it does
FSDP2's. Under tensor parallelism the placements are the user parameter's on the whole
mesh — zeroshard's dp placements, then the tp placement (``_StridedShard(0)`` where both
split dim 0, see [Note: tensor-parallel parameters]) — and with hybrid sharding
``Replicate`` on the replica dimension; DCP computes every piece's offsets, writes a
replicated piece once, and reads any overlap, so no tp collective runs here. Loading at
another world size, stage or tp degree asks for exactly the pieces the *new* layout owns,
viewing this rank's current buffers, and DCP reads the overlapping parts of whichever
stored chunks hold them. The 16-bit weights a mixed-precision run computes with are a
cast of the master weights, so they are not stored: loading re-derives them bit for bit.

Stage 0 keeps everything whole on every rank: whole tensors (DCP writes each once,
spreading the writing over the ranks), read back whole; a tensor-parallel one is a DTensor
on the tp mesh. Frozen parameters kept out of buckets likewise.

Version 1 of the format (zeroshard before this layout) stored every tensor flattened, in
arbitrary 1-D ranges (torch's deprecated sharded-tensor class); :func:`read_v1` loads it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ..engine.dtensors import dtensor, make_spec
from ..engine.engine import Engine
from ..engine.flat import FlatBucket, FlatParam
from ..engine.optimizer import one_optimizer  # re-exported for the checkpoint functions

__all__ = ["ParamEntry", "param_entries", "model_key", "optim_key", "bucket_view",
           "weights_view", "read_v1", "quiet", "global_ranks",
           "checkpoint_group", "rng_table", "one_optimizer"]


def global_ranks(group) -> list[int]:
    """Global rank of each rank of ``group`` (``None``: the world)."""
    size = dist.get_world_size(group)
    return [r if group is None else dist.get_global_rank(group, r) for r in range(size)]


def checkpoint_group(engine: Engine) -> tuple[Any, int, int, list[int], bool]:
    """(group, rank in it, size, global rank of each member, whether it writes): who saves
    and loads a checkpoint together — the sharding group, or under tensor parallelism a
    replica's (shard, tp) ranks — and whether this rank's group is the one that writes
    (replica 0: replicas hold the same pieces)."""
    writes = engine.replicate is None or engine.replicate.rank == 0
    tp = engine.tp
    if tp is None:
        c = engine.comm
        return c.group, c.rank, c.size, global_ranks(c.group), writes
    group = tp.ckpt_group
    return group, dist.get_rank(group), len(tp.ckpt_peers), tp.ckpt_peers, writes


@contextmanager
def quiet() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to load in a single process" UserWarning,
    which a single-process read (``no_dist=True``, consolidate.py, :func:`read_v1`) is."""
    with warnings.catch_warnings():
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
    slot: FlatParam | None
    trainable: bool

    @property
    def offset(self) -> int:
        return self.slot.offset if self.slot is not None else 0


def param_entries(engine: Engine) -> list[ParamEntry]:
    """Every parameter of the engine's model, in ``named_parameters`` order (names are the
    model's; each parameter once, whichever of its faces the modules hold now)."""
    slots: dict[nn.Parameter, FlatParam] = {}
    for b in engine.all_buckets:
        for s in b.slots:
            slots[s.param] = slots[s.user] = s
    names: dict[nn.Parameter, list[str]] = {}
    for n, p in engine.model.named_parameters(remove_duplicate=False):
        p = engine.faces.alias_of.get(p, p)  # a tied parameter's alias: the parameter
        names.setdefault(p, []).append(n)
    out = []
    for p, known_as in names.items():  # in order of first appearance
        s = slots.get(p)
        b = s.bucket if s is not None else None
        shape = tuple(s.shape) if s is not None else tuple(p.shape)
        if s is not None and engine.tp is not None:  # the whole parameter's, not the tp piece's
            shape = tuple(engine.tp.global_shape(s.param))
        out.append(ParamEntry(
            name=known_as[0], aliases=tuple(known_as[1:]), shape=shape,
            param=s.param if s is not None else p, bucket=b, slot=s,
            trainable=b.requires_grad if b is not None else p.requires_grad,
        ))
    return out


def bucket_view(engine: Engine, entry: ParamEntry, t: torch.Tensor) -> torch.Tensor:
    """What DCP writes and reads for ``entry`` given its bucket's tensor ``t`` (master, a
    state tensor, stage 3's frozen ``shard16``): a view of ``t``, so a load lands in place.

    A DTensor of the parameter's global shape over this rank's ``Shard(0)`` piece (stages
    >= 1), or the whole parameter (stage 0; a DTensor on the tp mesh under tensor
    parallelism). See [Note: checkpoint layout].
    """
    b, s = entry.bucket, entry.slot
    assert b is not None and s is not None
    i = b.slots.index(s)
    if b.world == 1:
        return _on_tp_mesh(engine, s, b.slot_view(t, i))
    return _piece_dtensor(engine, s, b.local(t, i))


def weights_view(engine: Engine, entry: ParamEntry) -> torch.Tensor:
    """What DCP writes and reads for ``entry``'s weights: :func:`bucket_view` of the
    bucket's master weights (stage 3's frozen ``shard16``), which may live inside ``full``
    (see [Note: masters inside the weights] in engine/chunks.py; each rank's piece is
    contiguous there, so DCP reads and writes it in place). A frozen parameter kept whole
    outside buckets (stages 0-2): the parameter itself (a DTensor on the tp mesh if
    tensor-parallel), written once."""
    b, s = entry.bucket, entry.slot
    if b is None or s is None:
        return entry.param.detach()
    if not b.master_in_full:
        return bucket_view(engine, entry, b.master.detach() if b.master is not None else b.shard16)
    if b.world == 1:
        return bucket_view(engine, entry, b.full)
    n = s.rows_of(b.rank) * s.row
    local = b.master_range(s.shard_offset, s.shard_offset + n).view(s.local_shape(b.rank))
    return _piece_dtensor(engine, s, local)


def _piece_dtensor(engine: Engine, s: FlatParam, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's piece) as the DTensor the user parameter is, in its dtype."""
    spec = s.spec
    return dtensor(local, make_spec(spec.mesh, spec.placements, spec.shape, local.dtype))


def _on_tp_mesh(engine: Engine, s: FlatParam, whole: torch.Tensor) -> torch.Tensor:
    """A whole (stage 0) parameter: under tensor parallelism this rank's tp piece is a
    DTensor on the tp mesh; otherwise the tensor itself (the same on every rank)."""
    spec = s.tp  # its tp placement (None without tensor parallelism)
    if spec is None or not spec.sharded:
        return whole
    return dtensor(whole, make_spec(spec.mesh, (spec.placement,), spec.shape, whole.dtype))


def rng_table(engine: Engine, row: torch.Tensor) -> torch.Tensor:
    """This rank's row of a ``[size, L]`` table over the checkpoint group (rng.py): a
    DTensor ``Shard(0)`` whose piece on group rank r is row r."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    group, _, size, _, _ = checkpoint_group(engine)
    mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD,
                                 engine.device.type)
    local = row.reshape(1, -1)
    return dtensor(local, make_spec(mesh, (Shard(0),), torch.Size([size, local.shape[1]]),
                                    local.dtype))


def read_v1(reader, metadata, targets: dict[str, torch.Tensor], shapes: dict[str, tuple]) -> None:
    """Load version-1 tensors (flattened whole, stored in 1-D pieces) into ``targets``
    (this layout's views, above): each rank reads each whole tensor on its own
    (``no_dist``: DCP in one process, reading only that key's chunks), one at a time, and
    copies its piece. Memory: the largest tensor, once. ``shapes``: each key's global
    shape."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for key, target in targets.items():
        md = metadata.state_dict_metadata[key]
        whole = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        with quiet():
            dcp.load({key: whole}, storage_reader=reader, no_dist=True)
        whole = whole.view(shapes[key])
        if isinstance(target, DTensor):
            # the piece DCP itself would place there (its planner calls the same function)
            sizes, offsets = compute_local_shape_and_global_offset(
                target.shape, target.device_mesh, target.placements)
            piece = whole[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
            target.to_local().copy_(piece)
        else:
            target.copy_(whole.view(target.shape))
