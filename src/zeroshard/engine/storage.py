"""Whether two tensors share memory, in a way that also holds for fake tensors.

Not ``data_ptr()``: fake tensors (traced planning, memory/traced.py) have null-based data
pointers, so every storage's first element would compare equal.
"""

from __future__ import annotations

import torch

__all__ = ["shares", "same_memory"]


def shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same storage (at any offset)."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same storage, same offset."""
    return shares(a, b) and a.storage_offset() == b.storage_offset()
