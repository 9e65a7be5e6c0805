"""Stage 3's secondary shard (ZeRO++'s hpZ, FSDP2's ``reshard_after_forward=<int>``).

[Note: the secondary shard]
With ``reshard_after_forward=k`` (a divisor of the shard group's N ranks, and of the node
size, so that k consecutive ranks share a node), a unit freed after its forward keeps a
*secondary shard*: of the N rank slices of each bucket (the gathered layout), group rank r
keeps those of ranks q with q ≡ r (mod k) — N/k slices, 1/k of the unit. The k consecutive
ranks of r's block (r - r % k, ..., r - r % k + k - 1) hold every slice between them, so
backward's all-gather runs inside that block (inside the node) instead of across all N:
the forward's all-gather is stage 3's, the backward's moves (k-1)/k of the unit over the
block. Memory: 1/k of the compute-dtype weights per rank, from a unit's forward to its
backward (Σ units = Ψ·bytes/k while backward has not begun).

The values are the forward's gathered weights, byte for byte, so a step is bitwise stage
3's. A secondary is never stale: it is built from the gathered weights at the end of the
unit's forward, dropped when the unit's backward is done, at the end of every backward,
at a step, and whenever the masters change (a load, an edit: ``drop_stale``); a backward
that finds none (a unit called twice, the second call's backward having dropped it) falls
back to the primary all-gather — correct, just not inside the node.

k = 1 keeps whole weights (``reshard_after_forward=False``) and k = N is the primary shard
(``True``): both are mapped to those, as the names say.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ..comm import Comm
from ..comm_links import Nodes
from .flat import FlatBucket

__all__ = ["resolve_reshard", "secondary_comm", "keep_secondary", "secondary_to_full"]


def resolve_reshard(value: bool | int, shard_size: int, nodes: Nodes, world: int) -> bool | int:
    """``reshard_after_forward`` as the engine runs it: True, False, or a k with
    1 < k < N dividing N and the node size ([Note: the secondary shard])."""
    if isinstance(value, bool):
        return value
    k = value
    size = nodes.size or world
    if k in (1, shard_size):
        mapped = k != 1
        keeps = "whole weights" if k == 1 else "the primary shard"
        choices = _choices(shard_size, size)
        warnings.warn(
            f"reshard_after_forward={k} keeps {keeps} (the shard group has {shard_size} "
            f"ranks): it runs as reshard_after_forward={mapped}, with no secondary shard"
            + (f"; a secondary shard needs k dividing both {shard_size} and "
               f"node_size={size}, 1 < k < {shard_size}: {choices}"
               if choices != "none" else ""),
            UserWarning, stacklevel=4)
        return mapped
    if shard_size % k or size % k:
        what = (f"does not divide the shard group of {shard_size} ranks" if shard_size % k
                else f"does not divide node_size={size} (a group of k consecutive ranks "
                "would span two nodes, and backward's all-gather would cross them)")
        raise ValueError(
            f"reshard_after_forward={k} {what}: the secondary shard lives on groups of k "
            f"consecutive ranks inside a node; choose k among {_choices(shard_size, size)} "
            "(dividing both the shard group and node_size), or True / False")
    return k


def _choices(shard_size: int, node_size: int) -> str:
    ks = [k for k in range(2, shard_size) if shard_size % k == 0 and node_size % k == 0]
    return ", ".join(map(str, ks)) or "none"


def secondary_comm(comm: Comm, k: int) -> Comm:
    """The k consecutive ranks of this rank's block of the shard group, as a Comm on the
    same ledger (label "secondary"). Only the block's members create it (local
    synchronisation), every block in the same order on all its ranks."""
    block = comm.rank // k * k
    ranks = comm.peers[block : block + k]
    group = dist.new_group(ranks, use_local_synchronization=True)
    return Comm(group, comm.ledger, label="secondary")


def keep_secondary(b: FlatBucket, k: int) -> None:
    """From the gathered weights in ``b.full``, keep this rank's secondary shard (the N/k
    rank slices q ≡ rank (mod k), in q order) in ``b.secondary``."""
    n, j = b.world, b.rank % k
    out = torch.empty(b.padded_numel // k, dtype=b.full.dtype, device=b.full.device)
    rows = out.view(n // k, b.shard_numel)
    dst, src = [], []
    for s in b.slots:
        dst.append(rows[:, s.shard_offset : s.shard_offset + s.chunk])
        src.append(b.full[s.offset : s.offset + n * s.chunk].view(n // k, k, s.chunk)[:, j])
    torch._foreach_copy_(dst, src)
    b.secondary = out


def secondary_to_full(b: FlatBucket, members: list[torch.Tensor], full: torch.Tensor) -> None:
    """The block's k secondaries (member j's holds rank slices q ≡ j (mod k)) into the
    parameter-major ``full``."""
    n, k = b.world, len(members)
    dst, src = [], []
    for j, m in enumerate(members):
        rows = m.view(n // k, b.shard_numel)
        for s in b.slots:
            dst.append(full[s.offset : s.offset + n * s.chunk].view(n // k, k, s.chunk)[:, j])
            src.append(rows[:, s.shard_offset : s.shard_offset + s.chunk])
    torch._foreach_copy_(dst, src)
