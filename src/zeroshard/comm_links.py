"""Which node each rank is on, and to which peer each byte of a collective goes.

[Note: bytes by link]
Between nodes the link is 4-16x slower than inside one, so the ledger splits each
collective's wire bytes (what this rank sends) into ``intra_wire_bytes`` (to ranks of its
own node) and ``inter_wire_bytes`` (to ranks of other nodes). Nodes are groups of
``node_size`` consecutive global ranks (torchrun numbers ranks node by node):
``shard(..., node_size=)``, by default torchrun's LOCAL_WORLD_SIZE, else the whole world
(one node). Any world may declare logical nodes (world 4 as 2 nodes x 2), so every
multi-node path runs in CPU tests.

The split follows the algorithm the backend really runs, peer by peer
(:func:`sends`, group ranks in the process group's order):

* gloo (read from gloo's sources and checked against the kernel's count of bytes each
  process writes to its sockets, ``tests/test_links.py``):
  - all-reduce, and reduce-scatter (which ProcessGroupGloo runs as an all-reduce): a ring
    to group rank ``r-1``, 2S(N-1)/N;
  - all-gather: a ring to ``r+1``, (N-1) x the input;
  - broadcast: a binomial tree from the root (the root sends log2(N) copies, the leaves
    none; N-1 copies in all);
  - reduce: a segmented ring reduce-scatter to ``r-1`` (spr segments of at most 1 MiB per
    rank, N·spr - 2 of them sent: (N-1)/N of the tensor when spr = 2, nearly all of it
    for a tensor of many MiB), then each non-root rank's chunk to the root.
* NCCL and the rest choose their algorithm at run time (ring or tree, channels laid out
  by topology); the ledger counts the ring in group-rank order (to ``r+1``: a ring crosses
  each node boundary once, as NCCL's inter-node rings do) and a broadcast as a chain
  from the root.
* all-to-all: what goes to each peer, exactly.

Summed over peers this is the record's ``wire_bytes``. On gloo, zeroshard issues an
all-gather as N broadcasts and a reduce-scatter as N reduces (see [Note: collectives per
backend] in comm.py): N broadcasts send S(N-1)/N per rank like a ring, but N reduces send
more (about S(N-1)/N + S(N-1)/N^2 for small slices, up to ~S + S(N-1)/N^2 for slices of
many MiB), which the wire bytes now show.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

__all__ = ["Nodes", "resolve_node_size", "sends", "sent_by"]

#: gloo's reduce splits its ring into segments of at most this many bytes (ReduceOptions).
GLOO_REDUCE_SEGMENT = 2**20


@dataclass(frozen=True)
class Nodes:
    """Nodes of ``size`` consecutive global ranks; ``size=None``: one node of every rank."""

    size: int | None = None

    @classmethod
    def single(cls) -> Nodes:
        return cls(None)

    def node_of(self, rank: int) -> int:
        return 0 if self.size is None else rank // self.size

    def count(self, world: int) -> int:
        return 1 if self.size is None else world // self.size


def resolve_node_size(node_size: int | None, world: int) -> int:
    """``node_size=`` as given, else torchrun's LOCAL_WORLD_SIZE, else ``world``; it must
    divide the world."""
    given = node_size is not None
    if not given:
        env = os.environ.get("LOCAL_WORLD_SIZE", "")
        node_size = int(env) if env.isdigit() and int(env) > 0 else world
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise ValueError(f"node_size={node_size!r} must be a positive int: the ranks per node")
    if world % node_size:
        where = "node_size" if given else "LOCAL_WORLD_SIZE (torchrun's ranks per node)"
        raise ValueError(
            f"{where}={node_size} does not divide the world of {world} ranks: nodes are "
            f"groups of node_size consecutive ranks; give node_size= a divisor of {world}")
    return node_size


#: The send model of each primitive on gloo and elsewhere. ProcessGroupGloo runs a
#: reduce-scatter as an all-reduce.
_ALGO = {
    "all_reduce": ("gloo_all_reduce", "ring_all_reduce"),
    "reduce_scatter": ("gloo_all_reduce", "ring"),
    "all_gather": ("gloo_all_gather", "ring"),
    "broadcast": ("gloo_broadcast", "chain"),
    "reduce": ("gloo_reduce", "chain"),
}


def sent_by(backend: str, prim: str, parts: list[tuple[int, int]], n: int, me: int,
            elem: int = 1) -> dict[int, int]:
    """Bytes group rank ``me`` sends to each peer for the primitives ``prim`` (a
    torch.distributed call) issued over ``parts`` ((bytes, root) each) on ``backend``."""
    algo = _ALGO[prim][0 if backend == "gloo" else 1]
    out: dict[int, int] = {}
    for nbytes, root in parts:
        for q, b in sends(algo, nbytes, n, me, root, elem):
            out[q] = out.get(q, 0) + b
    return out


@functools.lru_cache(maxsize=4096)
def sends(algo: str, nbytes: int, n: int, me: int, root: int = 0,
          elem: int = 1) -> tuple[tuple[int, int], ...]:
    """``(peer, bytes)`` for each peer group rank ``me`` of ``n`` sends to in one primitive
    ``algo`` over ``nbytes`` (the whole tensor's bytes; for a ring all-gather the gathered
    output's), see [Note: bytes by link]. Cached: the engine issues the same few shapes
    every step."""
    if n == 1 or nbytes == 0:
        return ()
    prev, nxt = (me - 1) % n, (me + 1) % n
    if algo == "gloo_all_reduce":
        return ((prev, 2 * nbytes * (n - 1) // n),)
    if algo == "ring_all_reduce":
        return ((nxt, 2 * nbytes * (n - 1) // n),)
    if algo in ("gloo_all_gather", "ring"):
        return ((nxt, nbytes * (n - 1) // n),)
    if algo == "gloo_broadcast":
        return tuple((peer, nbytes) for peer in _binomial_children(n, me, root))
    if algo == "chain":
        return () if (me - root) % n == n - 1 else ((nxt, nbytes),)
    if algo == "gloo_reduce":
        return _gloo_reduce(nbytes, n, me, root, elem)
    raise ValueError(f"no send model for {algo!r}")


def _binomial_children(n: int, me: int, root: int) -> list[int]:
    """The peers gloo's binomial-tree broadcast has ``me`` send to (gloo/broadcast.cc: in
    round i the virtual ranks with no bit set above i take part, those with bit i clear
    sending to their partner with it set)."""
    v = (me - root) % n
    dim = max(1, (n - 1).bit_length())
    mask = (1 << dim) - 1
    out = []
    for i in range(dim):
        mask ^= 1 << i
        partner = v ^ (1 << i)
        if v & mask or partner >= n or v & (1 << i):
            continue
        out.append((partner + root) % n)
    return out


def _gloo_reduce(nbytes: int, n: int, me: int, root: int,
                 elem: int) -> tuple[tuple[int, int], ...]:
    """gloo/reduce.cc: a ring reduce-scatter to ``me-1`` in segments of at most 1 MiB
    (N·spr - 2 sends of spr segments per rank, each cut at the tensor's end: the ring
    sends nearly the whole tensor once spr grows), then each non-root rank's chunk of spr
    segments to the root."""
    seg = _round_up(min(-(-nbytes // (2 * n)), GLOO_REDUCE_SEGMENT // elem * elem), elem)
    num = _round_up(max(-(-nbytes // seg), 2 * n), n)
    spr = num // n
    ring = sum(_in_range((((me + 1) * spr + i) * seg) % (num * seg), seg, nbytes)
               for i in range(num - 2))
    out = {(me - 1) % n: ring} if ring else {}
    if me != root:
        chunk = _in_range(me * spr * seg, spr * seg, nbytes)
        if chunk:
            out[root] = out.get(root, 0) + chunk
    return tuple(out.items())


def _in_range(offset: int, length: int, total: int) -> int:
    return max(0, min(length, total - offset))


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m
