"""Memory by category: one tracker for CPU, CUDA and fake tensors.

[Note: what is counted]
Memory is held by *storages*, not tensors: views share one storage and cost it once.
The tracker keeps one small record per live storage, keyed by the storage's identity
(PyTorch preserves one Python storage object per storage for as long as any tensor uses
it). A weak reference with a callback drops the record when the storage is freed, so the
tracker never keeps memory alive. Size is ``untyped_storage().nbytes()``, which is exact
for fake tensors too (their storage is a ``meta`` storage of the real size). Records come
from: storages held by registered sources at ``__enter__``; every tensor output of an op
dispatched while active (as a ``TorchDispatchMode``, including in-place/``out=`` results
and storages grown by ``resize_``); tensors saved for backward; ``label()``.
Storages that existed before ``__enter__`` and belong to no source are not counted unless
they are saved for backward or labelled. After ``__exit__`` frees are still seen,
allocations are not.

[Note: categories are resolved late]
A storage's category can change after it is allocated: a gradient is an op output first
and becomes ``p.grad`` only when autograd accumulates it; optimizer state is created by
plain ops inside ``step()``. So each record caches a category, and a *re-classification*
recomputes all of them, by priority:
``label()`` > registered sources (module params/grads/buffers, optimizer state,
``add_source``) > saved for backward (activations) > other.
Re-classification costs O(live storages + source tensors) and runs when a new total peak
is reached, on ``current()``/``snapshot()``/``report()``/``reset_peak()`` and after each
tracked optimizer step. While memory grows (forward) nearly every op is a new peak, so a
step costs O(ops x (live storages + source tensors)) Python work: fine for planning and
tests, measurable overhead in timed runs (keep the tracker out of throughput numbers). Between re-classifications a new storage gets its category from
its label, the last source scan, or the saved flag; grads of tracked modules are
re-filed as soon as they accumulate (post-accumulate-grad hook).

So ``peak()`` (the breakdown at the moment the *total* was highest) is exact, while
``max_per_category()`` is the maximum of the cached running totals: a storage that becomes
optimizer state during ``step()`` counts as ``other`` until the next re-classification.

[Note: device and host]
Every record also has a *location*, "device" or "host", kept as a second breakdown beside
the by-category one (``current_by_location()``, ``peak_by_location()``, ``report()``). A
storage is host memory when it is on the CPU while the model computes on an accelerator
(``compute_device``), or when a host source (``add_host_source``) lists it: ZeRO-Offload's
masters, optimizer state and gradient copies live in host memory *by design*, which must
show even on a CPU-only machine, where host and device are one memory (there the engine
copies nothing unless forced, and the split is what the layout would be on a GPU).
Each location has its own peak: the device's is what decides whether a run fits.

[Note: inside the optimizer step]
An optimizer step can allocate thousands of small tensors (the state of each parameter,
on the first step), each a new peak. Re-classifying at every one would cost
O(allocations x live storages), so inside a tracked optimizer's ``step()`` (between its
pre- and post-hooks) re-classification on a new peak waits until the total has grown by
1% since the last one, and what the step allocates that no source claims yet is filed
as ``optim`` (it is the optimizer's: state, or its working memory); what a host
optimizer's step allocates (``track_host_step``: offload) is host memory. The post-hook
re-classifies everything.

Fake tensors: enter the tracker inside ``with FakeTensorMode():`` or outside it; both
orders see every op (both are tested). A storage that was once saved for backward stays
``activations`` until it is freed (e.g. an input batch the caller still holds).
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_flatten

from zeroshard.memory.saved import _as_tensors, _ObserveSaved, storage_of
from zeroshard.memory.tally import Tally
from zeroshard.memory.timeline import Timeline

__all__ = ["Category", "MemoryTracker", "Source"]


class Category(str, Enum):
    """What a block of memory is for. Declaration order is the tie-break between sources."""

    PARAMS = "params"
    GRADS = "grads"
    OPTIM = "optim"
    ACTIVATIONS = "activations"
    KV_CACHE = "kv_cache"  # a generation's key/value cache (the sharded model's sources)
    COMM = "comm"
    OTHER = "other"


_RANK = {c: i for i, c in enumerate(Category)}

Source = Callable[[], dict[Category, Iterable[torch.Tensor]]]


@dataclass(eq=False)
class _Record:
    """One live storage: its size and what we know about it."""

    ref: weakref.ref[torch.UntypedStorage]
    nbytes: int
    key: int  # id() of the storage
    cpu: bool  # the storage is in CPU memory
    category: Category = Category.OTHER  # cached; see [Note: categories are resolved late]
    label: Category | None = None
    saved: bool = False
    host: bool = False  # cached location; see [Note: device and host]
    in_step: bool = False  # allocated inside a tracked optimizer's step()
    host_born: bool = False  # allocated by a host optimizer step (track_host_step)

    @property
    def where(self) -> str:
        return "host" if self.host else "device"


LOCATIONS = ("device", "host")


def _plain(d: dict[Category, int]) -> dict[str, int]:
    return {c.value: v for c, v in d.items()}


def _as_category(value: Category | str) -> Category:
    try:
        return Category(value)
    except ValueError:
        choices = ", ".join(c.value for c in Category)
        raise ValueError(f"unknown memory category {value!r}; use one of: {choices}") from None


class MemoryTracker(TorchDispatchMode):
    """Track live tensor storage bytes by :class:`Category` (see module notes).

    Args:
        device: count only storages on this device (``"cuda"``, ``"cuda:1"``, ``"cpu"``);
            None counts all. Fake tensors report the device they pretend to be on.
        compute_device: where the model computes; when it is an accelerator, CPU storages
            count as host memory (see [Note: device and host]). None: all is "device"
            except what host sources list.

    Example::

        tracker = MemoryTracker()
        tracker.track_module(model)
        tracker.track_optimizer(opt)
        with tracker:
            model(x).sum().backward()
            tracker.snapshot("after_backward")
            opt.step()
        tracker.peak()  # {Category.PARAMS: ..., Category.GRADS: ..., ...}
    """

    def __init__(self, *, device: str | torch.device | None = None,
                 compute_device: str | torch.device | None = None) -> None:
        super().__init__()
        self._device = torch.device(device) if device is not None else None
        compute = torch.device(compute_device) if compute_device is not None else None
        self._cpu_is_host = compute is not None and compute.type not in ("cpu", "meta")
        self._live: dict[int, _Record] = {}  # id(storage) -> record
        self._all = Tally(Category)  # bytes by category: now, at the peak, maxima
        # The same, per location (see [Note: device and host]).
        self._at = {w: Tally(Category) for w in LOCATIONS}
        self._host_sources: list[Callable[[], Iterable[torch.Tensor]]] = []
        self._host_ids: set[int] = set()
        self._host_optimizers: list[torch.optim.Optimizer] = []
        self._host_region = False  # inside a host optimizer's step
        self._in_step = False  # see [Note: inside the optimizer step]
        self._classified_total = 0  # the total at the last re-classification
        self._snapshots: dict[str, dict[Category, int]] = {}
        self._timeline: Timeline | None = None  # see record_timeline
        self._sources: list[Source] = []
        self._source_ids: dict[int, Category] = {}  # last source scan, by id(storage)
        self._modules: list[nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._handles: list[Any] = []  # hook handles, removed in __exit__
        self._observe: _ObserveSaved | None = None
        self._orig_resize: Callable[..., Any] | None = None
        self._active = False
        self._busy = False  # re-classifying: ops run by sources are not new memory

    # -- registration ------------------------------------------------------------------
    def track_module(self, module: nn.Module, *, params: bool = True) -> MemoryTracker:
        """Parameters -> params, their ``.grad`` -> grads, buffers -> other.

        ``params=False``: buffers only (a sharded model's parameters view buffers its
        engine files itself: masters under optim, see ``zeroshard.memory_tracker``)."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"track_module expects an nn.Module, got {type(module).__name__}")
        self._modules.append(module)
        if self._active:
            self._hook_module(module)
        if not params:
            return self.add_source(lambda: {Category.OTHER: module.buffers()})
        return self.add_source(
            lambda: {
                Category.PARAMS: module.parameters(),
                Category.GRADS: [p.grad for p in module.parameters() if p.grad is not None],
                Category.OTHER: module.buffers(),
            }
        )

    def track_optimizer(self, optimizer: torch.optim.Optimizer) -> MemoryTracker:
        """Every tensor in ``optimizer.state`` (moments, ``step`` counters) -> optim."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"track_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self._optimizers.append(optimizer)
        if self._active:
            self._hook_optimizer(optimizer)
        return self.add_source(
            lambda: {
                Category.OPTIM: [
                    v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)
                ]
            }
        )

    def add_source(self, fn: Source) -> MemoryTracker:
        """Register ``fn() -> {Category: tensors}``, evaluated at every re-classification.

        ``fn`` must be cheap and must not allocate: it runs at every new total peak.
        """
        if not callable(fn):
            raise TypeError(f"add_source expects a callable returning a dict, got {fn!r}")
        self._sources.append(fn)
        return self

    def track_host_step(self, optimizer: torch.optim.Optimizer) -> MemoryTracker:
        """What ``optimizer.step()`` allocates in CPU memory is host memory (offload: the
        optimizer runs on the host). See [Note: inside the optimizer step]."""
        self._host_optimizers.append(optimizer)
        if self._active:
            self._hook_host_step(optimizer)
        return self

    def add_host_source(self, fn: Callable[[], Iterable[torch.Tensor]]) -> MemoryTracker:
        """Register ``fn() -> tensors`` that live in host memory by design (offload).

        Evaluated with the other sources; see [Note: device and host].
        """
        if not callable(fn):
            raise TypeError(f"add_host_source expects a callable returning tensors, got {fn!r}")
        self._host_sources.append(fn)
        return self

    def label(
        self, tensors: torch.Tensor | Iterable[torch.Tensor], category: Category | str
    ) -> None:
        """File the storages of ``tensors`` under ``category`` (highest priority).

        A label on any view applies to the whole storage, and lasts until it is freed.
        Works inside or outside the ``with`` block; unseen storages start being counted.
        """
        cat = _as_category(category)
        for t in _as_tensors(tensors):
            if (rec := self._track(t)) is not None:
                rec.label = cat
                self._file(rec, None)
        self._after_change()

    # -- measurement -------------------------------------------------------------------
    def current(self) -> dict[Category, int]:
        """Bytes per category now (re-classifies first)."""
        self._after_change(reclassify=True)
        return dict(self._all.now)

    def current_total(self) -> int:
        return self._all.total

    def peak(self) -> dict[Category, int]:
        """Breakdown at the moment the total was highest since the last ``reset_peak``."""
        return dict(self._all.peak)

    def peak_total(self) -> int:
        return self._all.peak_total

    def current_by_location(self) -> dict[str, dict[Category, int]]:
        """``{"device": {category: bytes}, "host": {...}}`` now (re-classifies first)."""
        self._after_change(reclassify=True)
        return {w: dict(t.now) for w, t in self._at.items()}

    def peak_by_location(self) -> dict[str, dict[Category, int]]:
        """Per location, the breakdown at the moment *that location's* total was highest."""
        return {w: dict(t.peak) for w, t in self._at.items()}

    def peak_total_by_location(self) -> dict[str, int]:
        return {w: t.peak_total for w, t in self._at.items()}

    def max_per_category(self) -> dict[Category, int]:
        """Each category's own maximum (may occur at different moments; see notes)."""
        return dict(self._all.max)

    def reset_peak(self) -> None:
        """Restart peak and per-category maxima from the current state."""
        self._reclassify()
        for t in (self._all, *self._at.values()):
            t.reset_peak()
        self._after_change()

    def snapshot(self, label: str) -> dict[Category, int]:
        """Record (and return) the current breakdown under ``label``, e.g. "after_backward"."""
        self._snapshots[label] = self.current()
        return dict(self._snapshots[label])

    def record_timeline(self) -> MemoryTracker:
        """Also keep the bytes by category after every op (see :meth:`timeline`)."""
        self._timeline = Timeline()
        return self

    def mark(self, label: str) -> None:
        """Mark the current point of the timeline (e.g. "backward" when it starts)."""
        if self._timeline is not None:
            self._timeline.mark(label)

    def timeline(self, max_points: int = 600) -> dict[str, Any]:
        """Bytes by category over the ops seen since :meth:`record_timeline`, in op order:
        ``{"op": [...], "<category>": [...], "marks": [[op, label], ...]}``. Runs of ops
        are folded into at most ``max_points`` points, each the op of its run with the
        highest total, so every peak survives. A point's categories are as cached then:
        exact at new peaks (see [Note: categories are resolved late])."""
        timeline = self._timeline or Timeline()
        return timeline.folded([c.value for c in Category], max_points)

    @property
    def snapshots(self) -> dict[str, dict[Category, int]]:
        return {k: dict(v) for k, v in self._snapshots.items()}

    def report(self) -> dict[str, Any]:
        """JSON-ready summary: bytes by category (current, peak, max) and process stats."""
        plain = _plain
        return {
            "current": plain(self.current()),
            "current_total": self._all.total,
            "peak": plain(self._all.peak),
            "peak_total": self._all.peak_total,
            "max_per_category": plain(self._all.max),
            "snapshots": {k: plain(v) for k, v in self._snapshots.items()},
            **{w: {"current": plain(t.now), "current_total": t.total,
                   "peak": plain(t.peak), "peak_total": t.peak_total}
               for w, t in self._at.items()},
            **_process_memory(),
        }

    # -- context -----------------------------------------------------------------------
    def __enter__(self) -> MemoryTracker:
        if self._active:
            raise RuntimeError("this MemoryTracker is already active; use a second tracker to nest")
        self._active = True
        self._after_change(reclassify=True)  # count what the sources hold already
        for module in self._modules:
            self._hook_module(module)
        for opt in self._optimizers:
            self._hook_optimizer(opt)
        for opt in self._host_optimizers:
            self._hook_host_step(opt)
        self._patch_resize()
        self._observe = _ObserveSaved(self)
        self._observe.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        assert self._observe is not None
        self._observe.__exit__(*exc)
        self._observe = None
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._active = False
        # A step that raised never ran its post-hook: do not stay "inside the step".
        self._in_step = self._host_region = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # Let wrapper subclasses (DTensor...) desugar first; we then see their local ops.
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if not self._busy:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._track(t)
            self._after_change()
            if self._timeline is not None:
                self._timeline.record(tuple(self._all.now.values()))
        return out

    # -- internals ---------------------------------------------------------------------
    def _track(self, t: torch.Tensor) -> _Record | None:
        """Return the record of ``t``'s storage, creating it if new (no peak update)."""
        if self._device is not None and not _same_device(t.device, self._device):
            return None
        if (st := storage_of(t)) is None:
            return None
        key = id(st)
        if (rec := self._live.get(key)) is not None:
            self._resize(rec, st.nbytes())  # in-place resize_/set_ may have grown it
            return rec
        rec = _Record(ref=weakref.ref(st, self._on_free_callback(key)), nbytes=st.nbytes(),
                      key=key, cpu=t.device.type == "cpu", in_step=self._in_step,
                      host_born=self._host_region)
        self._live[key] = rec
        self._add(rec, rec.nbytes)
        self._file(rec, self._source_ids.get(key))
        return rec

    def _on_free_callback(self, key: int) -> Callable[[weakref.ref[Any]], None]:
        def on_free(ref: weakref.ref[Any]) -> None:
            rec = self._live.get(key)
            if rec is not None and rec.ref is ref:  # not a newer storage at a reused id
                del self._live[key]
                self._source_ids.pop(key, None)
                self._add(rec, -rec.nbytes)

        return on_free

    def _add(self, rec: _Record, delta: int) -> None:
        self._all.add(rec.category, delta)
        self._at[rec.where].add(rec.category, delta)

    def _resize(self, rec: _Record, nbytes: int) -> None:
        delta = nbytes - rec.nbytes
        rec.nbytes = nbytes
        self._add(rec, delta)

    def _file(self, rec: _Record, source: Category | None) -> None:
        """Set a record's category: label > source category > saved for backward > other."""
        if rec.label is not None:
            category = rec.label
        elif source is not None:
            category = source
        elif rec.saved:
            category = Category.ACTIVATIONS
        else:
            category = Category.OPTIM if rec.in_step else Category.OTHER
        host = (rec.cpu and (self._cpu_is_host or rec.host_born)) or rec.key in self._host_ids
        if category is not rec.category or host != rec.host:
            self._add(rec, -rec.nbytes)
            rec.category, rec.host = category, host
            self._add(rec, rec.nbytes)

    def _reclassify(self) -> None:
        """Re-scan sources and re-file every live storage: O(live + source tensors)."""
        if self._busy:
            return
        self._busy = True
        try:
            ids, host = _scan(self._sources, self._host_sources, self._track)
        finally:
            self._busy = False
        self._source_ids, self._host_ids = ids, host
        self._classified_total = self._all.total
        for key, rec in list(self._live.items()):
            self._file(rec, ids.get(key))

    def _after_change(self, *, reclassify: bool = False) -> None:
        """Called after every allocation/label/resize: peak and per-category maxima."""
        grew = any(t.total > t.peak_total for t in (self._all, *self._at.values()))
        if reclassify or (grew and (not self._in_step
                                    or self._all.total > 1.01 * self._classified_total)):
            self._reclassify()
        for t in (self._all, *self._at.values()):
            t.update_peak()
        self._all.update_max()

    def _hook_module(self, module: nn.Module) -> None:
        for p in module.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._handles.append(module.register_forward_hook(self._after_inference_forward))

    def _after_inference_forward(self, *_: Any) -> None:
        """After a forward without gradients, re-classify: a generation's forwards set no
        new total peak after the first, while each files new storages (the grown key/value
        cache) under ``other`` until the next re-classification, so ``max_per_category``
        would miss them. Forwards with gradients are left to the peaks (their re-
        classifications are what the training tables measure)."""
        if not torch.is_grad_enabled():
            self._after_change(reclassify=True)

    def _hook_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._handles.append(optimizer.register_step_pre_hook(lambda *_: self._step(True)))
        hook = optimizer.register_step_post_hook(lambda *_: self._step(False))
        self._handles.append(hook)

    def _hook_host_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._handles.append(optimizer.register_step_pre_hook(
            lambda *_: setattr(self, "_host_region", True)))
        self._handles.append(optimizer.register_step_post_hook(
            lambda *_: setattr(self, "_host_region", False)))

    def _step(self, starting: bool) -> None:
        """Optimizer step pre/post-hook; see [Note: inside the optimizer step]."""
        self._in_step = False
        self._after_change(reclassify=True)
        self._in_step = starting

    def _on_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: file the new ``.grad`` as grads at once."""
        if param.grad is not None and (rec := self._track(param.grad)) is not None:
            self._source_ids[rec.key] = Category.GRADS
            self._file(rec, Category.GRADS)
            self._after_change()

    def _on_saved(self, t: torch.Tensor) -> None:
        """Saved-tensors hook callback (see zeroshard.memory.saved)."""
        if (rec := self._track(t)) is not None:
            rec.saved = True
            self._file(rec, self._source_ids.get(rec.key))
            self._after_change()

    def _patch_resize(self) -> None:
        # ``UntypedStorage.resize_`` (how FSDP-style engines free/regrow flat buffers)
        # bypasses the dispatcher, so wrap it while active; restored in __exit__.
        orig = self._orig_resize = torch.UntypedStorage.resize_

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = orig(st, size)
            rec = self._live.get(id(st))
            if rec is not None and rec.ref() is st:
                self._resize(rec, st.nbytes())
                self._after_change()
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]


def _scan(sources: list[Source], host_sources: list[Callable[[], Iterable[torch.Tensor]]],
          track: Callable[[torch.Tensor], _Record | None]) -> tuple[dict[int, Category],
                                                                     set[int]]:
    """Each source tensor's storage key with its category (the highest-ranked where
    sources disagree), and the keys host sources name. ``track`` also registers storages
    created outside dispatch."""
    ids: dict[int, Category] = {}
    for fn in sources:
        for cat, tensors in fn().items():
            cat = _as_category(cat)
            for t in tensors:
                if (rec := track(t)) is None:
                    continue
                if rec.key not in ids or _RANK[cat] < _RANK[ids[rec.key]]:
                    ids[rec.key] = cat
    host = {rec.key for fn in host_sources for t in fn() if (rec := track(t)) is not None}
    return ids, host


def _same_device(a: torch.device, want: torch.device) -> bool:
    return a.type == want.type and (want.index is None or a.index == want.index)


def _process_memory() -> dict[str, int]:
    """Resident set size now and at peak; CUDA allocator peak when CUDA is available."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/statm") as f:
            out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource  # not on Windows

        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["peak_rss_bytes"] = maxrss if sys.platform == "darwin" else maxrss * 1024  # Linux: KiB
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated()
    return out
