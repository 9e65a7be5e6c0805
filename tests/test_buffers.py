"""Buffers as DDP keeps them (issue #46): every buffer, persistent or not, is rank 0's
before a forward that follows a training one; checkpoints hold rank 0's buffers, so a
resume of a model whose buffers differ across ranks (BatchNorm without SyncBatchNorm)
is bitwise."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.nn.functional as F
from _watch import ended_by_watch, print_to_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard
from zeroshard.testing import run_ranks, sweep
from zeroshard.testing.errors import RankError


class _Net(nn.Module):
    """A BatchNorm'd MLP with a non-persistent running statistic of the data that feeds
    the output (kept out of the state dict, updated in training forwards)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn = nn.Linear(6, 8), nn.BatchNorm1d(8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.b = nn.Linear(8, 2)
        self.register_buffer("scale", torch.ones(8), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.a(x)).relu()
        if self.training:
            with torch.no_grad():
                self.scale.mul_(0.5).add_(0.5 * h.abs().mean(0))
        h = h * self.scale
        for blk in self.blocks:
            h = blk(h).relu()
        return self.b(h)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g) * (1 + rank), torch.randn(4, 2, generator=g)


def _train(model: nn.Module, optim, rank: int, steps: range) -> list[float]:
    out = []
    for step in steps:
        x, y = _batch(rank, step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        out.append(loss.item())
    return out


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    inner = model.module if isinstance(model, DDP) else model
    out = {k: v.detach().clone() for k, v in inner.state_dict().items()}
    out["scale"] = inner.scale.clone()
    return out


def _ddp(rank: int) -> dict:
    model = DDP(_Net())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = _train(model, optim, rank, range(4))
    return {"losses": losses, "state": _state(model)}


def _sharded(rank: int, stage: int, root: str) -> dict:
    model, optim = zeroshard.shard(_Net(), torch.optim.AdamW, stage=stage, lr=1e-2)
    losses = _train(model, optim, rank, range(2))
    path = f"{root}/s{stage}"
    zeroshard.save_checkpoint(path, model, optim)
    saved = {k: v.clone() for k, v in model.named_buffers()}
    losses += _train(model, optim, rank, range(2, 4))
    again, optim2 = zeroshard.shard(_Net(), torch.optim.AdamW, stage=stage, lr=1e-2)
    zeroshard.load_checkpoint(path, again, optim2)
    loaded = {k: v.clone() for k, v in again.named_buffers()}
    # The non-persistent statistic is in no checkpoint (as under DDP); give it the value
    # the uninterrupted run's next forward broadcasts (rank 0's).
    again.scale.copy_(saved["scale"])
    torch.distributed.broadcast(again.scale, 0)
    resumed = _train(again, optim2, rank, range(2, 4))
    return {"losses": losses, "state": _state(model), "saved": saved, "loaded": loaded,
            "resumed": resumed, "resumed_state": _state(again)}


def _all(rank: int, world: int, root: str) -> dict:
    return {"ddp": _ddp(rank),
            "zs": sweep(_sharded, [{"rank": rank, "stage": s, "root": root} for s in (0, 3)])}


def test_buffers_are_rank_0s_as_under_ddp_and_in_checkpoints(tmp_path) -> None:
    """Non-persistent buffers too: the model and its running statistics equal DDP's at
    stages 0 and 3 (they once drifted on rank 1: the weights ended 0.4 off); a checkpoint
    holds rank 0's BatchNorm statistics (once rank 1's), so loading gives rank 0's on
    every rank and the resume continues bitwise."""
    ranks = run_ranks(_all, 2, str(tmp_path), timeout=120)
    rank0_saved = [r["saved"] for r in ranks[0]["zs"]]
    for rank, out in enumerate(ranks):
        ddp = out["ddp"]
        for i, got in enumerate(out["zs"]):
            assert got["losses"] == ddp["losses"], (rank, i, got["losses"], ddp["losses"])
            for k, v in ddp["state"].items():
                assert torch.allclose(got["state"][k].float(), v.float(), rtol=1e-5,
                                      atol=1e-6), (rank, i, k)
            for k, v in got["loaded"].items():
                if k != "scale":  # persistent buffers: the checkpoint's, i.e. rank 0's
                    assert torch.equal(v, rank0_saved[i][k]), (rank, i, k)
            assert got["resumed"] == got["losses"][2:], (rank, i)
            for k, v in got["state"].items():
                assert torch.equal(got["resumed_state"][k], v), (rank, i, k)


# -- when buffers are broadcast: DDP's rule, step by step -----------------------------------
def _fwd(model: nn.Module, rank: int, step: int, *, backward: bool = True) -> float:
    x, y = _batch(rank, step)
    loss = F.mse_loss(model(x), y)
    if backward and loss.requires_grad:
        loss.backward()
    return loss.item()


def _sequence(model: nn.Module, optim, rank: int, will_sync) -> dict:
    """train → no_sync micro-batches → no_grad train-mode forward → two no_grad evals →
    an eval with grad (and its backward) → train → buffers edited on rank 1 alone
    (through .data, reassigned) → train. ``will_sync()``: whether the next forward
    broadcasts buffers (DDP: its own predicate; zeroshard: a counted broadcast)."""
    syncs, losses = [], []

    def fwd(step: int, **kw) -> None:
        before = will_sync()
        losses.append(_fwd(model, rank, step, **kw))
        syncs.append(before if isinstance(before, bool) else will_sync() != before)

    def step() -> None:
        optim.step()
        optim.zero_grad()

    fwd(0)
    step()
    with model.no_sync():
        fwd(1)
        fwd(2)
    fwd(3)
    step()
    with torch.no_grad():
        fwd(4)
        model.eval()
        fwd(5)
        fwd(6)
    fwd(7)  # eval mode, grad enabled: a backward follows
    optim.zero_grad()
    model.train()
    fwd(8)
    step()
    inner = model.module if isinstance(model, DDP) else model
    if rank == 1:
        inner.bn.running_mean.data.add_(1.0)
        inner.scale = torch.full((8,), 3.0)  # reassigned: a new tensor
    fwd(9)
    step()
    return {"syncs": syncs, "losses": losses, "state": _state(model)}


def _ddp_sequence(rank: int) -> dict:
    model = DDP(_Net())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return _sequence(model, optim, rank, model._check_sync_bufs_pre_fwd)


def _counted(model: nn.Module):
    """The number of buffer broadcasts zeroshard has issued so far, as a callable."""
    world = zeroshard.api.engine_of(model).world
    count, broadcast = [0], world.broadcast

    def counting(tensor, src=0, **kw):
        count[0] += kw.get("unit") == "buffers"
        return broadcast(tensor, src, **kw)

    world.broadcast = counting
    return lambda: count[0]


def _zs_sequence(rank: int, stage: int) -> dict:
    model, optim = zeroshard.shard(_Net(), torch.optim.AdamW, stage=stage, lr=1e-2)
    return _sequence(model, optim, rank, _counted(model))


# -- the two switches: start-up and forward sync (DDP's broadcast_buffers and
# forward_sync_buffers), on a model whose buffers start different on each rank ---------------
def _switched(rank: int, stage: int | None, switch: dict) -> dict:
    torch.manual_seed(0)
    net = _Net()
    net.scale.fill_(1.0 + rank)
    if stage is None:
        model = DDP(net, **switch)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        model, optim = zeroshard.shard(net, torch.optim.AdamW, stage=stage, lr=1e-2, **switch)
    losses = _train(model, optim, rank, range(3))
    return {"losses": losses, "state": _state(model)}


# -- uneven inputs: rank 0 runs out first, so rank 1's statistics are the ones kept -----------
def _joined(rank: int, stage: int | None) -> dict:
    net = _Net()
    if stage is None:
        model = DDP(net)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ctx = model.join(divide_by_initial_world_size=False)  # zeroshard divides by active ranks
    else:
        model, optim = zeroshard.shard(net, torch.optim.AdamW, stage=stage, lr=1e-2)
        ctx = zeroshard.join(model, optim)
    with ctx:
        losses = _train(model, optim, rank, range(2 + 2 * rank))
    return {"losses": losses, "state": _state(model)}


SWITCHES = [{"broadcast_buffers": False}, {"forward_sync_buffers": False}]


def _rule_all(rank: int, world: int) -> dict:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # DDP's broadcast_buffers is deprecated
        ddp_switched = [_switched(rank, None, s) for s in SWITCHES]
    return {
        "ddp": _ddp_sequence(rank),
        "zs": sweep(_zs_sequence, [{"rank": rank, "stage": s} for s in range(4)]),
        "ddp_switched": ddp_switched,
        "zs_switched": sweep(_switched, [{"rank": rank, "stage": s, "switch": sw}
                                         for sw in SWITCHES for s in (0, 3)]),
        "ddp_join": _joined(rank, None),
        "zs_join": sweep(_joined, [{"rank": rank, "stage": s} for s in (0, 3)]),
    }


def _same(got: dict, want: dict, where: tuple) -> None:
    assert got["losses"] == want["losses"], (where, got["losses"], want["losses"])
    for k, v in want["state"].items():
        assert torch.equal(got["state"][k], v), (where, k, (got["state"][k] - v).abs().max())


def test_buffer_broadcasts_follow_ddps_rule() -> None:
    """Before which forwards buffers go out, from which rank, and the two switches —
    each equal to DDP's, with every buffer bitwise on both ranks: the sequence of
    ``_sequence`` at stages 0-3 (the count of broadcasts forward by forward, buffers
    changed on rank 1 alone overwritten by rank 0's); ``broadcast_buffers=False`` (no
    start-up sync either) and ``forward_sync_buffers=False`` (start-up sync only); uneven
    inputs under ``join()``, where the highest rank still training is the source."""
    ranks = run_ranks(_rule_all, 2, timeout=120)
    for rank, out in enumerate(ranks):
        want = out["ddp"]
        for stage, got in enumerate(out["zs"]):
            assert got["syncs"] == want["syncs"], (rank, stage, got["syncs"], want["syncs"])
            _same(got, want, (rank, stage))
        for i, got in enumerate(out["zs_switched"]):
            _same(got, out["ddp_switched"][i // 2], (rank, "switch", i))
        for i, got in enumerate(out["zs_join"]):
            _same(got, out["ddp_join"], (rank, "join", i))
    assert not torch.equal(ranks[0]["ddp_switched"][0]["state"]["scale"],
                           ranks[1]["ddp_switched"][0]["state"]["scale"])  # the test bites


# -- a forward on one rank alone: an error on every rank, never a hang -----------------------
DIVERGING = [{"stage": s, "bn": True} for s in range(4)]
LOCAL = ([{"stage": s, "bn": False} for s in range(3)]
         + [{"stage": 1, "bn": True, "broadcast_buffers": False},
            {"stage": 2, "bn": True, "forward_sync_buffers": False}])


def _local_forward(rank: int, world: int, root: str, points: list[dict]) -> list:
    """The DDP habit ``if rank == 0: model.module(x)`` then ``dist.barrier()``, after a
    training step, for each of ``points``; the script catches what it raises and calls
    ``destroy_process_group()`` itself (then starts the next point on a new group). What
    rank 0 caught is also written to ``root``, and what rank 1 prints: where the forward
    is a collective, rank 1's watch ends it in the barrier ([Note: asking the peers])."""
    import torch.distributed as dist

    out = []
    for i, point in enumerate(points):
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{root}/pg{i}", rank=rank,
                                    world_size=world)
        opts = {k: v for k, v in point.items() if k not in ("stage", "bn")}
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8) if point["bn"] else nn.ReLU(),
                            nn.Linear(8, 8), nn.Linear(8, 2))
        model, optim = zeroshard.shard(net, torch.optim.AdamW, stage=point["stage"], lr=1e-2,
                                       **opts)
        _train(model, optim, rank, range(1))
        start, got = time.monotonic(), "completed"
        if rank == 1 and len(points) == 1:
            print_to_file(root, rank)
        try:
            if rank == 0:
                model.module.eval()
                with torch.no_grad():
                    model.module(_batch(rank, 1)[0])
            dist.barrier()
        except Exception as e:  # what a script catches
            got = f"{type(e).__name__}: {e}"
        finally:
            dist.destroy_process_group()
        out.append((time.monotonic() - start, got))
        with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    return out


# Stages 1 and 2 take stage 0's path (the buffers' broadcast, checked before it is
# issued): slow-marked, stage 0 is their twin in make test.
@pytest.mark.parametrize("point", [
    pytest.param(p, id=f"s{p['stage']}",
                 marks=[pytest.mark.slow] if p["stage"] in (1, 2) else [])
    for p in DIVERGING])
def test_a_forward_on_one_rank_ends_every_rank_with_an_error(tmp_path, point) -> None:
    """Rank 0 alone runs a forward of a BatchNorm model after a training step: both ranks
    end with CollectiveMismatch within 30 s saying what fits the stage (stages 0-2: the
    buffers' broadcast and forward_sync_buffers=False; stage 3: the gathers) — rank 0
    catches it, destroys the group and returns (once, it hung in the exit-time clean-up
    after a broadcast it had issued alone); rank 1, in its barrier, is ended by its watch
    with the same error printed (fresh ranks: a process per script, as torchrun's)."""
    with pytest.raises(RankError, match="exit code 1"):
        run_ranks(_local_forward, 2, str(tmp_path), [point], timeout=120, fresh=True)
    results = [json.loads((tmp_path / "rank0.json").read_text()),
               [ended_by_watch(tmp_path, 1)]]
    for rank, [(seconds, got)] in enumerate(results):
        where = (rank, seconds, got)
        assert seconds < 30 and got.startswith("CollectiveMismatch"), where
        if point["stage"] == 3:
            assert "At stage 3 every forward gathers weights" in got, where
        else:
            assert "broadcasts rank 0's buffers" in got and \
                "forward_sync_buffers=False" in got and "stage 3" not in got, where


def test_a_forward_on_one_rank_without_buffer_broadcasts_is_local(tmp_path) -> None:
    """Without buffers, or with the forward broadcasts off, stages 0-2 run that forward
    locally, as DDP does: the script runs to completion."""
    results = run_ranks(_local_forward, 2, str(tmp_path), LOCAL, timeout=120)
    for rank, out in enumerate(results):
        for point, (seconds, got) in zip(LOCAL, out):
            assert got == "completed", (rank, point, seconds, got)


class _Cached(nn.Module):
    """A cache grown lazily to the input's length (rotary tables built on demand)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache.numel() < x.shape[0]:
            self.cache = torch.arange(float(x.shape[0]))
        return self.b(self.a(x) * self.cache[: x.shape[0], None])


def _grown_by_rank(rank: int, world: int, stage: int) -> str:
    model, optim = zeroshard.shard(_Cached(), torch.optim.SGD, stage=stage, lr=0.1)
    try:
        for n in (3, 3 + rank * 2, 3):  # the cache grew on rank 1 alone, then a broadcast
            model(torch.randn(n, 4)).sum().backward()
            optim.step()
        return "no error"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def test_a_buffer_grown_to_another_size_on_each_rank_fails_clearly() -> None:
    """A cache grown to each rank's input length: rank 0's cannot be broadcast (DDP fails
    too); the error says so and how to keep the buffer out of the broadcast, on every
    rank, before anything is sent."""
    results = run_ranks(_grown_all, 2, timeout=120)
    for rank, per_stage in enumerate(results):
        for stage, got in zip((0, 3), per_stage):
            assert got.startswith("CollectiveMismatch") and "buffers differ in size" in got \
                and "_ddp_params_and_buffers_to_ignore" in got, (rank, stage, got)


def _grown_all(rank: int, world: int) -> list[str]:
    return [_grown_by_rank(rank, world, s) for s in (0, 3)]


# -- checkpoints across stages and world sizes hold rank 0's buffers -------------------------
def _buffers_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "running" in k or "num_batches" in k}


def _across(rank: int, world: int, root: str) -> dict:
    """Save after 3 steps at stage 3, go on 2 steps; resume at stage 2 and go on alike."""
    import torch.distributed as dist

    model, optim = zeroshard.shard(_Net(), torch.optim.AdamW, stage=3, lr=1e-2)
    _train(model, optim, rank, range(3))
    live = {k: v.clone() for k, v in model.named_buffers()}
    zeroshard.save_checkpoint(f"{root}/ckpt", model, optim)
    after_save = {k: v.clone() for k, v in model.named_buffers()}
    full = zeroshard.full_state_dict(model)
    scale = live["scale"].clone()
    dist.broadcast(scale, 0)  # what the next forward gives every rank (not checkpointed)
    if rank == 0:
        zeroshard.consolidate(f"{root}/ckpt", f"{root}/whole.safetensors")
    uninterrupted = _train(model, optim, rank, range(3, 5))
    again, optim2 = zeroshard.shard(_Net(), torch.optim.AdamW, stage=2, lr=1e-2)
    zeroshard.load_checkpoint(f"{root}/ckpt", again, optim2)
    loaded = zeroshard.full_state_dict(again)
    loaded_local = {k: v.clone() for k, v in again.state_dict().items()}
    again.scale.copy_(scale)
    resumed = _train(again, optim2, rank, range(3, 5))
    return {"live": live, "after_save": after_save, "full": full, "loaded": loaded,
            "loaded_local": loaded_local, "uninterrupted": uninterrupted,
            "resumed": resumed, "state": _state(model), "resumed_state": _state(again)}


def _one_rank_load(rank: int, world: int, root: str) -> dict:
    again, optim = zeroshard.shard(_Net(), torch.optim.AdamW, stage=1, lr=1e-2)
    zeroshard.load_checkpoint(f"{root}/ckpt", again, optim)
    return {k: v.clone() for k, v in again.state_dict().items()}


def test_a_checkpoint_holds_rank_0s_buffers_across_stages_and_world_sizes(tmp_path) -> None:
    """Saved at stage 3 after 3 steps (ranks' BatchNorm statistics differ), loaded at
    stage 2: every rank's state equals rank 0's at the save, buffers included, and the
    run goes on bitwise as the uninterrupted one; the save leaves rank 1's live buffers
    alone; full_state_dict (what zeroshard.hf.save_pretrained writes) and consolidate's
    file (what the Lightning export reads) hold rank 0's; loaded at world 1, rank 0's."""
    from safetensors.torch import load_file

    r0, r1 = run_ranks(_across, 2, str(tmp_path), timeout=120)
    rank0 = r0["full"]
    assert not all(torch.equal(v, r1["live"][k]) for k, v in _buffers_of(r0["live"]).items())
    for k, v in r1["live"].items():
        assert torch.equal(r1["after_save"][k], v), k  # the save changed nothing live
    whole = load_file(str(tmp_path / "whole.safetensors"))
    world1 = run_ranks(_one_rank_load, 1, str(tmp_path), timeout=60)[0]
    for got in (r1["full"], r0["loaded"], r1["loaded"], whole, world1):
        assert got.keys() == rank0.keys()
        for k, v in rank0.items():
            assert torch.equal(got[k].float(), v), k
    for k, v in _buffers_of(rank0).items():
        assert torch.equal(v, r0["live"][k].float()), k  # rank 0's own
        for r in (r0, r1):
            assert torch.equal(r["loaded_local"][k].float(), v), k
    for r in (r0, r1):
        assert r["resumed"] == r["uninterrupted"]
        for k, v in r["state"].items():
            assert torch.equal(r["resumed_state"][k], v), k
