"""Each configuration steps with the torch it built against, not the one the others left.

[Note: the rows must not touch each other]
All configurations live in the same rank processes (see [Note: interleaving] in
worker.py), so whatever one system changes in torch's own namespaces reaches every row
that steps after it. DeepSpeed's ZeRO-3 does: ``deepspeed.initialize`` replaces
``torch.nn.functional.linear`` with its memory-efficient linear (``zero3_linear_wrap``)
for the whole process ("This will persist unless manually reset"). With a ``ds-z3`` row
in the run, every other row's linears went through DeepSpeed's autograd function, and
``zs-s3-selective-op`` ended 0.6% off DDP's loss (gpt2-small; 0.03% on gpt2-tiny).

So a configuration's build is watched: :meth:`TorchPatches.during` compares the
attributes of torch's namespaces (:data:`NAMESPACES`) before and after it, puts torch's
own back at once, and keeps the replacements; the worker installs them for that
configuration's steps only (``with patches:``) and removes them after. Replacements are
compared by identity; a submodule imported on the way is not a replacement. A system
that patches torch lazily during a step, or mutates a registry in place, is not seen.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed
import torch.nn.functional
import torch.utils.checkpoint

__all__ = ["NAMESPACES", "TorchPatches"]

#: Where systems replace torch's functions: the functional API, tensor and module methods,
#: the top-level ops and constructors, checkpointing, collectives.
NAMESPACES: tuple[Any, ...] = (torch, torch.nn.functional, torch.Tensor, torch.nn.Module,
                               torch.utils.checkpoint, torch.distributed)

_Key = tuple[int, str]


def _snapshot() -> dict[_Key, Any]:
    return {(i, name): value for i, ns in enumerate(NAMESPACES)
            for name, value in list(vars(ns).items())}


class TorchPatches:
    """What one configuration's build replaced in torch (see [Note: the rows must not
    touch each other]); a context manager that puts the replacements in place."""

    def __init__(self, ours: dict[_Key, Any], theirs: dict[_Key, Any]) -> None:
        self._ours, self._theirs = ours, theirs  # torch's values, the system's values

    @classmethod
    @contextmanager
    def during(cls, found: list[TorchPatches]) -> Iterator[None]:
        """Watch a build: on exit (raised or not) torch's own attributes are back, and
        ``found`` holds one :class:`TorchPatches` with what the build replaced."""
        before = _snapshot()
        try:
            yield
        finally:
            after = _snapshot()
            changed = [k for k, v in before.items()
                       if k in after and after[k] is not v
                       and not isinstance(after[k], types.ModuleType)]
            patches = cls({k: before[k] for k in changed}, {k: after[k] for k in changed})
            patches._set(patches._ours)
            found.append(patches)

    @property
    def names(self) -> list[str]:
        """The replaced attributes, e.g. ``torch.nn.functional.linear``."""
        return sorted(f"{_name(NAMESPACES[i])}.{attr}" for i, attr in self._theirs)

    def __bool__(self) -> bool:
        return bool(self._theirs)

    def __enter__(self) -> None:
        self._set(self._theirs)

    def __exit__(self, *exc: Any) -> None:
        self._set(self._ours)

    @staticmethod
    def _set(values: dict[_Key, Any]) -> None:
        for (i, attr), value in values.items():
            setattr(NAMESPACES[i], attr, value)


def _name(ns: Any) -> str:
    return ns.__name__ if isinstance(ns, types.ModuleType) else f"{ns.__module__}.{ns.__qualname__}"
