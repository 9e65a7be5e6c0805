"""Hand-written Accelerate loops on zeroshard: one call replaces ``accelerator.prepare``.

    from zeroshard.integrations.accelerate import prepare
    model, optimizer, loader, scheduler = prepare(accelerator, model, optimizer, loader,
                                                  scheduler, stage=2)
    # was: model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, ...)

[Note: Accelerate on zeroshard]
``accelerator.prepare(model)`` wraps a model in ``DistributedDataParallel``; around a
sharded model that reduces every gradient twice (silently wrong at stage 0, errors deep in
backward at stages 2-3), so the DDP constructor refuses it ([Note: double wrapping] in
wrapping.py) and names this call. Here the model is sharded with its optimizer (unless it
already is), marked as prepared (Accelerate's own ``_is_accelerate_prepared`` flag: it
registers the model for ``save_state`` / ``load_state`` and ``unwrap_model`` and does not
wrap it), and everything is then prepared by Accelerate as usual: the optimizer (its
``AcceleratedOptimizer`` skips steps while accumulating), the dataloaders (each rank its
share), the schedulers. What Accelerate would have done to the model itself is done here:
under ``mixed_precision="bf16"`` its autocast around ``forward`` (Accelerate's own context
manager and output cast), so the arithmetic is DDP-under-Accelerate's. ``fp16`` (Accelerate's
GradScaler over fp32 weights) is refused: zeroshard's own fp16 loss scaling is
``shard(..., mixed_precision="fp16")`` with ``Accelerator(mixed_precision="no")``.

What the loop then calls gives DDP's answer: ``accelerator.accumulate(model)`` (the
model's ``no_sync``), ``accelerator.backward``, ``accelerator.clip_grad_norm_`` (torch's
clipping: the global norm), ``save_state`` / ``load_state`` (whole weights and torch-format
optimizer state: resumable at another world size and stage), ``get_state_dict``,
``save_model`` and ``unwrap_model(model).save_pretrained`` (the model keeps its class name,
so ``config.json`` names the original architecture). Each of those that gathers is a
collective at stage 3: call it on every rank, as Accelerate's examples do.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

from torch import nn

__all__ = ["prepare"]

_UNSUPPORTED = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")


def _check_accelerator(accelerator: Any) -> None:
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind in _UNSUPPORTED:
        raise ValueError(
            f"the Accelerator is configured for {kind}: zeroshard replaces Accelerate's "
            "FSDP/DeepSpeed plugins; configure plain multi-process data parallelism "
            "(accelerate config: multi-CPU / multi-GPU, no FSDP or DeepSpeed) and shard with "
            "zeroshard.integrations.accelerate.prepare(accelerator, model, optimizer, ...)")
    if accelerator.mixed_precision == "fp16":
        raise ValueError(
            "Accelerator(mixed_precision='fp16') scales the loss with a GradScaler over fp32 "
            "weights, which zeroshard's optimizer does not step; use zeroshard's own fp16 "
            "loss scaling: Accelerator(mixed_precision='no') and prepare(accelerator, model, "
            "optimizer, ..., mixed_precision='fp16') (or 'bf16' on the Accelerator)")


def _autocast(accelerator: Any, model: nn.Module) -> None:
    """What ``Accelerator.prepare_model`` does to a model under native mixed precision."""
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    model._original_forward = model.forward  # type: ignore[assignment]
    context = get_mixed_precision_context_manager(accelerator.native_amp,
                                                  accelerator.autocast_handler)
    forward = context(model.forward.__func__)
    model.forward = MethodType(convert_outputs_to_fp32(forward), model)  # type: ignore[method-assign]


def prepare(accelerator: Any, model: nn.Module, optimizer: Any, *objects: Any,
            **shard_options: Any) -> tuple[Any, ...]:
    """Shard ``model`` with ``optimizer`` (``zeroshard.shard``'s keywords: ``stage=``,
    ``mixed_precision=`` ...; none if the model is sharded already, then ``optimizer``
    is the one ``shard`` returned) and prepare them and ``objects`` (dataloaders,
    schedulers) with ``accelerator``. Returns ``(model, optimizer, *objects)`` prepared,
    as ``accelerator.prepare`` would. See [Note: Accelerate on zeroshard]."""
    import zeroshard

    _check_accelerator(accelerator)
    if getattr(model, "_zeroshard_engine", None) is None:
        model, optimizer = zeroshard.shard(model, optimizer, **shard_options)
    elif shard_options:
        raise TypeError(f"the model is sharded already; shard options {sorted(shard_options)} "
                        "go to the shard() that sharded it")
    if getattr(model, "_is_accelerate_prepared", False):
        raise ValueError("this model was prepared already; prepare it once")
    if accelerator.native_amp:
        _autocast(accelerator, model)
    model._is_accelerate_prepared = True  # Accelerate registers it and leaves it unwrapped
    return tuple(accelerator.prepare(model, optimizer, *objects))
