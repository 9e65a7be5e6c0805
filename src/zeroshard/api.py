"""The public entry points: :func:`shard` and :func:`full_state_dict`."""

from __future__ import annotations

import atexit
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .comm import Comm, CommLedger
from .config import ShardConfig, suggest_option
from .engine.engine import Engine, ParamInit
from .engine.optimizer import (
    ShardedOptimizer,
    check_elementwise,
    check_group_keys,
    resolve_param_groups,
)
from .engine.units import UnitSpec
from .memory.tracker import MemoryTracker

__all__ = ["shard", "full_state_dict", "ShardedModule", "engine_of", "memory_tracker"]

OptimizerFactory = type[torch.optim.Optimizer] | Callable[..., torch.optim.Optimizer]


class ShardedModule:
    """Mixed into the user's model class by :func:`shard` (FSDP2 does the same)."""

    _zeroshard_engine: Engine

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients of the backwards inside without communication.

        Stages 0-1 accumulate into the whole gradient buffer they keep anyway; stage 2
        keeps each parameter's whole gradient until the next synchronised backward
        (memory: the whole 16-bit gradient, 2 bytes per parameter). Outside ``no_sync``
        every backward reduces, and reduced gradients accumulate in the shard.
        """
        with self._zeroshard_engine.no_sync():
            yield


def engine_of(model: nn.Module) -> Engine:
    engine = getattr(model, "_zeroshard_engine", None)
    if engine is None:
        raise ValueError(
            f"{type(model).__name__} was not sharded by zeroshard; call "
            "zeroshard.shard(model, ...) first"
        )
    return engine


def _swap_class(model: nn.Module) -> None:
    cls = type(model)
    if issubclass(cls, ShardedModule):
        return
    model.__class__ = type(f"ZeroShard{cls.__name__}", (ShardedModule, cls), {})


def _split_options(
    optimizer: OptimizerFactory, options: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate zeroshard's options from the optimizer's, catching misspellings."""
    ours = {k: v for k, v in options.items() if k in ShardConfig.option_names()}
    theirs = {k: v for k, v in options.items() if k not in ours}
    try:
        sig = inspect.signature(optimizer)
        accepts_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        accepted = set(sig.parameters)
    except (TypeError, ValueError):
        accepts_any, accepted = True, set()
    for k in theirs:
        if accepts_any or k in accepted:
            continue
        guess = suggest_option(k, ["process_group", "units", "param_init", "device", "hybrid",
                                   "param_groups",
                                   "mesh", *sorted(accepted)])
        hint = f"; did you mean {guess!r}?" if guess else ""
        raise TypeError(
            f"unknown option {k!r}: it is neither a zeroshard option "
            f"({', '.join(ShardConfig.option_names())}, process_group) nor accepted by "
            f"{getattr(optimizer, '__name__', optimizer)}{hint}"
        )
    return ours, theirs


def _check_model(model: nn.Module, stage: int) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard() needs an nn.Module, got {type(model).__name__}")
    if getattr(model, "_zeroshard_engine", None) is not None:
        raise ValueError("this model is already sharded; call shard() once per model")
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        raise ValueError(
            f"{type(model).__name__} has no trainable parameters (none with "
            "requires_grad=True); nothing to shard or optimize"
        )
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(
            f"parameters are on several devices {sorted(map(str, devices))}; move the model "
            "to one device (model.to(device)) before shard()"
        )
    if torch.device("meta") in devices and stage != 3:
        raise ValueError(
            "parameters are on the meta device; stages 0-2 need real weights: materialise "
            "the model first (zeroshard.models.materialize) or use stage=3"
        )


def shard(
    model: nn.Module,
    optimizer: OptimizerFactory,
    *,
    stage: int = 0,
    process_group: dist.ProcessGroup | None = None,
    units: UnitSpec = None,
    param_init: ParamInit | None = None,
    device: torch.device | str | None = None,
    hybrid: tuple[int, int] | None = None,
    mesh: Any = None,
    param_groups: list[dict[str, Any]] | None = None,
    **options: Any,
) -> tuple[nn.Module, ShardedOptimizer]:
    """Shard ``model`` for data-parallel training; return it with its optimizer.

    ``optimizer`` is an optimizer class or a callable ``params -> optimizer``; keywords that
    are not zeroshard options (see :class:`ShardConfig`) go to it, e.g.
    ``shard(model, torch.optim.AdamW, stage=2, lr=1e-3, weight_decay=0.1)``.
    The model is changed in place (its parameters become views of flat buffers) and
    returned; the returned optimizer steps this rank's shard.

    Stage 3 only: ``units`` — a list of submodules or a predicate ``module -> bool``
    (default: each module of the model's first ``nn.ModuleList``; the rest is the root
    unit). A model built on the meta device is materialised unit by unit on ``device``
    (default: the current CUDA device, else CPU) by ``param_init(model, names)``, which
    must fill the named parameters in place identically on every rank (default for
    zeroshard's reference models: ``zeroshard.models.init_weights(model, 0, names)``).

    Hybrid sharding (stages 1-3): ``hybrid=(replicas, shard_size)`` or a 2-D
    ``mesh`` (a ``DeviceMesh`` with dims ("replicate", "shard")) shards inside each group of
    ``shard_size`` consecutive ranks — keep it within a node — and all-reduces the
    reduced slices across the ``replicas`` groups. See docs/hybrid.md.

    ``param_groups``: optimizer parameter groups as torch takes them, e.g.
    ``[{"params": no_decay, "weight_decay": 0.0}]`` (the model's own parameters); each
    group's keys override the optimizer keywords for its parameters, and parameters no
    group lists form the default group (the optimizer's ``param_groups[0]``).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised; call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first, or launch with "
            "torchrun"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer is a {type(optimizer).__name__} instance; pass the class and its "
            f"keywords instead, e.g. zeroshard.shard(model, torch.optim."
            f"{type(optimizer).__name__}, stage={stage}, lr=1e-3): zeroshard builds the "
            "optimizer over this rank's shard"
        )
    ours, optim_kwargs = _split_options(optimizer, options)
    config = ShardConfig(stage=stage, **ours)
    _check_model(model, stage)
    check_elementwise(optimizer)
    group_of, group_options = resolve_param_groups(model, param_groups)
    if units is not None and stage != 3:
        raise ValueError(f"units= applies to stage 3 only (stage={stage}); drop it")
    meta = next(model.parameters()).is_meta
    dev = _resolve_device(device) if meta else None
    if meta and param_init is None:
        param_init = _default_param_init(model)
    ledger = CommLedger()
    if hybrid is not None or mesh is not None:
        if process_group is not None:
            raise ValueError("pass either process_group or hybrid=/mesh=, not both")
        if stage == 0:
            raise ValueError(
                "hybrid sharding needs stage 1, 2 or 3 (stage 0 shards nothing); drop "
                "hybrid= or pick a stage"
            )
        from .hybrid import hybrid_comms

        comm, replicate, world = hybrid_comms(ledger, hybrid=hybrid, mesh=mesh)
    else:
        label = "world" if process_group is None else "dp"
        comm, replicate, world = Comm(process_group, ledger, label=label), None, None
    engine = Engine(model, config, comm, units=units, param_init=param_init, device=dev,
                    replicate=replicate, world=world, param_groups=group_of)
    if (config.offload and optimizer in (torch.optim.AdamW, torch.optim.Adam)
            and "fused" not in optim_kwargs and "foreach" not in optim_kwargs):
        # The host step is the offload bottleneck: torch's fused CPU Adam(W) kernel is
        # 7.1x faster than its single-tensor loop on a 100M-element shard (docs/offload.md).
        optim_kwargs["fused"] = True
    params = (engine.optimizer_groups(group_options) if param_groups is not None
              else engine.master_params())
    inner = optimizer(params, **optim_kwargs)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer factory returned {type(inner).__name__}, not a torch.optim.Optimizer"
        )
    check_elementwise(inner)
    check_group_keys(inner, group_options)
    _destroy_group_at_exit()
    comm.ledger.mark_step()  # the initial broadcast is not part of any step
    comm.ledger.step = 0
    names = [b.name for b in engine.all_buckets] + [u.name for u in engine.units]
    for c in (comm, replicate, world):
        if c is not None:
            c.know_names([*names, "full_state_dict", "used", "grad_norm", "overflow", "join"])
    model._zeroshard_engine = engine
    _swap_class(model)
    return model, ShardedOptimizer(engine, inner)


_EXIT_HOOK = False


def _destroy_group_at_exit() -> None:
    """Tear the default process group down at interpreter exit if the script did not.

    Exiting with a live gloo group can abort the process ("terminate called without an
    active exception") after all the work is done; torchrun then reports the rank failed.
    """
    global _EXIT_HOOK
    if _EXIT_HOOK:
        return
    _EXIT_HOOK = True

    def _cleanup() -> None:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass

    atexit.register(_cleanup)


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _default_param_init(model: nn.Module) -> ParamInit:
    from .models import GPT2, Llama, init_weights

    if isinstance(model, (GPT2, Llama)):
        return lambda m, names: init_weights(m, 0, names)
    raise ValueError(
        f"{type(model).__name__} is on the meta device; pass param_init=fn(model, names) "
        "that initialises the named parameters in place (the same on every rank), or build "
        "the model on a real device"
    )


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: full fp32 CPU tensor}`` with the keys of the original ``state_dict()``.

    Collective: every rank must call it. Weights come from the fp32 master copies, so
    under mixed precision they are the exact values being trained, not 16-bit casts.
    """
    engine = engine_of(model)
    engine.world.sync_point("full_state_dict")
    values: dict[int, torch.Tensor] = {}
    for b in engine.all_buckets:
        full = engine.full_master(b)
        for s in b.slots:
            values[id(s.param)] = full[s.offset : s.offset + s.numel].view(s.shape)
    params = {id(p) for p in model.parameters()}
    out: dict[str, torch.Tensor] = {}
    named = dict(model.named_parameters(remove_duplicate=False))
    for key, tensor in model.state_dict(keep_vars=True).items():
        p = named.get(key)
        src = values.get(id(p), tensor) if p is not None and id(p) in params else tensor
        src = src.detach()
        out[key] = (src.float() if src.is_floating_point() else src).cpu().clone()
    return out


def memory_tracker(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> MemoryTracker:
    """A :class:`~zeroshard.memory.MemoryTracker` that knows the sharded model's buffers.

    Parameters, gradients (whole buffers, reduced slices, fp32 copies), fp32 master
    weights (filed under optimizer state, as in ZeRO's K) and optimizer state are
    attributed to their categories; use it as ``with tracker: ...`` around steps. With
    offload, what lives in host memory is reported under "host", the rest under
    "device" (``current_by_location()``, ``peak_by_location()``, ``report()``).
    """
    engine = getattr(model, "_zeroshard_engine", None)
    device = engine.device if engine is not None else next(model.parameters()).device
    tracker = MemoryTracker(compute_device=device)
    tracker.track_module(model)
    if optimizer is not None:
        tracker.track_optimizer(optimizer)
    if engine is not None:
        tracker.add_source(engine.memory_sources())
        tracker.add_host_source(lambda: _host_tensors(engine, optimizer))
        if engine.offload and optimizer is not None:  # the inner (host) optimizer's step
            tracker.track_host_step(getattr(optimizer, "optim", optimizer))
    return tracker


def _host_tensors(engine: Engine, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Offload: the engine's host buffers and the optimizer state of host masters."""
    out = engine.host_tensors()
    if optimizer is not None and engine.offload:
        state = getattr(optimizer, "optim", optimizer).state
        for b in engine.buckets:  # per-element state as flat buffers, and each chunk's step
            out += [v for c in b.chunks for v in state.get(c, {}).values() if torch.is_tensor(v)]
    return out
