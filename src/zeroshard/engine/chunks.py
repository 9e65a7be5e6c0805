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
masters and traces (fake tensors) are cut at parameter boundaries only, not by size: in
the accounting the one difference is AdamW's 4-byte ``step`` per chunk.

A chunk never spans two parameters: each parameter's optimizer state is its own, as
under torch. A parameter that got no gradient on any rank (an expert no token reached)
is skipped by the step exactly as torch skips it — its chunks get no gradient, so the
optimizer leaves their values and state, AdamW's ``step`` included, untouched — and a
parameter's scalar state (``slot_scalars``) is that of its chunks. Every parameter has
chunks on every rank: its region of each rank's shard is ``chunk`` elements, padding
where it has fewer rows than ranks (see [Note: flat buckets]), so every rank steps (or
skips) it alike and holds its scalars. Cutting at parameter boundaries costs nothing
measurable: AdamW over gpt2-124m's shapes, 475 chunks of ≤256K across parameters vs 585
within them, median of 15, one thread: 448 vs 432 ms.

The optimizer creates its state per chunk. Where one tensor per state key and bucket is
needed — checkpoints, the torch-format state dict, ``full_optimizer_state``, all through
``bucket_state`` — ``flatten_state`` re-points every per-element state tensor at a view
of one master-shaped buffer per key (the first time it copies, one key of one bucket at a
time: a transient of that much memory; afterwards it finds the views in place and does
nothing). Not after each step: the first step would then hold that transient beside the
fresh state, where a step's peak can be (a trace of gpt2-tiny at stage 0 measured +1 MB
at its peak). Torch's optimizers update their state in place, so the views stay live.
Scalar state (AdamW's ``step``) stays one tensor per chunk: the optimizer increments
each one (or, for a skipped parameter, not).

[Note: masters inside the weights]
Stages 1-2 without mixed precision and without offload keep no master of their own: the
weights the model computes with are already in the master dtype, and this rank's chunk
of every parameter is a contiguous range of ``full`` (see [Note: flat buckets]). The
chunks the optimizer steps are views of those ranges (cut at parameter boundaries too,
since the shard as a whole is not contiguous in ``full``), so the step updates this
rank's weights in place — as ZeroRedundancyOptimizer does, and as the ZeRO paper counts
fp32 Adam (K = 8: no weights beyond the model's) — and the post-step all-gather takes
its input from them (``Engine.refresh_weights``). This saves 4Ψ/N bytes per rank.
Gradients and optimizer state keep the shard layout (``master_grad``, ``chunking.state``);
code that reads or writes a range of the masters goes through ``master_range`` (one
parameter's chunk at a time: the shard as a whole is not contiguous in ``full``), and
checkpoints through ``state/layout.py: weights_view``.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from .flat import FlatBucket

#: Held while a bucket's state is flattened and read: the main thread and the shard
#: server's thread may both ask for it at once.
_FLATTENING = threading.RLock()

__all__ = ["CHUNK", "make_chunks", "set_master_grad", "bucket_state", "flatten_state",
           "set_bucket_state", "slot_scalars", "skip_slots"]

CHUNK = 2**18


def make_chunks(b: FlatBucket, group_of: dict[str, int] | None = None) -> None:
    """Cut ``b.master`` into ``b.chunks``: parameters viewing consecutive ranges of it.

    With optimizer parameter groups (``group_of``: parameter name -> group index, 0 for
    any name not in it) a chunk never spans two groups, so each chunk joins its group
    (``b.chunking.groups``); the bucket's padding goes with its last parameter.
    """
    data = b.master.detach() if b.master is not None else b.full
    n = b.shard_numel
    # never across a parameter: its state is its own (see [Note: optimizer chunks]); and
    # views of ``full`` must not span two parameters' chunks anyway
    runs = _split_at_slots(b, _group_runs(b, n, group_of or {}))
    # Cutting by size helps only CPU masters (cache); a CUDA optimizer (foreach, fused)
    # gains nothing and a trace (fake tensors, memory/traced.py) would pay ~20 dispatched
    # ops per chunk and step: there, masters are cut at parameter boundaries only.
    size = CHUNK if data.device.type == "cpu" and not is_fake(data) else n
    b.chunking.ranges, b.chunking.groups = [], []
    for a, z, g in runs:
        for lo in range(a, z, size):
            b.chunking.ranges.append((lo, min(lo + size, z)))
            b.chunking.groups.append(g)
    b.chunks = [_chunk(b, lo, hi) for lo, hi in b.chunking.ranges]
    starts = [s.shard_offset for s in b.slots]
    # the slot each chunk belongs to (a chunk starting in the padding tail: the last)
    b.chunking.slot_of = [max(0, bisect.bisect_right(starts, lo) - 1) for lo, _ in b.chunking.ranges]


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
    for c, (lo, hi) in zip(b.chunks, b.chunking.ranges):
        c.grad = None if grad is None else grad[lo:hi]


def skip_slots(b: FlatBucket, slots: set[int]) -> None:
    """Take the gradient off the chunks of ``slots`` (indices into ``b.slots``): the
    optimizer's next step skips them, as torch skips a parameter whose ``grad`` is None
    (see [Note: optimizer chunks]). The next ``set_master_grad`` gives them one again."""
    for c, i in zip(b.chunks, b.chunking.slot_of):
        if i in slots:
            c.grad = None


def slot_scalars(state: dict, b: FlatBucket, i: int) -> dict[str, Any] | None:
    """Slot ``i``'s scalar optimizer state (AdamW's ``step``): its first chunk's, as
    every chunk of a parameter steps together; None if the optimizer holds no state for
    it (never stepped: torch has no entry for such a parameter either)."""
    c = next((c for c, j in zip(b.chunks, b.chunking.slot_of) if j == i), None)
    st = state.get(c) if c is not None else None
    if not st:
        return None
    return {k: v for k, v in st.items() if not _per_element(v, c)}


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
    if all(k in b.chunking.views and all(
            state.get(c, {}).get(k, view) is view for c, view in zip(b.chunks, b.chunking.views[k]))
            for k in keys):
        return  # already views of the flat buffers
    b.chunking.state, b.chunking.views = {}, {}
    for k in keys:  # one key at a time: the chunks' old tensors go as the flat one comes
        have = [state.get(c, {}).get(k) for c in b.chunks]
        v0 = next(v for v in have if v is not None)
        if len(b.chunks) == 1:  # the chunk's own tensor is the flat buffer: no copy
            b.chunking.state[k], b.chunking.views[k] = v0, (v0,)
            continue
        flat = torch.zeros(b.shard_numel, dtype=v0.dtype, device=v0.device)
        views = tuple(flat[lo:hi] for lo, hi in b.chunking.ranges)
        for c, view, v in zip(b.chunks, views, have):
            if v is not None:
                view.copy_(v)
                state[c][k] = view
        b.chunking.state[k], b.chunking.views[k] = flat, views


def bucket_state(state: dict, b: FlatBucket) -> dict[str, Any]:
    """The bucket's state as one dict: per-element keys as master-shaped tensors (the flat
    buffers), scalar keys as the first chunk's. Empty before the first step."""
    with _FLATTENING:  # the shard server's thread reads it too ([Note: state dicts served])
        keys, scalars = _keys(state, b)
        if not keys and not scalars:
            return {}
        flatten_state(state, b)
        out: dict[str, Any] = {k: b.chunking.state[k] for k in keys}
        for k in scalars:  # the first chunk's that has it (all chunks step together)
            out[k] = next(state[c][k] for c in b.chunks if k in state.get(c, {}))
        return out


def set_bucket_state(state: dict, b: FlatBucket, values: dict[str, Any],
                     scalars: list[dict[str, Any] | None] | None = None) -> None:
    """Give every chunk its part of ``values``: master-shaped tensors become the flat
    buffers (sliced, as views). Scalars are per slot (``scalars[i]`` for slot ``i``; None
    there: the slot's chunks get no state at all, as a parameter torch never stepped),
    else the scalars in ``values`` for every slot; copied per chunk, since the optimizer
    updates each chunk's own in place. Empty ``values``: no state for the bucket."""
    for c in b.chunks:
        state.pop(c, None)
    per = {k: v for k, v in values.items()
           if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape == (b.shard_numel,)}
    b.chunking.state = per
    b.chunking.views = {k: tuple(f[lo:hi] for lo, hi in b.chunking.ranges) for k, f in per.items()}
    if not values and scalars is None:
        return
    shared = {k: v for k, v in values.items() if k not in per}
    order = list(values)
    for j, (c, i) in enumerate(zip(b.chunks, b.chunking.slot_of)):
        own = shared if scalars is None else scalars[i]
        if own is None:
            continue
        # torch's optimizers create their scalars (step) before their tensors
        keys = [k for k in own if k not in values] + order
        state[c] = {k: b.chunking.views[k][j] if k in per
                    else _copy(own[k]) for k in keys if k in per or k in own}


def _copy(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v
