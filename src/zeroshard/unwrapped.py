"""``model.module``: what DDP's gives, a module with no ``.module`` of its own.

[Note: DDP's unwrap idiom]
DDP scripts reach the wrapped model as ``model.module``, and generic code unwraps by
recursion — timm's ``unwrap_model`` (``return unwrap_model(model.module) if
hasattr(model, "module") else model``), transformers' ``unwrap_model``, ``while
hasattr(m, "module"): m = m.module``. zeroshard's model is the user's model (its class
mixed with ShardedModule, ``isinstance(model, UserClass)`` holds), so there is no inner
module to hand out, and answering ``model.module`` with ``model`` itself made every such
loop recurse until ``RecursionError``.

So ``model.module`` is the model's *twin*: an instance of a subclass of the model's class
whose ``__dict__`` **is** the model's ``__dict__`` (the same dict object, not a copy).
Everything a module is lives in that dict — parameters, buffers, submodules, hooks (the
engine's forward hooks among them), ``training``, the engine — so the twin's
``state_dict()``, ``load_state_dict()``, ``named_buffers()`` (timm's ``distribute_bn``),
``parameters()``, ``forward``, ``train()``/``eval()`` and attribute writes are the model's,
exactly, at every stage, at no cost; ``isinstance(twin, UserClass)`` holds, as it does for
DDP's ``module``. The twin's class answers ``module`` with the user's own submodule of that
name if it has one and otherwise raises AttributeError (``hasattr`` is False), so every
unwrap loop ends after one step, as under DDP. One twin per model, kept in the shared dict
(a cycle the collector frees with the model), so ``model.module is model.module``, as
under DDP.

What differs from DDP: ``model.module is not model`` (under DDP too) but the two are the
same module in every other respect; ``copy.deepcopy`` of either is refused alike (see
ShardedModule.__deepcopy__).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["twin_of"]

_KEY = "_zeroshard_twin_of_model"
_CLASSES: dict[type, type] = {}


class _Unwrapped:
    """Mixed in front of the sharded model's class for its twin (see the Note)."""

    _zeroshard_twin = True

    @property
    def module(self) -> nn.Module:
        sub = self._modules.get("module")  # type: ignore[attr-defined]
        if sub is None:  # what DDP's inner module answers: no such attribute
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute 'module' (it is already "
                "the unwrapped model, as DistributedDataParallel's model.module is)")
        return sub


def _twin_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (_Unwrapped, cls), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "_zeroshard_swapped": True})
    return _CLASSES[cls]


def twin_of(model: nn.Module) -> nn.Module:
    """The model's twin: the same module, whose ``.module`` does not exist."""
    twin = model.__dict__.get(_KEY)
    if twin is None or type(twin).__mro__[2] is not type(model):
        twin = object.__new__(_twin_class(type(model)))
        # The same dict object: parameters, hooks, the engine, ``training`` are shared.
        object.__setattr__(twin, "__dict__", model.__dict__)
        model.__dict__[_KEY] = twin
    return twin


def is_twin(module: Any) -> bool:
    return bool(getattr(type(module), "_zeroshard_twin", False))
