"""zeroshard: sharded data parallelism (ZeRO stages 0-3) with measured accounting."""

from __future__ import annotations

from . import models
from ._version import __version__
from .api import engine_of, full_state_dict, memory_tracker, shard_for_inference
from .comm import CollectiveError, CollectiveMismatch, CollectiveTimeout, CommLedger, CommRecord
from .config import ShardConfig
from .engine.outside_unit import ParameterOutsideUnit
from .front import shard
from .gather import gathered, register_forward_method
from .gathered_params import gathered_parameters
from .join import join
from .stream import stream_weights

# Checkpoints load on first use: torch.distributed.checkpoint imports DTensor (~0.7 s a
# process), which `zeroshard plan`, the bench's parent and most scripts never need.
_STATE = ("CheckpointError", "consolidate", "latest_checkpoint", "load_checkpoint",
          "save_checkpoint")


def __getattr__(name: str):
    if name in _STATE:
        from . import state

        return getattr(state, name)
    raise AttributeError(f"module 'zeroshard' has no attribute {name!r}")


__all__ = [
    "__version__",
    "models",
    "shard",
    "shard_for_inference",
    "full_state_dict",
    "engine_of",
    "memory_tracker",
    "gathered",
    "gathered_parameters",
    "register_forward_method",
    "stream_weights",
    "join",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "consolidate",
    "CheckpointError",
    "ShardConfig",
    "CommLedger",
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "ParameterOutsideUnit",
    "CommRecord",
]
