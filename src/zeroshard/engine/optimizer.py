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
from .engine import Engine
from .optimizer_state import load_torch_state_dict, state_view, torch_state_dict
from .whole import WholeUpdates
from .whole_state import whole_state_view

__all__ = ["ShardedOptimizer"]

_SCALER_KEY = "zeroshard_loss_scaler"


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps ``inner`` (built over the engine's master chunks, one inner group per user
    group); ``groups`` are the user's groups over the model's (user) parameters."""

    def __init__(self, engine: Engine, inner: torch.optim.Optimizer,
                 groups: list[dict[str, Any]], defaults: dict[str, Any] | None = None,
                 replaces: torch.optim.Optimizer | None = None,
                 whole: WholeUpdates | None = None) -> None:
        self.engine = engine
        self.optim = inner
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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._step_supports_amp_scaling and (
                getattr(self, "grad_scale", None) is not None
                or getattr(self, "found_inf", None) is not None):
            raise RuntimeError(
                "a torch.amp.GradScaler is stepping this optimizer, but the model was sharded "
                "with mixed_precision='fp16', which scales the loss itself: the loss would be "
                "scaled twice. Drop the GradScaler (call loss.backward() and optimizer.step()), "
                "or shard with mixed_precision=None and keep autocast + GradScaler")
        engine = self.engine
        if engine.prepare_grads():  # fp16 overflow somewhere: skip, back off the scale
            engine.scaler.update(overflow=True)
            engine.skip_step()
            return loss
        engine.scaler.update(overflow=False)
        engine.adopt_user_grads()  # .grad assigned by the user (see step_grads.py)
        self._sync_hyperparameters()
        unused = engine.unused_slots()
        for b, slots in unused:
            skip_slots(b, slots)  # as torch skips a parameter whose grad is None
        engine.settle_gathers()
        if self.whole is not None:
            self.whole.step(self.optim, dict(unused))
        else:
            self.optim.step()
        self._publish_hyperparameters()
        old = self._replaces() if self._replaces is not None else None
        if old is not None:
            old._opt_called = True  # type: ignore[attr-defined]
        engine.after_step()
        return loss

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
        returns; collective at stages >= 1. See [Note: torch-format optimizer state]."""
        if self.engine.policy.shard_optimizer:  # a collective: gathers every slice
            self.engine.world.sync_point("optimizer.state_dict")
        sd = torch_state_dict(self.engine, self.optim, self.param_groups, self.whole)
        if self.engine.scaler.enabled:
            sd[_SCALER_KEY] = self.engine.scaler.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's format (from this optimizer at any stage and world size, or from a
        plain torch optimizer over the same groups); no communication."""
        load_torch_state_dict(self.engine, self.optim, self.param_groups, state_dict,
                              self.whole)
        self._sync_hyperparameters()
        if self.engine.scaler.enabled and _SCALER_KEY in state_dict:
            self.engine.scaler.load_state_dict(state_dict[_SCALER_KEY])
