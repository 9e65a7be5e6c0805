"""Optimizer state loaded without its model's weights: refused, not trained on.

[Note: optimizer state without its weights]
A hand-written Accelerate loop ported the way ``ZeroShardTrainer`` works inside —
``shard(model, optimizer)``, then ``accelerator.prepare(optimizer, loaders, scheduler)``
without the model — gets an ``accelerator.save_state()`` with no model weights: Accelerate
saves the models it prepared or was told about, and this one it was not. ``load_state()``
then put step N's AdamW moments onto freshly initialised weights and training went on
6.5e-3 off the uninterrupted run with no word (stage 0, transformers'
run_clm_no_trainer.py, issue #64). So an optimizer state load that comes from
``Accelerator.load_state`` is refused unless that accelerator saves and loads the model
too (prepared by it — ``zeroshard.integrations.accelerate.prepare`` marks it so — or
registered with ``register_for_checkpointing``). The accelerator is the ``self`` of the
``load_state`` frame on the stack; nothing else is looked at.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

__all__ = ["refuse_weightless_accelerate_load"]


def _loading_accelerator() -> Any:
    """The Accelerator whose ``load_state`` is running (on this thread's stack), or None."""
    if "accelerate" not in sys.modules:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_code.co_name == "load_state"
                and frame.f_globals.get("__name__") == "accelerate.accelerator"):
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


def _holds(objects: Any, model: nn.Module) -> bool:
    for obj in objects or ():
        inner = obj
        for _ in range(4):  # DDP / compile / ZeroShardModel wrappers
            if inner is model:
                return True
            inner = getattr(inner, "module", getattr(inner, "_orig_mod", None))
            if inner is None:
                break
    return False


def refuse_weightless_accelerate_load(model: nn.Module) -> None:
    """See [Note: optimizer state without its weights]."""
    accelerator = _loading_accelerator()
    if accelerator is None:
        return
    if _holds(getattr(accelerator, "_models", ()), model) or _holds(
            getattr(accelerator, "_custom_objects", ()), model):
        return
    raise RuntimeError(
        f"accelerator.load_state() is loading a zeroshard optimizer's state, but not the "
        f"weights of its model ({type(model).__name__}): the accelerator did not prepare it, "
        "so save_state() did not save it, and the moments would be applied to the weights "
        "the model has now. Prepare the model with zeroshard.integrations.accelerate."
        "prepare(accelerator, model, optimizer, ...) (or call accelerator."
        "register_for_checkpointing(model) before save_state and load_state)")
