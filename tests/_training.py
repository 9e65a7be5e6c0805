"""Shared training loops for the parity tests: one sharded, one unsharded reference.

Both see the same global batch at every step (zeroshard.data.TokenLoader), so sharded
training at any world size must reproduce the reference up to float rounding.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

import zeroshard
from zeroshard.data import SyntheticLanguage, TokenLoader
from zeroshard.models import build_model, get_preset

GLOBAL_BATCH = 12  # divisible by worlds 1, 2, 3, and each rank's share by 2
STEPS = 3


def make_model(preset: str, seed: int = 0, freeze: str | None = None) -> torch.nn.Module:
    cfg = get_preset(preset)
    model = build_model(preset, seed=seed)
    if freeze:
        model.get_parameter(freeze).requires_grad_(False)
    del cfg
    return model


def make_optimizer_kwargs(opt: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    if opt == "sgd":
        return torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}
    return torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}


def loader(preset: str, rank: int, world: int) -> TokenLoader:
    cfg = get_preset(preset)
    src = SyntheticLanguage(cfg.vocab, cfg.seq_len // 4, seed=1)
    return TokenLoader(src, global_batch=GLOBAL_BATCH, rank=rank, world_size=world)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def train_sharded(
    rank: int, world: int, *, preset: str = "gpt2-tiny", stage: int = 0, opt: str = "adamw",
    clip: float | None = None, accum: int = 1, use_no_sync: bool = True,
    freeze: str | None = None, **options: Any,
) -> dict[str, torch.Tensor]:
    model = make_model(preset, freeze=freeze)
    cls, kwargs = make_optimizer_kwargs(opt)
    model, optim = zeroshard.shard(model, cls, stage=stage, **options, **kwargs)
    data = loader(preset, rank, world)
    for _ in range(STEPS):
        micro = data.micro_batches(accum)
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            if use_no_sync and not last:
                with model.no_sync():
                    (loss_of(model, x, y) / accum).backward()
            else:
                (loss_of(model, x, y) / accum).backward()
        if clip is not None:
            optim.clip_grad_norm_(clip)
        optim.step()
        optim.zero_grad()
    return zeroshard.full_state_dict(model)


def train_reference(
    *, preset: str = "gpt2-tiny", opt: str = "adamw", clip: float | None = None,
    freeze: str | None = None, split: int = 1, **_: Any,
) -> dict[str, torch.Tensor]:
    """Single process, whole global batch, plain torch optimizer.

    ``split=2`` sums the gradient over two halves of the batch instead: the same
    arithmetic re-associated, i.e. what any data-parallel run does. Its deviation from
    ``split=1`` measures how much float rounding this configuration amplifies (Adam
    turns near-zero gradient elements' rounding into whole-lr steps).
    """
    model = make_model(preset, freeze=freeze)
    cls, kwargs = make_optimizer_kwargs(opt)
    optim = cls([p for p in model.parameters() if p.requires_grad], **kwargs)
    data = loader(preset, 0, 1)
    for _ in range(STEPS):
        for x, y in data.micro_batches(split):
            (loss_of(model, x, y) / split).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optim.step()
        optim.zero_grad()
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def train_ddp(rank: int, world: int, *, preset: str = "gpt2-tiny", **_: Any):
    """torch DDP on the same batches: its deviation from the reference is the yardstick."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(preset)
    ddp = DDP(model)
    cls, kwargs = make_optimizer_kwargs("adamw")
    optim = cls(model.parameters(), **kwargs)
    data = loader(preset, rank, world)
    for _ in range(STEPS):
        x, y = next(data)
        loss_of(ddp, x, y).backward()
        optim.step()
        optim.zero_grad()
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


class Bf16Recipe:
    """The unsharded bf16 recipe zeroshard's bf16 mixed precision must equal: the model
    computes in bf16 and accumulates bf16 gradients, fp32 masters take the step."""

    def __init__(self, model: torch.nn.Module, optimizer: type[torch.optim.Optimizer],
                 **kwargs: Any) -> None:
        self.model = model
        self.names = [n for n, _ in model.named_parameters()]
        self.master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
        model.to(torch.bfloat16)
        self.optim = optimizer(self.master, **kwargs)

    def step(self) -> None:
        """The accumulated bf16 gradients into the masters, a step, the masters back."""
        for m, p in zip(self.master, self.model.parameters()):
            m.grad = p.grad.float() if p.grad is not None else None
            p.grad = None
        self.optim.step()
        self.optim.zero_grad()
        with torch.no_grad():
            for m, p in zip(self.master, self.model.parameters()):
                p.copy_(m)

    def weights(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, (m.detach().clone() for m in self.master)))


def rel_diffs(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """||got - ref|| / ||ref|| per parameter (same keys and shapes required)."""
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    out = {}
    for k, r in ref.items():
        g = got[k]
        assert g.shape == r.shape, (k, g.shape, r.shape)
        out[k] = (g - r).norm().item() / (r.norm().item() or 1.0)
    return out


def max_rel_diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(rel_diffs(got, ref).values())


@contextmanager
def zeroshard_log() -> Iterator[list[str]]:
    """The messages zeroshard's logger emits inside (e.g. the units it chose)."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep()
    logging.getLogger("zeroshard").addHandler(handler)
    try:
        yield records
    finally:
        logging.getLogger("zeroshard").removeHandler(handler)
