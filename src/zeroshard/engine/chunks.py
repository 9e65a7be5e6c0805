"""Optimizer chunks: what the torch optimizer steps, and the flat view of its state.

[Note: optimizer chunks]
Each bucket's master (1-D, what the optimizer updates) in CPU memory is handed to the
torch optimizer as views of at most ``CHUNK`` elements (``nn.Parameter`` objects sharing
its memory), not as one tensor. Torch's single-tensor optimizers (AdamW's default on CPU)
make several passes over each tensor; over a multi-million-element master every pass
streams from memory, over 256K-element chunks the passes stay in cache. gpt2-small's
25.5M elements, AdamW, 2 threads, median of 7 interleaved: 4 flat buckets 82.5 ms, per
parameter (as DDP sees them) 36.1 ms, 256K chunks 30.1 ms, 1M chunks 38.8 ms. The update
is elementwise, so the result is bitwise the same however the master is cut. CUDA
masters and traces (fake tensors) are cut at parameter-group boundaries only: in the
accounting the one difference is AdamW's 4-byte ``step`` per chunk.

The optimizer creates its state per chunk. After each step ``flatten_state`` re-points
every per-element state tensor at a view of one master-shaped buffer per state key and
bucket (after the first step it copies, one key of one bucket at a time: a transient of
that much memory; then it finds the views in place and does nothing), so checkpoints,
``full_optimizer_state`` and the unused-parameter restore read one tensor per key
(``bucket_state``). Torch's optimizers update their state in place, so the views stay
live. Scalar state (AdamW's ``step``) stays one tensor per chunk: the optimizer
increments each one.

[Note: masters inside the weights]
Stages 1-2 without mixed precision and without offload keep no master of their own: the
weights the model computes with are already in the master dtype, and this rank's chunk
of every parameter is a contiguous range of ``full`` (see [Note: flat buckets]). The
chunks the optimizer steps are views of those ranges (cut at parameter boundaries too,
since the shard as a whole is not contiguous in ``full``), so the step updates this
rank's weights in place — as ZeroRedundancyOptimizer does, and as the ZeRO paper counts
fp32 Adam (K = 8: no weights beyond the model's) — and the post-step all-gather takes
its input from them (``Engine.refresh_weights``). This saves 4Ψ/N bytes per rank.
Gradients and optimizer state keep the shard layout (``master_grad``, ``flat_state``);
code that reads or writes a range of the masters goes through ``master_range`` (one
parameter's chunk at a time: the shard as a whole is not contiguous in ``full``), and
checkpoints through ``state/layout.py: weights_views``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from .flat import FlatBucket

__all__ = ["CHUNK", "make_chunks", "set_master_grad", "bucket_state", "flatten_state",
           "set_bucket_state"]

CHUNK = 2**18


def make_chunks(b: FlatBucket, group_of: dict[str, int] | None = None) -> None:
    """Cut ``b.master`` into ``b.chunks``: parameters viewing consecutive ranges of it.

    With optimizer parameter groups (``group_of``: parameter name -> group index, 0 for
    any name not in it) a chunk never spans two groups, so each chunk joins its group
    (``b.chunk_groups``); the bucket's padding goes with its last parameter.
    """
    data = b.master.detach() if b.master is not None else b.full
    n = b.shard_numel
    runs = _group_runs(b, n, group_of or {})
    if b.master is None:  # views of ``full``: never across a parameter's chunk
        runs = _split_at_slots(b, runs)
    # Cutting by size helps only CPU masters (cache); a CUDA optimizer (foreach, fused)
    # gains nothing and a trace (fake tensors, memory/traced.py) would pay ~20 dispatched
    # ops per chunk and step: there, masters are cut at group boundaries only.
    size = CHUNK if data.device.type == "cpu" and not is_fake(data) else n
    b.chunk_ranges, b.chunk_groups = [], []
    for a, z, g in runs:
        for lo in range(a, z, size):
            b.chunk_ranges.append((lo, min(lo + size, z)))
            b.chunk_groups.append(g)
    b.chunks = [_chunk(b, lo, hi) for lo, hi in b.chunk_ranges]


def _chunk(b: FlatBucket, lo: int, hi: int) -> nn.Parameter:
    if b.master is not None:
        return nn.Parameter(b.master.detach()[lo:hi])
    # ``.data`` aliases the memory without sharing ``full``'s version counter (see
    # FlatBucket.replace_meta_params): the step's in-place update must not look to
    # autograd like a change of the compute weights' base.
    c = nn.Parameter(torch.empty(0, dtype=b.full.dtype, device=b.full.device))
    c.data = b.master_range(lo, hi)
    return c


def _split_at_slots(b: FlatBucket, runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    cuts = sorted({s.shard_offset for s in b.slots} | {s.shard_offset + s.chunk for s in b.slots})
    out = []
    for a, z, g in runs:
        inner = [c for c in cuts if a < c < z]
        for lo, hi in zip([a, *inner], [*inner, z]):
            out.append((lo, hi, g))
    return out


def _group_runs(b: FlatBucket, n: int, group_of: dict[str, int]) -> list[tuple[int, int, int]]:
    """Maximal ranges ``(lo, hi, group)`` of the master (this rank's shard; at stage 0 the
    whole bucket, a one-rank shard) whose parameters share a group; together they cover
    ``[0, n)``. Each parameter's chunk, padding included, goes with its group."""
    runs: list[tuple[int, int, int]] = []
    for s in b.slots:
        a, z = s.shard_offset, s.shard_offset + s.chunk
        if a >= z:
            continue
        g = group_of.get(s.names[0], 0)
        if runs and runs[-1][2] == g:
            runs[-1] = (runs[-1][0], z, g)
        else:
            runs.append((a, z, g))
    if not runs:  # a slice of padding only
        return [(0, n, 0)]
    runs[0] = (0, *runs[0][1:])  # slots are contiguous: only the padding tail is missing
    runs[-1] = (runs[-1][0], n, runs[-1][2])
    return runs


def set_master_grad(b: FlatBucket, grad: torch.Tensor | None) -> None:
    """``b.master_grad`` (also ``b.master.grad``) and, as views of it, each chunk's
    gradient."""
    b.master_grad = grad
    if b.master is not None:
        b.master.grad = grad
    for c, (lo, hi) in zip(b.chunks, b.chunk_ranges):
        c.grad = None if grad is None else grad[lo:hi]


def _per_element(value: Any, chunk: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == chunk.shape


def _keys(state: dict, b: FlatBucket) -> tuple[list[str], list[str]]:
    """(per-element keys, other keys) over all the bucket's chunks, in first-seen order.
    Chunks of different parameter groups can hold different keys (SGD keeps no momentum
    buffer for a group with momentum=0; Adam a max_exp_avg_sq only where amsgrad)."""
    per, other = {}, {}
    for c in b.chunks:
        for k, v in state.get(c, {}).items():
            (per if _per_element(v, c) else other).setdefault(k, None)
    return list(per), [k for k in other if k not in per]


def flatten_state(state: dict, b: FlatBucket) -> None:
    """Point each chunk's per-element state at a view of one flat buffer per key (no-op
    when it already is, or when the optimizer has no state for the bucket yet). A chunk
    without a key the others have gets zeros in the flat buffer and keeps not having it."""
    keys, _ = _keys(state, b)
    if all(k in b.flat_views and all(
            state.get(c, {}).get(k, view) is view for c, view in zip(b.chunks, b.flat_views[k]))
            for k in keys):
        return  # already views of the flat buffers
    b.flat_state, b.flat_views = {}, {}
    for k in keys:  # one key at a time: the chunks' old tensors go as the flat one comes
        have = [state.get(c, {}).get(k) for c in b.chunks]
        v0 = next(v for v in have if v is not None)
        if len(b.chunks) == 1:  # the chunk's own tensor is the flat buffer: no copy
            b.flat_state[k], b.flat_views[k] = v0, (v0,)
            continue
        flat = torch.zeros(b.shard_numel, dtype=v0.dtype, device=v0.device)
        views = tuple(flat[lo:hi] for lo, hi in b.chunk_ranges)
        for c, view, v in zip(b.chunks, views, have):
            if v is not None:
                view.copy_(v)
                state[c][k] = view
        b.flat_state[k], b.flat_views[k] = flat, views


def bucket_state(state: dict, b: FlatBucket) -> dict[str, Any]:
    """The bucket's state as one dict: per-element keys as master-shaped tensors (the flat
    buffers), scalar keys as the first chunk's. Empty before the first step."""
    keys, scalars = _keys(state, b)
    if not keys and not scalars:
        return {}
    flatten_state(state, b)
    out: dict[str, Any] = {k: b.flat_state[k] for k in keys}
    for k in scalars:  # the first chunk's that has it (all chunks step together)
        out[k] = next(state[c][k] for c in b.chunks if k in state.get(c, {}))
    return out


def set_bucket_state(state: dict, b: FlatBucket, values: dict[str, Any]) -> None:
    """Give every chunk its part of ``values``: master-shaped tensors become the flat
    buffers (sliced, as views), scalars are copied per chunk, since the optimizer updates
    each chunk's own in place. Empty ``values`` clears the bucket's state."""
    for c in b.chunks:
        state.pop(c, None)
    b.flat_state = {k: v for k, v in values.items()
                    if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape == (b.shard_numel,)}
    b.flat_views = {k: tuple(f[lo:hi] for lo, hi in b.chunk_ranges)
                    for k, f in b.flat_state.items()}
    if not values:
        return
    for i, c in enumerate(b.chunks):
        state[c] = {k: b.flat_views[k][i] if k in b.flat_state
                    else v.clone() if isinstance(v, torch.Tensor) and i > 0 else v
                    for k, v in values.items()}
