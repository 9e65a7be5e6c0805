"""Tied parameters (see [Note: tied parameters] in engine/params.py).

A token table that is also the output projection gets its gradient in two parts. Under
plain torch (and DDP, FSDP2) autograd holds the first part through the whole backward
and forms the sum as a third table-sized tensor; zeroshard gives each home its own
autograd leaf over the same memory and adds the later part into the held one in place.
Checked here, at world 2 and every stage: the peak holds two table-sized parts beside
the gradient buffers, not three (on a model whose table dominates, measured by the category
tracker against DDP measured the same way); training equals one process's when a home
is skipped, under accumulation with and without ``no_sync``, under reentrant
checkpointing, with clipping after a ``no_grad`` evaluation; outside forward the homes hold one parameter, as before ``shard()``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import zeroshard
from zeroshard.data import SyntheticLanguage, TokenLoader
from zeroshard.models import GPT2Config, build_model
from zeroshard.testing import run_ranks, sweep

CFG = GPT2Config(n_layers=1, hidden=256, n_heads=4, seq_len=16, vocab=8192)
TABLE = CFG.vocab * CFG.hidden * 4  # bytes of the tied table (fp32)


def _peak(rank: int, world: int, stage: int | None) -> dict:
    """One measured step after a warm one; ``stage=None``: torch DDP."""
    model = build_model(CFG, seed=0)
    if stage is None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model = DDP(model)
    else:
        model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=stage, lr=1e-3)
    data = TokenLoader(SyntheticLanguage(CFG.vocab, CFG.seq_len, seed=0), global_batch=4,
                       rank=rank, world_size=world)

    def step() -> None:
        x, y = next(data)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        optim.step()
        optim.zero_grad()

    step()
    tracker = zeroshard.memory_tracker(model, optim)
    with tracker:
        step()
    return {"peak": {k.value: v for k, v in tracker.peak().items()},
            "total": tracker.peak_total()}


class _Tied(nn.Module):
    """Embedding and head share one table; the head home can be skipped."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(32, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, head: bool = True, ckpt: bool = False):
        h = self.emb(idx)
        if not head:
            return self.mix(h).sum(-1, keepdim=True).expand(-1, -1, 32)
        if ckpt:  # the head's part arrives inside a reentrant backward
            return checkpoint(self._top, h, use_reentrant=True)
        return self._top(h)

    def _top(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(h)))


# (head used?, reentrant checkpointing?) per micro-batch, per step; 2 micro-batches = accumulation.
SCHEDULE = [[(True, False)], [(False, False)], [(True, False), (False, False)],
            [(True, True)], [(True, False), (True, True)]]


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randint(0, 32, (4, 5), generator=g), torch.randint(0, 32, (4, 5), generator=g)


def _train(rank: int, world: int, stage: int | None, use_no_sync: bool = True) -> dict:
    """The schedule on this rank's share of each batch; ``stage=None``: one process."""
    model = _Tied()
    if stage is None:
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        rank, world = 0, 1
    else:
        units = {"units": [model.mix]} if stage == 3 else {}  # the root holds the table
        model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=stage, lr=1e-2, **units)
    homes = []
    for step, micros in enumerate(SCHEDULE):
        for m, (head, ckpt) in enumerate(micros):
            x, y = (t[rank * 4 // world:(rank + 1) * 4 // world] for t in _batch(step, m))
            loss = F.cross_entropy(model(x, head, ckpt).flatten(0, 1), y.flatten())
            if len(micros) > 1 and m == 0 and use_no_sync and stage is not None:
                with model.no_sync():
                    (loss / len(micros)).backward()
            else:
                (loss / len(micros)).backward()
        with torch.no_grad():  # an evaluation between backward and step changes nothing
            model(x)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # the table's gradient too
        optim.step()
        optim.zero_grad()
        homes.append(model.head.weight is model.emb.weight)
    state = zeroshard.full_state_dict(model) if stage is not None else model.state_dict()
    return {"state": {k: v.detach().clone() for k, v in state.items()}, "homes": homes,
            "n_params": len(list(model.parameters()))}


def _all(rank: int, world: int) -> list:
    peaks = sweep(functools.partial(_peak, rank, world), [{"stage": s} for s in (None, 0, 1, 2, 3)])
    grid = [{"stage": s, "use_no_sync": n} for s in range(4) for n in (True, False)]
    runs = sweep(functools.partial(_train, rank, world), grid)
    return [peaks, grid, runs]


@functools.cache
def _results() -> list:
    return run_ranks(_all, 2, timeout=300)[0]


def test_the_tied_table_costs_one_part_at_the_peak_not_three() -> None:
    peaks = _results()[0]
    ddp, stages = peaks[0], peaks[1:]
    # DDP (plain torch autograd): the head's part held, the embedding's part, their sum.
    assert ddp["peak"]["other"] >= 3 * TABLE, ddp
    for stage, r in enumerate(stages):
        # The embedding's part, about to be added in place into the head's (held on its
        # leaf, filed as a gradient): no third tensor for the sum.
        assert TABLE <= r["peak"]["other"] < 1.5 * TABLE, (stage, r)
        assert r["total"] <= ddp["total"] - TABLE, (stage, r, ddp)


def test_tied_gradients_match_one_process_and_homes_stay_one_parameter() -> None:
    _, grid, runs = _results()
    ref = _train(0, 1, None)
    for point, got in zip(grid, runs):
        assert got["homes"] == [True] * len(SCHEDULE), (point, got["homes"])
        assert got["n_params"] == ref["n_params"], point
        assert got["state"].keys() == ref["state"].keys(), point
        for k, v in ref["state"].items():
            dev = (got["state"][k] - v).norm() / v.norm()
            assert dev < 1e-5, (point, k, dev.item())
