"""The public entry points: :func:`shard` and :func:`full_state_dict`."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .build import build_engine, finish
from .config import ShardConfig, ignored_options, suggest_option
from .engine.buffers import ignored_buffers, rank0_copies
from .engine.composite import CompositeOptimizer
from .engine.engine import Engine, ParamInit, engine_of
from .engine.model_state import load_model_state_dict, model_state_dict
from .engine.optimizer import OptimizerPart, ShardedOptimizer, one_optimizer
from .engine.optimizer_spec import (
    DIVIDES_ITSELF,
    OptimizerSpec,
    WholePlan,
    check_group_keys,
    disable,
    is_torch_elementwise,
    own_collective,
    spec_from_class,
    spec_from_instance,
    spec_from_instances,
    whole_kind,
    whole_plan,
)
from .engine.outside_unit import explain_outside_read
from .engine.sharded_state import called_by_dcp_api
from .engine.units import UnitSpec
from .engine.whole import WholeUpdates, whole_updates
from .gather import UnshardHandle, unshard
from .memory.tracker import MemoryTracker
from .unwrapped import twin_of
from .wrapping import ddp_refusal, refuse_constructing_wrapper, refuse_wrapped

__all__ = ["shard", "full_state_dict", "ShardedModule", "engine_of", "memory_tracker"]

OptimizerFactory = type[torch.optim.Optimizer] | Callable[..., torch.optim.Optimizer]


class ShardedModule:
    """Mixed into the user's model class by :func:`shard` (FSDP2 does the same), so the
    torch APIs a training script calls on its model give DDP's answers (docs/porting.md).
    """

    _zeroshard_engine: Engine

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        except RuntimeError as e:  # see [Note: reads outside a unit]
            try:
                explained = explain_outside_read(self, self._zeroshard_engine, e)  # type: ignore[arg-type]
            except Exception:  # explaining must never hide the error itself
                explained = None
            if explained is None:
                raise
            raise explained from e

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients of the backwards inside without communication.

        Stages 0-1 accumulate into the whole gradient buffer they keep anyway; stages 2-3
        keep each parameter's whole gradient until the next synchronised backward
        (memory: the whole 16-bit gradient, 2 bytes per parameter). Outside ``no_sync``
        every backward reduces, and reduced gradients accumulate in the shard.
        """
        with self._zeroshard_engine.no_sync():
            yield

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's switch (what its ``no_sync()`` toggles): False accumulates locally."""
        return self._zeroshard_engine.sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._zeroshard_engine.sync = bool(value)

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> Any:
        # DistributedDataParallel's constructor asks for this before it touches a
        # parameter: the place to refuse DDP around a sharded model ([Note: double
        # wrapping] in wrapping.py).
        raise ddp_refusal(self)  # type: ignore[arg-type]

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        if not recurse:  # what DDP's and fully_shard's constructors ask each module
            refuse_constructing_wrapper(self)  # type: ignore[arg-type]
        return super().named_parameters(  # type: ignore[misc]
            prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    @property
    def module(self) -> nn.Module:
        """What DDP's ``model.module`` is: the same module, with no ``.module`` of its own
        (see [Note: DDP's unwrap idiom] in unwrapped.py)."""
        return self._modules.get("module") or twin_of(self)  # type: ignore[attr-defined, arg-type]

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:
        """The unsharded model's state dict: whole weights, original dtypes (CPU tensors
        at stage 3). Read from the other ranks where they hold the shards (one rank may
        call it alone; a collective under NCCL or TP); see [Note: model state dicts] in
        engine/model_state.py."""
        if args:
            raise TypeError("pass state_dict's destination, prefix and keep_vars as keywords "
                            "(torch deprecated the positional form)")
        engine = self._zeroshard_engine
        return model_state_dict(self, engine, destination=destination,  # type: ignore[arg-type]
                                prefix=prefix, keep_vars=keep_vars,  # FSDP2's answer to DCP
                                sharded=called_by_dcp_api())

    def load_state_dict(self, state_dict: Any, strict: bool = True,
                        assign: bool = False) -> Any:
        """Load a whole state dict into every rank's shards and masters (any stage)."""
        return load_model_state_dict(self, self._zeroshard_engine,  # type: ignore[arg-type]
                                     state_dict, strict=strict, assign=assign)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, including the sharded ones the engine accumulates."""
        self._zeroshard_engine.zero_grad(set_to_none)

    # -- FSDP2's module methods (torch.distributed.fsdp.FSDPModule), where they mean
    # something here; the others say what zeroshard does instead. A loop written for
    # fully_shard (torchtitan's, Lightning's and Accelerate's FSDP2 paths) calls them.
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """FSDP2's switch for accumulation: False keeps gradients local (``no_sync``)."""
        self._zeroshard_engine.sync = bool(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, *,
                                  recurse: bool = True) -> None:
        """Stage 3: free (True) or keep (False) each unit's gathered weights after its
        forward, as ``shard(..., reshard_after_forward=)`` does."""
        engine = self._zeroshard_engine
        if not engine.units:
            raise ValueError(
                f"set_reshard_after_forward has no meaning at stage {engine.config.stage}: "
                "every rank holds the whole weights; it applies at stage 3")
        engine.set_reshard_after_forward(bool(reshard_after_forward))

    def __deepcopy__(self, memo: dict) -> Any:
        # Without this, copy.deepcopy fails deep inside: "cannot pickle ProcessGroup"
        # (stages 0-2) or "invalid python storage" (stage 3's freed gathered weights).
        raise TypeError(
            f"copy.deepcopy of a sharded {type(self).__name__}: its parameters view "
            "zeroshard's flat buffers and its engine holds process groups, neither of which "
            "copies. Copy the model before shard() (ref = copy.deepcopy(model), then shard "
            "each), or build a fresh one and load the whole weights on every rank: "
            "ref.load_state_dict(zeroshard.full_state_dict(model)) — then "
            "zeroshard.shard_for_inference(ref) for a sharded reference model")

    def reshard(self) -> None:
        """Free every gathered unit, those ``unshard()`` holds included (stage 3; nothing
        is gathered at stages 0-2) — but not the weights a pending backward's graph saved
        (between a forward and its backward: they are freed after it). Not inside forward
        or backward: there the engine decides."""
        self._zeroshard_engine.reshard_all()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather every stage-3 unit and keep it gathered until ``reshard()``: forwards and
        backwards between issue no gathers (FSDP2's semantics; a step frees them and the
        next forward gathers the new values). With ``async_op`` a handle to ``wait()``
        on. Collective. See docs/generation.md (``zeroshard.gathered`` takes a budget)."""
        return unshard(self, async_op)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        raise NotImplementedError(
            "set_reshard_after_backward: zeroshard frees a unit's gathered weights once its "
            "backward is done, always. For accumulation use model.no_sync() or "
            "set_requires_gradient_sync(False); to keep units gathered between forward and "
            "backward, shard(..., reshard_after_forward=False)")

    def set_modules_to_forward_prefetch(self, modules: Any) -> None:
        raise NotImplementedError(
            "set_modules_to_forward_prefetch: zeroshard prefetches the next units in the "
            "order they ran in the first forward; set how many with shard(..., prefetch=k)")

    def set_modules_to_backward_prefetch(self, modules: Any) -> None:
        raise NotImplementedError(
            "set_modules_to_backward_prefetch: zeroshard prefetches the next units of "
            "backward in the reverse of the forward's order; set how many with "
            "shard(..., prefetch=k)")

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        raise NotImplementedError(
            "set_is_last_backward: zeroshard reduces gradients in every backward outside "
            "no_sync(); for accumulation wrap the earlier backwards in model.no_sync() (or "
            "set_requires_gradient_sync(False) before them and True before the last)")


def _swap_class(model: nn.Module) -> None:
    """Mix ShardedModule in, keeping the class's name and module: code that records a
    model's class by name reads the user's (HF's save_pretrained writes it as
    config.json's "architectures"; a "ZeroShardLlamaForCausalLM" there made the export
    unloadable by AutoModelForCausalLM). ``isinstance(m, ShardedModule)`` tells them apart."""
    cls = type(model)
    if issubclass(cls, ShardedModule):
        return
    model.__class__ = type(cls.__name__, (ShardedModule, cls), {
        "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        "_zeroshard_swapped": True})


# DistributedDataParallel's keywords, which a ported script may still pass.
_DDP_OPTIONS = {
    "device_ids": "zeroshard computes where the model is: move it first (model.to(device))",
    "output_device": "zeroshard leaves outputs where the model computes them",
    "find_unused_parameters": "zeroshard finds parameters without a gradient itself",
    "static_graph": "zeroshard needs no static-graph hint",
    "gradient_as_bucket_view": "zeroshard's gradients always live in its buckets",
    "bucket_cap_mb": "use bucket_bytes= (bytes, e.g. bucket_bytes=25 * 2**20)",
}


def _refuse_ddp_option(k: str) -> None:
    if k in _DDP_OPTIONS:
        raise TypeError(f"{k!r} is a DistributedDataParallel option, not a zeroshard one: "
                        f"{_DDP_OPTIONS[k]}; drop it")


def _split_options(
    optimizer: OptimizerFactory, options: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate zeroshard's options from the optimizer's, catching misspellings."""
    ours = {k: v for k, v in options.items() if k in ShardConfig.option_names()}
    theirs = {k: v for k, v in options.items() if k not in ours}
    for k in theirs:
        _refuse_ddp_option(k)
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


def _require_dist() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised; call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first, or launch with "
            "torchrun"
        )


def shard_for_inference(
    model: nn.Module, *, stage: int = 3, process_group: dist.ProcessGroup | None = None,
    units: UnitSpec = None, param_init: ParamInit | None = None,
    device: torch.device | str | None = None, hybrid: tuple[int, int] | None = None,
    mesh: Any = None, **options: Any,
) -> nn.Module:
    """Shard a forward-only model — an RL loop's reference or reward model — and return
    it: stage 3 by default, no optimizer, no gradients, no optimizer state, on the same
    process groups, units and divergence checks as :func:`shard`. Its parameters are
    frozen (``requires_grad=False``) and each rank keeps only its slice, in the compute
    dtype (``mixed_precision=``): 1/N of the model's bytes per rank. Forwards gather unit
    by unit; ``generate()``, ``gathered()``, ``stream_weights()`` and state dicts work as
    on a trained model. Under ``torch.no_grad()``, as a reference model runs."""
    _require_dist()
    for k in options:
        if k not in ShardConfig.option_names():
            guess = suggest_option(k)
            raise TypeError(f"unknown option {k!r} for shard_for_inference"
                            + (f"; did you mean {guess!r}?" if guess else
                               f"; it takes {', '.join(ShardConfig.option_names())}"))
    config = ShardConfig(stage=stage, **options)
    for message in ignored_options(config, set(options)):
        warnings.warn(message, UserWarning, stacklevel=2)
    _check_model(model, stage, trainable=False)
    for p in model.parameters():
        p.requires_grad_(False)
    engine = build_engine(model, config, units=units, param_init=param_init, device=device,
                          hybrid=hybrid, mesh=mesh, process_group=process_group, group_of={})
    model._zeroshard_engine = engine
    _swap_class(model)
    finish(model, engine)
    return model


def _check_model(model: nn.Module, stage: int, trainable: bool = True) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard() needs an nn.Module, got {type(model).__name__}")
    if getattr(model, "_zeroshard_engine", None) is not None:
        raise ValueError("this model is already sharded; call shard() once per model")
    refuse_wrapped(model)
    params = list(model.parameters())
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameters; nothing to shard")
    if trainable and not any(p.requires_grad for p in params):
        peft = (" A peft model loaded with PeftModel.from_pretrained is frozen unless "
                "loaded with is_trainable=True." if any(
                    c.__module__.startswith("peft") for c in type(model).__mro__) else "")
        raise ValueError(
            f"{type(model).__name__} has no trainable parameters (none with "
            f"requires_grad=True); nothing to shard or optimize.{peft}"
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
    optimizer: (OptimizerFactory | torch.optim.Optimizer
                | tuple[torch.optim.Optimizer, ...] | None) = None,
    *,
    stage: int | str = 0,
    process_group: dist.ProcessGroup | None = None,
    units: UnitSpec = None,
    param_init: ParamInit | None = None,
    device: torch.device | str | None = None,
    hybrid: tuple[int, int] | None = None,
    mesh: Any = None,
    param_groups: list[dict[str, Any]] | None = None,
    **options: Any,
) -> tuple[nn.Module, Any]:
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

    Several optimizers (Muon for the matrices, AdamW for the rest): pass a tuple of
    instances built on the model's parameters, each parameter in one of them;
    ``model, (muon, adamw) = shard(model, (muon, adamw), stage=3)`` returns one optimizer
    per instance, in order (see docs/optimizers.md).

    ``param_groups``: optimizer parameter groups as torch takes them, e.g.
    ``[{"params": no_decay, "weight_decay": 0.0}]`` (the model's own parameters); each
    group's keys override the optimizer keywords for its parameters, and parameters no
    group lists form the default group (the optimizer's ``param_groups[0]``).

    ``stage="auto"`` with ``memory_budget=`` (bytes per rank) and
    ``example_batch=(micro_batch, seq_len)``: traces every stage × checkpointing policy,
    prices each with the calibration profile (``profile=PATH`` from ``zeroshard
    calibrate``; else a brief calibration), and shards with the fastest that fits, its
    checkpointing applied; ``engine_of(model).auto_choice`` keeps the table
    (docs/planning.md, [Note: stage="auto"] in timing/auto.py; resolved in front.py).
    """
    _require_dist()
    if stage == "auto":
        raise TypeError("stage='auto' is resolved by zeroshard.shard (zeroshard/front.py); "
                        "call zeroshard.shard, not zeroshard.api.shard")
    if optimizer is None:
        raise TypeError(
            "shard() needs the optimizer: build it on model.parameters() before sharding "
            "(where a DDP script builds it after wrapping, move it above the wrap line) and "
            "pass it: model, optimizer = zeroshard.shard(model, optimizer, stage=2); or pass "
            "its class and keywords: zeroshard.shard(model, torch.optim.AdamW, lr=1e-3)")
    several = isinstance(optimizer, (list, tuple))
    if several or isinstance(optimizer, torch.optim.Optimizer):
        if param_groups is not None:
            raise TypeError(
                "param_groups= goes with an optimizer class; a "
                f"{type(optimizer).__name__} instance brings its own param_groups")
        ours = {k: v for k, v in options.items() if k in ShardConfig.option_names()}
        optim_kwargs = {k: v for k, v in options.items() if k not in ours}
        for k in optim_kwargs:
            _refuse_ddp_option(k)
            guess = suggest_option(k, ["process_group", "units", "param_init", "device",
                                       "hybrid", "mesh"])
            if guess:
                raise TypeError(f"unknown option {k!r}; did you mean {guess!r}?")
    elif callable(optimizer):
        ours, optim_kwargs = _split_options(optimizer, options)
    else:
        raise TypeError(
            f"optimizer={optimizer!r} is not an optimizer: pass a torch optimizer class and "
            "its keywords (zeroshard.shard(model, torch.optim.AdamW, lr=1e-3)), a callable "
            "params -> optimizer, or a torch optimizer built on model.parameters()")
    config = ShardConfig(stage=stage, **ours)
    for message in ignored_options(config, set(ours)):
        warnings.warn(message, UserWarning, stacklevel=3)
    _check_model(model, stage)
    parts: list[OptimizerSpec] = []
    if several:
        spec, parts = spec_from_instances(model, list(optimizer), optim_kwargs)
    elif isinstance(optimizer, torch.optim.Optimizer):
        spec = spec_from_instance(model, optimizer, optim_kwargs)
    else:
        spec = spec_from_class(model, optimizer, optim_kwargs, param_groups)
    engine = build_engine(model, config, units=units, param_init=param_init, device=device,
                          hybrid=hybrid, mesh=mesh, process_group=process_group,
                          group_of=spec.group_of)
    if (config.offload and spec.factory in (torch.optim.AdamW, torch.optim.Adam)
            and spec.instance is None
            and "fused" not in spec.kwargs and "foreach" not in spec.kwargs):
        # The host step is the offload bottleneck: torch's fused CPU Adam(W) kernel is
        # 7.1x faster than its single-tensor loop on a 100M-element shard (docs/offload.md).
        spec.kwargs["fused"] = True
    if several:
        plan, whole_part = _several_plan(list(optimizer), parts, config)
    else:
        plan, whole_part = whole_plan(optimizer, spec.options, config.whole_params), None
    whole = whole_updates(engine, spec.group_of, plan) if plan is not None else None
    if whole is not None and whole.size > 1:
        _refuse_own_division(optimizer[whole_part] if several else optimizer)
    inner = _build_inner(engine, spec, whole)
    if several:
        groups = [g for sp in parts for g in _user_groups(engine, sp, inner)]
    else:
        groups = _user_groups(engine, spec, inner)
    optim = ShardedOptimizer(engine, inner, groups, defaults=spec.defaults or None,
                             replaces=spec.instance, whole=whole, whole_part=whole_part)
    handed: Any = optim
    if several:  # one OptimizerPart per optimizer given (see [Note: several optimizers])
        handed = tuple(OptimizerPart(optim, k, o) for k, o in enumerate(optimizer))
        for part, sp in zip(handed, parts):
            if sp.state is not None:
                part.load_state_dict(sp.state)
    elif spec.state is not None:  # a resumed instance: its state carries over
        optim.load_state_dict(spec.state)
    model._zeroshard_engine = engine
    _swap_class(model)
    finish(model, engine)
    for sp in parts or [spec]:
        if sp.instance is not None:
            disable(sp.instance)
    return model, handed


def _refuse_own_division(optimizer: Any) -> None:
    """A sharded whole-parameter step refuses an optimizer that divides the matrices
    among the ranks itself ([Note: optimizers that divide the work themselves])."""
    call = own_collective(optimizer)
    if call is not None:
        name = (optimizer if isinstance(optimizer, type) else type(optimizer)).__name__
        raise ValueError(f"optimizer {name} calls {call}() in its source: it {DIVIDES_ITSELF}. "
                         "(At stage 0 it would run as under DDP.)")


def _several_plan(opts: list[torch.optim.Optimizer], parts: list[OptimizerSpec],
                  config: ShardConfig) -> tuple[WholePlan | None, int | None]:
    """Several optimizers: which one steps whole parameters (at most one), and its
    groups' indices among all of them; at most one elementwise one (see [Note: several
    optimizers] in engine/composite.py)."""
    # whole_params=True names the optimizer zeroshard cannot tell is whole-parameter
    # (a Muon subclass, your own Shampoo), not torch's elementwise ones beside it.
    plans = [whole_plan(o, sp.options, False if (config.whole_params is True
                                                  and is_torch_elementwise(o))
                        else config.whole_params) for o, sp in zip(opts, parts)]
    whole = [k for k, p in enumerate(plans) if p is not None]
    flat = [k for k, p in enumerate(plans) if p is None or len(p.groups) < len(parts[k].options)]
    if len(whole) > 1 or len(flat) > 1:
        names = ", ".join(type(o).__name__ for o in opts)
        kinds = ", ".join(f"{type(o).__name__}: {'whole' if p is not None else 'elementwise'}"
                          for o, p in zip(opts, plans))
        raise NotImplementedError(
            f"shard(model, ({names})): several optimizers may be one that steps whole "
            "parameters (Muon, Adafactor) and one elementwise (AdamW, SGD), not more of "
            f"either kind yet; here {kinds}"
            + (" (whole_params=True marks every optimizer but torch's elementwise ones; "
               "pass whole_params=fn, a test on each group's options, to choose)"
               if config.whole_params is True else "")
            + ". Merge the ones of one kind into one optimizer with a param group each "
            "(torch.optim.AdamW([{'params': a, 'lr': 1e-3}, {'params': b, 'lr': 1e-4}]))")
    if not whole:
        return None, None
    k = whole[0]
    start = sum(len(sp.options) for sp in parts[:k])
    p = plans[k]
    assert p is not None
    return WholePlan(frozenset(start + g for g in p.groups), p.cost, p.per_bucket), k


def _build_inner(engine: Engine, spec: OptimizerSpec,
                 whole: WholeUpdates | None) -> torch.optim.Optimizer:
    """The torch optimizer over this rank's master chunks (or, for a whole-parameter
    optimizer, the whole parameters this rank owns), one group per user group."""
    groups = engine.optimizer_groups(spec.options)  # the flat chunks of every group
    if whole is not None:
        # Built once over every whole parameter first (shaped placeholders, no memory), so
        # that a constructor refusing one (torch's Muon: a 1-D parameter) fails on every
        # rank alike, not only on its owner while the others go on to the collectives.
        probe = whole.optimizer_groups(spec.groups, spec.options, every=True)
        _construct(spec, [probe[i] if i in whole.groups else g for i, g in enumerate(groups)],
                   whole)
        # ... the whole-parameter groups hold this rank's owned tensors
        owned = whole.optimizer_groups(spec.groups, spec.options)
        groups = [owned[i] if i in whole.groups else g for i, g in enumerate(groups)]
    inner = _construct(spec, groups, whole)
    if not isinstance(inner, torch.optim.Optimizer | CompositeOptimizer):
        raise TypeError(
            f"optimizer factory returned {type(inner).__name__}, not a torch.optim.Optimizer"
        )
    if whole is None and whole_kind(inner) is not None:
        raise ValueError(
            f"the optimizer factory returned {type(inner).__name__}, whose update needs "
            "whole parameters: pass its class or an instance instead of a factory "
            f"(zeroshard.shard(model, torch.optim.{type(inner).__name__}, lr=...)), or "
            "shard with whole_params=True")
    check_group_keys(inner, spec)
    if spec.defaults:
        inner.defaults.update(spec.defaults)
    return inner


def _construct(spec: OptimizerSpec, groups: list[dict[str, Any]],
               whole: WholeUpdates | None) -> Any:
    """``spec.factory`` over ``groups``; its refusals explained."""
    if len(groups) == 1 and spec.instance is None and not spec.options[0]:
        params: Any = groups[0]["params"]  # a factory may expect a flat list of tensors
    else:
        params = groups
    try:
        return spec.factory(params, **spec.kwargs)
    except (ValueError, TypeError) as e:
        if whole is not None:
            odd = [s.names[0] for s in whole.owner if len(s.shape) != 2]
            if odd and "2D" in str(e):
                raise ValueError(
                    f"{e}: {', '.join(odd[:3])}{' ...' if len(odd) > 3 else ''} "
                    f"({len(odd)} parameter(s) not 2-D) are in the optimizer's whole-"
                    "parameter groups. Give Muon the 2-D parameters only "
                    "(torch.optim.Muon([p for p in model.parameters() if p.ndim == 2])), "
                    "or one optimizer with AdamW groups for the rest (use_muon=False; "
                    "docs/optimizers.md)") from e
            raise
        if isinstance(spec.factory, type):
            raise
        raise ValueError(
            f"the optimizer factory failed on zeroshard's flat (1-D) master chunks: {e}. An "
            "optimizer whose update needs whole parameters (Muon, Adafactor) must be passed "
            "as a class or an instance, or with whole_params=True") from e


def _user_groups(engine: Engine, spec: OptimizerSpec,
                 inner: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The user's groups (see [Note: optimizer groups]): the inner groups' hyperparameters
    over the model's user parameters. From an instance, its own group dicts (holding the
    user parameters now), so an LR scheduler built on it before sharding still sets the
    learning rate that is stepped."""
    by_name = engine.user_params_by_name()
    if spec.instance is not None:
        for g, names in zip(spec.instance.param_groups, spec.groups):
            g["params"] = [by_name[n] for n in names]
        return spec.instance.param_groups
    return [{**{k: v for k, v in g.items() if k != "params"},
             "params": [by_name[n] for n in names]}
            for g, names in zip(inner.param_groups, spec.groups)]


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: full fp32 CPU tensor}`` with the keys of the original ``state_dict()``.

    Collective: every rank must call it. Weights come from the fp32 master copies, so
    under mixed precision they are the exact values being trained, not 16-bit casts;
    buffers are rank 0's on every rank (what DDP users save), the live ones untouched.
    """
    engine = engine_of(model)
    engine.world.sync_point("full_state_dict")
    engine.refresh_handed_out("full_state_dict after dcp.load")
    values: dict[str, torch.Tensor] = {}
    for b in engine.all_buckets:
        full = engine.full_master(b)
        for s in b.slots:
            v = full[s.offset : s.offset + s.numel].view(s.shape)
            if engine.tp is not None:  # the tp pieces joined (in slot order on every rank)
                v = engine.tp.whole(s.param, v)
            for n in s.names:
                values[n] = v
    whole = nn.Module.state_dict(model, keep_vars=True)
    # Buffers as rank 0 holds them, on every rank (BatchNorm's statistics may differ by
    # rank): see rank0_copies.
    ignored = ignored_buffers(model)
    buffers = {id(t) for t in model.buffers()}
    values.update(rank0_copies({k: t for k, t in whole.items() if id(t) in buffers
                                and k not in values and k not in ignored}, engine.world))
    out: dict[str, torch.Tensor] = {}
    for key, tensor in whole.items():
        src = values.get(key, tensor).detach()
        if hasattr(src, "full_tensor"):  # a frozen tp parameter kept whole (stages 1-2)
            src = src.full_tensor()
        out[key] = (src.float() if src.is_floating_point() else src).cpu().clone()
    return out


def memory_tracker(
    model: nn.Module, optimizer: Any = None
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
    tracker.track_module(model, params=engine is None)
    if isinstance(optimizer, (list, tuple)):  # several optimizers: their shared core
        optimizer = one_optimizer(optimizer)
    inner = getattr(optimizer, "optim", optimizer)
    # the inner optimizer holds the (chunked) state; several: each part its own
    inners = list(inner.parts) if isinstance(inner, CompositeOptimizer) else [inner]
    for o in inners if optimizer is not None else []:
        tracker.track_optimizer(o)
    if engine is not None:
        tracker.add_source(engine.memory_sources())
        tracker.add_host_source(lambda: _host_tensors(engine, optimizer))
        if engine.offload and optimizer is not None:  # the inner (host) optimizer's step
            for o in inners:
                tracker.track_host_step(o)
    return tracker


def _host_tensors(engine: Engine, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Offload: the engine's host buffers and the optimizer state of host masters."""
    out = engine.host_tensors()
    if optimizer is not None and engine.offload:
        state = getattr(optimizer, "optim", optimizer).state
        for b in engine.buckets:  # per-element state as flat buffers, and each chunk's step
            out += [v for c in b.chunks for v in state.get(c, {}).values() if torch.is_tensor(v)]
    return out
