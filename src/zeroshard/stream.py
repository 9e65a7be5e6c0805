"""Whole weights streamed out of a sharded model, one bucket at a time: what an RL loop
pushes into an inference engine after every step (vLLM's ``load_weights(iterator)``).

``full_state_dict`` holds the whole model at once (~2.3x the model per rank at stage 3,
measured); a ``p.full_tensor()`` loop stays bounded but issues one collective per tensor.
:func:`stream_weights` gathers each bucket (a stage-3 unit: one or two buckets, by dtype
and trainability) in one collective and yields its tensors before gathering the next, so
the extra memory is about one unit, however large the model.

[Note: streaming memory]
On gloo (``Comm.decompose``) a bucket's pieces are broadcast straight into place in a
parameter-major buffer: one unit's bytes, no copy. Elsewhere (NCCL) the all-gather lands
rank-major and each tensor is copied out as it is yielded: one unit plus one tensor.
The tensors yielded are views of that buffer (or those copies): nothing is freed under
the caller, and a caller that keeps them all keeps the whole model, as it asked. A unit's
buffer is freed when the caller lets go of its tensors and the collective's worker thread
of it: gloo's lets go a moment after the collective completes, so on a loaded machine the
next unit's buffer may be allocated first — two units' bytes for an instant.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .engine.buffers import ignored_buffers, rank0_copies
from .engine.engine import engine_of
from .engine.flat import FlatBucket

__all__ = ["stream_weights"]


def _source(engine: Any, b: FlatBucket) -> tuple[torch.Tensor, bool]:
    """The bucket's master values: (this rank's shard, True) to gather, or (the whole
    full-layout tensor, False) where every rank holds them whole already."""
    if not engine.policy.shard_optimizer:
        return b.master.detach(), False  # stage 0
    if b.master_in_full:
        return b.full, False  # the masters are the weights' own chunks: whole and current
    return (b.master if b.master is not None else b.shard16).detach(), True


@torch.no_grad()
def _gathered(engine: Any, b: FlatBucket, dtype: torch.dtype | None
              ) -> Iterator[tuple[Any, torch.Tensor]]:
    """(slot, whole tensor) for each parameter of ``b``, after one collective."""
    src, sharded = _source(engine, b)
    if dtype is not None:
        src = src.to(dtype)  # cast first: fewer bytes on the wire
    if not sharded or b.world == 1:  # whole already: a copy, not a view of live weights
        for s in b.slots:
            yield s, src[s.offset : s.offset + s.numel].view(s.shape).clone()
        return
    comm = engine.comm
    src = src.to(b.device)  # offloaded masters are on the host; collectives on the device
    if comm.decompose:  # see [Note: streaming memory]
        full = torch.empty(b.padded_numel, dtype=src.dtype, device=b.device)
        b.shard_to_full(src, full)
        comm.all_gather_pieces(full, b.rank_pieces(full), phase="state", unit=b.name).wait()
        for s in b.slots:
            yield s, full[s.offset : s.offset + s.numel].view(s.shape)
        return
    gathered = torch.empty(b.padded_numel, dtype=src.dtype, device=b.device)
    b.shard_of(gathered).copy_(src)
    comm.all_gather(gathered, phase="state", unit=b.name).wait()
    for i, s in enumerate(b.slots):
        region = b.grad_region(gathered, i)  # its N chunks, rank-major: one copy
        yield s, region.reshape(-1)[: s.numel].view(s.shape)


def stream_weights(model: nn.Module, *, dtype: torch.dtype | None = None,
                   to_rank: int | None = None, buffers: bool = True
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, whole tensor)`` for every parameter (and buffer) of a sharded model, one
    collective per bucket — per unit at stage 3 — with about one unit's bytes alive at a
    time ([Note: streaming memory]). Names are the model's ``state_dict()`` keys (both
    names of a tied weight, as it gives both; Hugging Face's names for HF models), in
    bucket order; values are the fp32 masters' (the exact values being trained), in
    ``dtype`` if given (cast before the collective), else in each parameter's dtype as
    built. Buffers are rank 0's, as ``full_state_dict`` gives them.

    A collective: every rank iterates it to the end. With ``to_rank`` only that rank
    gets tensors (the others' iterations are empty but still take part). Tensor
    parallelism is refused (use ``zeroshard.full_state_dict``)."""
    engine = engine_of(model)
    if engine.tp is not None:
        raise NotImplementedError(
            "stream_weights() under tensor parallelism: each tp piece would need a tp "
            "collective per tensor; use zeroshard.full_state_dict(model) (or p.full_tensor() "
            "per parameter) there")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype={dtype!r} is not a torch.dtype; pass e.g. torch.bfloat16")
    if to_rank is not None and (isinstance(to_rank, bool) or not isinstance(to_rank, int)):
        raise TypeError(f"to_rank={to_rank!r} is not a rank; pass an int (e.g. to_rank=0) "
                        "or None (every rank gets the tensors)")
    if to_rank is not None and not 0 <= to_rank < engine.world.size:
        raise ValueError(f"to_rank={to_rank} is not a rank of the model's group "
                         f"(0..{engine.world.size - 1})")
    return _stream(model, engine, dtype, to_rank, buffers)


def _stream(model: nn.Module, engine: Any, dtype: torch.dtype | None,
            to_rank: int | None, buffers: bool) -> Iterator[tuple[str, torch.Tensor]]:
    engine.world.sync_point("stream_weights")
    mine = to_rank is None or engine.world.rank == to_rank
    done: set[str] = set()
    for b in engine.all_buckets:
        for s, t in _gathered(engine, b, dtype):
            out = t if dtype is not None else t.to(engine.orig_dtype.get(s.names[0], t.dtype))
            done.update(s.names)
            if mine:
                for name in s.names:
                    yield name, out
        t = out = None  # the last views hold this bucket's buffer: not beside the next one
    rest = {k: t for k, t in nn.Module.state_dict(model, keep_vars=True).items()
            if k not in done}
    found = set(model.buffers())
    ignored = ignored_buffers(model)
    out = {k: t for k, t in rest.items() if t not in found}  # parameters kept whole
    if buffers:  # rank 0's (a broadcast), those kept out of DDP's broadcast each rank's
        out.update(rank0_copies({k: t for k, t in rest.items()
                                 if t in found and k not in ignored}, engine.world))
        out.update({k: t for k, t in rest.items() if t in found and k in ignored})
    for k, t in out.items():
        t = t.detach().clone()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if mine:
            yield k, t
