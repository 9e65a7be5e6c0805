"""The optimizer the user holds: a torch optimizer over this rank's flat master slices,
facing the user with the groups and state format torch's optimizer would have.

The wrapped (inner) optimizer sees 1-D fp32 tensors: each bucket's master (the rank's
slice, or the whole bucket at stage 0) in chunks (see [Note: optimizer chunks]), so any
optimizer whose update is elementwise — AdamW, Adam, SGD with momentum, Adagrad,
RMSprop, Lion-style — works unchanged and matches the unsharded update. Optimizers whose
update mixes elements of a parameter (Muon's orthogonalisation, a factored or matrix
preconditioner, a per-tensor norm) would see flat slices and silently compute something
else: their parameters are stepped whole, each by one owner rank (``whole``, see [Note:
whole-parameter updates] in whole.py), and the ones we cannot recognise are refused.

What the user sees (see [Note: optimizer groups] in optimizer_spec.py): ``param_groups``
hold the model's parameters in the user's groups; hyperparameters set on them (a
learning-rate schedule) reach the inner groups at every step; ``state_dict()`` is
torch's format ([Note: torch-format optimizer state] in optimizer_state.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .chunks import skip_slots
from .composite import CompositeOptimizer
from .engine import Engine
from .load_guard import refuse_weightless_accelerate_load
from .optimizer_state import load_torch_state_dict, state_view, torch_state_dict
from .shard_server import WEIGHTS
from .sharded_state import dcp_request
from .whole import WholeUpdates
from .whole_state import whole_state_view

__all__ = ["ShardedOptimizer", "OptimizerPart", "one_optimizer", "part_state_dict"]

_SCALER_KEY = "zeroshard_loss_scaler"


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps ``inner`` (built over the engine's master chunks, one inner group per user
    group); ``groups`` are the user's groups over the model's (user) parameters."""

    def __init__(self, engine: Engine, inner: torch.optim.Optimizer | CompositeOptimizer,
                 groups: list[dict[str, Any]], defaults: dict[str, Any] | None = None,
                 replaces: torch.optim.Optimizer | None = None,
                 whole: WholeUpdates | None = None, whole_part: int | None = None) -> None:
        self.engine = engine
        self.optim = inner
        # Several optimizers (a CompositeOptimizer, see [Note: several optimizers]): the
        # part whose groups ``whole`` steps, and the parts not stepped yet this iteration.
        self.whole_part = whole_part
        self._unstepped: set[int] = set()
        # A whole-parameter optimizer (Muon): ``inner`` holds the whole parameters this
        # rank owns, stepped by ``whole`` (see [Note: whole-parameter updates]).
        self.whole = whole
        # The instance handed to shard(): schedulers built on it share our groups; its
        # ``_opt_called`` tells them the optimizer did step (their first-step check).
        self._replaces = weakref.ref(replaces) if replaces is not None else None
        self._built = False
        # Optimizer.__init__ sets up the hook dicts LR schedulers and profilers expect.
        super().__init__(groups, dict(defaults or inner.defaults))
        self._built = True
        # With zeroshard's own fp16 loss scaling, GradScaler would scale twice: torch's
        # GradScaler hands optimizers that set this to their own step, which refuses it.
        self._step_supports_amp_scaling = engine.scaler.enabled
        # Its state served to a rank taking optimizer.state_dict() alone ([Note: state
        # dicts served] in shard_server.py).
        self._serve_kind = WEIGHTS + 1 + engine.server.register_optimizer(
            engine.server_id, self) if engine.server is not None else -1

    def _sync_hyperparameters(self) -> None:
        """Hyperparameters set on the user's groups (lr schedules) -> the inner groups."""
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v

    def _publish_hyperparameters(self) -> None:
        """What the inner optimizer wrote into its groups during the step (D-Adaptation's
        and Prodigy's ``d``, a step count) -> the user's groups, as torch's optimizer
        would hold it: the user reads it there, ``state_dict()`` saves it, and the next
        step's sync must not put the old value back."""
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            for k, v in inner.items():
                if k != "params":
                    outer[k] = v

    # -- what the user calls -------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step; ``closure`` (forward + backward, returning the loss) is run once first
        and its loss returned, as torch's first-order optimizers do (Lightning's automatic
        optimisation steps this way). Optimizers that re-evaluate it (LBFGS) do not shard."""
        return self.step_part(None, closure)

    @torch.no_grad()
    def step_part(self, part: int | None, closure: Callable[[], Any] | None = None,
                  stepped: torch.optim.Optimizer | None = None) -> Any:
        """:meth:`step` over one part of several optimizers (None: all of them);
        ``stepped``: the optimizer the user stepped (a GradScaler marks that one)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with self.engine.clock.change():  # see [Note: the state clock]
            self._step(part, stepped)
        return loss

    def _step(self, part: int | None, stepped: torch.optim.Optimizer | None) -> None:
        asked = self if stepped is None else stepped
        if self._step_supports_amp_scaling and (
                getattr(asked, "grad_scale", None) is not None
                or getattr(asked, "found_inf", None) is not None):
            raise RuntimeError(
                "a torch.amp.GradScaler is stepping this optimizer, but the model was sharded "
                "with mixed_precision='fp16', which scales the loss itself: the loss would be "
                "scaled twice. Drop the GradScaler (call loss.backward() and optimizer.step()), "
                "or shard with mixed_precision=None and keep autocast + GradScaler")
        engine = self.engine
        if engine.prepare_grads():  # fp16 overflow somewhere: skip, back off the scale
            engine.scaler.update(overflow=True)
            engine.skip_step()
            return
        engine.scaler.update(overflow=False)
        engine.adopt_user_grads()  # .grad assigned by the user (see step_grads.py)
        self._sync_hyperparameters()
        unused = engine.unused_slots()
        for b, slots in unused:
            skip_slots(b, slots)  # as torch skips a parameter whose grad is None
        engine.settle_gathers()
        composite = isinstance(self.optim, CompositeOptimizer)
        if composite:
            self.optim.active = None if part is None else [part]
        try:
            if self.whole is not None and part in (None, self.whole_part):
                self.whole.step(self.optim, dict(unused))
            else:
                _flat_step(self.optim)
        finally:
            if composite:
                self.optim.active = None
        self._publish_hyperparameters()
        old = self._replaces() if self._replaces is not None else None
        if old is not None:
            old._opt_called = True  # type: ignore[attr-defined]
        engine.after_step(close=self._iteration_done(part))

    def _iteration_done(self, part: int | None) -> bool:
        """Whether this step ends the iteration: always with one optimizer; with several,
        once each has stepped (the ledger's step and join's record then span them all)."""
        if part is None or not isinstance(self.optim, CompositeOptimizer):
            return True
        if not self._unstepped:
            self._unstepped = set(range(len(self.optim.parts)))
        self._unstepped.discard(part)
        return not self._unstepped

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_built", True):  # Optimizer.__init__ building the groups
            return super().add_param_group(param_group)
        raise NotImplementedError(
            "add_param_group is not supported after zeroshard.shard(): the optimizer's "
            "groups are fixed when the model is sharded; build the optimizer with all its "
            "groups (or pass param_groups=[...]) before sharding")

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over all shards; return that norm (as torch's does)."""
        if max_norm <= 0:
            raise ValueError(f"max_norm={max_norm!r} must be > 0")
        norm_type = float(norm_type)
        if norm_type not in (2.0, float("inf")) and norm_type <= 0:
            raise ValueError(f"norm_type={norm_type!r} must be positive or inf")
        self.engine.replay.clip_this_iter = (max_norm, norm_type)  # replayed by join()
        total = self.engine.grad_norm(norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self.engine.scale_grads(coef)
        return total

    @property  # type: ignore[override]
    def state(self) -> dict[Any, dict[str, Any]]:
        """Per user parameter, the optimizer state of this rank's piece (views; DTensors
        at stages >= 1). Whole state in torch's format: ``state_dict()``."""
        if not getattr(self, "_built", False):
            return {}
        view = state_view(self.engine, self.optim)
        if self.whole is not None:
            view.update(whole_state_view(self.whole, self.optim))
        return view

    @state.setter
    def state(self, value: Any) -> None:
        """Optimizer.__init__ assigns an empty state; the state lives in the inner
        optimizer, per chunk."""

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 when not scaling)."""
        return self.engine.scaler.scale

    # -- state in torch's format ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What torch's optimizer over the unsharded model (same groups, same order)
        returns; read from the other ranks at stages >= 1 (a collective under NCCL, TP or
        Muon). See [Note: torch-format optimizer state].
        To torch's DCP API, DTensor shards ([Note: sharded state dicts for torch's DCP
        API])."""
        return self.torch_format(dcp_request())

    def torch_format(self, dcp: str | None = None) -> dict[str, Any]:
        """Torch's format: whole values (read from the other ranks at stages >= 1), or
        for torch's DCP API (``dcp``: see ``dcp_request``) DTensor views, a whole-parameter
        optimizer's entries on their owners (gathered for ``"full"``)."""
        sharded = dcp is not None
        whole_local = dcp == "sharded" or self.whole is None
        served = self.engine.server is not None and self.whole is None
        if self.engine.policy.shard_optimizer and not (sharded and whole_local) and not served:
            self.engine.world.sync_point("optimizer.state_dict")  # a collective: gathers
        sd = torch_state_dict(self.engine, self.optim, self.param_groups, self.whole,
                              sharded=sharded, whole_local=whole_local,
                              served=self._serve_kind if served and not sharded else None)
        if self.engine.scaler.enabled:
            sd[_SCALER_KEY] = self.engine.scaler.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's format (from this optimizer at any stage and world size, or from a
        plain torch optimizer over the same groups); no communication."""
        refuse_weightless_accelerate_load(self.engine.model)
        with self.engine.loading("optimizer.load_state_dict"):
            load_torch_state_dict(self.engine, self.optim, self.param_groups, state_dict,
                                  self.whole)
        self._sync_hyperparameters()
        if self.engine.scaler.enabled and _SCALER_KEY in state_dict:
            self.engine.scaler.load_state_dict(state_dict[_SCALER_KEY])


class OptimizerPart(torch.optim.Optimizer):
    """One of several optimizers handed to ``shard()`` (see [Note: several optimizers] in
    composite.py): its groups are the instance's own group dicts (an LR scheduler built
    on it before sharding keeps working), over the model's parameters; ``step`` steps its
    parameters, ``zero_grad`` clears their gradients, ``state_dict`` is torch's format for
    its groups alone — what torch's optimizer over the unsharded model would give."""

    def __init__(self, core: ShardedOptimizer, index: int, replaces: torch.optim.Optimizer
                 ) -> None:
        self.core = core
        self.index = index
        self._replaces = weakref.ref(replaces)
        self._built = False
        super().__init__(replaces.param_groups, dict(replaces.defaults))
        self._built = True
        self._step_supports_amp_scaling = core._step_supports_amp_scaling

    @property
    def engine(self) -> Engine:
        return self.core.engine

    @property
    def _range(self) -> range:
        assert isinstance(self.core.optim, CompositeOptimizer)
        return self.core.optim.group_ranges()[self.index]

    def _mine(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = self.core.step_part(self.index, closure, stepped=self)
        old = self._replaces()
        if old is not None:
            old._opt_called = True  # type: ignore[attr-defined]
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear this optimizer's parameters' gradients, as torch's ``zero_grad`` (the
        next backward starts them afresh: [Note: gradients edited between backwards]);
        once no parameter has one left, the engine's buffers are freed too."""
        mine = self._mine()
        if set_to_none:
            held = set(mine)
            if all(p.grad is None for g in self.core.param_groups for p in g["params"]
                   if p not in held):
                self.core.zero_grad(True)
                return
        for p in mine:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_built", True):
            return super().add_param_group(param_group)
        self.core.add_param_group(param_group)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Over every parameter of the model (all optimizers'), as the engine clips."""
        return self.core.clip_grad_norm_(max_norm, norm_type)

    @property  # type: ignore[override]
    def state(self) -> dict[Any, dict[str, Any]]:
        if not getattr(self, "_built", False):
            return {}
        held = set(self._mine())
        return {p: st for p, st in self.core.state.items() if p in held}

    @state.setter
    def state(self, value: Any) -> None:
        """See ShardedOptimizer.state."""

    @property
    def loss_scale(self) -> float:
        return self.core.loss_scale

    def state_dict(self) -> dict[str, Any]:
        """Torch's format for this optimizer's groups (collective, as the core's; DTensor
        shards to torch's DCP API, as the core's)."""
        return part_state_dict(self.core.torch_format(dcp_request()),
                               self._range)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Torch's format for this optimizer's groups. A collective where the optimizer
        is sharded: the other optimizers' state is read back first (each optimizer's
        state lives in one engine)."""
        whole = self.core.state_dict()
        self.core.load_state_dict(_with_part(whole, state_dict, self._range))


def part_state_dict(sd: dict[str, Any], groups: range) -> dict[str, Any]:
    """The entries of ``groups`` of a torch-format state dict, numbered from 0 (one of
    several optimizers' own state dict)."""
    mine = [dict(g) for g in sd["param_groups"][groups.start : groups.stop]]
    ids = [i for g in mine for i in g["params"]]
    base = min(ids, default=0)
    for g in mine:
        g["params"] = [i - base for i in g["params"]]
    held = set(ids)
    out = {"state": {i - base: v for i, v in sd["state"].items() if i in held},
           "param_groups": mine}
    if _SCALER_KEY in sd:
        out[_SCALER_KEY] = sd[_SCALER_KEY]
    return out


def _with_part(sd: dict[str, Any], part: dict[str, Any], groups: range) -> dict[str, Any]:
    """``sd`` with the entries of ``groups`` replaced by ``part``'s, matched by position
    as torch's ``load_state_dict`` matches them (``part`` may key its state by any ids:
    torch's DCP ``set_state_dict`` passes parameter names)."""
    if not isinstance(part, dict) or "state" not in part or "param_groups" not in part:
        raise ValueError("optimizer.load_state_dict() takes torch's format, a dict with "
                         "'state' and 'param_groups' (what optimizer.state_dict() returns)")
    if len(part["param_groups"]) != len(groups):
        raise ValueError(f"loaded optimizer state has {len(part['param_groups'])} parameter "
                         f"group(s), this optimizer has {len(groups)}; build it with the "
                         "same groups")
    old = sd["param_groups"][groups.start : groups.stop]
    held = {i for g in old for i in g["params"]}
    state = {i: v for i, v in sd["state"].items() if i not in held}
    new = []
    for g_old, g in zip(old, part["param_groups"]):
        if len(g["params"]) != len(g_old["params"]):
            raise ValueError(f"a parameter group of the loaded state holds "
                             f"{len(g['params'])} parameters, this optimizer's "
                             f"{len(g_old['params'])}; build it over the same parameters "
                             "in the same order")
        for mine, theirs in zip(g_old["params"], g["params"]):
            if theirs in part["state"]:
                state[mine] = part["state"][theirs]
        new.append({**g, "params": list(g_old["params"])})
    groups_all = list(sd["param_groups"])
    groups_all[groups.start : groups.stop] = new
    out = {"state": state, "param_groups": groups_all}
    if _SCALER_KEY in part:
        out[_SCALER_KEY] = part[_SCALER_KEY]
    elif _SCALER_KEY in sd:
        out[_SCALER_KEY] = sd[_SCALER_KEY]
    return out


def one_optimizer(optimizer: Any) -> Any:
    """What the checkpoint functions take: an optimizer ``shard()`` returned, or the tuple
    it returned for several optimizers (their shared core; see [Note: several
    optimizers] in engine/composite.py)."""
    core = getattr(optimizer, "core", None)
    if core is not None:  # one part alone would save or load part of the state
        raise TypeError("this optimizer is one of several shard() returned: pass all of "
                        "them, as the tuple shard() returned (model, opts = shard(model, "
                        "(muon, adamw)); then save_checkpoint / load_checkpoint / "
                        "full_optimizer_state(..., model, opts))")
    if not isinstance(optimizer, (list, tuple)):
        return optimizer
    cores = {id(getattr(o, "core", None)) for o in optimizer}
    core = getattr(optimizer[0], "core", None) if optimizer else None
    if core is None or len(cores) != 1 or len(optimizer) != len(core.optim.parts):
        raise TypeError("a tuple of optimizers here must be the one shard() returned for "
                        "several optimizers, all of them in its order")
    return core


_SHAPE_ERRORS = (IndexError, RuntimeError, ValueError)
_SHAPE_WORDS = ("imension", "shape", "2D", "2-D", "1-D", "matri", "size")


def _flat_step(optim: Any) -> None:
    """The elementwise path's step: the optimizer sees 1-D chunks of the parameters. An
    optimizer that needs whole tensors but was not recognised (a Muon-style one under
    another name) fails in its own code with a shape error: say why, and the fix."""
    try:
        optim.step()
    except (IndexError, RuntimeError, ValueError) as e:
        # exactly these types (a subclass may not take one message) and a shape error
        if type(e) not in _SHAPE_ERRORS or not any(w in str(e) for w in _SHAPE_WORDS):
            raise
        name = type(optim).__name__
        raise type(e)(
            f"{e}\n(zeroshard stepped {name} on flat 1-D chunks of the parameters, as an "
            "elementwise optimizer such as AdamW is stepped. If its update needs whole "
            "tensors — a matrix orthogonalisation like Muon's, a preconditioner, a "
            "per-tensor norm — shard with whole_params=True: each parameter is then stepped "
            "whole by one rank (docs/optimizers.md).)") from e
