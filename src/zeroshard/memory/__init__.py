"""Memory accounting: the category tracker and the saved-activation counter."""

from __future__ import annotations

from zeroshard.memory.saved import SavedTensorCounter, record_kept
from zeroshard.memory.tracker import Category, MemoryTracker

__all__ = ["Category", "MemoryTracker", "SavedTensorCounter", "record_kept"]
