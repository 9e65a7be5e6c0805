"""Deterministic, order-free parameter init, and materialising meta-built models.

[Note: init is a function of (seed, name)]
A sharded engine builds the model on the meta device and materialises one unit at a
time, on whatever rank owns it. For that to reproduce an unsharded run bit for bit, the
value of a parameter must not depend on which other parameters were initialised before
it, on which device it lives, or on the global RNG. So every parameter draws from its own
``torch.Generator`` seeded with a 64-bit BLAKE2 hash of ``(seed, fully qualified name)``
(stable across processes, unlike ``hash()``; 64 bits, unlike ``zlib.crc32``, so name
collisions are out of reach). Values are drawn in float32 on the CPU and copied into the
tensor, so CPU, CUDA and bf16 copies of a model agree up to the final cast.

The scheme is GPT-2's as written in nanoGPT: N(0, init_std) for linear and embedding
weights, zeros for biases, ones for norm weights, and residual output projections
(modules named ``out_proj``) scaled by 1/sqrt(2L), one factor per residual addition
(Radford et al. 2019, sec. 2.3). Tied weights are initialised once, under the name
``named_parameters()`` reports for them (``tok_emb.weight``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["InitRule", "init_weights", "materialize", "param_seed"]

_RESIDUAL_PROJ = "out_proj"


@dataclass(frozen=True)
class InitRule:
    """How one parameter is initialised: ``normal`` with ``std``, ``zeros`` or ``ones``."""

    kind: str
    std: float = 0.0


def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name``: a stable 63-bit hash of (seed, name)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def _rule(
    module: nn.Module, module_name: str, attr: str, std: float, resid_std: float, full_name: str
) -> InitRule:
    if isinstance(module, nn.Embedding) and attr == "weight":
        return InitRule("normal", std)
    if isinstance(module, nn.Linear):
        if attr == "bias":
            return InitRule("zeros")
        is_residual = module_name.rpartition(".")[2] == _RESIDUAL_PROJ
        return InitRule("normal", resid_std if is_residual else std)
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return InitRule("ones" if attr == "weight" else "zeros")
    raise TypeError(
        f"init_weights has no rule for parameter {full_name!r} of a {type(module).__name__}; "
        "use nn.Linear / nn.Embedding / nn.LayerNorm / nn.RMSNorm or extend init._rule"
    )


def _rules(model: nn.Module) -> dict[str, tuple[nn.Parameter, InitRule]]:
    """Canonical parameter name -> (parameter, rule), tied parameters listed once."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "n_layers"):
        raise TypeError(
            f"init_weights needs a model with a .config carrying n_layers and init_std, "
            f"got {type(model).__name__}; build it with zeroshard.models.build_model"
        )
    std = config.init_std
    resid_std = std / math.sqrt(2 * config.n_layers)
    rules: dict[str, tuple[nn.Parameter, InitRule]] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            full = f"{module_name}.{attr}" if module_name else attr
            rules[full] = (param, _rule(module, module_name, attr, std, resid_std, full))
    return rules


def _alias_groups(model: nn.Module) -> list[list[str]]:
    """Names of each parameter reachable under several names (canonical name first)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


@torch.no_grad()
def _fill_(param: torch.Tensor, rule: InitRule, seed: int) -> None:
    if rule.kind == "zeros":
        param.zero_()
    elif rule.kind == "ones":
        param.fill_(1.0)
    else:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
        values = torch.empty(param.shape, dtype=torch.float32, device="cpu")
        values.normal_(0.0, rule.std, generator=gen)
        param.copy_(values)


def init_weights(model: nn.Module, seed: int, names: Iterable[str] | None = None) -> None:
    """Initialise the parameters of ``model`` (all, or those in ``names``) in place.

    Each value depends only on ``seed`` and the parameter's name (see [Note: init is a
    function of (seed, name)]), so subsets may be initialised in any order, on any
    device. ``names`` may use any alias of a tied parameter (``lm_head.weight``).
    Parameters still on the meta device hold no data and are skipped.
    """
    rules = _rules(model)
    if names is None:
        selected = list(rules)
    else:
        canonical = {alias: group[0] for group in _alias_groups(model) for alias in group}
        selected = []
        for name in names:
            name = canonical.get(name, name)
            if name not in rules:
                raise ValueError(
                    f"init_weights: {type(model).__name__} has no parameter {name!r}; "
                    "pass names from model.named_parameters()"
                )
            selected.append(name)
    for name in selected:
        param, rule = rules[name]
        if not param.is_meta:
            _fill_(param, rule, param_seed(seed, name))


def materialize(model: nn.Module, device: torch.device | str, seed: int = 0) -> nn.Module:
    """Allocate a (meta-built) model on ``device`` and initialise it; returns ``model``.

    ``to_empty`` allocates each module's parameters separately, which silently unties
    shared weights, so ties are restored first. Buffers are then recomputed by the
    model's ``reset_buffers()`` (RoPE tables) and parameters by ``init_weights``. The
    result is bitwise equal to building the model directly on ``device`` with ``seed``.
    """
    if torch.device(device).type == "meta":
        raise ValueError("materialize(device='meta') has nothing to allocate; pass a real device")
    groups = _alias_groups(model)
    model.to_empty(device=device)
    for canonical, *aliases in groups:
        shared = model.get_parameter(canonical)
        for alias in aliases:
            owner, _, attr = alias.rpartition(".")
            setattr(model.get_submodule(owner), attr, shared)
    reset = getattr(model, "reset_buffers", None)
    if callable(reset):
        reset()
    elif any(True for _ in model.buffers()):
        raise TypeError(
            f"{type(model).__name__} has buffers but no reset_buffers(); to_empty leaves "
            "them uninitialised, so add a reset_buffers() that recomputes them"
        )
    init_weights(model, seed)
    return model
