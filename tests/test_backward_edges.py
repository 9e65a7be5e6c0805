"""Backwards that arrive in unusual shapes give DDP's gradients, or a clear error.

Found by review of the lazy gradient buffers (issue #17), each checked at world 2 against
one process running the same backwards (both ranks see the same inputs, so the average
over ranks is that process's gradient):

* reentrant activation checkpointing (``use_reentrant=True``, HF's default) runs one
  backward per region from inside the outer one: a parameter used in several regions
  gets its gradient in parts, and the end of the first region's backward is not the end
  of backward (with a frozen head, the first gradient arrives inside a region);
* fp16 loss scaling with fp32 reductions and two backwards before a step (no no_sync):
  the unscaled gradient must not be formed in the accumulator;
* no_sync() backwards, then a synchronised one in which some parameter is unused: its
  earlier gradient must still be reduced.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import zeroshard
from zeroshard.testing import run_ranks


class Block(nn.Module):
    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.shared = shared

    def forward(self, x: torch.Tensor, use_shared: bool = True) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.shared(h) if use_shared else h


class Net(nn.Module):
    def __init__(self, frozen_head: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        shared = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([Block(shared), Block(shared)])
        self.head = nn.Linear(8, 1)
        self.head.requires_grad_(not frozen_head)
        self.reentrant: bool | None = None

    def forward(self, x: torch.Tensor, skip_shared: bool = False) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            if skip_shared:
                h = b(h, use_shared=False)
            elif self.reentrant is None:
                h = b(h)
            else:
                h = checkpoint(b, h, use_reentrant=self.reentrant)
        return self.head(h).sum()


X1, X2 = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.randn(
    4, 8, generator=torch.Generator().manual_seed(2))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            g = p.grad
            out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).float().clone()
    return out


def _case(name: str, model: nn.Module, **kw) -> dict[str, torch.Tensor] | str:
    try:
        if name == "reentrant-shared":
            model.reentrant = True
            model(X1).backward()
        elif name == "reentrant-frozen-head":
            model.reentrant = True
            model(X1).backward()
        elif name == "fp16-two-backwards":
            model(X1).backward()
            model(X2).backward()
        elif name == "no-sync-then-unused":
            with model.no_sync():
                model(X1).backward()
            model(X2, skip_shared=True).backward()
    except RuntimeError as e:
        return str(e)
    return _grads(model)


CASES = [  # (case, stage, shard options, frozen head)
    *[("reentrant-shared", s, {}, False) for s in (1, 2, 3)],
    *[("reentrant-shared", s, {"overlap": False, "bucket_bytes": 64}, False) for s in (0, 2)],
    *[("reentrant-shared", s, {"bucket_bytes": 64}, False) for s in (0, 2)],  # refused
    *[("reentrant-frozen-head", s, {}, True) for s in (0, 1, 2, 3)],
    *[("fp16-two-backwards", s, {"mixed_precision": "fp16", "reduce_dtype": "fp32",
                                 "init_scale": 1024.0}, False) for s in (1, 2, 3)],
    *[("no-sync-then-unused", s, {}, False) for s in (1, 2, 3)],
]


def _all(rank: int, world: int) -> list:
    out = []
    for name, stage, opts, frozen in CASES:
        torch.manual_seed(0)
        model, _ = zeroshard.shard(Net(frozen), torch.optim.SGD, stage=stage, lr=0.1, **opts)
        out.append(_case(name, model))
    return out


def _reference(name: str, frozen: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net(frozen)
    if name.startswith("reentrant"):
        model(X1).backward()
    elif name == "fp16-two-backwards":
        (model(X1) + model(X2)).backward()
    else:
        (model(X1) + model(X2, skip_shared=True)).backward()
    return _grads(model)


def test_edge_backwards_give_ddps_gradients_or_a_clear_error() -> None:
    results = run_ranks(_all, 2, timeout=300)[0]
    for (name, stage, opts, frozen), got in zip(CASES, results):
        where = (name, stage, opts)
        if name == "reentrant-shared" and opts == {"bucket_bytes": 64}:
            assert isinstance(got, str) and "use_reentrant=False" in got, where
            continue
        assert isinstance(got, dict), (where, got)
        want = _reference(name, frozen)
        assert got.keys() == want.keys(), where
        tol = {"rtol": 2e-2, "atol": 1e-3} if "mixed_precision" in opts else {}
        for k in want:
            torch.testing.assert_close(got[k], want[k], **tol,
                                       msg=lambda m, k=k, w=where: f"{w} {k}: {m}")
