"""zeroshard: sharded data parallelism (ZeRO stages 0-3) with measured accounting."""

from __future__ import annotations

__version__ = "0.1.0"  # before the imports below: zeroshard.state reads it

from . import models
from .api import engine_of, full_state_dict, memory_tracker, shard
from .comm import CommLedger, CommRecord
from .config import ShardConfig
from .join import join
from .state import (
    CheckpointError,
    consolidate,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

__all__ = [
    "__version__",
    "models",
    "shard",
    "full_state_dict",
    "engine_of",
    "memory_tracker",
    "join",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "consolidate",
    "CheckpointError",
    "ShardConfig",
    "CommLedger",
    "CommRecord",
]
