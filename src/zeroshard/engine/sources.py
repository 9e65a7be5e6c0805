"""What the engine holds, read by others: its tensors by memory category (the tracker),
and the whole master weights of a bucket (state dicts, checkpoints)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..comm import Comm
from .flat import FlatBucket
from .policy import StagePolicy
from .step_grads import StepGrads
from .storage import shares
from .tied import TiedGrads

__all__ = ["memory_sources", "full_master", "gather_shard", "full_of"]


def memory_sources(all_buckets: list[FlatBucket], frozen: list[nn.Parameter],
                   tied: TiedGrads, grads: StepGrads, by_unit: bool,
                   kv_cache: Callable[[], Any] = lambda: None,
                   residuals: Callable[[], list[torch.Tensor]] = list,
                   ) -> Callable[[], dict[str, list[torch.Tensor]]]:
    """Tensors by category, for the memory tracker (names match memory.Category);
    ``kv_cache()``: the key/value cache of the model's last forward, or None;
    ``residuals()``: quantised gradients' error feedback (quantized_grads.py)."""

    def sources() -> dict[str, list[torch.Tensor]]:
        params, grad, optim = [], [], []
        for b in all_buckets:
            params += [t for t in (b.full, b.shard16, b.host.weights, b.secondary)
                       if t is not None]
            grad += [t for t in (b.grad, b.reduction.shard, b.host.grad) if t is not None]
            if b.master_grad is not None:
                grad.append(b.master_grad)
            if b.master is None:
                continue
            if not shares(b.master, b.full) and not (
                b.shard16 is not None and shares(b.master, b.shard16)
            ):
                optim.append(b.master)
        params += frozen
        if by_unit:  # stage 3: gradients autograd left on a unit until its _fold
            grad += [s.param.grad for b in all_buckets if b.requires_grad for s in b.slots
                     if s.param.grad is not None]
        # A tied parameter's parts held until its other uses deliver (tied.py).
        grad += tied.held_grads()
        grad += residuals()
        # Stage 3's all-gathers in flight (gathered layout, before the copy-out; on gloo
        # the other ranks' slices only, see Comm.all_gather_from).
        comm = [b.gathering for b in all_buckets if b.gathering is not None]
        # The per-parameter "got a gradient" flags: bookkeeping, whenever first seen.
        other = [b.marks.used for b in all_buckets if b.marks.used is not None]
        used = grads.used_flags
        other += [used] if used is not None else []
        return {"params": params, "grads": grad, "optim": optim, "comm": comm,
                "other": other, "kv_cache": cache_tensors(kv_cache())}

    return sources


def cache_tensors(cache: Any, depth: int = 3) -> list[torch.Tensor]:
    """The tensors a key/value cache holds: Hugging Face's ``Cache`` classes (their
    ``layers``' keys, values and any other state), or nested lists, tuples and dicts of
    tensors; nothing for what it does not recognise."""
    if cache is None or depth < 0:
        return []
    if isinstance(cache, torch.Tensor):
        return [cache]
    if isinstance(cache, (list, tuple)):
        return [t for c in cache for t in cache_tensors(c, depth - 1)]
    if isinstance(cache, dict):
        return [t for c in cache.values() for t in cache_tensors(c, depth - 1)]
    layers = getattr(cache, "layers", None)
    if isinstance(layers, (list, tuple)):
        return [t for layer in layers for v in getattr(layer, "__dict__", {}).values()
                if not isinstance(v, nn.Module) for t in cache_tensors(v, depth - 1)]
    return [t for v in getattr(cache, "__dict__", {}).values()
            if isinstance(v, (torch.Tensor, list, tuple)) for t in cache_tensors(v, depth - 1)]


def full_master(policy: StagePolicy, comm: Comm, b: FlatBucket) -> torch.Tensor:
    """The whole master-precision weights of a bucket in the full layout, every rank.

    Collective at stages >= 1 unless the compute weights are the master values
    (stages 1-2 without mixed precision).
    """
    if not policy.shard_optimizer:
        return b.master.detach()
    if b.master_in_full:
        return b.full  # the masters are the weights' own chunks: whole and current
    src = (b.master if b.master is not None else b.shard16).detach()
    return gather_shard(comm, b, src, phase="state")


def gather_shard(comm: Comm, b: FlatBucket, shard: torch.Tensor, *, phase: str
                 ) -> torch.Tensor:
    """Every rank's ``shard`` (shard layout, any dtype) as one full-layout tensor."""
    # Offloaded slices are on the host; collectives run on the device (NCCL needs it).
    gathered = torch.empty(b.padded_numel, dtype=shard.dtype, device=b.device)
    comm.all_gather_into(gathered, shard.to(b.device), phase=phase, unit=b.name)
    return full_of(b, gathered)


def full_of(b: FlatBucket, gathered: torch.Tensor) -> torch.Tensor:
    """A gathered-layout tensor (``world`` rows of shards) in the full layout."""
    if b.world == 1:
        return gathered
    full = torch.empty_like(gathered)
    b.gathered_to_full(gathered, full)
    return full
