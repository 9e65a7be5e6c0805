"""timm's train.py on a sharded model (issue #60), with its idioms written out
(_timm_idioms.py): DDP's unwrap idiom ends, and EMA, ``--dist-bn reduce`` and saving give
DDP's answers at every stage."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _timm_idioms import (
    Block,
    EmaV3,
    TinyResNet,
    TinyViT,
    distribute_bn,
    get_state_dict,
    unwrap_model,
)
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


# -- rank-0-only saving (item 2) --------------------------------------------------------------
def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int, rank: int) -> float:
    x, y = _batch(step, rank)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def _sharded(kind: str, stage: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(kind)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return zeroshard.shard(model, optim, stage=stage)


def _save_run(rank: int, world: int, kind: str, stage: int, alone: bool, path: str) -> dict:
    """Six steps; after step 1 every rank takes both state dicts (an earlier call), after
    step 3 rank 0 saves alone (the others train on into step 4) or every rank does."""
    from _timm_idioms import rank0_save

    from zeroshard.engine.engine import engine_of

    model, optim = _sharded(kind, stage)
    server = engine_of(model).server
    out: dict = {"losses": []}
    for step in range(6):
        out["losses"].append(_step(model, optim, step, rank))
        if step == 1:
            model.state_dict(), optim.state_dict()
        if step == 3:
            if alone:
                saved = rank0_save(model, optim, epoch=step)
            else:
                saved = {"state_dict": model.state_dict(), "optimizer": optim.state_dict()}
            if rank == 0:
                torch.save(saved, path)
                out["saved"] = saved
    out["final"] = {k: v.clone() for k, v in model.state_dict().items()}
    # the state versions a peer read this rank's shards at (version k: after k steps)
    out["read_at"] = sorted(server.served) if server is not None else []
    return out


def _resume(rank: int, path: str, kind: str, stage: int) -> dict:
    """A fresh model at ``stage`` loads the rank-0 checkpoint and trains steps 4-5."""
    import torch.distributed as dist

    dist.barrier()  # rank 0 wrote it
    saved = torch.load(path, weights_only=True)
    model, optim = _sharded(kind, stage)
    model.load_state_dict(saved["state_dict"])
    optim.load_state_dict(saved["optimizer"])
    losses = [_step(model, optim, step, rank) for step in (4, 5)]
    return {"losses": losses, "final": model.state_dict()}


def _save_all(rank: int, world: int, kind: str, root: str) -> list:
    out = []
    for stage in (0, 1, 2, 3):
        runs = [_save_run(rank, world, kind, stage, alone, f"{root}/s{stage}-{alone}.pt")
                for alone in (True, False)]
        resumed = [_resume(rank, f"{root}/s{stage}-True.pt", kind, s) for s in (stage, 3 - stage)]
        out.append((runs, resumed))
    return out


def _equal_state(a: dict, b: dict, where: object) -> None:
    assert a.keys() == b.keys(), where
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), (where, k)
        elif isinstance(a[k], dict):
            _equal_state(a[k], b[k], (where, k))
        elif isinstance(a[k], list):
            assert len(a[k]) == len(b[k]), (where, k)
            for i, (x, y) in enumerate(zip(a[k], b[k])):
                if isinstance(x, dict):
                    _equal_state(x, y, (where, k, i))
                else:
                    assert x == y, (where, k, i)
        else:
            assert a[k] == b[k], (where, k)


def test_rank0_only_save_is_the_all_rank_state_of_that_step_and_resumes(tmp_path) -> None:
    """CheckpointSaver's save on rank 0 alone, the other rank training on into the next
    step (blocked at its first collective with rank 0), two steps after an earlier state
    dict call: ``{"state_dict", "optimizer"}`` equal, bitwise, the dicts every rank takes
    at that step in the same run without it, at stages 0-3; nothing else changes (losses
    and final weights bitwise those of the all-rank run); it loads strict into a fresh
    model at the same stage and another and training resumes bitwise; no request reaches
    a server in a step without a state dict call ([Note: state dicts served])."""
    _check_saves(run_ranks(_save_all, 2, "resnet", str(tmp_path), timeout=300), True)


@pytest.mark.slow
def test_rank0_only_save_at_world_4(tmp_path) -> None:
    """The same at world 4: rank 0 reads three peers' shards, each training on."""
    _check_saves(run_ranks(_save_all, 4, "resnet", str(tmp_path), timeout=600), False)


def _check_saves(per_rank: list, exact_across_stages: bool) -> None:
    for rank, stages in enumerate(per_rank):
        for stage, ((alone, everyone), resumed) in enumerate(stages):
            where = (rank, stage)
            # read only after the steps a state dict was taken at (1, 3, the last): no
            # request reaches a server in a step without one
            assert set(alone["read_at"]) <= {2, 4, 6}, (where, alone["read_at"])
            assert set(everyone["read_at"]) <= {2, 4, 6}, (where, everyone["read_at"])
            if stage == 3:  # the last model.state_dict() is read from the peers
                assert 6 in everyone["read_at"], where
            assert alone["losses"] == everyone["losses"], where
            _equal(alone["final"], everyone["final"], where)
            if rank == 0:
                assert alone["saved"]["arch"] == "TinyResNet"
                _equal(alone["saved"]["state_dict"], everyone["saved"]["state_dict"], where)
                _equal_state(alone["saved"]["optimizer"], everyone["saved"]["optimizer"],
                             where)
                # what a plain torch AdamW and model load
                plain = _model("resnet")
                plain.load_state_dict(alone["saved"]["state_dict"], strict=True)
                torch.optim.AdamW(plain.parameters(), lr=1e-2).load_state_dict(
                    alone["saved"]["optimizer"])
            same, other = resumed  # resumed at this stage, and at 3 - stage
            assert same["losses"] == alone["losses"][4:], where
            _equal(same["final"], alone["final"], where)
            if exact_across_stages:  # 2 ranks: every stage's sums are DDP's, bitwise
                assert other["losses"] == alone["losses"][4:], where
                _equal(other["final"], alone["final"], where)
            else:  # 4 ranks: stages reduce in another order (rounding), resumed or not
                for a, b in zip(other["losses"], alone["losses"][4:]):
                    assert abs(a - b) <= 1e-6 * abs(b), (where, a, b)


# -- units inside a container of repeated blocks (item 3) ---------------------------------
def _units(rank: int, world: int, kind: str) -> dict:
    from _training import zeroshard_log

    with zeroshard_log() as records:
        model = TinyViT(depth=12) if kind == "vit" else TinyResNet()
        ref = {k: v.clone() for k, v in model.state_dict().items()}
        model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=3, lr=1e-2)
    engine = zeroshard.engine_of(model)
    losses = [_step(model, optim, step, rank) for step in range(2)]
    return {"units": [u.name for u in engine.units],
            "unit_bytes": {u.name: u.unsharded_bytes for u in engine.units},
            "peak": engine.peak_unsharded_bytes, "log": records, "losses": losses,
            "shard_bytes": sum(b.shard_numel * 4 for b in engine.all_buckets),
            "whole_bytes": sum(v.numel() * 4 for k, v in ref.items() if "running" not in k
                               and "num_batches" not in k)}


def _check_units(got: dict, kind: str, world: int) -> None:
    if kind == "vit":
        want = ["patch_embed"] + [f"blocks.{i}" for i in range(12)] + ["norm", "head", "root"]
        assert got["units"] == want, got["units"]
    blocks = [b for n, b in got["unit_bytes"].items() if n != "root"]
    root = got["unit_bytes"]["root"]
    # the gathered peak is the root plus a few blocks (one computing, one prefetched, one
    # being freed), not the container whole (97% of timm's ViT taken as one unit)
    assert root + max(blocks) <= got["peak"] <= root + 3 * max(blocks), got
    assert got["peak"] < 0.4 * got["whole_bytes"], got
    # per rank: its 1/N of the weights plus that peak
    assert abs(got["shard_bytes"] - got["whole_bytes"] / world) < 0.02 * got["whole_bytes"]


def _per_rank_peak(got: dict) -> int:
    return got["shard_bytes"] + got["peak"]


def test_stage3_units_are_the_blocks_inside_a_sequential() -> None:
    """timm's ViT keeps its blocks in an nn.Sequential (no ModuleList): stage 3's automatic
    units are the blocks, named in the log; the gathered peak is a few blocks, per rank
    the shard plus that; a ResNet's layerN blocks likewise; training works (= the losses
    of the same run at world 2 on each rank's data)."""
    for kind in ("vit", "resnet"):
        per_rank = run_ranks(_units, 2, kind, timeout=300)
        for rank, got in enumerate(per_rank):
            _check_units(got, kind, 2)
            assert (len(got["log"]) == 1) == (rank == 0), got["log"]
        if kind == "vit":
            message = per_rank[0]["log"][0]
            assert "blocks.0 (" in message and "block of blocks" in message, message


@pytest.mark.slow
def test_stage3_block_units_peak_falls_with_world_size() -> None:
    """The per-rank peak (shard + gathered blocks) at world 4 is below world 2's by the
    shard's halving, as the per-block units predict, on the ViT and the ResNet."""
    for kind in ("vit", "resnet"):
        two = run_ranks(_units, 2, kind, timeout=300)[0]
        four = run_ranks(_units, 4, kind, timeout=300)[0]
        _check_units(four, kind, 4)
        # the same blocks gathered (their padding to a multiple of N aside)
        assert abs(four["peak"] - two["peak"]) <= 0.05 * two["peak"], (two, four)
        predicted = _per_rank_peak(two) - two["whole_bytes"] / 4
        assert abs(_per_rank_peak(four) - predicted) < 0.02 * two["whole_bytes"]
        assert _per_rank_peak(four) < 0.8 * _per_rank_peak(two)


def test_units_by_size_splits_only_repeated_blocks() -> None:
    """A Sequential of repeated blocks is split into a unit per block; a Sequential mixing
    classes is taken whole as before; a Sequential of a single block is not split by the
    block rule (its children are chosen by size as before)."""
    from torch import nn

    from zeroshard.engine.auto_units import repeated_blocks, units_by_size

    vit = TinyViT(depth=12)
    assert repeated_blocks(vit.blocks) == list(vit.blocks)
    units = units_by_size(vit)
    assert [u for u in units if u in set(vit.blocks)] == list(vit.blocks)
    assert vit.blocks not in units

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(8, 8)
            self.body = nn.Sequential(*[  # each child under 1/SHARE of the model
                nn.Linear(32, 32) if i % 2 else nn.Sequential(nn.Linear(32, 32), nn.ReLU())
                for i in range(12)])
            self.head = nn.Linear(32, 4)

    mixed = Mixed()
    assert repeated_blocks(mixed.body) == []
    assert mixed.body in units_by_size(mixed)

    class Single(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(8, 32)
            self.body = nn.Sequential(Block(32))
            self.head = nn.Linear(32, 4)

    single = Single()
    assert repeated_blocks(single.body) == []
    units = units_by_size(single)
    assert single.body not in units and single.body[0] not in units  # as before: by size
    assert any(u in set(single.body[0].modules()) for u in units)
