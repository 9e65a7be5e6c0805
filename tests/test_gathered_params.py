"""zeroshard.gathered_parameters (DeepSpeed's GatheredParameters with modifier_rank):
whole fp32 copies on every rank; with ``modifier_rank`` that rank's edits reach every
rank's shards and masters, so training goes on as DDP's after the same edit (bit for bit
at world 2); without it edits are discarded. See [Note: editing gathered parameters]."""

from __future__ import annotations

import functools

import pytest
import torch
from _training import loader, loss_of, make_model

import zeroshard
from zeroshard.testing import run_ranks

PRESET = "llama-tiny"
ROW = 3


def _edit(full: dict[str, torch.Tensor], rank: int, keep: int) -> None:
    """The edit: on the kept rank, row ROW of the embedding set, the final norm scaled;
    on the others something else (to be discarded)."""
    if rank == keep:
        full["tok_emb.weight"][ROW].fill_(0.5)
        full["norm_f.weight"].mul_(2.0)
    else:
        full["tok_emb.weight"].zero_()


def _ddp(rank: int, world: int) -> dict[str, torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(PRESET)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    net = DDP(model)
    data = loader(PRESET, rank, world)
    for i in range(3):
        x, y = next(data)
        loss_of(net, x, y).backward()
        optim.step()
        optim.zero_grad()
        if i == 0:
            with torch.no_grad():
                model.tok_emb.weight[ROW].fill_(0.5)
                model.norm_f.weight.mul_(2.0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(rank: int, world: int) -> dict:
    out: dict = {"ddp": _ddp(rank, world)}
    for stage in range(4):
        model = make_model(PRESET)
        model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=stage, lr=1e-2)
        if stage == 3:
            model.unshard()  # units kept gathered must not keep the old values
        data = loader(PRESET, rank, world)
        ledger = zeroshard.engine_of(model).comm.ledger
        for i in range(3):
            x, y = next(data)
            loss_of(model, x, y).backward()
            optim.step()
            optim.zero_grad()
            if i == 0:
                before = zeroshard.full_state_dict(model)
                with zeroshard.gathered_parameters(model, None) as every:
                    seen = {k: torch.equal(v, before[k]) for k, v in every.items()}
                params = dict(model.named_parameters())
                with zeroshard.gathered_parameters(
                        model, [params["norm_f.weight"], "tok_emb.weight"],
                        modifier_rank=1) as full:
                    names = list(full)
                    _edit(full, rank, keep=1)
                n0 = len(ledger.records)
                with zeroshard.gathered_parameters(model, ["norm_f.weight"]) as ro:
                    ro["norm_f.weight"].zero_()  # discarded: no modifier_rank
                ops = [r.op for r in ledger.records[n0:]]
        out[stage] = {"weights": zeroshard.full_state_dict(model), "seen": seen,
                      "names": names, "ops": ops,
                      "params": [n for n, _ in model.named_parameters()]}
    return out


@functools.cache
def _results() -> list[dict]:
    return run_ranks(_run, 2, timeout=300)


@pytest.mark.parametrize("stage", range(4))
def test_the_modifier_rank_s_edit_trains_as_ddp_s(stage: int) -> None:
    ranks = _results()
    for r in ranks:
        got = r[stage]
        assert all(got["seen"].values()) and list(got["seen"]) == got["params"]
        assert got["names"] == ["tok_emb.weight", "norm_f.weight"]  # model order
        for name, w in r["ddp"].items():
            assert torch.equal(got["weights"][name], w), (stage, name)


@pytest.mark.parametrize("stage", range(4))
def test_without_modifier_rank_nothing_is_written_or_sent(stage: int) -> None:
    ops = _results()[0][stage]["ops"]
    assert "broadcast" not in ops, ops


def _errors(rank: int, world: int) -> dict[str, str]:
    model = make_model(PRESET)
    other = torch.nn.Parameter(torch.zeros(3))
    model, _ = zeroshard.shard(model, torch.optim.AdamW, stage=3, lr=1e-2)
    out = {}
    for key, kw in {"rank": {"params": None, "modifier_rank": 2},
                    "name": {"params": ["nope.weight"]},
                    "foreign": {"params": [other]}}.items():
        try:
            with zeroshard.gathered_parameters(model, **kw):
                pass
        except ValueError as e:
            out[key] = str(e)
    return out


def test_bad_arguments_are_refused_naming_the_fix() -> None:
    msgs = run_ranks(_errors, 2, timeout=120)[0]
    assert "modifier_rank=2: give the rank (0 to 1)" in msgs["rank"]
    assert "'nope.weight' is not a parameter of the sharded" in msgs["name"]
    assert "a (3,) tensor is not a parameter" in msgs["foreign"]


def _hybrid(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Hybrid 2x2 at stage 3: rank 3 (the second replica group) edits; every rank holds
    its edit afterwards, masters and compute weights alike."""
    model = make_model(PRESET)
    model, _ = zeroshard.shard(model, torch.optim.AdamW, stage=3, lr=1e-2, hybrid=(2, 2))
    with zeroshard.gathered_parameters(model, "tok_emb.weight", modifier_rank=3) as full:
        full["tok_emb.weight"][ROW].fill_(float(rank))  # each rank writes its own number
    x = torch.tensor([[ROW, 1, 2]])
    with torch.no_grad():
        logits = model(x)  # the compute weights (gathered at stage 3)
    return {"master": zeroshard.full_state_dict(model)["tok_emb.weight"][ROW],
            "logits": logits}


def test_hybrid_sharding_takes_the_modifier_s_values_everywhere() -> None:
    plain = make_model(PRESET)
    with torch.no_grad():
        plain.tok_emb.weight[ROW].fill_(3.0)
        want = plain(torch.tensor([[ROW, 1, 2]]))
    for r in run_ranks(_hybrid, 4, timeout=300):
        assert torch.equal(r["master"], torch.full_like(r["master"], 3.0))
        torch.testing.assert_close(r["logits"], want, rtol=1e-6, atol=1e-6)


def _misuse(rank: int, world: int) -> dict[str, str]:
    """gpt2-tiny (lm_head.weight is tok_emb.weight's alias) at stage 3."""
    model = make_model("gpt2-tiny")
    model, _ = zeroshard.shard(model, torch.optim.AdamW, stage=3, lr=1e-2)
    out = {}
    with zeroshard.gathered_parameters(model, ["lm_head.weight"], modifier_rank=0) as full:
        out["alias_keys"] = ",".join(full)  # the name given
        if rank == 0:
            full["lm_head.weight"][0].fill_(1.0)
    out["alias_written"] = str(float(zeroshard.full_state_dict(model)["tok_emb.weight"][0, 0]))
    try:
        with zeroshard.gathered_parameters(model, ["norm_f.weight"], modifier_rank=0) as full:
            if rank == 0:  # a larger tensor where the copy was: refused on every rank
                full["norm_f.weight"] = torch.zeros(full["norm_f.weight"].numel() + 8)
    except ValueError as e:
        out["resized"] = str(e)
    try:
        with zeroshard.gathered_parameters(model, ["norm_f.weight"], modifier_rank=1):
            if rank == 1:
                raise KeyError("user code failed on rank 1")
    except KeyError as e:
        out["raised"] = f"KeyError: {e}"
    except RuntimeError as e:
        out["raised"] = f"RuntimeError: {e}"
    return out


def test_misuse_is_named_on_every_rank_and_writes_nothing() -> None:
    """Keys are the names given (an alias included); a resized copy, or an exception in
    the block on one rank, ends the block on every rank with an error, nothing written."""
    r0, r1 = run_ranks(_misuse, 2, timeout=120)
    for r in (r0, r1):
        assert r["alias_keys"] == "lm_head.weight" and r["alias_written"] == "1.0", r
        assert "changed shape or dtype" in r["resized"], r
        assert "resize the model before zeroshard.shard()" in r["resized"], r
    assert "'norm_f.weight' is now (" in r0["resized"]
    assert r1["raised"] == "KeyError: 'user code failed on rank 1'"
    assert r0["raised"].startswith("RuntimeError: gathered_parameters(): another rank raised")
