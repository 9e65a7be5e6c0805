"""Activation checkpointing policies, applied per transformer block.

Checkpointing (Chen et al. 2016) stores a region's *input* in forward and recomputes its
inside during backward, so a region's internals exist for one region at a time, at the
price of a second forward (~+33% arithmetic: training is ~3 forwards). A policy picks
the regions: ``none``; ``full`` (every block); ``every-k`` (blocks k-1, 2k-1, ...);
``selective`` (each block's ``attn.core``: scores, softmax and dropout cost O(a*s^2)
bytes but few FLOPs, Korthikanti et al. 2022, sec. 4.2); ``selective-op`` (every block,
keeping the outputs of its matmuls and fused attention kernels: see [Note: op-level
selective checkpointing]); ``sqrt`` (segments of ceil(sqrt(n)) consecutive blocks, one
input stored per segment, Chen et al. 2016, sec. 4).

The engine is ``torch.utils.checkpoint.checkpoint(use_reentrant=False,
preserve_rng_state=True)``: the RNG state is stashed before the forward and restored for
the recompute, so dropout masks replay bit for bit. Its *early stop* ends a recompute as
soon as the last tensor backward needs is rebuilt: ops after the last save (a block's
final matmul when no dropout follows it) are not rerun, so "+33%" can be less.

[Note: wrapping by class swap]
A wrapped module keeps its place and its parameter names (``state_dict`` keys do not
change): we swap ``module.__class__`` for a cached subclass ``Checkpointed<Cls>`` whose
``forward`` runs the original under the checkpoint, as FSDP2's ``fully_shard`` does.
Unlike an instance-level ``forward`` patch this survives ``copy.deepcopy`` (a patched
bound method would keep calling the original module). ``isinstance`` still holds;
:func:`remove_checkpointing` restores the classes.

[Note: sqrt segments]
A model calls its blocks one by one (``x = block(x, *args)``), so a segment of blocks
``[i, i+k)`` is run by its first block: it checkpoints all k original forwards as one
region, and the other k-1 blocks, when called with exactly that output tensor and the same
extra arguments, pass it through. Called any other way they run as checkpointed single
blocks. The stored inputs drop from n to n/k, but backward recomputes k blocks at once,
so peak memory during backward holds k blocks' internals: O(n/k + k), least at k=sqrt(n).

[Note: what the checkpoint keeps, and the saved-tensor counter]
Inside a checkpointed region torch's own saved-tensor hooks replace outer ones, so a
:class:`~zeroshard.memory.SavedTensorCounter` sees nothing saved in there. What the
region keeps alive is its tensor inputs; we report them with
:func:`~zeroshard.memory.record_kept` (all active counters and trackers; storages are
counted once, so torch versions that also pass the inputs through the outer hooks are
not double counted); ``selective-op`` also reports the op outputs it caches. The CPU
RNG state stashed per region (``torch.get_rng_state()``, 5056 bytes of host memory) is
not an activation and is not reported.

[Note: op-level selective checkpointing]
With a fused attention kernel (SDPA's flash / memory-efficient paths, and the CPU's flash
kernel when dropout is 0) no a*s^2 scores are stored, so ``selective`` (recompute the
attention core) frees almost nothing. ``selective-op`` works one level lower, as
torchtitan's op-level selective AC does: each block is checkpointed with
``torch.utils.checkpoint.create_selective_checkpoint_contexts`` and a policy that
*saves the outputs* of ``mm`` / ``addmm`` (every linear layer) and of the fused SDPA
kernels, and *recomputes* every other op in backward: norms, GELU / SiLU, rotary
embedding, dropout (its RNG replayed), residual adds, the math-path attention (``bmm``,
softmax: the scores are not saved either). The FLOP-heavy ops run once; what is dropped
is the inputs and outputs of the cheap elementwise ops. For a GPT-2 block (b, s, h, no
dropout) the stored tensors go from 16 b*s*h elements (norm inputs and outputs, qkv,
attention output, the MLP's 4h hidden before and after GELU, plus norm statistics and the
kernel's log-sum-exp) to 11 (the block input, qkv 3, attention output 1, both output
projections 1 + 1, the MLP's 4h hidden before GELU 4); ``full`` keeps 1. The MLP's output
projection is kept although backward never needs it (the policy sees an op before it
runs, not whether its output will be needed; the recompute stops before it, torch's early
stop, so it never runs twice): 1 b*s*h per block that a smarter policy could drop.
The cached outputs are held by the checkpoint, not through saved-tensor hooks, so
:func:`~zeroshard.memory.record_kept` reports them to counters and trackers.
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from zeroshard.memory.saved import record_kept
from zeroshard.sac_policy import keep_outputs_contexts

__all__ = [
    "CheckpointPolicy",
    "EveryK",
    "FullCheckpoint",
    "NoCheckpoint",
    "Selective",
    "SelectiveOps",
    "SqrtSegments",
    "apply_checkpointing",
    "checkpointed_modules",
    "find_blocks",
    "offload_to_host",
    "parse_policy",
    "remove_checkpointing",
]

SUPPORTED = "'none', 'full', 'every-<k>' (e.g. 'every-2'), 'selective', 'selective-op', 'sqrt'"
Match = str | type | Callable[[str, nn.Module], bool]


class CheckpointPolicy:
    """Base class: a policy maps the model's blocks to regions checkpointed as one unit."""

    name = "base"

    def regions(self, blocks: Sequence[nn.Module]) -> list[list[nn.Module]]:
        raise NotImplementedError

    def context_fn(self) -> Callable[[], tuple[Any, Any]] | None:
        """``torch.utils.checkpoint``'s ``context_fn`` for every region (None: plain)."""
        return None


@dataclass(frozen=True)
class NoCheckpoint(CheckpointPolicy):
    """Store every activation; the fastest and largest."""

    name = "none"

    def regions(self, blocks: Sequence[nn.Module]) -> list[list[nn.Module]]:
        return []


@dataclass(frozen=True)
class FullCheckpoint(CheckpointPolicy):
    """Checkpoint every block: store only block inputs, recompute one forward in backward."""

    name = "full"

    def regions(self, blocks: Sequence[nn.Module]) -> list[list[nn.Module]]:
        return [[b] for b in blocks]


@dataclass(frozen=True)
class EveryK(CheckpointPolicy):
    """Checkpoint blocks k-1, 2k-1, ... (torchtitan's ``ac_freq`` convention); k=1 is full."""

    k: int

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ValueError(f"EveryK.k must be an integer >= 1, got {self.k!r}; e.g. EveryK(2)")

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"every-{self.k}"

    def regions(self, blocks: Sequence[nn.Module]) -> list[list[nn.Module]]:
        return [[b] for i, b in enumerate(blocks) if i % self.k == self.k - 1]


@dataclass(frozen=True)
class Selective(CheckpointPolicy):
    """Recompute only the attention core of each block (Korthikanti et al. 2022, sec. 4.2).

    ``match`` selects the submodules: a string (contained in the class name), a module
    type, or ``fn(qualified_name_inside_block, module) -> bool``.
    """

    match: Match = "CoreAttention"
    name = "selective"

    def regions(self, blocks: Sequence[nn.Module]) -> list[list[nn.Module]]:
        found = [[m] for b in blocks for n, m in b.named_modules() if n and self._hit(n, m)]
        if not found:
            classes = sorted({type(b).__name__ for b in blocks})
            raise ValueError(
                f"selective checkpointing found no attention core matching {self.match!r} in "
                f"{len(blocks)} blocks ({', '.join(classes)}). It recomputes the module holding "
                "only the attention scores/softmax/dropout (zeroshard.models.CoreAttention). Pass "
                "Selective(match=...) with a class-name substring, a module type or a function "
                "(name, module) -> bool, or use another policy: " + SUPPORTED
            )
        return found

    def _hit(self, name: str, module: nn.Module) -> bool:
        if isinstance(self.match, str):
            return self.match in type(module).__name__
        if isinstance(self.match, type):
            return isinstance(module, self.match)
        return bool(self.match(name, module))


@dataclass(frozen=True)
class SelectiveOps(CheckpointPolicy):
    """Checkpoint every block, keeping the outputs of its matmuls and fused attention
    kernels; recompute the cheap ops (see [Note: op-level selective checkpointing])."""

    name = "selective-op"

    def regions(self, blocks: Sequence[nn.Module]) -> list[list[nn.Module]]:
        return [[b] for b in blocks]

    def context_fn(self) -> Callable[[], tuple[Any, Any]] | None:
        return _op_level_contexts


def _saved_ops() -> frozenset:
    """The aten ops whose outputs ``selective-op`` keeps: the matmuls of linear layers and
    the fused SDPA kernels (those this torch build has)."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    fused = [getattr(aten, n).default for n in names if hasattr(aten, n)]
    return frozenset([aten.mm.default, aten.addmm.default, *fused])


def _keep_matmuls(op: Any, args: tuple) -> bool:
    return op in _SAVED_OPS


class _ReportCached(TorchDispatchMode):
    """Entered after SAC's caching mode, so it sees each op first: reports the outputs the
    cache keeps to active counters and trackers (they bypass saved-tensor hooks)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func in _SAVED_OPS:
            record_kept([t for t in (out if isinstance(out, tuple) else (out,))
                         if isinstance(t, torch.Tensor)])
        return out


class _Both:
    def __init__(self, first: Any, second: Any) -> None:
        self._first, self._second = first, second

    def __enter__(self) -> None:
        self._first.__enter__()
        self._second.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self._second.__exit__(*exc)
        finally:
            self._first.__exit__(*exc)


def _op_level_contexts() -> tuple[Any, Any]:
    # exact under in-place writes into a kept matmul: [Note: in-place writes into a kept
    # output] in sac_policy.py
    forward, recompute = keep_outputs_contexts(_keep_matmuls)
    return _Both(forward, _ReportCached()), recompute


_SAVED_OPS = _saved_ops()


@dataclass(frozen=True)
class SqrtSegments(CheckpointPolicy):
    """Segments of ``segment_size`` blocks (default ceil(sqrt(n))), each one region."""

    segment_size: int | None = None
    name = "sqrt"

    def __post_init__(self) -> None:
        if self.segment_size is not None and (
            not isinstance(self.segment_size, int) or self.segment_size < 1
        ):
            raise ValueError(
                f"SqrtSegments.segment_size must be None or >= 1, got {self.segment_size!r}"
            )

    def size_for(self, n_blocks: int) -> int:
        return self.segment_size or math.ceil(math.sqrt(n_blocks))

    def regions(self, blocks: Sequence[nn.Module]) -> list[list[nn.Module]]:
        k = self.size_for(len(blocks))
        return [list(blocks[i : i + k]) for i in range(0, len(blocks), k)]


def parse_policy(policy: str | CheckpointPolicy) -> CheckpointPolicy:
    """The policy for a name (see ``SUPPORTED``), or ``policy`` itself."""
    if isinstance(policy, CheckpointPolicy):
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a name or a CheckpointPolicy, got {type(policy).__name__}")
    simple = {
        "none": NoCheckpoint,
        "full": FullCheckpoint,
        "selective": Selective,
        "selective-op": SelectiveOps,
        "sqrt": SqrtSegments,
    }
    if policy in simple:
        return simple[policy]()
    if (m := re.fullmatch(r"every-(-?\d+)", policy)) and int(m.group(1)) >= 1:
        return EveryK(int(m.group(1)))
    raise ValueError(
        f"unknown checkpoint policy {policy!r} (every-k needs k >= 1); supported: {SUPPORTED}"
    )


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """``model.blocks``, else the first ModuleList of >1 modules of one class."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return blocks
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(b) for b in m}) == 1:
            return m
    raise ValueError(
        f"found no repeated blocks in {type(model).__name__} (no `blocks` "
        "ModuleList, no ModuleList of >1 same-class modules); pass blocks=..."
    )


@dataclass(eq=False)
class _Region:
    """Checkpoint state shared by the modules of one region (one module unless sqrt)."""

    modules: list[nn.Module]
    checkpoint: bool = True
    offload: bool = False
    pin_memory: bool = True
    context_fn: Callable[[], tuple[Any, Any]] | None = None
    # Leader's output and call, awaited by follower ``next_index`` (see [Note: sqrt segments]).
    pending: tuple[weakref.ref[torch.Tensor], int, tuple, dict] | None = field(default=None)


class _CheckpointedMixin(nn.Module):
    """Put first in the MRO of ``Checkpointed<Cls>``; see [Note: wrapping by class swap]."""

    _zs_region: _Region

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        region = self._zs_region
        index = next(i for i, m in enumerate(region.modules) if m is self)
        if index > 0:
            p = region.pending
            if p and p[1] == index and args and p[0]() is args[0] and _same(p[2:], args, kwargs):
                region.pending = (
                    (p[0], index + 1, *p[2:]) if index + 1 < len(region.modules) else None
                )
                return args[0]
            return _run(
                _Region([self], region.checkpoint, region.offload, region.pin_memory,
                        context_fn=region.context_fn), args, kwargs
            )
        return _run(region, args, kwargs)


def _same(call: tuple, args: tuple, kwargs: dict) -> bool:
    l_args, l_kwargs = call  # the leader's extra arguments (all but the first)
    return (
        len(l_args) == len(args) - 1
        and all(a is b for a, b in zip(l_args, args[1:]))
        and l_kwargs.keys() == kwargs.keys()
        and all(l_kwargs[k] is kwargs[k] for k in kwargs)
    )


def _run(region: _Region, args: tuple, kwargs: dict) -> Any:
    mods = region.modules

    def chain(*a: Any, **kw: Any) -> Any:
        out = _original_class(mods[0]).forward(mods[0], *a, **kw)
        for m in mods[1:]:
            if not isinstance(out, torch.Tensor):
                raise TypeError(
                    f"sqrt segments need blocks mapping a tensor to a tensor; "
                    f"{type(m).__name__} got {type(out).__name__}"
                )
            out = _original_class(m).forward(m, out, *a[1:], **kw)
        return out

    ctx: AbstractContextManager[Any] = (
        offload_to_host(pin_memory=region.pin_memory) if region.offload else nullcontext()
    )
    with ctx:
        if not (region.checkpoint and torch.is_grad_enabled()):
            out = chain(*args, **kwargs)
        else:
            if not region.offload:  # offloaded inputs are reported by the offload hook
                record_kept(_tensors(args, kwargs))
            extra = {} if region.context_fn is None else {"context_fn": region.context_fn}
            out = checkpoint(chain, *args, use_reentrant=False, preserve_rng_state=True,
                             **extra, **kwargs)
    if len(mods) > 1 and isinstance(out, torch.Tensor):
        region.pending = (weakref.ref(out), 1, args[1:], kwargs)
    return out


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


_CLASSES: dict[type, type] = {}


def region_size(module: nn.Module) -> int:
    """How many blocks share ``module``'s checkpoint region (1 unless sqrt segments)."""
    region = getattr(module, "_zs_region", None)
    return len(region.modules) if region is not None else 1


def _original_class(m: nn.Module) -> type:
    return getattr(type(m), "_zs_original", type(m))


def _wrap(m: nn.Module, region: _Region) -> None:
    cls = _original_class(m)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            f"Checkpointed{cls.__name__}", (_CheckpointedMixin, cls), {"_zs_original": cls}
        )
    m.__class__ = _CLASSES[cls]
    m._zs_region = region


#: The root module's record of what apply_checkpointing applied: (policy,
#: offload_activations, the default blocks).
APPLIED = "_zeroshard_checkpointing"


def applied_policy(model: nn.Module) -> tuple[CheckpointPolicy, bool, bool] | None:
    """What :func:`apply_checkpointing` last applied to ``model`` (None: nothing, or it was
    applied to a submodule)."""
    return model.__dict__.get(APPLIED)


def remove_checkpointing(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_checkpointing` on every wrapped module of ``model``."""
    for m in model.modules():
        if isinstance(m, _CheckpointedMixin):
            m.__class__ = _original_class(m)
            del m._zs_region
    model.__dict__.pop(APPLIED, None)
    return model


def apply_checkpointing(
    model: nn.Module,
    policy: str | CheckpointPolicy = "full",
    *,
    blocks: Sequence[nn.Module] | None = None,
    offload_activations: bool = False,
    pin_memory: bool = True,
) -> nn.Module:
    """Apply ``policy`` to ``model``'s blocks in place and return ``model``.

    Args:
        policy: a name (``'none'``, ``'full'``, ``'every-2'``, ``'selective'``,
            ``'selective-op'``, ``'sqrt'``)
            or a :class:`CheckpointPolicy`. Replaces any policy applied before.
        blocks: the repeated blocks; default :func:`find_blocks`.
        offload_activations: run each block under :func:`offload_to_host`, so what it
            saves (for a checkpointed block: its input) waits for backward in host memory.
        pin_memory: pinned host buffers for asynchronous copies (CUDA only).
    """
    pol = parse_policy(policy)
    remove_checkpointing(model)
    default_blocks = blocks is None
    blocks = list(find_blocks(model) if blocks is None else blocks)
    regions = pol.regions(blocks)  # raises before anything is modified
    for mods in regions:
        on_blocks = mods[0] in blocks
        region = _Region(mods, offload=offload_activations and on_blocks, pin_memory=pin_memory,
                         context_fn=pol.context_fn())
        for m in mods:
            _wrap(m, region)
    if offload_activations:
        for b in blocks:
            if not isinstance(b, _CheckpointedMixin):
                _wrap(b, _Region([b], checkpoint=False, offload=True, pin_memory=pin_memory))
    # What was applied, for whoever must apply it again to a copy (stage="auto" traces a
    # picklable twin: the Checkpointed<Cls> classes are made at run time); a plain
    # attribute, not a registered one, so state dicts and module walks never see it.
    model.__dict__[APPLIED] = (pol, offload_activations, default_blocks)
    return model


class offload_to_host(torch.autograd.graph.saved_tensors_hooks):
    """Keep tensors saved for backward in host memory until backward needs them.

    Like ``torch.autograd.graph.save_on_cpu``, except that tensors already on the CPU and
    parameters (alive anyway) are kept as they are: ``save_on_cpu(pin_memory=True)``
    copies even CPU tensors into a new buffer. On a CPU-only machine this copies nothing.
    Kept or copied tensors are reported to active counters via ``record_kept``.
    """

    def __init__(self, *, pin_memory: bool = True) -> None:
        pin = pin_memory and torch.cuda.is_available()

        def pack(t: torch.Tensor) -> tuple[torch.device | None, torch.Tensor]:
            if (
                t.device.type == "cpu"
                or isinstance(t, nn.Parameter)
                or isinstance(t._base, nn.Parameter)
            ):
                record_kept(t)
                return None, t
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            record_kept(host)
            return t.device, host

        def unpack(packed: tuple[torch.device | None, torch.Tensor]) -> torch.Tensor:
            device, t = packed
            return t if device is None else t.to(device, non_blocking=pin)

        super().__init__(pack, unpack)


def checkpointed_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` for every module currently wrapped by a policy."""
    return ((n, m) for n, m in model.named_modules() if isinstance(m, _CheckpointedMixin))
