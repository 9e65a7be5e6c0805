"""Whole weights kept gathered across forwards at stage 3: ``model.unshard()`` /
``model.reshard()``, ``zeroshard.gathered(model, budget=...)``, and ``generate()`` that
gathers each unit once per call instead of once per token.

The mechanism is [Note: resident units] in engine/stage3.py; this file chooses which
units to hold and gives the user the calls. Generation is where it pays: each new token is
a forward, and at stage 3 a forward gathers every unit (one all-gather per unit per token,
4-5x stage 0's time per token on a small model). Held units are gathered once; forwards
and backwards between hold and release issue no gathers for them.

Every call here is a collective: every rank calls it, with the same budget (a budget
left to zeroshard is agreed on by the ranks: the smallest free device memory).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .engine.engine import engine_of
from .engine.units import Unit, UnitState
from .sizes import parse_bytes

__all__ = ["gathered", "register_forward_method", "UnshardHandle", "ShardedUnit",
           "choose_units", "give_units_their_calls", "unshard"]

#: Share of the free device memory a budget left to zeroshard may use for resident
#: weights; the rest stays for activations and the KV cache.
FREE_SHARE = 0.5


class UnshardHandle:
    """``model.unshard(async_op=True)``'s handle (FSDP2's ``UnshardHandle``): ``wait()``
    finishes the gathers it started."""

    def __init__(self, units: list[Unit]) -> None:
        self._units = units

    def wait(self) -> None:
        for u in self._units:
            u.wait()
        self._units = []


def unshard(model: nn.Module, async_op: bool = False) -> UnshardHandle | None:
    """Gather every unit and keep it gathered until ``model.reshard()`` (FSDP2's
    ``FSDPModule.unshard``); at stages 0-2 the weights are whole already: nothing to do."""
    engine = engine_of(model)
    if not engine.units:
        return UnshardHandle([]) if async_op else None
    held = engine.hold(list(engine.units), async_op=async_op)
    return UnshardHandle(held) if async_op else None


class ShardedUnit:
    """Mixed into the class of each stage-3 unit's module but the root (whose class has
    ShardedModule's): FSDP2 gives every ``fully_shard``-ed module ``unshard()`` and
    ``reshard()``, and so does zeroshard, for the unit the module is. The class keeps
    its name and module (as the root's does, api.py); a class that defines ``unshard`` or
    ``reshard`` itself is left as it is (:func:`give_units_their_calls`)."""

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this unit and keep it gathered until its ``reshard()`` (or the model's):
        forwards and backwards between issue no gather for it; a step frees it and the
        next forward gathers the new values (FSDP2's semantics). With ``async_op`` a handle
        to ``wait()`` on. Collective: every rank, the same units."""
        engine, unit = _unit_of(self)
        held = engine.hold([unit], async_op=async_op)
        return UnshardHandle(held) if async_op else None

    def reshard(self) -> None:
        """Free this unit's gathered weights (held by its ``unshard()`` or the model's).
        Between steps only."""
        engine, unit = _unit_of(self)
        engine.release([unit])


def _unit_of(module: nn.Module) -> tuple[Any, Unit]:
    engine = module.__dict__.get("_zeroshard_unit_of")
    unit = next((u for u in getattr(engine, "units", ()) if u.module is module), None)
    if unit is None:
        raise RuntimeError(f"this {type(module).__name__} is no longer a unit of a sharded "
                           "model (a copy of one?): call unshard()/reshard() on the model "
                           "it belongs to")
    return engine, unit


_UNIT_CLASSES: dict[type, type] = {}


def give_units_their_calls(engine: Any) -> None:
    """``unshard()``/``reshard()`` on every stage-3 unit's module but the root's (see
    :class:`ShardedUnit`). The module keeps its engine (``_zeroshard_unit_of``), as the
    root keeps its own; a module no engine lists as a unit says so when called."""
    for u in engine.units:
        if u.is_root:
            continue
        m, cls = u.module, type(u.module)
        if not issubclass(cls, ShardedUnit):
            if hasattr(cls, "unshard") or hasattr(cls, "reshard"):
                continue  # the module's own methods keep their names
            if cls not in _UNIT_CLASSES:
                _UNIT_CLASSES[cls] = type(cls.__name__, (ShardedUnit, cls), {
                    "__module__": cls.__module__, "__qualname__": cls.__qualname__})
            m.__class__ = _UNIT_CLASSES[cls]
        m.__dict__["_zeroshard_unit_of"] = engine


def choose_units(units: list[Unit], budget: int | None) -> list[Unit]:
    """The units to keep gathered within ``budget`` bytes of gathered weights: the root
    first (every forward reads it), then the others in model order while they fit; all
    of them with no budget."""
    if budget is None:
        return list(units)
    order = [units[-1], *units[:-1]]  # the root is last in ``units``
    chosen, used = [], 0
    for u in order:
        if used + u.unsharded_bytes <= budget:
            chosen.append(u)
            used += u.unsharded_bytes
    return chosen


def _budget(engine: Any, budget: int | str | None) -> int | None:
    """Bytes, from an int or a size (``"2GiB"``); None on a GPU: ``FREE_SHARE`` of the
    smallest free device memory among the ranks (every rank must hold the same units);
    None on a CPU: no limit."""
    if isinstance(budget, bool) or not (budget is None or isinstance(budget, (int, str))):
        raise TypeError(f"budget={budget!r}: give bytes (an int), a size such as '2GiB', or "
                        "None (every unit the device has room for)")
    if isinstance(budget, str):
        return parse_bytes(budget, what="budget", zero=True)
    if isinstance(budget, int):
        if budget < 0:
            raise ValueError(f"budget={budget} bytes is negative; give 0 or more (0 keeps "
                             "nothing resident: every forward gathers, as without gathered())")
        return budget
    if engine.device.type != "cuda":
        return None
    free = torch.tensor([float(torch.cuda.mem_get_info(engine.device)[0])],
                        device=engine.device)
    engine.world.all_reduce(free, op=dist.ReduceOp.MIN, phase="control", unit="budget").wait()
    return int(free.item() * FREE_SHARE)


@contextmanager
def gathered(model: nn.Module, budget: int | str | None = None) -> Iterator[list[str]]:
    """Keep stage-3 units gathered inside the block: as many as fit in ``budget`` bytes
    of gathered weights (root first, then in model order); forwards inside gather only the
    others, once per forward. Yields the names of the units held. Nested blocks add to the
    outer one's; each releases what it added. Stages 0-2: nothing to gather (a no-op).

    Like DeepSpeed's ``GatheredParameters`` for reading whole weights, and FSDP2's
    ``unshard()``/``reshard()`` pair; see docs/generation.md."""
    engine = engine_of(model)
    if not engine.units:
        yield []
        return
    held = engine.hold(choose_units(engine.units, _budget(engine, budget)))
    try:
        yield [u.name for u in held]
    finally:
        engine.release(held)


@contextmanager
def _root_shown(engine: Any, skips_root: bool, no_grad: bool = False) -> Iterator[None]:
    """[Note: methods that skip the root's forward]
    At stage 3 the root unit's weights (embeddings, head, final norm) are put in the
    modules by the root's forward hooks. A registered method may never call the root's
    forward: PEFT's ``generate`` goes through the wrapped model's ``generate``, whose
    forwards are the base model's, inside the root. So, without gradients, the method
    runs with the root held and its modules holding the gathered weights (edits since
    the last step refreshed first, as the root's forward would); forwards of the root
    itself inside (a plain HF model's generate) still show and hide them per call. With
    gradients a backward must follow the root's forward: not done here. ``skips_root``:
    False for HF's own ``generate``, which forwards the root per token (within the
    budget, which then holds the root or not as asked). ``no_grad``: the
    method runs without gradients whatever the caller's mode (HF's ``generate`` is
    decorated with ``torch.no_grad``; PEFT's calls it)."""
    if not engine.units or not skips_root or (torch.is_grad_enabled() and not no_grad):
        yield
        return
    schedule = engine.schedule
    engine.weights.refresh_edited()
    held = engine.hold([schedule.root])  # nothing new where gathered() holds it already
    schedule.faces.show(schedule.root.buckets, compute=True)
    try:
        yield
    finally:
        if schedule.root.state is not UnitState.SHARDED:
            schedule.faces.show(schedule.root.buckets, compute=False)
        engine.release(held)


def register_forward_method(model: nn.Module, name: str,
                            budget: int | str | None = None) -> None:
    """Make ``model.<name>(...)`` run inside :func:`gathered` (FSDP2's
    ``register_fsdp_forward_method``): an entry point other than ``forward`` — HF's
    ``generate``, an ``encode`` that calls submodules directly — then finds the units
    gathered (within ``budget``) and gathers each once per call, not once per forward it
    runs. ``shard()`` registers ``generate`` itself at stage 3 (``generate_budget=``);
    registering a method again replaces its budget."""
    engine = engine_of(model)
    cls = type(model)  # shard() gave each sharded model a class of its own (api.py)
    method = getattr(cls, name, None)
    if not callable(method) or name in vars(model):
        raise ValueError(f"{cls.__name__} has no method {name!r} to register; name a method "
                         "of the model's class (e.g. 'generate')")
    method = getattr(method, "_zeroshard_method", method)  # registered before: the original
    if not engine.units:
        return  # whole weights on every rank: nothing to gather

    # Hugging Face's generate() stops a rank whose sequences all ended (EOS) while others
    # go on; a stage-3 forward that gathers is a collective, so it must keep forwarding
    # with them: synced_gpus=True, which HF itself sets under DeepSpeed ZeRO-3 and FSDP.
    # Not when every unit is resident: forwards then issue no collective, and synced_gpus
    # would cost an all-reduce per token (~2 ms of a 30 ms token on 2 CPU ranks).
    synced = "synced_gpus" in inspect.signature(method).parameters
    # HF's generate forwards the model itself, token by token: the root's forward runs
    # (and gathers the root within the budget). Any other method may not call it.
    skips_root = not (name == "generate" and any(
        k.__name__ == "GenerationMixin" for k in type(model).__mro__))

    # On the class, taking ``self``: the method reads the engine of the model it is
    # called on, not one captured here (a sharded model cannot be deep-copied: api.py).
    @functools.wraps(method)
    def gathering(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        engine = engine_of(self)
        # Its collectives in the ledger's window ``name`` (CommLedger.window), not the step's.
        with (engine.comm.ledger.window(name), gathered(self, budget),
              _root_shown(engine, skips_root, no_grad=name == "generate")):
            if (synced and kwargs.get("synced_gpus") is None and engine.world.size > 1
                    and not engine.schedule.all_resident()):
                kwargs["synced_gpus"] = True
            return method(self, *args, **kwargs)

    gathering._zeroshard_method = method  # type: ignore[attr-defined]
    setattr(cls, name, gathering)
