"""Checkpoints in the previous format (version 1: flattened 1-D pieces, ShardedTensor) load.

tests/data/checkpoint_v1 holds three, written by zeroshard at 83f4139 (make.py there):
gpt2 at stage 2 and llama with a frozen weight at stage 3 (world 2), and llama on a
(dp 2, tp 2) mesh at stage 3 — with the whole weights and optimizer state they held when
saved. Each loads at other worlds, stages and layouts, exactly: ``torch.equal`` on every
weight and every optimizer state tensor.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import zeroshard
from zeroshard.models import build_model, get_preset
from zeroshard.state import CheckpointReader, full_optimizer_state, load_checkpoint
from zeroshard.testing import run_ranks, sweep

DATA = Path(__file__).resolve().parent / "data" / "checkpoint_v1"
# as make.py built them
GPT2 = dataclasses.replace(get_preset("gpt2-tiny"), n_layers=1, hidden=16, n_heads=2,
                           seq_len=16, vocab=37)
LLAMA = dataclasses.replace(get_preset("llama-tiny"), n_layers=1, hidden=16, n_heads=4,
                            n_kv_heads=2, seq_len=16, vocab=37, intermediate=24)
TP_LLAMA = dataclasses.replace(LLAMA, n_kv_heads=4, seq_len=32)
FROZEN = "blocks.0.attn.q_proj.weight"


def _model(name: str, stage: int, tp: str | None, **options: Any):
    if name == "tp-dp2xtp2-s3":
        torch.manual_seed(5)
        model = build_model(TP_LLAMA)
    else:
        model = build_model(GPT2 if name == "gpt2-s2" else LLAMA, seed=5)
    if name == "llama-frozen-s3":
        model.get_parameter(FROZEN).requires_grad_(False)
    if tp is not None:
        from _tp import parallelize_llama, tp_mesh

        mesh = tp_mesh(tp)
        parallelize_llama(model, mesh["tp"])
        options["mesh"] = mesh
    return zeroshard.shard(model, torch.optim.AdamW, stage=stage, lr=1e-2, weight_decay=0.1,
                           **options)


def _load(rank: int, world: int, grid: list[dict]) -> list:
    def point(name: str, stage: int, tp: str | None = None, **options: Any) -> Any:
        model, optim = _model(name, stage, tp, **options)
        extra = load_checkpoint(DATA / name, model, optim)
        return extra, zeroshard.full_state_dict(model), full_optimizer_state(model, optim)

    return sweep(point, grid)


def _check(point: dict, got: tuple) -> None:
    extra, weights, optim = got
    want = torch.load(DATA / f"{point['name']}.expected.pt")
    assert extra["step"] == (2 if point["name"].startswith("tp") else 3), point
    assert weights.keys() == want["model"].keys(), point
    bad = [k for k, v in want["model"].items() if not torch.equal(weights[k], v)]
    assert optim.keys() == want["optim"].keys(), point
    bad += [f"{n}.{k}" for n, st in want["optim"].items() for k, v in st.items()
            if not torch.equal(torch.as_tensor(optim[n][k]), torch.as_tensor(v))]
    assert not bad, f"{point}: differ in {bad[:6]}"


GRID_2 = [{"name": "gpt2-s2", "stage": 3, "mixed_precision": "bf16"},
          {"name": "llama-frozen-s3", "stage": 2},  # the frozen weight outside buckets
          {"name": "tp-dp2xtp2-s3", "stage": 1}]
GRID_4 = [{"name": "tp-dp2xtp2-s3", "stage": 2, "tp": "dp2xtp2"},  # rows, columns, norms
          {"name": "gpt2-s2", "stage": 1}]
GRID_1 = [{"name": "gpt2-s2", "stage": 0}, {"name": "llama-frozen-s3", "stage": 3}]


@pytest.mark.parametrize("world,grid", [(2, GRID_2), (4, GRID_4), (1, GRID_1)],
                         ids=["world2", "world4-tp", "world1"])
def test_version_1_checkpoints_load_exactly(world: int, grid: list[dict]) -> None:
    for point, got in zip(grid, run_ranks(_load, world, grid, timeout=300)[0]):
        _check(point, got)


def test_version_1_checkpoints_read_and_consolidate(tmp_path: Path) -> None:
    """One process: ``CheckpointReader`` (what consolidate and the framework exports use)
    reads the flattened tensors in their shapes."""
    import safetensors.torch

    want = torch.load(DATA / "tp-dp2xtp2-s3.expected.pt")
    reader = CheckpointReader(DATA / "tp-dp2xtp2-s3")
    for k, v in want["model"].items():
        assert torch.equal(reader.tensor(k), v), k
    name = "blocks.0.attn.out_proj.weight"  # row-wise under tp: columns in the pieces
    assert torch.equal(reader.optimizer_state(name, "exp_avg"), want["optim"][name]["exp_avg"])
    zeroshard.state.consolidate(DATA / "gpt2-s2", tmp_path / "out.safetensors")
    flat = safetensors.torch.load_file(tmp_path / "out.safetensors")
    want = torch.load(DATA / "gpt2-s2.expected.pt")["model"]
    assert all(torch.equal(flat[k], v) for k, v in want.items())
