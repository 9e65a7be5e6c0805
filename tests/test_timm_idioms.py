"""timm's train.py on a sharded model (issue #60), with its idioms written out
(_timm_idioms.py): DDP's unwrap idiom ends, and EMA, ``--dist-bn reduce`` and saving give
DDP's answers at every stage."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _timm_idioms import EmaV3, TinyResNet, TinyViT, distribute_bn, get_state_dict, unwrap_model
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard
from zeroshard.testing import run_ranks

STAGES = (None, 0, 1, 2, 3)  # None: DDP


def _batch(step: int, rank: int, image: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 3, image, image, generator=g), torch.randint(4, (4,), generator=g)


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyResNet() if kind == "resnet" else TinyViT()


def _unwrap_run(rank: int, world: int, kind: str, stage: int | None) -> dict:
    model = _model(kind)
    cls = type(model)
    ema = EmaV3(model)  # train.py builds its EMA before the wrap
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if stage is None:
        model = DDP(model)
    else:
        model, optim = zeroshard.shard(model, optim, stage=stage)
    out: dict = {"losses": []}
    for step in range(4):
        x, y = _batch(step, rank)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        ema.update(model, step=step + 1)
        out["losses"].append(loss.item())
        if step == 1:  # an "epoch" ends: --dist-bn reduce
            distribute_bn(model, world, reduce=True)
    m = model
    hops = 0
    while hasattr(m, "module"):  # every unwrap loop ends after one step, as under DDP
        m, hops = m.module, hops + 1
    out["hops"] = hops
    out["unwrapped_is_users_class"] = isinstance(unwrap_model(model), cls)
    out["model_is_users_class"] = stage is None or isinstance(model, cls)
    out["same_twice"] = model.module is model.module
    model.eval()
    x, _ = _batch(9, 0)
    with torch.no_grad():
        out["eval_same"] = torch.equal(model(x), model.module(x))
        out["eval"] = model.module(x)
    out["weights"] = get_state_dict(model)
    out["ema"] = ema.module.state_dict()
    return out


def _unwrap_all(rank: int, world: int, kind: str) -> list:
    return [_unwrap_run(rank, world, kind, s) for s in STAGES]


def _equal(a: dict, b: dict, where: object) -> None:
    assert a.keys() == b.keys(), where
    for k in a:
        assert torch.equal(a[k].cpu(), b[k].cpu()), (where, k, (a[k] - b[k]).abs().max())


def test_unwrap_ema_and_dist_bn_as_under_ddp() -> None:
    """timm's ``unwrap_model`` and a ``while hasattr(m, "module")`` loop end after one step
    at stages 0-3 (the model itself stays an instance of the user's class); the unwrapped
    module forwards, saves and takes ``distribute_bn`` as the model does; a ModelEmaV3-style
    EMA and ``--dist-bn reduce`` give DDP's values, bitwise, on a BatchNorm ResNet."""
    per_rank = run_ranks(_unwrap_all, 2, "resnet", timeout=300)
    for rank, (ddp, *ours) in enumerate(per_rank):
        assert ddp["hops"] == 1
        for stage, r in enumerate(ours):
            where = (rank, stage)
            assert r["hops"] == 1, where
            assert r["unwrapped_is_users_class"] and r["model_is_users_class"], where
            assert r["same_twice"] and r["eval_same"], where
            assert r["losses"] == ddp["losses"], where
            assert torch.equal(r["eval"], ddp["eval"]), where
            _equal(r["weights"], ddp["weights"], where)
            _equal(r["ema"], ddp["ema"], where)
