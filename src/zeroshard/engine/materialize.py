"""Set-up: the model's parameters cut into buckets, and each bucket's buffers allocated.

Runs once, in :class:`~zeroshard.engine.engine.Engine`'s constructor: it reads the
engine's configuration (stage policy, dtypes, communicators, offload) and leaves every
bucket with the buffers [Note: buffer lifetimes] in engine.py lists for the time between
steps — ``full`` (stage 3: only its slice ``shard16``), ``master``, the optimizer's
chunks — and the compute parameters pointing into ``full``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import Comm
from ..config import ShardConfig, auto_bucket_bytes
from .chunks import make_chunks
from .flat import FlatBucket, cut_buckets
from .offload import Offload
from .policy import StagePolicy
from .units import Unit, UnitSpec, build_units, iter_buckets

ParamInit = Callable[[nn.Module, list[str]], None]

__all__ = ["ParamInit", "Build", "named_params", "check_shardable", "cut_layout",
           "materialize", "user_mesh", "placements"]


@dataclass(frozen=True)
class Build:
    """What allocating a bucket's buffers reads of the engine's configuration."""

    model: nn.Module
    world: Comm  # rank 0's weights are broadcast over it
    device: torch.device
    policy: StagePolicy
    compute_dtype: torch.dtype | None
    offloader: Offload
    tensor_parallel: bool
    group_of: dict[str, int]  # optimizer parameter group by parameter name


def named_params(model: nn.Module) -> list[tuple[tuple[str, ...], nn.Parameter]]:
    """Unique parameters in registration order, each with every name it is known by."""
    names: dict[nn.Parameter, list[str]] = {}  # in order of first appearance
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    return [(tuple(n), p) for p, n in names.items()]


def check_shardable(named: list[tuple[tuple[str, ...], nn.Parameter]],
                    policy: StagePolicy) -> None:
    """Stages >= 1 cut parameters along dim 0 (see [Note: flat buckets]); a 0-dim one has
    no dim 0, and no DTensor can shard it."""
    for names, p in named:
        sharded = policy.shard_params or (policy.shard_optimizer and p.requires_grad)
        if sharded and p.dim() == 0:
            raise ValueError(
                f"parameter {names[0]!r} is 0-dimensional; stages 1-3 shard each parameter "
                "along dim 0, which a scalar does not have. Give it shape (1,) (e.g. "
                "nn.Parameter(torch.ones(1)) and index [0] where it is used), or use stage 0")


def cut_layout(model: nn.Module, named: list[tuple[tuple[str, ...], nn.Parameter]], *,
               config: ShardConfig, policy: StagePolicy, comm: Comm, units: UnitSpec
               ) -> tuple[list[Unit], list[FlatBucket], list[nn.Parameter]]:
    """The units (stage 3), every bucket, and the frozen parameters left out of buckets
    (stages 0-2; stage 3 keeps frozen ones in frozen buckets of their unit)."""
    if policy.units_by_module:
        built = build_units(model, units, comm.size, comm.rank)
        return built, list(iter_buckets(built)), []
    frozen = [p for _, p in named if not p.requires_grad]
    trainable = [(n, p) for n, p in named if p.requires_grad]
    # Reverse registration order approximates the order backward produces grads.
    # Stage 0 shards nothing: its layout is that of one rank (no padding, and the
    # gathered and full layouts coincide, see [Note: flat buckets]).
    world, rank = (comm.size, comm.rank) if policy.shard_optimizer else (1, 0)
    itemsize = (config.compute_dtype or torch.float32).itemsize
    bucket = config.bucket_bytes or auto_bucket_bytes(
        sum(p.numel() for _, p in trainable) * itemsize,
        keep_full_grads=policy.keep_full_grads)
    return [], cut_buckets(list(reversed(trainable)), bucket, world, rank), frozen


def materialize(e: Build, b: FlatBucket, param_init: ParamInit | None) -> None:
    """Allocate a bucket's buffers (see [Note: buffer lifetimes] in engine.py).

    Every rank starts from rank 0's weights, as DDP does, except for a model built on
    the meta device: its bucket is initialised here by ``param_init`` — a function of
    (seed, name), identical on every rank — and only the slice is kept, so no rank
    ever holds more than one whole unit.
    """
    if param_init is not None:
        flat = torch.zeros(b.padded_numel, dtype=b.dtype, device=e.device)
        b.device = flat.device
        b.replace_meta_params(e.model, flat)
        with torch.no_grad():
            param_init(e.model, [s.names[0] for s in b.slots])
    else:
        flat = b.flatten()
        e.world.broadcast(flat, 0, phase="init", unit=b.name)
    compute = e.compute_dtype or b.dtype
    full = flat if compute == flat.dtype else flat.to(compute)
    b.full = full
    b.point_params_at(full)
    if e.policy.shard_params:
        _materialize_sharded(e, b, flat)
        return
    # Under tensor parallelism the user parameters are DTensors on the whole mesh over
    # a master of their own (params.py), so the masters are not the weights' chunks.
    if (e.policy.shard_optimizer and not e.offloader.enabled and e.compute_dtype is None
            and not e.tensor_parallel):
        b.master_in_full = True  # see [Note: masters inside the weights] in chunks.py
        make_chunks(b, e.group_of)
        return
    if e.policy.shard_optimizer:
        master_src = b.shard_from_full(flat)  # only the slice stays alive
        if e.compute_dtype is not None:
            master_src = master_src.float()
    else:
        master_src = flat if e.compute_dtype is None else flat.float()
    b.master = nn.Parameter(_on_host(e, master_src))
    make_chunks(b, e.group_of)
    # Gradient buffers are allocated by the first gradient of a backward and freed by
    # zero_grad(set_to_none=True): see [Note: buffer lifetimes] in engine.py.


def _on_host(e: Build, t: torch.Tensor) -> torch.Tensor:
    """With offload, a pinned host copy of ``t``; otherwise ``t`` itself."""
    return e.offloader.to_host(t) if e.offloader.enabled else t


def _materialize_sharded(e: Build, b: FlatBucket, flat: torch.Tensor) -> None:
    """Stage 3: keep the slices; free the whole buffer's storage."""
    if b.requires_grad:
        src = b.shard_from_full(flat)
        master = src.float() if e.compute_dtype else src
        b.master = nn.Parameter(_on_host(e, master))
        make_chunks(b, e.group_of)
    params_on_host = e.offloader.params
    if b.master is not None and b.master.dtype == b.full.dtype and (
        params_on_host or not e.offloader.enabled
    ):
        b.shard16 = b.master.detach()  # fp32 without mixed precision: one copy only
    elif params_on_host:
        b.shard16 = e.offloader.to_host(b.shard_from_full(b.full))
    else:
        b.shard16 = b.shard_from_full(b.full)
    # Compute parameters stay views of ``full``; between uses the modules hold the
    # user parameters (params.py), so nothing reads the freed storage.
    b.full.untyped_storage().resize_(0)


def user_mesh(comm: Comm, device: torch.device, mesh: Any):
    """The DeviceMesh the user parameters' DTensors live on: the sharding group, or
    with hybrid sharding the 2-D (replicate, shard) mesh."""
    if mesh is not None:
        return mesh
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    group = comm.group if comm.group is not None else dist.group.WORLD
    with unset_fake_temporarily():  # a trace (memory/traced.py) runs under fake mode
        return DeviceMesh.from_group(group, device.type)


def placements(replicate: Comm | None) -> tuple:
    from torch.distributed.tensor import Replicate, Shard

    if replicate is not None:
        return (Replicate(), Shard(0))
    return (Shard(0),)
