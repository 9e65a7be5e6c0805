"""zeroshard: sharded data parallelism (ZeRO stages 0-3) with measured accounting."""

from __future__ import annotations

from . import models
from ._version import __version__
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
