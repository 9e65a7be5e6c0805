"""Several optimizers over one sharded model (see [Note: several optimizers] in
engine/composite.py): Muon for the 2-D hidden matrices, AdamW for the rest, as two
optimizers — ``model, (muon, adamw) = zeroshard.shard(model, (muon, adamw), stage=s)``.

World 2, stages 0-3, each against DDP with the same two optimizers (a sum of two
gradients is order-free: bit for bit), in the loop people write for two optimizers
(``for o in opts: o.step(); o.zero_grad()``, each zero_grad clearing its own parameters
before the other steps), with an LR scheduler per optimizer; each optimizer's
``state_dict()`` equals DDP's; a resume at another stage from the two state dicts
continues as the uninterrupted run; refusals name the fix.
"""

from __future__ import annotations

import functools

import pytest
import torch
from _training import loader, loss_of, make_model

import zeroshard
from zeroshard.testing import run_ranks

PRESET = "llama-tiny"
STEPS = 4


class MyMuon(torch.optim.Muon):
    """A subclass (the same update): zeroshard needs whole_params=True to step it whole."""


def _optimizers(model: torch.nn.Module, muon: type = torch.optim.Muon
                ) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and "emb" not in n
              and "lm_head" not in n]
    rest = [p for n, p in model.named_parameters() if not any(p is q for q in hidden)]
    return (muon(hidden, lr=0.02, weight_decay=0.1),
            torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01))


def _loop(model, opts, rank: int, world: int, steps: int, skip: int = 0,
          net=None) -> None:
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in opts]
    data = loader(PRESET, rank, world)
    for _ in range(skip):
        next(data)
    for _ in range(steps):
        x, y = next(data)
        loss_of(net or model, x, y).backward()
        for o in opts:  # each zero_grad runs before the next optimizer steps
            o.step()
            o.zero_grad()
        for s in scheds:
            s.step()


def _ddp(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(PRESET)
    opts = _optimizers(model)
    _loop(model, opts, rank, world, STEPS, net=DDP(model))
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "states": [o.state_dict() for o in opts]}


def _sharded(rank: int, world: int, stage: int, steps: int = STEPS, skip: int = 0,
             resume: dict | None = None, muon: type = torch.optim.Muon, **options) -> dict:
    model = make_model(PRESET)
    states = None
    if resume is not None:
        model.load_state_dict(resume["weights"])
        states = resume["states"]
    opts = _optimizers(model, muon)
    if states is not None:  # a resume: the instances hold the saved state before shard()
        for o, st in zip(opts, states):
            o.load_state_dict(st)
    model, opts = zeroshard.shard(model, opts, stage=stage, **options)
    assert isinstance(opts, tuple) and len(opts) == 2
    _loop(model, opts, rank, world, steps, skip)
    return {"weights": zeroshard.full_state_dict(model),
            "states": [o.state_dict() for o in opts],
            "steps": zeroshard.engine_of(model).comm.ledger.step}


def _run(rank: int, world: int) -> dict:
    out: dict = {"ddp": _ddp(rank, world)}
    for stage in range(4):
        out[stage] = _sharded(rank, world, stage)
    half = _sharded(rank, world, 3, steps=2)
    out["resumed"] = _sharded(rank, world, 1, steps=STEPS - 2, skip=2, resume=half)
    out["subclass"] = _sharded(rank, world, 3, muon=MyMuon, whole_params=True)
    return out


@functools.cache
def _results() -> dict:
    return run_ranks(_run, 2, timeout=300)[0]


def _same_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"])
    for i, st in b["state"].items():
        for k, v in st.items():
            got = a["state"][i][k]
            assert torch.equal(got, v) if torch.is_tensor(v) else got == v, (i, k)


@pytest.mark.parametrize("stage", range(4))
def test_two_optimizers_train_as_ddp_with_the_same_two(stage: int) -> None:
    out = _results()
    for name, w in out["ddp"]["weights"].items():
        assert torch.equal(out[stage]["weights"][name], w), (stage, name)
    for got, want in zip(out[stage]["states"], out["ddp"]["states"]):
        _same_state(got, want)


def test_whole_params_true_names_the_muon_subclass_not_adamw_beside_it() -> None:
    """whole_params=True with (a Muon subclass, AdamW): the subclass steps whole, torch's
    AdamW stays elementwise (it was made whole too, and the pair refused as two whole
    optimizers with advice to merge them), and the run is DDP's."""
    out = _results()
    for name, w in out["ddp"]["weights"].items():
        assert torch.equal(out["subclass"]["weights"][name], w), name


def test_the_ledger_counts_one_step_per_iteration() -> None:
    assert all(_results()[stage]["steps"] == STEPS for stage in range(4))


def test_resume_from_each_optimizer_s_state_dict_at_another_stage() -> None:
    out = _results()
    for name, w in out["ddp"]["weights"].items():
        assert torch.equal(out["resumed"]["weights"][name], w), name


def _ckpt(rank: int, world: int, root: str) -> dict:
    """zeroshard's checkpoints with the tuple: 2 steps at stage 3, save; load at stage 1
    into fresh optimizers, 2 more steps."""
    from pathlib import Path

    from zeroshard.state import load_checkpoint, save_checkpoint

    model = make_model(PRESET)
    model, opts = zeroshard.shard(model, _optimizers(model), stage=3)
    _loop(model, opts, rank, world, 2)
    save_checkpoint(Path(root) / "c", model, opts)
    out = {}
    try:
        save_checkpoint(Path(root) / "d", model, opts[0])
    except TypeError as e:
        out["one_part"] = str(e)
    other = make_model(PRESET)
    other, adam = zeroshard.shard(other, torch.optim.AdamW, stage=1)
    try:  # the two optimizers' checkpoint into one AdamW: named as the user built them
        load_checkpoint(Path(root) / "c", other, adam)
    except Exception as e:  # noqa: BLE001 - its text is checked
        out["into_adamw"] = f"{type(e).__name__}: {e}"
    model = make_model(PRESET, seed=3)
    model, opts = zeroshard.shard(model, _optimizers(model), stage=1)
    load_checkpoint(Path(root) / "c", model, opts)
    _loop(model, opts, rank, world, STEPS - 2, skip=2)
    out["weights"] = zeroshard.full_state_dict(model)
    return out


def test_zeroshard_checkpoints_take_the_tuple() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        out = run_ranks(_ckpt, 2, root, timeout=300)[0]
    for name, w in _results()["ddp"]["weights"].items():
        assert torch.equal(out["weights"][name], w), name
    assert "pass all of them, as the tuple shard() returned" in out["one_part"]
    assert ("holds the state of (torch.optim.Muon, torch.optim.adamw.AdamW), but the "
            "optimizer is torch.optim.adamw.AdamW") in out["into_adamw"], out["into_adamw"]


def _refusals(rank: int, world: int) -> dict[str, str]:
    out = {}

    def attempt(name: str, fn) -> None:
        try:
            fn()
        except (ValueError, TypeError, NotImplementedError) as e:
            out[name] = f"{type(e).__name__}: {e}"

    m = make_model(PRESET)
    a = torch.optim.AdamW(m.parameters())
    attempt("overlap", lambda: zeroshard.shard(m, (a, torch.optim.SGD(m.parameters(), lr=1)),
                                               stage=1))
    m = make_model(PRESET)
    ps = list(m.parameters())
    attempt("two_flat", lambda: zeroshard.shard(
        m, (torch.optim.AdamW(ps[:3]), torch.optim.SGD(ps[3:], lr=1)), stage=1))
    attempt("class", lambda: zeroshard.shard(m, (torch.optim.AdamW,), stage=1))
    m = make_model(PRESET)
    m, opts = zeroshard.shard(m, _optimizers(m), stage=2, mixed_precision="fp16")
    scaler = torch.amp.GradScaler("cpu")
    x, y = next(loader(PRESET, rank, world))
    scaler.scale(loss_of(m, x, y)).backward()
    try:  # zeroshard's fp16 scales the loss itself: a GradScaler on one part is refused
        scaler.step(opts[1])
    except RuntimeError as e:
        out["grad_scaler"] = f"RuntimeError: {e}"
    return out


@pytest.mark.parametrize(("case", "needle"), [
    ("overlap", "is in optimizer 0 (AdamW) and optimizer 1 (SGD); give each parameter to one"),
    ("two_flat", "NotImplementedError.*one that steps whole parameters.*one elementwise"),
    ("class", "a tuple of torch optimizer instances"),
    ("grad_scaler", "GradScaler is stepping this optimizer.*scaled twice"),
])
def test_refusals_name_the_fix(case: str, needle: str) -> None:
    msgs = run_ranks(_refusals, 1, timeout=120)[0]
    assert case in msgs, f"{case} was accepted"
    assert all(part in msgs[case] for part in needle.split(".*")), msgs[case]


def _dcp(rank: int, world: int, root: str) -> dict:
    """torch's DCP with the two optimizers (torchtitan's resume): get_state_dict(model,
    (muon, adamw)) + dcp.save at stage 3, then dcp.load + set_state_dict at stage 1."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = make_model(PRESET)
    model, opts = zeroshard.shard(model, _optimizers(model), stage=3)
    _loop(model, opts, rank, world, 2)
    msd, osd = get_state_dict(model, opts)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root)
    model = make_model(PRESET, seed=5)
    model, opts = zeroshard.shard(model, _optimizers(model), stage=1)
    sd = dict(zip(("model", "optim"), get_state_dict(model, opts)))
    dcp.load(sd, checkpoint_id=root)
    set_state_dict(model, opts, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _loop(model, opts, rank, world, STEPS - 2, skip=2)
    return zeroshard.full_state_dict(model)


def test_torch_dcp_resume_with_both_optimizers_at_another_stage() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        got = run_ranks(_dcp, 2, root, timeout=300)[0]
    for name, w in _results()["ddp"]["weights"].items():
        assert torch.equal(got[name], w), name


def _tracked(rank: int, world: int) -> dict[str, int]:
    model = make_model(PRESET)
    model, opts = zeroshard.shard(model, _optimizers(model), stage=2)
    with zeroshard.memory_tracker(model, opts) as tracker:
        _loop(model, opts, rank, world, 1)
    moments = sum(t.numel() * t.element_size() for o in opts for st in o.state.values()
                  for t in st.values() if torch.is_tensor(t) and t.numel() > 1)
    return {"optim": tracker.current().get("optim", 0), "moments": moments}


def test_the_memory_tracker_takes_the_tuple() -> None:
    """Both optimizers' state is filed under optimizer state (with the fp32 masters)."""
    for r in run_ranks(_tracked, 2, timeout=120):
        assert r["optim"] >= r["moments"] > 0, r


def _joined(rank: int, world: int, system: str) -> dict[str, torch.Tensor]:
    """Uneven data: rank 1 runs out after 2 batches, rank 0 has 3. zeroshard.join with
    both optimizers (rank 1 shadows the third step of each), or DDP's own Join averaging
    over the ranks with data (divide_by_initial_world_size=False: zeroshard's rule)."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(PRESET)
    opts = _optimizers(model)
    if system == "ddp":
        net = DDP(model)
        ctx = Join([net], divide_by_initial_world_size=False)
    else:
        net, opts = zeroshard.shard(model, opts, stage=3)
        ctx = zeroshard.join(net, opts)
    data = loader(PRESET, rank, world)
    batches = [next(data) for _ in range(3 if rank == 0 else 2)]
    with ctx:
        for x, y in batches:
            loss_of(net, x, y).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    if system == "ddp":
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return zeroshard.full_state_dict(net)


def _join_both(rank: int, world: int) -> dict:
    return {s: _joined(rank, world, s) for s in ("ddp", "zeroshard")}


def test_uneven_inputs_under_join_with_both_optimizers() -> None:
    """zeroshard.join(model, (muon, adamw)) at stage 3: DDP's Join result bit for bit."""
    for r in run_ranks(_join_both, 2, timeout=300):
        for name, w in r["ddp"].items():
            assert torch.equal(r["zeroshard"][name], w), name
