"""The root module's forward hooks: what every forward does before and after the model
runs, and the hand-over from forward to backward.

Before: refuse parameters replaced or re-flagged since sharding, re-derive weights the
user edited (refresh.py), count the ranks with data inside ``join()`` (replay.py),
broadcast buffers as DDP does (buffers.py), and put the compute parameters into the
modules (stage 3: gather the root unit and prefetch; units are gathered by stage3.py's
hooks). After: hand the modules back the user parameters until a backward starts
([Note: between forward and backward]) and scale the gradient entering the model (fp16).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_flatten

from ..comm import Comm
from ..config import ShardConfig
from ..wrapping import REPLACED_HINT, refuse_active_ddp, refuse_wrapping_caller
from .backward import BackwardPass
from .buffers import broadcast_buffers
from .params import Faces
from .precision import LossScaler
from .refresh import WeightRefresh
from .replay import JoinReplay
from .stage3 import UnitSchedule, in_backward

__all__ = ["RootHooks"]


class RootHooks:
    """The root module's forward pre- and post-hooks. Before the model runs they check
    the parameters, refresh edited weights, count ranks inside ``join()``, sync buffers
    and put the compute parameters in place; after it, they hand the modules back the
    user parameters until a backward starts and scale the gradient entering the model."""

    def __init__(self, *, model: nn.Module, config: ShardConfig, comm: Comm, world: Comm,
                 faces: Faces, weights: WeightRefresh, schedule: UnitSchedule,
                 backward: BackwardPass, replay: JoinReplay, scaler: LossScaler,
                 frozen: list[nn.Parameter], compute: list[nn.Parameter]) -> None:
        self.model = model
        self.config = config
        self.comm = comm
        self.world = world
        self.faces = faces
        self.weights = weights
        self.schedule = schedule
        self.by_unit = bool(schedule.units)  # stage 3
        self.backward = backward
        self.replay = replay
        self.scaler = scaler
        self.compute_dtype = config.compute_dtype
        # DDP syncs buffers before a forward that follows a training forward (and before
        # the first): see broadcast_buffers in buffers.py.
        self.sync_buffers = True
        self.kv_cache: weakref.ref | None = None  # the last forward's past_key_values
        self._callers_checked = False  # see wrapping.refuse_wrapping_caller
        # After materialising: a meta model's parameters are new objects by now.
        self._known_params = {*model.parameters(), *faces.known(), *compute}
        # requires_grad as sharded, per parameter the user holds (see _check_params).
        self._grad_flags = {s.user: s.user.requires_grad
                            for b in faces.buckets for s in b.slots}
        self._grad_flags.update((p, False) for p in frozen)
        # Where each plain-tensor parameter the user holds keeps its values: a view of the
        # engine's buffer (see [Note: parameters given new storage]; a DTensor's .data
        # setter torch itself ignores, as under FSDP2).
        dtensor = sys.modules.get("torch.distributed.tensor")  # loaded once one exists
        self._homes = {s.user: s.user.detach() for b in faces.buckets for s in b.slots
                       if (dtensor is None or not isinstance(s.user, dtensor.DTensor))
                       and _storage_of(s.user) != -1}

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        self._check_params()
        # A cache passed to a forward without gradients (generation's); in training its
        # keys and values are activations the backward needs, filed as such.
        self._note_kv_cache(None if torch.is_grad_enabled() else _kv_cache_of(kwargs))
        if not in_backward():
            refuse_active_ddp(self.model)
            if not self._callers_checked:
                refuse_wrapping_caller(self.model)
                self._callers_checked = True
            self.weights.refresh_edited()
            self.backward.ended = False
            self.replay.forward_begins()
        if self.by_unit and not self.schedule.all_resident():
            # One rank alone in a forward (evaluation on rank 0 only) is refused here,
            # before any gather; see [Note: divergence] in comm_check.py. With every unit
            # resident (unshard(), generate()'s gather) the forward issues no collective
            # and may run alone, as at stage 0: no check point (one per generated token
            # was ~1 ms of a 30 ms token on 2 CPU ranks).
            self.comm.sync_point("forward", phase="forward")
        if self.config.sync_buffers_in_forward and self.sync_buffers and not in_backward():
            # Checked before it is issued: one rank alone in it (stages 0-2: no check
            # point above), or buffers whose sizes differ by rank, must raise with
            # nothing in flight.
            broadcast_buffers(self.model, self.world, self.replay.buffer_src, strict=True)
        if self.by_unit:
            self.schedule.root_pre_forward()
        else:
            self.faces.hold(compute=True)
        if self.compute_dtype is None:
            return None
        cast = self._cast_floating
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    def _note_kv_cache(self, cache: Any) -> None:
        """Remember the forward's key/value cache (see _kv_cache_of),
        weakly, for the memory tracker's ``kv_cache`` category (sources.py); a forward
        without one forgets it."""
        try:
            self.kv_cache = None if cache is None else weakref.ref(cache)
        except TypeError:  # a legacy tuple of tuples: not weakly referenceable
            self.kv_cache = None

    def _cast_floating(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(self.compute_dtype)
        return x

    def post_forward(self, module: nn.Module, args, output):
        if not in_backward():  # as DDP: the next forward syncs buffers after a training one
            self.sync_buffers = torch.is_grad_enabled() and self.backward.sync
        if not torch.is_grad_enabled() and (cache := _kv_cache_of_output(output)) is not None:
            self._note_kv_cache(cache)  # one the forward made (HF: use_cache=True)
        if self.by_unit:
            self.schedule.root_post_forward()
        elif not torch.is_grad_enabled():
            self.faces.hold(compute=False)  # no backward follows
        if torch.is_grad_enabled() and not in_backward():
            self._between_forward_and_backward(output)
        if self.scaler.enabled and torch.is_grad_enabled():
            # Scaling the gradient that enters the model equals scaling the loss (backward
            # is linear) and keeps the plain ``loss.backward()`` API. If the model returns a
            # scalar (a loss computed inside), scale only that: its gradient already flows
            # through the other outputs.
            leaves = [t for t in tree_flatten(output)[0]
                      if isinstance(t, torch.Tensor) and t.requires_grad]
            scalars = [t for t in leaves if t.dim() == 0]
            for t in scalars or leaves:
                t.register_hook(self._scale_grad)
        return output

    def _between_forward_and_backward(self, output: Any) -> None:
        """[Note: between forward and backward]
        A forward with gradients may have no backward after it (a validation loss computed
        without ``torch.no_grad()``). Until a backward starts, the modules must hold the
        user parameters, as they do between steps: torch APIs on ``model.parameters()``
        (``clip_grad_norm_``, an optimizer, ``p.grad``) read those, and under DDP that
        forward changes nothing. The autograd graph already holds the compute
        parameters, so the backward needs them in the modules only to recompute
        (activation checkpointing): the first gradient reaching an output shows them again
        (_backward_begins). Gathered stage-3 units stay gathered for that backward; a
        step frees them (after_step), so no forward uses weights gathered before it."""
        if not (self.by_unit or self.faces.swaps):
            return  # the modules hold the user parameters throughout
        if self.by_unit:
            self.schedule.show_gathered(compute=False)
        else:
            self.faces.hold(compute=False)
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._backward_begins)

    def _backward_begins(self, grad: torch.Tensor) -> None:
        """See [Note: between forward and backward]."""
        if self.by_unit and self.backward.ended:
            # The units were freed at the end of the last backward, and the graph's saved
            # tensors view their (now empty) storage: refuse before autograd reads them.
            raise RuntimeError(
                "stage 3 runs one backward per forward: this backward goes through a graph "
                "that an earlier backward already went through (retain_graph=True), or "
                "through a second forward's graph after the first one's backward. Sum the "
                "losses and call backward once ((loss_a + loss_b).backward()), run a "
                "forward before each backward, or use stage 2")
        if self.by_unit:
            self.schedule.show_gathered(compute=True)
        else:
            self.faces.hold(compute=True)

    def _scale_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.scaler.scale

    def _check_params(self) -> None:
        for name, p in self.model.named_parameters():
            if p not in self._known_params:
                raise RuntimeError(
                    f"parameter {name!r} was replaced after zeroshard.shard(); sharded "
                    "buffers no longer back it. Change the model before sharding it, or "
                    "build a new model and shard that" + REPLACED_HINT
                )
            home = self._homes.get(p)
            if home is not None and _storage_of(p) != _storage_of(home):
                _take_home(name, p, home)
            was = self._grad_flags.get(p)
            if was is None or p.requires_grad == was or not torch.is_grad_enabled():
                # A forward without gradients computes none, so a flag flipped for it is
                # harmless: peft's disable_adapter() (TRL's DPO reference pass) flips the
                # adapters' flags under torch.no_grad() and flips them back after.
                continue
            # Freezing is honoured where the modules compute with the parameters you
            # hold (fp32 stages 0-2: autograd skips them, the step restores them as
            # unused). Elsewhere the model computes with other tensors, whose flag is
            # the engine's; and a parameter frozen at shard() time has no optimizer
            # state or bucket slot at all: either would train (or not) silently.
            if was and not self.faces.swap:
                continue
            raise RuntimeError(
                f"parameter {name!r} had requires_grad={was} when the model was sharded "
                f"and has requires_grad={p.requires_grad} now: "
                + ("a parameter frozen at shard() time has no optimizer state and is never "
                   "stepped" if not was else "at this stage (or under mixed precision or "
                   "offload) the model computes with zeroshard's own tensors, so the flag "
                   "would not reach the backward")
                + ". Set requires_grad before zeroshard.shard() (for a schedule that "
                "unfreezes layers later, shard them trainable and keep their gradient out "
                "with lr=0 in their own parameter group)")


def _take_home(name: str, p: nn.Parameter, home: torch.Tensor) -> None:
    """[Note: parameters given new storage]
    At stages 0-2 (fp32) the parameters the user holds view the engine's flat buffers: the
    optimizer steps those, and the reduced gradients land there. Something that gives a
    parameter new storage (``p.data = tensor``; ``model.to(device)`` whenever torch
    copies, as it does from ``cpu`` to ``cpu:0``: Accelerate's ``prepare_model`` for
    evaluation, which the Trainer's ``evaluate()`` calls) would leave the forward on the
    new tensor and the optimizer on the old one. A copy holding the same bits (a move to
    the same device) changes nothing DDP would see: the parameter goes back to its home.
    A tensor with other values, dtype or shape is refused: the two would part silently."""
    new = p.detach()
    if (new.shape == home.shape and new.dtype == home.dtype and new.device == home.device
            and _same_bits(new, home)):
        p.data = home
        return
    raise RuntimeError(
        f"parameter {name!r} was given new storage after zeroshard.shard() (p.data = tensor, "
        f"or a model.to()/.half() conversion): now {tuple(new.shape)} {new.dtype} on "
        f"{new.device}, sharded as {tuple(home.shape)} {home.dtype} on {home.device}"
        + ("" if new.shape != home.shape or new.dtype != home.dtype else ", other values")
        + ". The optimizer and the forward would use different tensors (DDP's would not). "
        "Copy values in instead (with torch.no_grad(): p.copy_(tensor)); choose the dtype "
        "with shard(..., mixed_precision=...) and the device before sharding")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN equals NaN, -0.0 differs from 0.0): one tensor copied."""
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _storage_of(p: torch.Tensor) -> int:
    """The address of ``p``'s values; -1 in a trace (fake or meta: no address)."""
    if is_fake(p) or p.is_meta:
        return -1
    return p.untyped_storage().data_ptr()


def _kv_cache_of(kwargs: dict) -> Any:
    """A forward's key/value cache: ``past_key_values`` (Hugging Face up to 4.x, most
    models), or ``cache`` when it is one of Hugging Face's ``Cache`` objects (5.x)."""
    cache = kwargs.get("past_key_values")
    if cache is None:
        cache = kwargs.get("cache")
        if not type(cache).__module__.startswith("transformers"):
            return None
    return cache


def _kv_cache_of_output(output: Any) -> Any:
    """The key/value cache a forward returns (Hugging Face's outputs: ``past_key_values``,
    or 5.x's ``cache``), or None. Read after forwards without gradients only: in training
    the same tensors are activations the backward needs, and are filed as such."""
    if not hasattr(output, "keys"):
        return None
    try:
        return _kv_cache_of(dict(output))
    except (TypeError, ValueError):
        return None
