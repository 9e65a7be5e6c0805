"""A tiny mixture-of-experts model and data that leave experts empty on some ranks.

Each block routes every token to one expert (top-1) and, as Mixtral-style code in
``transformers`` does, skips an expert that receives no token, so which parameters get a
gradient depends on the rank's data. Routing is by token id (a hash router, Roller et al.
2021, "Hash Layers"), so the tests control it exactly: expert ``e`` of every block serves
the tokens ``t`` with ``t % EXPERTS == e``; the router's softmax weight still scales each
expert's output, so the router trains. Per step, rank by rank:

* expert 0 and 1 are busy on every rank;
* expert 2 is busy on rank 0 and empty on every other rank;
* expert 3 is empty on every rank (no token is 3 mod EXPERTS): it must keep
  ``grad = None`` and its optimizer state, ``step`` included, untouched;
* the ``aux`` head runs only for a batch that holds token 0 — on rank 0 only (a branch
  taken on one rank only, outside the blocks: the root unit at stage 3).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, EXPERTS, BLOCKS, SEQ = 32, 16, 4, 2, 8


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).flatten(0, 1)
        weight = self.router(h).softmax(-1)
        route = ids.flatten() % EXPERTS
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (route == e).nonzero().squeeze(1)
            if idx.numel() == 0:  # no token for this expert here: skip it (Mixtral)
                continue
            out = out.index_add(0, idx, expert(h[idx]) * weight[idx, e : e + 1])
        return x + out.view_as(x)


class TinyMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(BLOCKS))
        self.aux = nn.Linear(HIDDEN, HIDDEN)  # used for batches that hold token 0 only
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, ids)
        if bool((ids == 0).any()):
            x = x + self.aux(x)
        return self.head(self.norm(x))


def make_moe(seed: int = 0) -> TinyMoE:
    torch.manual_seed(seed)
    return TinyMoE()


def batch(rank: int, step: int, rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step`` (inputs, targets); see the module docstring
    for which experts each rank uses."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    allowed = torch.tensor([t for t in range(VOCAB) if t % EXPERTS != 3
                            and (rank == 0 or t % EXPERTS != 2) and (rank == 0 or t != 0)])
    ids = allowed[torch.randint(0, len(allowed), (rows, SEQ + 1), generator=g)]
    if rank == 0:  # expert 2 and the aux branch busy here, every step
        ids[0, 0], ids[0, 1] = 0, 2
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def expert_use(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Which experts got tokens in ``x`` (the routing is the same in every block)."""
    route = x.flatten() % EXPERTS
    return {"experts": sorted({int(e) for e in route}), "aux": bool((x == 0).any())}
