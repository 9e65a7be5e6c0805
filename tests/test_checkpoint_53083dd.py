"""Checkpoints written by zeroshard at 53083dd load here, exactly (issue #64's acceptance).

tests/data/checkpoint_53083dd holds two, written at world 2, stage 3 by that commit (the
main before torch's DCP API answered with DTensor shards and before async saves; make.py
there): ``zs-s3`` by ``zeroshard.save_checkpoint``, ``dcp-s3`` by ``get_state_dict`` +
``dcp.save`` (whole tensors then). Each loads into a fresh model — ``zs-s3`` by
``load_checkpoint`` at world 2 stage 1 and world 1 stage 3, ``dcp-s3`` by torch's recipe
(``get_state_dict``, now DTensor shards, -> ``dcp.load`` -> ``set_state_dict``) at world 2
stage 3 and stage 1 — holding the weights and optimizer state they were saved with,
``torch.equal`` on every tensor.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import zeroshard
from zeroshard.models import build_model, get_preset
from zeroshard.state import full_optimizer_state, load_checkpoint
from zeroshard.testing import run_ranks, sweep

DATA = Path(__file__).resolve().parent / "data" / "checkpoint_53083dd"
GPT2 = dataclasses.replace(get_preset("gpt2-tiny"), n_layers=2, hidden=16, n_heads=2,
                           seq_len=16, vocab=37)  # as make.py built it


def _load(name: str, stage: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = zeroshard.shard(build_model(GPT2, seed=9), torch.optim.AdamW, stage=stage,
                                   lr=1e-2, weight_decay=0.1)
    if name == "zs-s3":
        extra = load_checkpoint(DATA / name, model, optim)
        assert extra == {"step": 3}
    else:
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(DATA / name))
        set_state_dict(model, optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    return {"model": zeroshard.full_state_dict(model), "optim": full_optimizer_state(model, optim)}


def _grid(rank: int, world: int, grid: list[dict]) -> list[dict]:
    return sweep(_load, grid)


def _check(got: dict, name: str) -> None:
    want = torch.load(DATA / f"{name}.expected.pt", weights_only=True)
    assert got["model"].keys() == want["model"].keys()
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), (name, k)
    for p, entry in want["optim"].items():
        for k, v in entry.items():
            assert torch.equal(torch.as_tensor(got["optim"][p][k]), torch.as_tensor(v)), (name, p, k)


def test_checkpoints_of_53083dd_load_exactly() -> None:
    grid = [{"name": "zs-s3", "stage": 1}, {"name": "dcp-s3", "stage": 3},
            {"name": "dcp-s3", "stage": 1}]
    for rank in run_ranks(_grid, 2, grid, timeout=120):
        for point, got in zip(grid, rank):
            _check(got, point["name"])
    (got,) = run_ranks(_grid, 1, [{"name": "zs-s3", "stage": 3}], timeout=120)[0]
    _check(got, "zs-s3")
