"""zeroshard: sharded data parallelism (ZeRO stages 0-3) with measured accounting."""

from __future__ import annotations

from .api import engine_of, full_state_dict, memory_tracker, shard
from .comm import CommLedger, CommRecord
from .config import ShardConfig
from .join import join

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "shard",
    "full_state_dict",
    "engine_of",
    "memory_tracker",
    "join",
    "ShardConfig",
    "CommLedger",
    "CommRecord",
]
