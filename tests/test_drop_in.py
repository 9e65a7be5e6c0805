"""A sharded model is still a torch model: torch's own APIs give DDP's answers (issue #16).

One training script of the usual shape runs at stages 0-3, worlds 1-3, fp32 and bf16, on
gpt2-tiny (tied embedding and head) with a frozen parameter and decay / no-decay groups:

* the optimizer is a torch AdamW the script built on ``model.parameters()`` and loaded
  from a plain run's state dict before sharding (its groups, hyperparameters and state
  carry over; the old instance refuses to step);
* the learning rate is set through ``optimizer.param_groups`` every step; gradients
  accumulate through ``model.require_backward_grad_sync``; clipping is
  ``torch.nn.utils.clip_grad_norm_(model.parameters())``;
* parameter shapes, counts, dtypes and devices are the unsharded model's;
* ``model.state_dict()`` / ``optimizer.state_dict()`` are torch's (they load into a plain
  model and a plain AdamW), and loading them into a fresh model sharded at another stage
  continues training as the uninterrupted run does.

fp32 runs are compared with plain single-process torch on the same global batch, with
test_parity.py's yardstick (the same batch summed in two halves) for the parameters whose
gradient is pure rounding noise. bf16 runs compute in 16 bits where the reference does
not, so there the checks are exact self-consistency: torch's clipping norm equals the
engine's own global norm, state dicts equal ``full_state_dict`` and round-trip exactly.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from _training import loader, loss_of, make_model, rel_diffs

import zeroshard
from zeroshard.testing import run_ranks, sweep

FREEZE = "blocks.0.norm1.weight"
LR, CLIP, ACCUM, STEPS = 3e-3, 0.5, 2, 2


def _groups(model: torch.nn.Module) -> list[dict]:
    """nanoGPT's recipe; the frozen parameter sits in a group, as model.parameters() has it."""
    named = dict(model.named_parameters())
    decay = [p for p in named.values() if p.dim() >= 2]
    no_decay = [p for p in named.values() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _lr(step: int) -> float:
    return LR * (0.5 + 0.5 * math.cos(math.pi * step / 4))


def _fresh(start: dict | None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model("gpt2-tiny", freeze=FREEZE)
    optim = torch.optim.AdamW(_groups(model), lr=LR, betas=(0.9, 0.95))
    if start is not None:  # copies: torch's state dicts alias the live state
        model.load_state_dict(copy.deepcopy(start["model"]))
        optim.load_state_dict(copy.deepcopy(start["optim"]))
    return model, optim


@functools.cache
def _start() -> dict:
    """A plain run's first step: the state the sharded runs resume from."""
    model, optim = _fresh(None)
    x, y = next(loader("gpt2-tiny", 0, 1))
    loss_of(model, x, y).backward()
    optim.step()
    optim.zero_grad()
    return copy.deepcopy({"model": model.state_dict(), "optim": optim.state_dict()})


def _train(model, optim, data, steps: int, first: int = 0) -> list[float]:
    norms = []
    for step in range(first, first + steps):
        for g in optim.param_groups:
            g["lr"] = _lr(step)
        micro = data.micro_batches(ACCUM)
        for i, (x, y) in enumerate(micro):
            model.require_backward_grad_sync = i == len(micro) - 1
            (loss_of(model, x, y) / len(micro)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optim.step()
        optim.zero_grad()
    return norms


@functools.cache
def _reference(split: int = 1) -> dict:
    """Plain torch, one process, the whole global batch (in ``split`` micro-batches)."""
    model, optim = _fresh(_start())
    data = loader("gpt2-tiny", 0, 1)
    norms = []
    for step in range(STEPS + 1):
        for g in optim.param_groups:
            g["lr"] = _lr(step)
        for x, y in data.micro_batches(split):
            (loss_of(model, x, y) / split).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optim.step()
        optim.zero_grad()
        if step == STEPS - 1:
            sd = {k: v.clone() for k, v in model.state_dict().items()}
            osd = copy.deepcopy(optim.state_dict())
    return {"norms": norms, "sd": sd, "osd": osd,
            "final": {k: v.clone() for k, v in model.state_dict().items()}}


def _case(rank: int, world: int, stage: int, mixed_precision: str | None) -> dict:
    model, optim = _fresh(_start())
    plain = {n: (tuple(p.shape), p.numel(), p.dtype) for n, p in model.named_parameters()}
    old = optim
    model, optim = zeroshard.shard(model, optim, stage=stage, mixed_precision=mixed_precision)
    engine = zeroshard.engine_of(model)
    out: dict = {"plain": plain}
    with pytest.raises(RuntimeError, match="replaced by zeroshard.shard"):
        old.step()
    out["meta"] = {n: (tuple(p.shape), p.numel(), p.dtype) for n, p in model.named_parameters()}
    out["devices"] = {p.device.type for p in model.parameters()}
    out["same_groups"] = [len(g["params"]) for g in optim.param_groups] == [
        len(g["params"]) for g in old.param_groups]
    data = loader("gpt2-tiny", rank, world)
    norms = _train(model, optim, data, STEPS - 1)
    # The last step by hand: torch's clipping norm against the engine's own global norm.
    for g in optim.param_groups:
        g["lr"] = _lr(STEPS - 1)
    micro = data.micro_batches(ACCUM)
    for i, (x, y) in enumerate(micro):
        model.require_backward_grad_sync = i == len(micro) - 1
        (loss_of(model, x, y) / len(micro)).backward()
    own = float(engine.grad_norm(2.0))
    grads = {type(p.grad).__name__ for p in model.parameters() if p.grad is not None}
    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
    out.update(own_norm=own, grad_types=grads)
    optim.step()
    optim.zero_grad()
    out["norms"] = norms
    out["sd"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["full"] = zeroshard.full_state_dict(model)
    out["osd"] = optim.state_dict()
    # optimizer.state: per parameter, this rank's piece (DTensors at stages >= 1)
    state = optim.state
    out["state_len"] = len(state)
    p = dict(model.named_parameters())["blocks.1.mlp.fc.weight"]
    m = state[p]["exp_avg"]
    out["state_fc"] = (m.full_tensor() if hasattr(m, "full_tensor") else m).detach().clone()
    if stage == 3:  # a sharded parameter's values: its DTensor's full value
        out["dtensor_full"] = {n: p.full_tensor().detach().clone()
                               for n, p in model.named_parameters()}
    # Continue one step, and from the state dicts at another stage: the same result.
    _train(model, optim, data, 1, first=STEPS)
    out["continued"] = zeroshard.full_state_dict(model)
    fresh, fresh_optim = _fresh({"model": out["sd"], "optim": out["osd"]})
    other = (stage + 2) % 4
    fresh, fresh_optim = zeroshard.shard(fresh, fresh_optim, stage=other,
                                         mixed_precision=mixed_precision)
    data = loader("gpt2-tiny", rank, world)
    data.step = STEPS  # where the saved run stopped
    _train(fresh, fresh_optim, data, 1, first=STEPS)
    out["resumed"] = zeroshard.full_state_dict(fresh)
    return out if rank == 0 else {}


GRID = [{"stage": s, "mixed_precision": mp} for s in (0, 1, 2, 3) for mp in (None, "bf16")]
# Per world, fp32 and bf16 at two stages or more; over the worlds every point of GRID, all
# four stages at world 3 (uneven shards).
KEPT = {1: [{"stage": 0, "mixed_precision": None}, {"stage": 1, "mixed_precision": "bf16"}],
        2: [{"stage": 0, "mixed_precision": "bf16"}, {"stage": 2, "mixed_precision": None}],
        3: [{"stage": 1, "mixed_precision": None}, {"stage": 2, "mixed_precision": "bf16"},
            {"stage": 3, "mixed_precision": None}, {"stage": 3, "mixed_precision": "bf16"}]}
# `make slow` (README, "Tests"): the rest of GRID at each world
# (test_torch_apis_give_ddps_answers_at_more_points; twin: test_torch_apis_give_ddps_answers).
SLOW = {world: [p for p in GRID if p not in kept] for world, kept in KEPT.items()}


def _all(rank: int, world: int, grid: list[dict]) -> list:
    return sweep(functools.partial(_case, rank, world), grid)


def _within_yardstick(got: dict, ref: dict, what: str) -> None:
    yard = rel_diffs(_reference(2)["final"] if what == "final" else _reference(2)["sd"],
                     _reference()["final"] if what == "final" else _reference()["sd"])
    for name, dev in rel_diffs(got, ref).items():
        assert dev <= max(1e-5, 3 * yard[name]), (what, name, dev, yard[name])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_torch_apis_give_ddps_answers(world: int) -> None:
    """KEPT[world]; the rest of GRID in `make slow`:
    test_torch_apis_give_ddps_answers_at_more_points."""
    _check_ddps_answers(world, KEPT[world], run_ranks(_all, world, KEPT[world],
                                                      timeout=600)[0])


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_torch_apis_give_ddps_answers_at_more_points(world: int) -> None:
    """SLOW[world], checked as its twin test_torch_apis_give_ddps_answers checks
    KEPT[world]."""
    _check_ddps_answers(world, SLOW[world], run_ranks(_all, world, SLOW[world],
                                                      timeout=600)[0])


def _check_ddps_answers(world: int, grid: list[dict], results: list[dict]) -> None:
    """Rank 0's results at ``grid``'s points against plain torch and themselves."""
    ref = _reference()
    for point, r in zip(grid, results, strict=True):
        fp32 = point["mixed_precision"] is None
        where = (world, point)
        # 5. metadata: the unsharded model's, between forwards, at every stage (a frozen
        # parameter is kept in the compute dtype: no fp32 copy of what is not trained)
        plain = dict(r["plain"])
        if not fp32:
            plain[FREEZE] = (*plain[FREEZE][:2], torch.bfloat16)
        assert r["meta"] == plain, where
        assert r["devices"] == {"cpu"} and r["same_groups"], where
        # 4. clipping: torch's global norm is the engine's, and DDP's in fp32
        assert r["norms"][-1] == pytest.approx(r["own_norm"], rel=1e-5), where
        assert r["grad_types"] == ({"Tensor"} if point["stage"] == 0 else {"DTensor"}), where
        if fp32:
            assert r["norms"] == pytest.approx(ref["norms"][:STEPS], rel=1e-4), where
        # 2. model.state_dict(): torch's keys, shapes and dtypes; the values being trained
        assert list(r["sd"]) == list(ref["sd"]), where
        for k, v in r["sd"].items():
            assert v.shape == ref["sd"][k].shape and v.dtype == ref["sd"][k].dtype, (where, k)
            assert torch.equal(v, r["full"][k]), (where, k)
            if "dtensor_full" in r and k in r["dtensor_full"]:
                assert torch.equal(r["dtensor_full"][k], v), (where, k)
        if fp32:
            _within_yardstick(r["sd"], ref["sd"], "sd")
        # 3. optimizer.state_dict(): torch's format, loadable by a plain AdamW
        osd, rosd = r["osd"], ref["osd"]
        assert [{k: v for k, v in g.items()} for g in osd["param_groups"]] == [
            {k: v for k, v in g.items()} for g in rosd["param_groups"]], where
        assert sorted(osd["state"]) == sorted(rosd["state"]), where
        for i, st in rosd["state"].items():
            assert list(osd["state"][i]) == list(st), (where, i)
            assert float(osd["state"][i]["step"]) == float(st["step"]), (where, i)
            for k in ("exp_avg", "exp_avg_sq"):
                assert osd["state"][i][k].shape == st[k].shape, (where, i, k)
                if fp32:
                    assert torch.allclose(osd["state"][i][k], st[k], rtol=1e-3, atol=1e-7), (
                        where, i, k)
        trainable = [n for n, p in _fresh(None)[0].named_parameters() if p.requires_grad]
        assert r["state_len"] == len(trainable), where
        m0 = _fresh(None)[0]  # torch numbers parameters in group order
        order = [id(p) for g in _groups(m0) for p in g["params"]]
        fc = order.index(id(m0.get_parameter("blocks.1.mlp.fc.weight")))
        assert torch.equal(r["state_fc"], osd["state"][fc]["exp_avg"]), where
        plain_model, plain_optim = _fresh(None)
        plain_model.load_state_dict(r["sd"])
        plain_optim.load_state_dict(osd)
        # 1 + 2 + 3: resuming from the state dicts (at another stage) continues the run
        # (bf16: another stage reduces 16-bit gradients in another order, so the step
        # differs by bf16 rounding, not by a lost or misplaced value)
        for k, dev in rel_diffs(r["resumed"], r["continued"]).items():
            assert dev < (1e-5 if fp32 else 1e-2), (where, k, dev)
        if fp32:
            _within_yardstick(r["continued"], ref["final"], "final")


# -- 6. torch.amp.GradScaler -----------------------------------------------------------
def _poison(model: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
    """An inf in one element of one parameter's gradient, on this rank only: after the
    reduction only the rank owning row 0 (rank 0) holds it."""
    block = model.blocks[1].mlp

    def pre(m, args):  # the compute weight is what the block holds during forward
        def once(g: torch.Tensor) -> torch.Tensor:
            handle.remove()
            return g.index_fill(0, torch.tensor([0]), float("inf"))

        handle = m.fc.weight.register_hook(once)

    return block.register_forward_pre_hook(pre)


def _scaled(rank: int, world: int, stage: int) -> dict:
    model, optim = zeroshard.shard(*_fresh(None), stage=stage)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    data = loader("gpt2-tiny", rank, world)
    scales, changed = [], []
    for step in range(3):
        x, y = next(data)
        hook = _poison(model) if step == 1 and rank == world - 1 else None
        scaler.scale(loss_of(model, x, y)).backward()
        if hook is not None:
            hook.remove()
        scaler.unscale_(optim)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        before = zeroshard.full_state_dict(model)
        scaler.step(optim)
        scaler.update()
        optim.zero_grad()
        after = zeroshard.full_state_dict(model)
        scales.append(scaler.get_scale())
        changed.append(any(not torch.equal(after[k], v) for k, v in before.items()))
    return {"scales": scales, "changed": changed, "weights": zeroshard.full_state_dict(model)}


def _double_scaling(rank: int, world: int) -> str:
    model, optim = zeroshard.shard(*_fresh(None), stage=2, mixed_precision="fp16")
    scaler = torch.amp.GradScaler("cpu")
    x, y = next(loader("gpt2-tiny", rank, world))
    scaler.scale(loss_of(model, x, y)).backward()
    try:
        scaler.step(optim)
    except RuntimeError as e:
        return str(e)
    return "no error"


def _scaler_all(rank: int, world: int) -> list:
    return [*sweep(functools.partial(_scaled, rank, world), [{"stage": s} for s in range(4)]),
            _double_scaling(rank, world)]


def test_grad_scaler_finds_infs_on_every_rank() -> None:
    """An inf that only one rank's shard holds skips the step on every rank, and every
    rank backs off its scale alike (torch's GradScaler, unchanged: its inf check runs on
    the DTensor gradients, which reduce it over the mesh)."""
    per_rank = run_ranks(_scaler_all, 2, timeout=300)
    for stage in range(4):
        r0, r1 = (r[stage] for r in per_rank)
        assert r0["scales"] == r1["scales"] == [1024.0, 512.0, 512.0], (stage, r0, r1)
        assert r0["changed"] == r1["changed"] == [True, False, True], stage
        for k, v in r0["weights"].items():
            assert torch.equal(v, r1["weights"][k]), (stage, k)
    for r in per_rank:
        assert "scales the loss itself" in r[-1] and "Drop the GradScaler" in r[-1], r[-1]


# -- 2. the stage-3 state dict's memory ---------------------------------------------------
def _state_dict_peak(rank: int, world: int) -> dict:
    model, optim = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=3,
                                   lr=1e-3, mixed_precision="bf16")
    x, y = next(loader("gpt2-tiny", rank, world))
    loss_of(model, x, y).backward()
    optim.step()
    optim.zero_grad()
    del x, y
    engine = zeroshard.engine_of(model)
    tracker = zeroshard.memory_tracker(model, optim)
    with tracker:
        before = sum(tracker.current().values())
        sd = model.state_dict()
        peak = sum(tracker.peak().values())
    storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in sd.values()}
    return {"extra": peak - before, "result": sum(storages.values()),
            "bucket": max(b.padded_numel for b in engine.all_buckets) * 4}


@pytest.mark.parametrize("world", [2, 3])
def test_stage3_state_dict_holds_one_gathered_unit_at_a_time(world: int) -> None:
    """Peak while ``model.state_dict()`` runs, over what was live before it =
    the returned fp32 CPU tensors (the whole model, which the caller asked for)
    + one bucket (one unit) gathered in fp32, padding included. Nothing else: no unit is
    gathered twice, no whole-model staging copy (on a GPU the first term is host memory,
    so the device holds its shards plus one gathered unit). Beside them, the divergence
    guard's descriptors of up to two gathers in flight (comm.py: 7 int64 of its own and 7
    per rank; whether one is still alive at the peak depends on when gloo completes it:
    seen 168 bytes over at world 2 under a loaded run)."""
    r = run_ranks(_state_dict_peak, world)[0]
    checks = 2 * 7 * 8 * (world + 1)
    assert r["result"] <= r["extra"] <= r["result"] + r["bucket"] + checks, r


# -- what DDP scripts also do -------------------------------------------------------------
class _Net(torch.nn.Module):
    """A small CNN with BatchNorm: buffers that change in every training forward."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())])
        self.head = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.flatten(1))


def _cnn(rank: int, world: int, stage: int | None) -> dict:
    """SGD + a scheduler built on the optimizer *before* wrapping, BatchNorm, and
    ``zero_grad(set_to_none=False)``: under DDP (stage None) or zeroshard."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _Net()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    if stage is None:
        model = DDP(model)
    else:
        model, optim = zeroshard.shard(model, optim, stage=stage)
    out: dict = {"lrs": [], "zero_grads": []}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. "lr_scheduler.step() before ..."
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(10, (4,), generator=g)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=False)
            out["lrs"].append(optim.param_groups[0]["lr"])
            grads = [p.grad for p in model.parameters()]
            out["zero_grads"].append(all(
                gr is not None and tuple(gr.shape) == tuple(p.shape)
                and float((gr.full_tensor() if hasattr(gr, "full_tensor") else gr).abs().sum()) == 0
                for gr, p in zip(grads, model.parameters())))
    raw = model.module
    out["buffers"] = {n: t.clone() for n, t in raw.named_buffers()}
    out["weights"] = {k: v.clone() for k, v in raw.state_dict().items()}
    return out


def _cnn_all(rank: int, world: int) -> list:
    return [_cnn(rank, world, s) for s in (None, 0, 1, 2, 3)]


def test_schedulers_buffers_and_zeroed_grads_as_under_ddp() -> None:
    """An LR scheduler built on the optimizer before sharding drives the optimizer shard()
    returns (no warning); BatchNorm's running statistics are broadcast from rank 0 before
    each training forward as DDP does, so every rank's buffers equal DDP's on that rank;
    ``zero_grad(set_to_none=False)`` leaves zeros of the parameters' shapes."""
    per_rank = run_ranks(_cnn_all, 2, timeout=300)
    for rank, runs in enumerate(per_rank):
        ddp, *ours = runs
        for stage, r in enumerate(ours):
            where = (rank, stage)
            assert r["lrs"] == ddp["lrs"] == [0.05, 0.025, 0.0125], where
            assert r["zero_grads"] == ddp["zero_grads"] == [True] * 3, where
            for n, t in ddp["buffers"].items():
                assert torch.allclose(r["buffers"][n].float(), t.float(), atol=1e-6), (where, n)
            for k, v in ddp["weights"].items():
                assert torch.allclose(r["weights"][k].float(), v.float(), atol=1e-5), (where, k)
