"""Count the bytes autograd keeps for backward ("saved activations").

How it works
------------
Every autograd op that needs an input or output in its backward formula hands that
tensor to the innermost pair of ``torch.autograd.graph.saved_tensors_hooks``. Our *pack*
hook looks at the tensor, records its storage, and returns the tensor unchanged, so
training behaves exactly as without the hook.

Only the innermost hook pair is ever called. To let a :class:`SavedTensorCounter` and a
:class:`~zeroshard.memory.tracker.MemoryTracker` (or two counters) be active at once,
every observer installs the same fan-out hook, which notifies *all* active observers.

What is counted (exactly)
-------------------------
* Storage granularity: a saved tensor costs ``untyped_storage().nbytes()`` — the whole
  storage, because that is what stays alive. A saved slice of a big tensor costs the
  big tensor; two views of one storage cost it once.
* Each storage once per counter, however many ops save it (``x`` fed to two linears is
  saved twice by autograd, counted once here). Freed storages stay counted: ``bytes`` is
  the unique bytes saved during the ``with`` block, not the bytes alive at its end.
* Parameters are model state, not activations. With ``exclude_params=True`` (default) a
  saved tensor is skipped when it is an ``nn.Parameter``, a view of one (``weight.t()``
  saved by ``linear``), or shares storage with a tensor from ``params``.
* Not seen: tensors saved inside ``torch.utils.checkpoint`` regions or under other
  ``saved_tensors_hooks`` (e.g. ``save_on_cpu``) installed inside ours — those hooks
  replace ours. Activation checkpointing reports what it keeps with :func:`record_kept`
  (all observers) or ``SavedTensorCounter.active().add_kept(...)`` (one counter).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import nn

__all__ = ["SavedTensorCounter", "record_kept", "storage_of"]


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """Return ``t``'s untyped storage, or None for tensors without one (sparse, nested).

    The storage object is preserved by PyTorch for as long as any tensor uses it, so its
    ``id`` and weak references identify the memory block itself (works for fake tensors:
    their storage is a ``meta`` storage whose ``nbytes()`` is the real size).
    """
    local = getattr(t, "_local_tensor", None)  # a DTensor holds no storage of its own
    if isinstance(local, torch.Tensor):
        t = local
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class _SavedObserver(Protocol):
    def _on_saved(self, t: torch.Tensor) -> None: ...


# Active observers, outermost first. Only the innermost hook pair runs, and it fans out
# to every entry here, so nesting counters and trackers in any order sees everything.
_OBSERVERS: list[_SavedObserver] = []


def _pack(t: torch.Tensor) -> torch.Tensor:
    for obs in tuple(_OBSERVERS):
        obs._on_saved(t)
    return t


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class _ObserveSaved:
    """Install the fan-out hooks for one observer (used by counter and tracker)."""

    def __init__(self, observer: _SavedObserver) -> None:
        self._observer = observer
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> None:
        _OBSERVERS.append(self._observer)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        self._hooks.__enter__()

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None
        _OBSERVERS.remove(self._observer)


def record_kept(tensors: torch.Tensor | Iterable[torch.Tensor]) -> None:
    """Tell every active counter/tracker that ``tensors`` are kept for backward.

    Activation checkpointing calls this for the block inputs it keeps, because inside a
    ``torch.utils.checkpoint`` region the checkpoint's own hooks replace ours.
    """
    for t in _as_tensors(tensors):
        _pack(t)


ParamsArg = nn.Module | Iterable[torch.Tensor] | Callable[[], Iterable[torch.Tensor]] | None


class SavedTensorCounter:
    """Count unique storage bytes saved for backward inside a ``with`` block.

    Args:
        exclude_params: skip parameters (see module docstring). Default True.
        params: extra tensors to treat as parameters, matched by storage: a module
            (its ``parameters()``) or a zero-argument callable returning tensors, both
            re-read at each save (O(params) per save; for engines that swap parameter
            storages, e.g. stage-3 gathered flat buffers), or an iterable of tensors,
            read once at ``__enter__``.

    Attributes:
        bytes: unique storage bytes saved. count: number of unique storages.
        saves: number of tensors packed (duplicates included).
        by_dtype: bytes per dtype (dtype of the first tensor seen on each storage).

    Example::

        with SavedTensorCounter(params=model) as c:
            loss = model(x).sum()
        print(c.bytes, c.by_dtype)
    """

    def __init__(self, *, exclude_params: bool = True, params: ParamsArg = None) -> None:
        self.exclude_params = exclude_params
        self._params = params
        self._fixed_param_ids: set[int] | None = None
        self.bytes = 0
        self.count = 0
        self.saves = 0
        self.by_dtype: dict[torch.dtype, int] = {}
        # id(storage) -> weakref; the callback drops the id when the storage dies so a
        # new storage reusing the address is not mistaken for an old one.
        self._seen: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._observe: _ObserveSaved | None = None

    # -- context -----------------------------------------------------------------------
    def __enter__(self) -> SavedTensorCounter:
        if self._observe is not None:
            raise RuntimeError("SavedTensorCounter is already active; create a new one to nest.")
        if self._params is not None and not callable(self._params):
            # A fixed list of tensors is read once (it could be a one-shot generator).
            self._fixed_param_ids = _storage_ids(_as_tensors(self._params))
        self._observe = _ObserveSaved(self)
        self._observe.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._observe is not None
        self._observe.__exit__(*exc)
        self._observe = None

    @staticmethod
    def active() -> SavedTensorCounter | None:
        """The innermost active counter, or None."""
        for obs in reversed(_OBSERVERS):
            if isinstance(obs, SavedTensorCounter):
                return obs
        return None

    # -- counting ----------------------------------------------------------------------
    def add_kept(self, tensors: torch.Tensor | Iterable[torch.Tensor]) -> None:
        """Count tensors kept for backward by other means (same rules as saved ones)."""
        for t in _as_tensors(tensors):
            self._on_saved(t)

    def _on_saved(self, t: torch.Tensor) -> None:
        self.saves += 1
        st = storage_of(t)
        if st is None or id(st) in self._seen:
            return
        if self.exclude_params and self._is_param(t, st):
            return
        key = id(st)
        self._seen[key] = weakref.ref(st, lambda _ref, key=key: self._seen.pop(key, None))
        nbytes = st.nbytes()
        self.bytes += nbytes
        self.count += 1
        self.by_dtype[t.dtype] = self.by_dtype.get(t.dtype, 0) + nbytes

    def _is_param(self, t: torch.Tensor, st: torch.UntypedStorage) -> bool:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return True
        if self._params is None:
            return False
        if self._fixed_param_ids is not None:
            return id(st) in self._fixed_param_ids
        return id(st) in _storage_ids(_as_tensors(self._params))

    def __repr__(self) -> str:
        return f"SavedTensorCounter(bytes={self.bytes}, count={self.count}, saves={self.saves})"


def _as_tensors(obj: object) -> list[torch.Tensor]:
    """Normalise a tensor / module / iterable / callable of tensors to a list."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, nn.Module):
        return list(obj.parameters())
    if callable(obj):
        obj = obj()
    if isinstance(obj, Iterable):
        out = list(obj)
        bad = [type(x).__name__ for x in out if not isinstance(x, torch.Tensor)]
        if bad:
            raise TypeError(
                f"expected tensors, got {bad[:3]}; pass a tensor, an iterable of tensors, "
                "a module or a callable returning tensors"
            )
        return out
    raise TypeError(
        f"expected a tensor, an iterable of tensors, a module or a callable, got "
        f"{type(obj).__name__}"
    )


def _storage_ids(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {id(st) for t in tensors if (st := storage_of(t)) is not None}
