"""Sharded checkpoints: save, resume, reshard, consolidate.

``save_checkpoint(path, model, optimizer, extra)`` writes, from every rank, only what that
rank owns (its 1-D pieces of each parameter's fp32 master weights and optimizer state)
through ``torch.distributed.checkpoint``; ``load_checkpoint(path, model, optimizer)``
reads them back at any world size and any ZeRO stage and returns ``extra``;
``consolidate(path, out)`` streams the full weights into one safetensors file with
bounded memory. See docs/checkpoints.md.
"""

from __future__ import annotations

from .async_save import AsyncCheckpoint
from .consolidate import CheckpointReader, consolidate
from .full import full_optimizer_state
from .load import load_checkpoint
from .manifest import CheckpointError, latest_checkpoint, step_dir
from .save import save_checkpoint

__all__ = [
    "AsyncCheckpoint",
    "CheckpointError",
    "CheckpointReader",
    "consolidate",
    "full_optimizer_state",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "step_dir",
]
