"""Build a reference model from a preset name or a config, and count its parameters."""

from __future__ import annotations

import torch
from torch import nn

from .config import GPT2Config, LlamaConfig, ModelConfig, get_preset
from .gpt2 import GPT2
from .llama import Llama

__all__ = ["build_model", "param_count"]


def build_model(
    preset_or_config: str | ModelConfig,
    *,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> nn.Module:
    """The model for a preset name (see ``PRESETS``) or a config, initialised with ``seed``.

    ``device="meta"`` allocates nothing and skips init; ``materialize(model, device,
    seed)`` later gives bitwise the same model as building on ``device`` directly.
    """
    config = get_preset(preset_or_config) if isinstance(preset_or_config, str) else preset_or_config
    if isinstance(config, GPT2Config):
        return GPT2(config, device=device, seed=seed)
    if isinstance(config, LlamaConfig):
        return Llama(config, device=device, seed=seed)
    raise TypeError(
        f"build_model takes a preset name, GPT2Config or LlamaConfig, got "
        f"{type(preset_or_config).__name__}"
    )


def param_count(model: nn.Module) -> int:
    """Number of parameter elements, each tied tensor counted once (works on meta)."""
    return sum(p.numel() for p in model.parameters())
