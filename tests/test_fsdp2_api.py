"""FSDP2's module methods on a sharded model (issue #28, item 3).

A torchtitan-style loop written for ``fully_shard`` calls ``set_requires_gradient_sync``
for accumulation and may tune resharding: those mean the same here; the FSDP2 methods
without a meaning in zeroshard raise naming what it does instead.
"""

from __future__ import annotations

import pytest
import torch
from _training import loader, loss_of, make_model

import zeroshard
from zeroshard.testing import run_ranks


def _accumulate(rank: int, world: int, how: str) -> dict:
    model, optim = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=3,
                                   lr=1e-2)
    engine = zeroshard.engine_of(model)
    data = loader("gpt2-tiny", rank, world)
    gathered_after_forward = []
    for _ in range(2):
        micro = data.micro_batches(2)
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            if how == "fsdp2":
                model.set_requires_gradient_sync(last)  # torchtitan's accumulation
                loss = loss_of(model, x, y) / 2
                gathered_after_forward.append(engine.unsharded_bytes)
                loss.backward()
            elif how == "keep":
                model.set_reshard_after_forward(False)
                model.set_requires_gradient_sync(last)
                loss = loss_of(model, x, y) / 2
                gathered_after_forward.append(engine.unsharded_bytes)
                loss.backward()
            elif last:
                (loss_of(model, x, y) / 2).backward()
            else:
                with model.no_sync():
                    (loss_of(model, x, y) / 2).backward()
        optim.step()
        optim.zero_grad()
        model.reshard()  # between steps: nothing stays gathered
        assert engine.unsharded_bytes == 0
    return {"weights": zeroshard.full_state_dict(model), "gathered": gathered_after_forward}


def _all(rank: int, world: int) -> dict:
    return {how: _accumulate(rank, world, how) for how in ("no_sync", "fsdp2", "keep")}


def test_set_requires_gradient_sync_and_reshard_after_forward() -> None:
    out = run_ranks(_all, 2, timeout=180)[0]
    ref = out["no_sync"]["weights"]
    for k, v in out["fsdp2"]["weights"].items():
        assert torch.equal(v, ref[k]), k  # the same arithmetic as no_sync()
    root_only = min(out["fsdp2"]["gathered"])
    assert all(g > root_only for g in out["keep"]["gathered"])  # the blocks stay gathered
    for k, v in out["keep"]["weights"].items():
        assert torch.equal(v, ref[k]), k  # keeping them changes nothing but memory


def _refusals(rank: int, world: int) -> dict:
    model, _ = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=3, lr=1e-2)
    out = {}
    # (unshard() has FSDP2's meaning: tests/test_generation.py)
    for name, call in [("set_reshard_after_backward",
                        lambda: model.set_reshard_after_backward(False)),
                       ("set_modules_to_forward_prefetch",
                        lambda: model.set_modules_to_forward_prefetch([])),
                       ("set_modules_to_backward_prefetch",
                        lambda: model.set_modules_to_backward_prefetch([])),
                       ("set_is_last_backward", lambda: model.set_is_last_backward(True))]:
        try:
            call()
            out[name] = "no error"
        except NotImplementedError as e:
            out[name] = str(e)
    m2, _ = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=2, lr=1e-2)
    try:
        m2.set_reshard_after_forward(False)
        out["stage2"] = "no error"
    except ValueError as e:
        out["stage2"] = str(e)
    m2.reshard()  # nothing gathered at stage 2: a no-op, as FSDP2's on a resharded module
    return out


@pytest.mark.parametrize(("name", "says"), [
    ("set_reshard_after_backward", "no_sync()"),
    ("set_modules_to_forward_prefetch", "prefetch=k"),
    ("set_modules_to_backward_prefetch", "prefetch=k"),
    ("set_is_last_backward", "no_sync()"), ("stage2", "applies at stage 3"),
])
def test_fsdp2_methods_without_a_meaning_say_what_to_use(name: str, says: str) -> None:
    msg = _refusal_messages()[name]
    assert says in msg, msg


_CACHE: dict = {}


def _refusal_messages() -> dict:
    if not _CACHE:
        _CACHE.update(run_ranks(_refusals, 2, timeout=120)[0])
    return _CACHE


def _dcp_state_dict(rank: int, world: int) -> bool:
    """torch.distributed.checkpoint.state_dict's get_state_dict / set_state_dict round trip
    (FSDP2 loops save with it): a fresh sharded model and optimizer continue exactly."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build():
        return zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=3, lr=1e-2)

    data = loader("gpt2-tiny", rank, world)
    batches = [next(data) for _ in range(3)]
    model, optim = build()
    for x, y in batches[:2]:
        loss_of(model, x, y).backward()
        optim.step()
        optim.zero_grad()
    msd, osd = get_state_dict(model, optim)
    model2, optim2 = build()
    set_state_dict(model2, optim2, model_state_dict=msd, optim_state_dict=osd)
    for m, o in ((model, optim), (model2, optim2)):
        x, y = batches[2]
        loss_of(m, x, y).backward()
        o.step()
        o.zero_grad()
    a, b = zeroshard.full_state_dict(model), zeroshard.full_state_dict(model2)
    return all(torch.equal(a[k], b[k]) for k in a)


def test_torch_get_state_dict_set_state_dict_round_trip() -> None:
    assert all(run_ranks(_dcp_state_dict, 2, timeout=120))
