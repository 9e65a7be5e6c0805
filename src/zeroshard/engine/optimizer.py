"""The optimizer the user holds: a torch optimizer over this rank's flat master slices.

The wrapped optimizer sees 1-D fp32 tensors: each bucket's master (the rank's slice, or
the whole bucket at stage 0) in chunks (see [Note: optimizer chunks]), so any optimizer whose update is elementwise — AdamW, Adam,
SGD with momentum, Adagrad, RMSprop, Lion-style — works unchanged and matches the
unsharded update. Optimizers whose update mixes elements of a parameter (a per-tensor
norm, a factored or matrix preconditioner) would see flat slices instead of tensors and
silently compute something else, so the ones we can detect are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .chunks import bucket_state, flatten_state
from .engine import Engine
from .flat import FlatBucket

__all__ = ["ShardedOptimizer", "check_elementwise", "resolve_param_groups", "check_group_keys"]

# Updates that depend on a whole tensor (trust ratios, factored moments, preconditioners).
_NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "SparseAdam", "Shampoo", "Muon", "Lamb", "LARS",
                    "Lars", "SOAP", "Sophia", "Kron")


def check_elementwise(optimizer: torch.optim.Optimizer | type) -> None:
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    for bad in _NOT_ELEMENTWISE:
        if bad.lower() in cls.__name__.lower():
            raise ValueError(
                f"optimizer {cls.__name__} is not elementwise: its update depends on whole "
                "tensors, which a flat shard does not have. zeroshard supports elementwise "
                "optimizers (AdamW, Adam, SGD, Adagrad, RMSprop, Lion-style); use one of "
                "them or an unsharded run for this optimizer"
            )


def resolve_param_groups(
    model: nn.Module, groups: Any
) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """``param_groups=`` of ``shard()`` -> (group index by parameter name, each group's
    options). Group 0 is the default: every trainable parameter no group lists, with the
    optimizer keywords given to ``shard()``; group i >= 1 is ``groups[i - 1]``. A group's
    ``params`` may hold the model's parameters, their names, or ``(name, parameter)``
    pairs as ``model.named_parameters()`` yields them (torch takes those too)."""
    if groups is None:
        return {}, [{}]
    if isinstance(groups, dict) or not isinstance(groups, list | tuple):
        raise TypeError(f"param_groups must be a list of dicts like torch's, e.g. "
                        f"[{{'params': no_decay, 'weight_decay': 0.0}}]; got "
                        f"{type(groups).__name__}")
    names: dict[int, list[str]] = {}
    by_name: dict[str, nn.Parameter] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
        by_name[n] = p
    group_of: dict[str, int] = {}
    options: list[dict[str, Any]] = [{}]
    for i, g in enumerate(groups, start=1):
        where = f"param_groups[{i - 1}]"
        if not isinstance(g, dict) or "params" not in g:
            what = (f"a dict with keys {sorted(map(str, g))}" if isinstance(g, dict)
                    else f"a {type(g).__name__}")
            raise TypeError(f"{where} must be a dict with a 'params' list (e.g. {{'params': "
                            f"no_decay, 'weight_decay': 0.0}}); got {what}")
        for p in _group_params(g["params"], by_name, where):
            if id(p) not in names:
                raise ValueError(f"{where} lists a {tuple(p.shape)} tensor that is not a "
                                 "parameter of the model being sharded; pass the model's own "
                                 "parameters (e.g. from model.named_parameters())")
            name = names[id(p)][0]
            if not p.requires_grad:
                raise ValueError(f"{where} lists {name!r}, which is frozen "
                                 "(requires_grad=False) and gets no optimizer state; drop it")
            if name in group_of:
                tied = (f" ({' = '.join(names[id(p)])}: one tied parameter)"
                        if len(names[id(p)]) > 1 else "")
                other = group_of[name] - 1
                twice = (f"twice in {where}" if other == i - 1
                         else f"in param_groups[{other}] and {where}")
                raise ValueError(f"{name!r}{tied} is {twice}; list each parameter once")
            for n in names[id(p)]:
                group_of[n] = i
        options.append({k: v for k, v in g.items() if k != "params"})
    return group_of, options


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


def check_group_keys(inner: torch.optim.Optimizer, options: list[dict[str, Any]]) -> None:
    """Torch keeps unknown keys of a param group silently; a misspelt one would be lost.
    A factory must also keep the groups it is given (one torch group per zeroshard one)."""
    from ..config import suggest_option

    if len(inner.param_groups) != len(options):
        raise ValueError(
            f"the optimizer factory returned {len(inner.param_groups)} param group(s) for "
            f"{len(options)} (the default group and {len(options) - 1} of param_groups=): "
            "with param_groups the factory receives torch's group dicts and must pass them "
            "on as they are, e.g. lambda groups: torch.optim.AdamW(groups, lr=1e-3)")
    known = set(inner.defaults)
    for i, opts in enumerate(options[1:]):
        for k in opts:
            if k not in known:
                guess = suggest_option(k, sorted(known))
                hint = f"; did you mean {guess!r}?" if guess else ""
                raise TypeError(f"param_groups[{i}] has {k!r}, which "
                                f"{type(inner).__name__} does not know{hint}")


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps ``inner`` (built over the engine's master slices).

    ``param_groups`` and ``state`` are the inner optimizer's own objects, so learning-rate
    schedulers and manual lr changes work as usual.
    """

    def __init__(self, engine: Engine, inner: torch.optim.Optimizer) -> None:
        self.engine = engine
        self.optim = inner
        # Optimizer.__init__ sets up hook dicts the LR schedulers and profilers expect.
        super().__init__(engine.master_params(), dict(inner.defaults))
        self.param_groups = inner.param_groups
        self.state = inner.state
        # State is created per chunk; flatten it as part of the inner step (so a memory
        # tracker sees it inside that step: on the host with offload).
        inner.register_step_post_hook(lambda *_: self._flatten())

    def _flatten(self) -> None:
        for b in self.engine.buckets:
            flatten_state(self.optim.state, b)

    # -- what the user calls -------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise ValueError(
                "closure is not supported: zeroshard steps once per backward; call "
                "loss.backward() then optimizer.step() without a closure"
            )
        engine = self.engine
        if engine.prepare_grads():  # fp16 overflow somewhere: skip, back off the scale
            engine.scaler.update(overflow=True)
            engine.skip_step()
            return None
        engine.scaler.update(overflow=False)
        unused = engine.unused_slots()
        saved = [self._save_range(b, lo, hi) for b, lo, hi in unused]
        self.optim.step()  # its post-hook flattens the per-chunk state (chunks.py)
        for (b, lo, hi), old in zip(unused, saved):
            self._restore_range(b, lo, hi, old)
        engine.after_step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over all shards; return that norm (as torch's does)."""
        if max_norm <= 0:
            raise ValueError(f"max_norm={max_norm!r} must be > 0")
        norm_type = float(norm_type)
        if norm_type not in (2.0, float("inf")) and norm_type <= 0:
            raise ValueError(f"norm_type={norm_type!r} must be positive or inf")
        self.engine._clip_this_iter = (max_norm, norm_type)  # replayed by join()
        total = self.engine.grad_norm(norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self.engine.scale_grads(coef)
        return total

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 when not scaling)."""
        return self.engine.scaler.scale

    # -- parameters no rank used this step: leave them and their state untouched --------
    def _save_range(self, b: FlatBucket, lo: int, hi: int) -> list[torch.Tensor]:
        tensors = [b.master.detach()] + self._state_tensors(b)
        return [t[lo:hi].clone() for t in tensors]

    def _restore_range(self, b: FlatBucket, lo: int, hi: int,
                       old: list[torch.Tensor]) -> None:
        tensors = [b.master.detach()] + self._state_tensors(b)
        for t, o in zip(tensors, old):
            t[lo:hi].copy_(o)

    def _state_tensors(self, b: FlatBucket) -> list[torch.Tensor]:
        return [v for v in bucket_state(self.optim.state, b).values()
                if isinstance(v, torch.Tensor) and v.shape == b.master.shape]

    def state_dict(self) -> dict[str, Any]:
        return {"optim": self.optim.state_dict(), "scaler": self.engine.scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict["optim"])
        self._flatten()
        self.engine.scaler.load_state_dict(state_dict["scaler"])
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state
