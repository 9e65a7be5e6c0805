"""Reference models for zeroshard: GPT-2 and Llama, their configs, presets and init.

Both models build on the meta device first and are materialised by ``init_weights``, a
per-parameter function of (seed, name), so a sharded engine can allocate and initialise
one unit at a time and still match an unsharded model bit for bit.
"""

from __future__ import annotations

from .attention import CoreAttention
from .build import build_model, param_count
from .config import PRESETS, GPT2Config, LlamaConfig, ModelConfig, get_preset
from .gpt2 import GPT2, GPT2Block
from .init import init_weights, materialize
from .llama import Llama, LlamaBlock
from .parallel import parallelize_llama

__all__ = [
    "GPT2",
    "PRESETS",
    "CoreAttention",
    "GPT2Block",
    "GPT2Config",
    "Llama",
    "LlamaBlock",
    "LlamaConfig",
    "ModelConfig",
    "build_model",
    "get_preset",
    "init_weights",
    "materialize",
    "parallelize_llama",
    "param_count",
]
