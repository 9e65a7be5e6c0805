"""Optimizer chunks (engine/chunks.py): cutting masters changes nothing but speed.

The torch optimizer steps each master as ≤CHUNK-element views. Small chunks (CHUNK=1000,
so every bucket is cut into many, with ranges that straddle parameters) must train,
checkpoint and reload bit for bit like one chunk per master, including parameters no
rank used (their ranges and state are restored after the step) and torch's own
optimizer ``state_dict`` round trip.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch
from _training import loader, loss_of, make_model

import zeroshard
import zeroshard.engine.chunks as chunks
from zeroshard.engine.flat import FlatBucket
from zeroshard.state import full_optimizer_state, load_checkpoint, save_checkpoint
from zeroshard.testing import run_ranks, sweep


def _run(rank: int, world: int, root: str, stage: int, mp: str | None, chunk: int,
         opt: str = "adamw") -> dict:
    chunks.CHUNK = chunk
    optim_cls, kw = {"adamw": (torch.optim.AdamW, {"weight_decay": 0.1}),
                     "sgd": (torch.optim.SGD, {"momentum": 0.9})}[opt]

    def build(seed: int):  # llama-tiny with a frozen and an unused parameter
        model = make_model("llama-tiny", seed=seed, freeze="blocks.0.attn.q_proj.weight")
        return zeroshard.shard(model, optim_cls, stage=stage, mixed_precision=mp, lr=1e-2,
                               **kw)

    model, optim = build(0)
    data = loader("llama-tiny", rank, world)
    for i in range(3):
        x, y = next(data)
        if i == 1:  # the head gets no gradient on any rank this step: left untouched
            model(x).sum().mul(0).backward()
        else:
            loss_of(model, x, y).backward()
        optim.step()
        optim.zero_grad()
    engine = zeroshard.engine_of(model)
    out = {"state": zeroshard.full_state_dict(model),
           "optim": full_optimizer_state(model, optim),
           "n_opt": len(engine.master_params()),
           "max_chunk": max(c.numel() for c in engine.master_params())}
    path = Path(root) / f"s{stage}{mp}{chunk}{opt}"
    save_checkpoint(path, model, optim)
    model2, optim2 = build(5)
    load_checkpoint(path, model2, optim2)
    out["reloaded"] = full_optimizer_state(model2, optim2)
    # torch's own state_dict round trip re-creates per-chunk state: flattened again
    optim2.load_state_dict(optim.state_dict())
    out["torch_reloaded"] = full_optimizer_state(model2, optim2)
    chunks.CHUNK = 2**18
    return out


# (stage, mixed precision, optimizer): each trained with CHUNK=1000 and with one chunk
# per master. The default run keeps every stage, precision, optimizer and kind of master:
# the weights themselves (stage 0 fp32), views of ``full`` (stage 2 fp32, SGD), a slice
# master of its own (stage 1 bf16) and both of stage 3. The rest: make slow.
PAIRS = [(s, mp, "adamw") for s in (0, 1, 3) for mp in (None, "bf16")] + [(2, None, "sgd")]
FAST_PAIRS = [(0, None, "adamw"), (1, "bf16", "adamw"), (2, None, "sgd"),
              (3, None, "adamw"), (3, "bf16", "adamw")]
MORE_PAIRS = [p for p in PAIRS if p not in FAST_PAIRS]


def _grid(pairs: list[tuple]) -> list[dict]:
    """Each pair's two runs: small chunks and one chunk per master."""
    return [{"stage": s, "mp": mp, "chunk": c, "opt": opt}
            for s, mp, opt in pairs for c in (1000, 2**30)]


def _all(rank: int, world: int, root: str, grid: list[dict]) -> list:
    return sweep(functools.partial(_run, rank, world, root), grid)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(torch.as_tensor(a[n][k]), torch.as_tensor(b[n][k])) for n in a for k in a[n])


def _check(pairs: list[tuple]) -> None:
    grid = _grid(pairs)
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_all, 2, root, grid, timeout=300)[0]
    by = {tuple(p.values()): r for p, r in zip(grid, results)}
    for stage, mp, opt in pairs:
        small, whole = by[(stage, mp, 1000, opt)], by[(stage, mp, 2**30, opt)]
        assert small["max_chunk"] <= 1000 and small["n_opt"] > 2 * whole["n_opt"]
        for name, ref in whole["state"].items():
            assert torch.equal(small["state"][name], ref), (stage, mp, opt, name)
        assert _equal(small["optim"], whole["optim"]), (stage, mp, opt)
        for r in (small, whole):
            assert _equal(r["reloaded"], r["optim"]), (stage, mp, opt, "checkpoint")
            assert _equal(r["torch_reloaded"], r["optim"]), (stage, mp, opt, "state_dict")


def test_chunked_masters_train_and_checkpoint_bit_for_bit() -> None:
    """Small chunks train, checkpoint and reload like one chunk per master (FAST_PAIRS);
    twin: test_chunked_masters_train_and_checkpoint_bit_for_bit_more_configurations."""
    _check(FAST_PAIRS)


@pytest.mark.slow
def test_chunked_masters_train_and_checkpoint_bit_for_bit_more_configurations() -> None:
    """The same for MORE_PAIRS (stage 0 bf16, stage 1 fp32); twin:
    test_chunked_masters_train_and_checkpoint_bit_for_bit."""
    _check(MORE_PAIRS)


def test_flatten_keeps_each_chunks_own_scalars() -> None:
    p = torch.nn.Parameter(torch.zeros(10))
    b = FlatBucket(0, "b", [(("w",), p)], world=1, rank=0)
    b.master = torch.nn.Parameter(torch.arange(10.0))
    old = chunks.CHUNK
    chunks.CHUNK = 4
    try:
        chunks.make_chunks(b)
    finally:
        chunks.CHUNK = old
    assert [c.numel() for c in b.chunks] == [4, 4, 2]
    state = {c: {"step": torch.tensor(float(i)), "m": torch.full((c.numel(),), float(i))}
             for i, c in enumerate(b.chunks)}
    flat = chunks.bucket_state(state, b)
    assert torch.equal(flat["m"], torch.tensor([0.0] * 4 + [1.0] * 4 + [2.0] * 2))
    assert [float(state[c]["step"]) for c in b.chunks] == [0.0, 1.0, 2.0]  # not merged
    flat["m"].add_(1)  # the chunks' state are views of the flat buffer
    assert float(state[b.chunks[2]]["m"][0]) == 3.0
    chunks.set_bucket_state(state, b, {"step": torch.tensor(7.0), "m": torch.zeros(10)})
    steps = [state[c]["step"] for c in b.chunks]
    assert all(float(s) == 7.0 for s in steps) and len({id(s) for s in steps}) == 3
    chunks.set_bucket_state(state, b, {})
    assert not state and chunks.bucket_state(state, b) == {}
