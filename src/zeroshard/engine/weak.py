"""Hooks that hold their objects weakly.

Autograd and module hooks are kept in C++ (or on a module the model outlives), where
Python's collector cannot see a cycle back to the engine: a hook holding the engine
strongly kept every sharded model, its buffers and its process group alive after the
script dropped it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["weakly"]


def weakly(method: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    """``functools.partial(method, *args)`` holding the method's object and the
    objects among ``args`` weakly (numbers as they are): a no-op once they are gone."""
    target = weakref.WeakMethod(method)  # type: ignore[arg-type]
    refs = [(lambda a=a: a) if isinstance(a, (int, float, str)) else weakref.ref(a)
            for a in args]

    def hook(*more: Any) -> Any:
        m, held = target(), [r() for r in refs]
        if m is None or any(h is None for h in held):
            return None
        return m(*held, *more)

    return hook
