"""Model factories for benchmark runs (``zeroshard bench --model-factory benchmarks.models:NAME``)."""

from __future__ import annotations

import dataclasses

from torch import nn

from zeroshard.models import build_model, get_preset


def gpt2_small_1k() -> nn.Module:
    """gpt2-small's shape (8 x 512, ~25M parameters) at a 1024-token context."""
    return build_model(dataclasses.replace(get_preset("gpt2-small"), seq_len=1024))


def gpt2_small_1k_dropout() -> nn.Module:
    """The same with dropout 0.1: CPU attention then stores its probabilities (a·s² per
    layer), the term selective checkpointing exists to drop."""
    cfg = dataclasses.replace(get_preset("gpt2-small"), seq_len=1024, dropout=0.1)
    return build_model(cfg)
