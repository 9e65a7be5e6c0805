"""What the user asked to optimize, and how: an optimizer class with keywords, or a torch
optimizer instance they already built on the model's parameters.

[Note: optimizer groups]
zeroshard steps this rank's master slices with a torch optimizer of the user's class
(engine/optimizer.py); the user holds a :class:`ShardedOptimizer` whose
``param_groups`` look like the ones torch would have over the unsharded model — the
same groups, in the same order, with the same hyperparameters, holding the model's
(user) parameters. Group ``i`` of the user's optimizer steps the chunks of the
parameters listed in it; trainable parameters no group lists are not stepped at all
(torch leaves them alone too). How the groups arise:

* ``shard(model, torch.optim.AdamW, lr=..., param_groups=[...])``: group 0 holds every
  parameter no entry of ``param_groups`` lists (frozen ones included, as
  ``AdamW(model.parameters())`` would), with the keywords; group ``i`` is
  ``param_groups[i - 1]``, its keys overriding the keywords;
* ``shard(model, optimizer_instance)``: its groups as they are, its class, its
  defaults; any state it holds (a resume that loaded a state dict before sharding)
  carries over. The instance is then disabled: stepping it raises.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .composite import CompositeOptimizer

__all__ = ["DIVIDES_ITSELF", "OptimizerSpec", "is_torch_elementwise", "own_collective",
           "spec_from_class",
           "spec_from_instance", "spec_from_instances", "check_elementwise",
           "check_group_keys", "disable", "whole_kind", "whole_plan", "WholePlan"]

# Updates that depend on a whole tensor (trust ratios, factored moments, preconditioners):
# run whole by an owner rank (engine/whole.py) when known or asked for (whole_params=True).
_NOT_ELEMENTWISE = ("Adafactor", "Shampoo", "Muon", "Lamb", "LARS", "Lars", "SOAP",
                    "Sophia", "Kron", "Scion", "Dion")
# Known whole-parameter optimizers, by exact class (module, name) -> the cost that balances
# their owners (engine/whole.py). A subclass may change the update: it needs whole_params.
_WHOLE = {
    ("torch.optim", "Muon"): "newton_schulz",
    ("torch.optim", "Adafactor"): "numel",
    ("transformers.optimization", "Adafactor"): "numel",
}
# Refused in every form, with the reason (docs/optimizers.md lists them).
_REFUSED = {
    "LBFGS": "it re-evaluates the closure (forward and backward) several times within one "
             "step, which the sharded step cannot replay; train with a first-order optimizer, "
             "or run LBFGS unsharded",
    "SparseAdam": "it takes sparse gradients, and zeroshard's gradients are dense flat shards; "
                  "use AdamW (dense), or keep the sparse embedding out of the sharded model",
}

#: Group index of trainable parameters the user's optimizer does not hold.
NOT_STEPPED = -1


@dataclass
class OptimizerSpec:
    """How to build the inner optimizer and the user's groups (see [Note: optimizer
    groups]). Parameters are named by their first ``named_parameters`` name."""

    factory: Callable[..., torch.optim.Optimizer]
    kwargs: dict[str, Any]  # passed to ``factory`` with the inner groups
    groups: list[list[str]]  # per user group, its parameters' names, in order
    options: list[dict[str, Any]]  # per user group, its hyperparameters
    group_of: dict[str, int]  # every name of every trainable parameter -> group index
    state: dict[str, Any] | None = None  # a torch-format state dict to load, if any
    instance: torch.optim.Optimizer | None = None
    check_keys: bool = True  # options came from the user (misspellings possible)
    defaults: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WholePlan:
    """Which of the user's groups step whole parameters, and how (engine/whole.py)."""

    groups: frozenset[int]  # indices of the user's groups stepped whole
    cost: str  # "newton_schulz" or "numel": what balances the owners
    per_bucket: bool  # the optimizer keeps no state beyond each parameter's


def whole_plan(optimizer: Any, options: list[dict[str, Any]],
               whole_params: bool | Callable[[dict[str, Any]], bool] = False
               ) -> WholePlan | None:
    """How ``optimizer`` (a class, an instance, or a factory) is stepped: None for the
    flat, elementwise path; else its whole-parameter groups (see docs/optimizers.md):

    * a known class (torch's Muon and Adafactor, transformers' Adafactor): every group;
    * ``whole_params=True``: every group; ``whole_params=fn``: the groups whose options
      (the group dict without ``params``) ``fn`` accepts;
    * groups with a ``use_muon`` key (the MuonWithAuxAdam convention): those where it
      is true, the others elementwise.

    Raises for the refused classes, and for a class whose name says its update is not
    elementwise when none of the above applies."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    is_class = isinstance(optimizer, type | torch.optim.Optimizer)
    if is_class:
        _refuse(cls)
        known = _WHOLE.get((cls.__module__, cls.__qualname__))
        if known is not None:
            return WholePlan(frozenset(range(len(options))), known, True)
    cost = "newton_schulz" if "muon" in cls.__name__.lower() else "numel"
    if whole_params is True:
        return WholePlan(frozenset(range(len(options))), cost, False)
    if callable(whole_params):
        chosen = frozenset(i for i, o in enumerate(options) if whole_params(dict(o)))
        return WholePlan(chosen, cost, False) if chosen else None
    if any("use_muon" in o for o in options):
        chosen = frozenset(i for i, o in enumerate(options) if o.get("use_muon"))
        return WholePlan(chosen, "newton_schulz", False) if chosen else None
    if is_class:
        check_elementwise(cls)
    return None


# [Note: optimizers that divide the work themselves]
# Some Muon implementations for DDP divide the matrices among the ranks inside step():
# rank r steps matrices r, r + N, ... of its list and all-gathers the results
# (KellerJordan/Muon's ``Muon`` and ``MuonWithAuxAdam``, modded-nanogpt's). zeroshard
# already gives each matrix whole to one owner rank, and each rank's optimizer holds only
# its own matrices: the optimizer's division then steps some of them on no rank and its
# all-gather copies one matrix over another of the same shape — silently wrong weights,
# or a hang where ranks own different counts. At stage 0 (every rank holds every matrix,
# as under DDP) it is right. So a sharded whole-parameter step refuses a class whose
# source calls a torch.distributed collective (before any step: a hang cannot be
# reported), and, for what the source does not show (a helper elsewhere, another alias),
# WholeUpdates checks that the default group saw no collective during the step.
_COLLECTIVE = re.compile(
    r"\b(?:dist|distributed|torch\.distributed)\.(all_gather\w*|all_reduce\w*|"
    r"reduce_scatter\w*|broadcast\w*|all_to_all\w*|gather|scatter|reduce|barrier|"
    r"send|recv|isend|irecv)\s*\(")

DIVIDES_ITSELF = (
    "steps only this rank's share of the matrices and exchanges results with the other "
    "ranks itself (as KellerJordan's distributed Muon / MuonWithAuxAdam do for DDP), but "
    "zeroshard already gives each matrix whole to one owner rank: the two divisions "
    "together step the wrong matrices. Use the optimizer's single-device form "
    "(SingleDeviceMuon / SingleDeviceMuonWithAuxAdam) or torch.optim.Muon: zeroshard "
    "spreads the work over the ranks (docs/optimizers.md)")


def own_collective(optimizer: Any) -> str | None:
    """The first torch.distributed call in the source of ``optimizer``'s class (or of a
    base class outside torch), e.g. ``dist.all_gather(``; None when there is none or no
    source to read. See [Note: optimizers that divide the work themselves]."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    for k in cls.__mro__:
        if k is object or k.__module__.split(".")[0] == "torch":
            continue
        try:
            source = inspect.getsource(k)
        except (OSError, TypeError):
            continue
        found = _COLLECTIVE.search(source)
        if found:
            return found.group(0).rstrip("( ")
    return None


# torch's own elementwise optimizers, by exact class: never stepped whole.
_TORCH_ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop",
                      "Adagrad", "Adadelta", "ASGD", "Rprop")


def is_torch_elementwise(optimizer: Any) -> bool:
    """Is ``optimizer`` (a class or an instance) exactly one of torch's elementwise
    optimizers (AdamW, SGD, ...)? A subclass may change the update: not counted."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    return (cls.__qualname__ in _TORCH_ELEMENTWISE
            and getattr(torch.optim, cls.__qualname__, None) is cls)


def whole_kind(optimizer: Any) -> str | None:
    """The cost of a known whole-parameter optimizer class (None: not one of them)."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    return _WHOLE.get((cls.__module__, cls.__qualname__))


def _refuse(cls: type) -> None:
    """The refused optimizers (and their subclasses), each with its reason."""
    for name, why in _REFUSED.items():
        if any(k.__name__ == name for k in cls.__mro__):
            raise ValueError(f"optimizer {cls.__name__} cannot be sharded: {why}")


def check_elementwise(optimizer: torch.optim.Optimizer | type) -> None:
    """Refuse a class whose name says its update needs whole tensors (not known to us,
    and ``whole_params`` not given): the flat path would silently compute something
    else."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    _refuse(cls)
    for bad in _NOT_ELEMENTWISE:
        if bad.lower() in cls.__name__.lower():
            raise ValueError(
                f"optimizer {cls.__name__} looks not elementwise: its update depends on whole "
                "tensors, which a flat shard does not have. If it updates each parameter "
                "from that parameter alone (Shampoo, SOAP, LAMB, a Muon subclass), shard "
                "with whole_params=True: each parameter is then stepped whole by one rank "
                "(docs/optimizers.md). If it is elementwise after all, rename the class"
            )


def _names(model: nn.Module
           ) -> tuple[dict[nn.Parameter, list[str]], dict[str, nn.Parameter]]:
    names: dict[nn.Parameter, list[str]] = {}
    by_name: dict[str, nn.Parameter] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(n)
        by_name[n] = p
    return names, by_name


def spec_from_class(model: nn.Module, factory: Callable[..., torch.optim.Optimizer],
                    kwargs: dict[str, Any], groups: Any) -> OptimizerSpec:
    """``param_groups=`` of ``shard()`` -> the spec. A group's ``params`` may hold the
    model's parameters, their names, or ``(name, parameter)`` pairs as
    ``model.named_parameters()`` yields them (torch takes those too)."""
    names, by_name = _names(model)
    listed: dict[str, int] = {}
    options: list[dict[str, Any]] = [{}]
    members: list[list[str]] = [[]]
    if groups is not None and (isinstance(groups, dict) or not isinstance(groups, list | tuple)):
        raise TypeError(f"param_groups must be a list of dicts like torch's, e.g. "
                        f"[{{'params': no_decay, 'weight_decay': 0.0}}]; got "
                        f"{type(groups).__name__}")
    for i, g in enumerate(groups or [], start=1):
        where = f"param_groups[{i - 1}]"
        if not isinstance(g, dict) or "params" not in g:
            what = (f"a dict with keys {sorted(map(str, g))}" if isinstance(g, dict)
                    else f"a {type(g).__name__}")
            raise TypeError(f"{where} must be a dict with a 'params' list (e.g. {{'params': "
                            f"no_decay, 'weight_decay': 0.0}}); got {what}")
        members.append([])
        for p in _group_params(g["params"], by_name, where):
            if p not in names:
                raise ValueError(f"{where} lists a {tuple(p.shape)} tensor that is not a "
                                 "parameter of the model being sharded; pass the model's own "
                                 "parameters (e.g. from model.named_parameters())")
            name = names[p][0]
            if not p.requires_grad:
                raise ValueError(f"{where} lists {name!r}, which is frozen "
                                 "(requires_grad=False) and gets no optimizer state; drop it")
            if name in listed:
                tied = (f" ({' = '.join(names[p])}: one tied parameter)"
                        if len(names[p]) > 1 else "")
                other = listed[name] - 1
                twice = (f"twice in {where}" if other == i - 1
                         else f"in param_groups[{other}] and {where}")
                raise ValueError(f"{name!r}{tied} is {twice}; list each parameter once")
            listed[name] = i
            members[i].append(name)
        options.append({k: v for k, v in g.items() if k != "params"})
    group_of: dict[str, int] = {}
    for ns in names.values():
        i = listed.get(ns[0], 0)
        if i == 0:
            members[0].append(ns[0])
        for n in ns:
            group_of[n] = i
    return OptimizerSpec(factory=factory, kwargs=kwargs, groups=members, options=options,
                         group_of=group_of)


def _group_params(params: Any, by_name: dict[str, nn.Parameter],
                  where: str) -> list[torch.Tensor]:
    """A group's ``params`` as tensors: parameters, names, or (name, parameter) pairs."""
    items = [params] if isinstance(params, torch.Tensor | str) else list(params)
    out = []
    for item in items:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            item = item[1]  # named_parameters() form
        if isinstance(item, str):
            if item not in by_name:
                from ..config import suggest_option

                guess = suggest_option(item, sorted(by_name))
                hint = f"; did you mean {guess!r}?" if guess else ""
                raise ValueError(f"{where} names {item!r}, which is not a parameter of the "
                                 f"model{hint}")
            item = by_name[item]
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"{where}['params'] holds a {type(item).__name__}; pass the "
                            "model's parameters, their names or (name, parameter) pairs")
        out.append(item)
    return out


def spec_from_instance(model: nn.Module, opt: torch.optim.Optimizer,
                       extra: dict[str, Any]) -> OptimizerSpec:
    """A torch optimizer built on ``model``'s parameters -> the spec (its class, defaults,
    groups and state)."""
    cls = type(opt)
    if extra:
        raise TypeError(
            f"optimizer keywords {sorted(extra)} were given with a {cls.__name__} instance, "
            "which already has its hyperparameters; set them when building it, or pass the "
            f"class: zeroshard.shard(model, torch.optim.{cls.__name__}, lr=...)")
    if getattr(opt, "_zeroshard_replaced", False):
        raise ValueError(f"this {cls.__name__} was already handed to zeroshard.shard() and "
                         "replaced; pass the optimizer shard() returned, or a new one")
    names, _ = _names(model)
    members: list[list[str]] = []
    options: list[dict[str, Any]] = []
    group_of: dict[str, int] = {}
    for i, g in enumerate(opt.param_groups):
        members.append([])
        for p in g["params"]:
            if p not in names:
                raise ValueError(
                    f"the {cls.__name__} holds a {tuple(p.shape)} tensor (param_groups[{i}]) "
                    f"that is not a parameter of the {type(model).__name__} being sharded; "
                    "build the optimizer on this model's parameters (e.g. "
                    f"torch.optim.{cls.__name__}(model.parameters(), ...)), or pass its class "
                    "and keywords")
            members[i].append(names[p][0])
            if p.requires_grad:
                for n in names[p]:
                    group_of[n] = i
        options.append({k: v for k, v in g.items() if k != "params"})
    for ns in names.values():  # trainable but not in the optimizer: never stepped
        for n in ns:
            group_of.setdefault(n, NOT_STEPPED)
    accepted = _constructor_keys(cls)
    kwargs = {k: v for k, v in opt.defaults.items() if accepted is None or k in accepted}
    state = opt.state_dict() if opt.state else None
    return OptimizerSpec(factory=cls, kwargs=kwargs, groups=members, options=options,
                         group_of=group_of, state=state, instance=opt, check_keys=False,
                         defaults=dict(opt.defaults))


def spec_from_instances(model: nn.Module, opts: list[torch.optim.Optimizer],
                        extra: dict[str, Any]) -> tuple[OptimizerSpec, list[OptimizerSpec]]:
    """Several torch optimizers built on ``model``'s parameters (see [Note: several
    optimizers] in composite.py) -> one spec over all their groups, in order, whose
    factory builds a :class:`CompositeOptimizer`; and each one's own spec."""
    if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
        got = ", ".join(type(o).__name__ for o in opts) or "nothing"
        raise TypeError(
            f"optimizer=({got}): several optimizers go to shard() as a tuple of torch "
            "optimizer instances built on model.parameters() (e.g. (torch.optim.Muon("
            "matrices, lr=0.02), torch.optim.AdamW(rest, lr=3e-4))); pass one optimizer "
            "class or instance otherwise")
    if len({id(o) for o in opts}) < len(opts):
        raise ValueError("the same optimizer appears twice in the tuple given to shard()")
    specs = [spec_from_instance(model, o, extra) for o in opts]
    where: dict[str, int] = {}
    for k, sp in enumerate(specs):
        for n in (n for names in sp.groups for n in names):
            if n in where:
                raise ValueError(
                    f"parameter {n!r} is in optimizer {where[n]} ({type(opts[where[n]]).__name__}) "
                    f"and optimizer {k} ({type(opts[k]).__name__}); give each parameter to "
                    "one optimizer")
            where[n] = k
    groups: list[list[str]] = []
    options: list[dict[str, Any]] = []
    group_of: dict[str, int] = {}
    for sp in specs:
        for n, g in sp.group_of.items():
            if g >= 0:
                group_of[n] = len(groups) + g
            else:
                group_of.setdefault(n, NOT_STEPPED)
        groups += sp.groups
        options += sp.options

    def factory(params: list[dict[str, Any]], **_: Any) -> CompositeOptimizer:
        parts, start = [], 0
        for sp in specs:  # each part over its own groups, as its class builds them
            parts.append(sp.factory(params[start : start + len(sp.groups)], **sp.kwargs))
            start += len(sp.groups)
        return CompositeOptimizer(parts)

    combined = OptimizerSpec(factory=factory, kwargs={}, groups=groups, options=options,
                             group_of=group_of, check_keys=False)
    return combined, specs


def _constructor_keys(cls: type) -> set[str] | None:
    """Keywords ``cls(params, ...)`` accepts (None: any). Torch keeps some defaults its
    constructor does not take (AdamW's ``decoupled_weight_decay``): those are set on the
    groups directly."""
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return set(sig.parameters) - {"self", "params"}


def check_group_keys(inner: torch.optim.Optimizer, spec: OptimizerSpec) -> None:
    """Torch keeps unknown keys of a param group silently; a misspelt one would be lost.
    A factory must also keep the groups it is given (one torch group per user one)."""
    from ..config import suggest_option

    options = spec.options
    if len(inner.param_groups) != len(options):
        raise ValueError(
            f"the optimizer factory returned {len(inner.param_groups)} param group(s) for "
            f"{len(options)} (the default group and {len(options) - 1} of param_groups=): "
            "with param_groups the factory receives torch's group dicts and must pass them "
            "on as they are, e.g. lambda groups: torch.optim.AdamW(groups, lr=1e-3)")
    if not spec.check_keys:
        return
    known = set(inner.defaults)
    for i, opts in enumerate(options[1:]):
        for k in opts:
            if k not in known:
                guess = suggest_option(k, sorted(known))
                hint = f"; did you mean {guess!r}?" if guess else ""
                raise TypeError(f"param_groups[{i}] has {k!r}, which "
                                f"{type(inner).__name__} does not know{hint}")


def disable(opt: torch.optim.Optimizer) -> None:
    """The instance handed to ``shard()`` is replaced: using it afterwards is an error,
    and its state (now held, sharded, by the new optimizer) is released."""

    def refuse(*_: Any, **__: Any) -> None:
        raise RuntimeError(
            f"this {type(opt).__name__} was replaced by zeroshard.shard(): step the "
            "optimizer shard() returned (model, optimizer = zeroshard.shard(model, "
            "optimizer, ...)); the old one no longer holds the training state")

    opt.register_step_pre_hook(refuse)
    opt.register_load_state_dict_pre_hook(refuse)
    opt.state.clear()
    opt._zeroshard_replaced = True  # type: ignore[attr-defined]
