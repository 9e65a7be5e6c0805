"""Stages 2-3's quantised gradient reduce-scatter (ZeRO++'s qgZ): ``quantize_grads=``.

[Note: quantised gradients]
With ``quantize_grads="int8" | "int4"`` and more than one node in the shard group, a
bucket's reduce-scatter becomes two hops of quantised all-to-alls, inside the node first:

* the shard group's N = M·g ranks are M nodes of g consecutive ranks; rank (m, l) is
  node m's l-th. Its reduced slice is slice m·g + l of the N.
* hop 1, inside the node: rank (m, l) sends node-peer l' the M slices that end on ranks
  (·, l') — the slices of every node's l'-th rank — quantised (blocks of 256, an fp32
  scale each, engine/quantize.py; int4 two values a byte). It keeps its own part exact,
  dequantises what it receives and sums in fp32: the node's partial sum of its M slices.
* hop 2, across nodes: it sends node m' the row of that partial for rank (m', l),
  requantised, and sums (fp32) its own row with the M-1 it receives: its slice, summed
  over all N ranks. The engine then divides by the data-parallel world as after any
  reduce-scatter (before, in fp16).

Each rank sends (g-1)/g of the bucket inside its node and (M-1)/(M·g) of it across
nodes, at 1 (int8) or 1/2 (int4) byte per element plus the scales, where a ring
reduce-scatter of bf16 sends (N-1)/N at 2 bytes, most of it across nodes.

**Error feedback** (``grad_error_feedback=True``; off by default): what quantising lost
is added back into the next step's gradient — hop 1's loss at the sender, per bucket and
rank, a float32 buffer of the whole bucket, and hop 2's, 1/g of it: 4Ψ(1 + 1/g) bytes
per rank beside the model (a whole fp32 gradient: at stage 3 over 64 ranks, 16 times
the rank's share of the model state — hence off unless asked), which the memory tracker
counts under "grads". Their sum is
what the reduced gradient misses, and checkpoints keep that sum ([Note: residuals in
checkpoints] in state/residuals.py).

One node in the shard group (``node_size`` ≥ the group, hybrid shard groups within a
node), or a bucket whose slices are under one block (256 elements): the plain
reduce-scatter, unquantised, as the ledger records it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..comm import Comm
from ..comm_links import Nodes
from .quantize import BLOCK, dequantize, packed_numel, quantize

__all__ = ["TwoHop", "two_hop_for"]


@dataclass
class _Residuals:
    """One bucket's error feedback: hop 1's (the whole bucket, fp32) and hop 2's (1/g)."""

    node: torch.Tensor | None = None
    across: torch.Tensor | None = None


@dataclass
class TwoHop:
    """The groups of the two hops and the residuals, for one shard group."""

    kind: str
    node: Comm  # the g ranks of this rank's node, in group order
    across: Comm  # the M ranks with this rank's position in their nodes
    error_feedback: bool = True
    residuals: dict[int, _Residuals] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.node.size * self.across.size

    def applies(self, buf: torch.Tensor) -> bool:
        """Quantise this bucket: slices of at least one block (else the plain path)."""
        return buf.numel() // self.world >= BLOCK

    def forget(self) -> None:
        """Drop every residual (a load through torch's state-dict APIs, which carry none:
        the next steps start from the loaded state), saying so where there were some."""
        if self.residuals:
            warnings.warn(
                "torch's state dicts carry no error-feedback residuals of quantize_grads: "
                "this load restarts them at zero (zeroshard.save_checkpoint / "
                "load_checkpoint keep them)", UserWarning, stacklevel=4)
        self.residuals.clear()

    def residual_of(self, key: int) -> _Residuals:
        return self.residuals.setdefault(key, _Residuals())

    def contribution(self, key: int, numel: int, device: torch.device) -> torch.Tensor:
        """What this rank's residuals of bucket ``key`` add to the next reduction, in the
        bucket's rank-major layout (``numel`` elements, float32): hop 1's where they lie,
        hop 2's rows at the slices of ranks (m', this rank's position in its node)."""
        out = torch.zeros(numel, dtype=torch.float32, device=device)
        res = self.residuals.get(key)
        if res is not None and res.node is not None:
            out += res.node
        if res is not None and res.across is not None:
            m_count = self.across.size
            out.view(m_count, self.node.size, -1)[:, self.node.rank] += \
                res.across.view(m_count, -1)
        return out

    def install(self, key: int, rank: int, mine: torch.Tensor, numel: int) -> None:
        """A loaded sum of residuals: this rank's slice ``mine`` at its own place in hop
        1's residual (sent exact, it reaches this rank's reduced slice), the rest zero."""
        node = torch.zeros(numel, dtype=torch.float32, device=mine.device)
        node.view(self.world, -1)[rank] = mine
        self.residual_of(key).node = node

    def tensors(self) -> list[torch.Tensor]:
        return [t for r in self.residuals.values() for t in (r.node, r.across)
                if t is not None]

    def launch(self, buf: torch.Tensor, key: int, *, phase: str, unit: str) -> _Pending:
        """Start hop 1 of ``buf``'s (rank-major, N slices) reduce-scatter; the returned
        object's ``wait()`` runs hop 2 and gives this rank's slice (a sum, ``buf``'s
        dtype)."""
        g, m_count = self.node.size, self.across.size
        s = buf.numel() // self.world
        x = buf.float().view(m_count, g, s)
        res = self.residuals.setdefault(key, _Residuals()) if self.error_feedback else None
        if res is not None and res.node is not None:
            x = x + res.node.view(m_count, g, s)
        me = self.node.rank
        # to node-peer q: the M slices ending on the ranks (., q), each quantised on its
        # own (no block straddles two slices of different ranks)
        send = [torch.cat([quantize(x[j, q], self.kind) for j in range(m_count)])
                if q != me else x.new_empty(0, dtype=torch.uint8) for q in range(g)]
        if res is not None:
            lost = torch.zeros(m_count, g, s, device=buf.device)
            for q in range(g):
                if q != me:
                    lost[:, q] = x[:, q] - _rows(send[q], self.kind, s)
            res.node = lost.view(-1)
        size = m_count * packed_numel(s, self.kind)
        out_splits = [0 if q == me else size for q in range(g)]
        inp = torch.cat(send)
        out = torch.empty(sum(out_splits), dtype=torch.uint8, device=buf.device)
        pending = self.node.all_to_all(out, inp, out_splits, [t.numel() for t in send],
                                       total=buf.numel(), phase=phase, unit=unit,
                                       async_op=True)
        return _Pending(self, pending, x[:, me].clone(), out, s, buf.dtype, res, phase, unit)


class _Pending:
    """Hop 1 in flight; ``wait()`` finishes it and runs hop 2."""

    def __init__(self, hop: TwoHop, first, own: torch.Tensor, received: torch.Tensor,
                 s: int, dtype: torch.dtype, res: _Residuals | None, phase: str,
                 unit: str) -> None:
        self.hop, self.first, self.own, self.received = hop, first, own, received
        self.s, self.dtype, self.res, self.phase, self.unit = s, dtype, res, phase, unit

    def done(self) -> bool:
        return self.first.done()

    def wait(self) -> torch.Tensor:
        hop, s = self.hop, self.s
        self.first.wait()
        m_count = hop.across.size
        size = m_count * packed_numel(s, hop.kind)
        partial = self.own  # (M, S): this rank's part, exact
        for chunk in self.received.view(-1, size) if self.received.numel() else ():
            partial += _rows(chunk, hop.kind, s)
        rows = partial
        if self.res is not None and self.res.across is not None:
            rows = rows + self.res.across.view(m_count, s)
        me = hop.across.rank
        send = [quantize(rows[q], hop.kind) if q != me else rows.new_empty(0, dtype=torch.uint8)
                for q in range(m_count)]
        if self.res is not None:
            lost = torch.zeros(m_count, s, device=rows.device)
            for q in range(m_count):
                if q != me:
                    lost[q] = rows[q] - dequantize(send[q], hop.kind, s, torch.float32)
            self.res.across = lost.view(-1)
        size2 = packed_numel(s, hop.kind)
        out_splits = [0 if q == me else size2 for q in range(m_count)]
        out = torch.empty(sum(out_splits), dtype=torch.uint8, device=rows.device)
        hop.across.all_to_all(out, torch.cat(send), out_splits, [t.numel() for t in send],
                              total=m_count * s, phase=self.phase, unit=self.unit).wait()
        mine = rows[me].clone()
        for row in out.view(-1, size2) if out.numel() else ():
            mine += dequantize(row, hop.kind, s, torch.float32)
        return mine.to(self.dtype)


def _rows(packed: torch.Tensor, kind: str, s: int) -> torch.Tensor:
    """Rows of ``s`` elements, each quantised on its own, back to float32 (R, S)."""
    size = packed_numel(s, kind)
    return torch.stack([dequantize(r, kind, s, torch.float32) for r in packed.view(-1, size)])


def two_hop_for(comm: Comm, kind: str | None, error_feedback: bool) -> TwoHop | None:
    """The two hops of ``comm``'s reduce-scatter over its nodes, or None where it runs
    plain (no quantisation asked, or one node in the group). The group's ranks must lie
    node by node, g of them on every node ([Note: quantised gradients])."""
    if kind is None:
        return None
    nodes: Nodes = comm.ledger.nodes
    of = [nodes.node_of(p) for p in comm.peers]
    order = list(dict.fromkeys(of))
    if len(order) == 1:
        return None
    g = of.count(order[0])
    if any(of.count(m) != g for m in order) or of != [m for m in order for _ in range(g)]:
        raise ValueError(
            f"quantize_grads={kind!r}: the shard group's ranks {comm.peers} do not lie node "
            f"by node with the same count on each node (nodes of node_size={nodes.size}); "
            "give node_size= the ranks per node, or a group laid out node by node")
    m, local = comm.rank // g, comm.rank % g
    node = comm.peers[m * g:(m + 1) * g]
    across = [comm.peers[j * g + local] for j in range(len(order))]
    return TwoHop(
        kind=kind,
        node=Comm(dist.new_group(node, use_local_synchronization=True), comm.ledger,
                  label="grad-node"),
        across=Comm(dist.new_group(across, use_local_synchronization=True), comm.ledger,
                    label="grad-across"),
        error_feedback=error_feedback)
