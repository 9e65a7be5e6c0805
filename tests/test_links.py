"""Bytes by link ([Note: bytes by link] in comm_links.py): the ledger's wire bytes are what
each rank really writes to its sockets, and they split into intra- and inter-node bytes by
the peers the backend's algorithm sends to."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _training import loader, loss_of, make_model

import zeroshard
from zeroshard.comm import Comm, CommLedger
from zeroshard.comm_links import Nodes, resolve_node_size, sends
from zeroshard.testing import run_ranks

#: Bytes a collective writes beyond its payload: gloo's per-message headers (a few dozen
#: bytes each; the largest collective here sends ~100 messages).
HEADERS = 16 * 2**10


def _written() -> int:
    """Bytes this process has written through write()/send() calls: gloo's TCP sockets."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def _ops(comm: Comm, rank: int, n: int) -> dict:
    """Each collective Comm issues, on sizes that do not divide evenly into gloo's
    segments (and one of several MiB, where gloo's reduce has more than 2 segments per
    rank)."""
    big = 5 * 2**20 // 4 // n * n + 3 * n  # fp32 elements, divisible by n
    small = 7 * 1000 * n + n
    pieces_full = torch.zeros(n * 3000)
    pieces = [[pieces_full[q * 3000:][:100], pieces_full[q * 3000 + 100:][:2900]]
              for q in range(n)]  # a small piece each (packed) and a large one
    splits = [1000 * (q + 1) + rank for q in range(n)]
    out_splits = [1000 * (rank + 1) + q for q in range(n)]
    return {
        "all_reduce": lambda: comm.all_reduce(torch.ones(big)),
        "reduce_scatter big": lambda: comm.reduce_scatter(torch.ones(big)),
        "reduce_scatter small": lambda: comm.reduce_scatter(torch.ones(small)),
        "all_gather": lambda: comm.all_gather(torch.ones(big)),
        "all_gather_from": lambda: comm.all_gather_from(torch.ones(small // n),
                                                        torch.empty(small // n * (n - 1))),
        "all_gather_pieces": lambda: comm.all_gather_pieces(pieces_full, pieces),
        "all_to_all": lambda: comm.all_to_all(torch.empty(sum(out_splits)),
                                              torch.ones(sum(splits)), out_splits, splits,
                                              total=0),
        "broadcast": lambda: comm.broadcast(torch.ones(small), src=n - 1),
    }


def _measure(rank: int, world: int, node_size: int) -> dict:
    ledger = CommLedger(nodes=Nodes(node_size))
    out = {}
    for decompose in (True, False):
        comm = Comm(None, ledger, decompose=decompose)
        for name, op in _ops(comm, rank, world).items():
            if not decompose and name.startswith("all_gather_"):
                continue  # broadcasts only
            dist.barrier()
            before, recorded = _written(), len(ledger.records)
            op()  # every algorithm here waits for its own sends before it returns
            written = _written() - before
            (rec,) = ledger.records[recorded:]
            out[(name, rec.impl)] = (written, rec.wire_bytes, rec.intra_wire_bytes,
                                     rec.inter_wire_bytes)
    return out


@pytest.mark.parametrize("world,node_size", [(4, 2), (3, 1)])
def test_wire_bytes_are_what_each_rank_writes(world: int, node_size: int) -> None:
    """Every collective's ``wire_bytes`` on gloo (N broadcasts, N reduces, gloo's own
    all-gather, reduce-scatter and all-reduce, pieces, all-to-all) against the kernel's
    count of bytes the rank wrote during it: at least the payload, at most a few KiB of
    message headers more, on every rank (roots and leaves of the trees alike) — and split
    into intra + inter."""
    results = run_ranks(_measure, world, node_size)
    for rank, res in enumerate(results):
        for key, (written, wire, intra, inter) in res.items():
            assert intra + inter == wire, (rank, key)
            assert wire <= written <= wire + HEADERS, (rank, key, written, wire)
    # the old S(N-1)/N for N reduces is far off on a 5 MiB tensor: the check can fail
    rs = results[0][("reduce_scatter big", "reduce")]
    assert rs[1] > 1.2 * (5 * 2**20) * (world - 1) / world


def test_ring_peers_and_node_split() -> None:
    """Who sends to whom, per algorithm (gloo's sources), and the split at 2 nodes x 2."""
    assert sends("gloo_all_reduce", 800, 4, 0) == ((3, 1200),)
    assert sends("gloo_all_gather", 800, 4, 0) == ((1, 600),)
    assert sends("ring", 800, 4, 3) == ((0, 600),)
    assert sends("gloo_broadcast", 100, 4, 0, 0) == ((1, 100), (2, 100))
    assert sends("gloo_broadcast", 100, 4, 1, 0) == ((3, 100),)
    assert sends("gloo_broadcast", 100, 4, 3, 0) == ()
    assert sends("gloo_broadcast", 100, 3, 1, 1) == ((2, 100), (0, 100))
    assert sends("chain", 100, 4, 1, 2) == ()  # the chain from 2 ends at 1
    # gloo's reduce: 8 MiB at N=2, 1 MiB segments: 6 of 8 on the ring, then half to root
    assert dict(sends("gloo_reduce", 8 * 2**20, 2, 1, 0, 4)) == {0: 6 * 2**20 + 4 * 2**20}
    nodes = Nodes(2)
    assert [nodes.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert Nodes.single().node_of(7) == 0


def _hybrid_split(rank: int, world: int, hybrid: tuple[int, int] | None,
                  node_size: int) -> dict:
    torch.manual_seed(0)
    model, opt = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=3,
                                 hybrid=hybrid, node_size=node_size, lr=1e-3)
    x, y = loader("gpt2-tiny", rank, world).micro_batches(1)[0]
    loss_of(model, x, y).backward()
    opt.step()
    ledger = zeroshard.engine_of(model).comm.ledger
    return ledger.by("group", ledger.last_step())


def test_hybrid_shard_groups_inside_nodes_send_only_replicate_bytes_across() -> None:
    """hybrid=(2, 2) on 2 nodes of 2: the shard group's traffic stays inside each node and
    the replicate group's all crosses; a flat stage 3 over the same 4 ranks crosses too."""
    for by in run_ranks(_hybrid_split, 4, (2, 2), 2):
        assert by["shard"]["inter_wire_bytes"] == 0 < by["shard"]["intra_wire_bytes"]
        assert by["replicate"]["intra_wire_bytes"] == 0 < by["replicate"]["inter_wire_bytes"]
    flat = run_ranks(_hybrid_split, 4, None, 2)
    assert all(by["world"]["inter_wire_bytes"] > 0 for by in flat)
    one_node = run_ranks(_hybrid_split, 4, None, 4)
    assert all(by["world"]["inter_wire_bytes"] == 0 for by in one_node)


def test_node_size_must_divide_the_world(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"node_size=3 does not divide the world of 4"):
        resolve_node_size(3, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE.*=3 does not divide"):
        resolve_node_size(None, 4)
    assert resolve_node_size(2, 4) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_node_size(None, 4) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert resolve_node_size(None, 4) == 4
    with pytest.raises(ValueError, match="node_size=0 must be None or a positive int"):
        zeroshard.ShardConfig(node_size=0)


def _uneven(rank: int, world: int) -> str:
    """torchrun on a node of 3 ranks and a node of 1: LOCAL_WORLD_SIZE 3 on ranks 0-2, 1 on
    rank 3 (which alone divides the world)."""
    import os

    os.environ["LOCAL_WORLD_SIZE"] = "3" if rank < 3 else "1"
    try:
        zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=3, lr=1e-3)
    except ValueError as e:
        return str(e)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    return "sharded"


def test_unequal_nodes_are_refused_on_every_rank() -> None:
    """Every rank raises, naming both sizes, instead of one rank going on alone into
    collectives its peers never join."""
    for said in run_ranks(_uneven, 4):
        assert "the ranks disagree on the ranks per node (1 to 3" in said
        assert "LOCAL_WORLD_SIZE differs between nodes" in said
