"""No double wrapping: zeroshard refuses to go inside another data-parallel wrapper, and
refuses to have one put around it.

[Note: double wrapping]
zeroshard *is* the data-parallel wrapper of a model it shards: it reduces the gradients
and keeps the replicas equal itself. A second wrapper either way trains silently wrong:
DDP around a stage-0 model reduces gradients zeroshard already reduced (Accelerate's
``prepare(model)`` does exactly this; the clipped norm was 1.17 against DDP's 1.38), and
a model that is already a DDP/FSDP/DeepSpeed module hands zeroshard parameters that the
other wrapper reduces or re-lays out behind its back. So:

* ``shard()`` refuses a model that is, or contains, a ``DistributedDataParallel``, an
  FSDP1 ``FullyShardedDataParallel``, an FSDP2 ``fully_shard`` module (``FSDPModule``)
  or a DeepSpeed engine / ZeRO-3 partitioned parameter (:func:`refuse_wrapped`). The
  classes are recognised by name and module, so no wrapper's package is imported.
* ``DistributedDataParallel(sharded_model)`` fails in DDP's constructor: DDP asks the
  module for ``_ddp_params_and_buffers_to_ignore`` before it touches a parameter, and
  ``ShardedModule`` answers with the error (:func:`ddp_refusal`). A DDP around a module
  that *contains* the sharded model is caught at the first forward, before any gradient
  exists: DDP marks the module whose forward runs (``_get_active_ddp_module()``, the
  hook torch keeps for dynamo) and the root pre-forward hook asks
  (:func:`refuse_active_ddp`).
* At stage 3 the parameters are DTensors, and DDP around a parent of the sharded model,
  or ``fully_shard`` of it, failed inside torch's constructors before any forward
  ("c10d.broadcast_ does not have a sharding strategy", "Invariant encountered"). Both
  ask each module for its own parameters (``named_parameters(recurse=False)``) first:
  ``ShardedModule`` answers a call from their modules with the error
  (:func:`refuse_constructing_wrapper`).
* FSDP1 and FSDP2 around a sharded model replace its parameters; the pre-forward hook's
  check of the parameters refuses that and names these wrappers
  (:data:`REPLACED_HINT`).
* A wrapper whose ``forward`` calls the model — DeepSpeed's engine, FSDP1 — is on the
  stack at the first forward (:func:`refuse_wrapping_caller`, by the frames' qualified
  names; Python >= 3.11).
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["REPLACED_HINT", "ddp_refusal", "foreign_wrapper", "refuse_active_ddp",
           "refuse_constructing_wrapper", "refuse_wrapped", "refuse_wrapping_caller"]

#: What to do instead, in every refusal.
SUPPORTED = (
    "zeroshard.shard(model, optimizer, stage=...) replaces DDP/FSDP/DeepSpeed: it returns "
    "the model ready to train, use it as it is. Under Accelerate, replace "
    "accelerator.prepare(model, optimizer, ...) with zeroshard.integrations.accelerate."
    "prepare(accelerator, model, optimizer, ..., stage=...) on the bare model and the "
    "optimizer built on it (it shards them and prepares the rest; "
    "docs/trainers-accelerate.md); under Lightning, use the zeroshard strategy instead of "
    "'ddp'/'fsdp'/'deepspeed' (docs/trainers-lightning.md)")

#: Appended to the error for a parameter replaced after shard().
REPLACED_HINT = (
    "; if FSDP (fully_shard or FullyShardedDataParallel) or DeepSpeed was applied to the "
    "sharded model, it replaced them: drop that wrapper, " + SUPPORTED)


def _kind(cls: type) -> str | None:
    """The wrapper a class is, by its name and module (no wrapper package imported)."""
    mod, name = cls.__module__ or "", cls.__name__
    if name == "DistributedDataParallel" and mod.startswith("torch.nn.parallel"):
        return "DistributedDataParallel"
    if name == "FullyShardedDataParallel" and mod.startswith("torch.distributed.fsdp"):
        return "FSDP (FullyShardedDataParallel)"
    if name == "FSDPModule" and mod.startswith("torch.distributed.fsdp"):
        return "FSDP2 (fully_shard)"
    if mod.split(".")[0] == "deepspeed" and name.endswith("Engine"):
        return f"DeepSpeed ({name}, from deepspeed.initialize)"
    return None


def foreign_wrapper(model: nn.Module) -> tuple[str, str] | None:
    """(the wrapper, where) for the first data-parallel wrapper in ``model``, if any."""
    for name, m in model.named_modules():
        for cls in type(m).__mro__:
            kind = _kind(cls)
            if kind is not None:
                return kind, repr(name) if name else "the model itself"
    for name, p in model.named_parameters():
        if hasattr(p, "ds_id"):  # partitioned by DeepSpeed ZeRO-3 (deepspeed.zero.Init)
            return "DeepSpeed ZeRO-3 (a partitioned parameter)", repr(name)
    return None


def refuse_wrapped(model: nn.Module) -> None:
    """``shard()``'s check: the model is not, and contains no, data-parallel wrapper."""
    found = foreign_wrapper(model)
    if found is None:
        return
    kind, where = found
    unwrap = (" Pass the bare model (model.module for DDP; for FSDP/DeepSpeed build the "
              "model again without the wrapper).")
    raise TypeError(
        f"shard() got a model wrapped in {kind} ({where}): zeroshard would shard parameters "
        "that the other wrapper also reduces or lays out, which trains silently wrong."
        f"{unwrap} {SUPPORTED}")


def ddp_refusal(model: nn.Module) -> RuntimeError:
    """The error DDP's constructor raises on a sharded model (see the Note)."""
    return RuntimeError(
        f"DistributedDataParallel around a model sharded by zeroshard "
        f"({type(model).__name__}): zeroshard already reduces its gradients, so DDP would "
        f"reduce them a second time (or fail inside backward). {SUPPORTED}")


#: Modules whose constructors list each module's own parameters: the wrapper they build.
_CONSTRUCTORS = {"torch.nn.parallel.distributed": "DistributedDataParallel around a module "
                 "that contains", "torch.distributed.fsdp._fully_shard": "fully_shard of"}


def refuse_constructing_wrapper(model: nn.Module) -> None:
    """Raise if the caller of ``model.named_parameters(recurse=False)`` (two frames up) is
    DDP's or FSDP2's constructor (see [Note: double wrapping])."""
    import sys

    caller = sys._getframe(2).f_globals.get("__name__", "")
    what = next((w for m, w in _CONSTRUCTORS.items() if caller.startswith(m)), None)
    if what is not None:
        raise RuntimeError(
            f"{what} a model sharded by zeroshard ({type(model).__name__}): zeroshard already "
            "shards it and reduces its gradients, so a second data-parallel wrapper would "
            f"reduce them again or re-lay out its shards. {SUPPORTED}")


#: ``forward`` methods of wrappers that call the model they wrap, by qualified name.
_CALLERS = {
    "DeepSpeedEngine.forward": "DeepSpeed (DeepSpeedEngine, from deepspeed.initialize)",
    "FullyShardedDataParallel.forward": "FSDP (FullyShardedDataParallel)",
}


def refuse_wrapping_caller(model: nn.Module) -> None:
    """The first forward's check for a wrapper whose ``forward`` calls the model:
    DeepSpeed's engine (``deepspeed.initialize(model=sharded)``), FSDP1. Their frames are
    on the stack: the first 64 are matched by their code's qualified name. Not by the
    frames' ``self``: reading ``f_locals`` snapshots every caller's locals into its frame,
    which then keeps them (and their tensors) alive after the caller ``del``s them."""
    import sys

    frame = sys._getframe(1)
    for _ in range(64):
        if frame is None:
            return
        kind = _CALLERS.get(getattr(frame.f_code, "co_qualname", ""))  # Python >= 3.11
        if kind is not None:
            raise RuntimeError(
                f"the zeroshard-sharded {type(model).__name__} runs inside {kind}: that "
                f"wrapper would reduce or re-lay out the gradients zeroshard already "
                f"reduces. {SUPPORTED}")
        frame = frame.f_back


def refuse_active_ddp(model: nn.Module) -> None:
    """The root pre-forward hook's check for a DDP around a module holding ``model``."""
    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is None:
        return
    if any(m is model for m in ddp.module.modules()):
        raise RuntimeError(
            f"the zeroshard-sharded {type(model).__name__} runs inside "
            f"DistributedDataParallel({type(ddp.module).__name__}): DDP would reduce "
            f"gradients zeroshard already reduces. {SUPPORTED}")
