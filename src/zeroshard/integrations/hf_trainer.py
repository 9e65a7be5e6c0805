"""The Hugging Face ``Trainer`` — and TRL's trainers built on it — on zeroshard.

    from zeroshard.integrations.hf_trainer import ZeroShardTrainer
    trainer = ZeroShardTrainer(model=model, args=args, train_dataset=ds,
                               zeroshard={"stage": 2})        # was: Trainer(...)

    from trl import SFTTrainer
    from zeroshard.integrations.hf_trainer import zeroshard_trainer
    trainer = zeroshard_trainer(SFTTrainer)(model=model, args=cfg, train_dataset=ds,
                                            zeroshard={"stage": 3})

[Note: the Trainer on zeroshard]
The Trainer has no plug-in point for a sharding backend: it builds its own Accelerator,
which wraps the model in DDP, and its checkpoints are rank 0's state dicts. A subclass
replaces exactly what touches distribution, and nothing else (data, loss, logging,
evaluation and callbacks stay the Trainer's):

* **wrapping** (``_wrap_model``): the model is sharded in place with the optimizer the
  Trainer built (``create_optimizer``: its decay / no-decay groups and hyperparameters
  carry over) and handed back inside :class:`ZeroShardModel`, a thin module the Trainer
  trains through. It is not ``self.model``, so the Trainer asks Accelerate to prepare the
  optimizer only: no DDP around sharded parameters. Gradient accumulation reaches the
  engine through its ``no_sync``; clipping is Accelerate's ``clip_grad_norm_`` over the
  parameters, whose DTensor gradients give the global norm (the logged ``grad_norm``).
* **precision**: Accelerate's own mixed precision is turned off (no autocast, no
  GradScaler); ``bf16=True`` / ``fp16=True`` become zeroshard's ``mixed_precision``
  (16-bit compute weights and fp32 masters; fp16 with zeroshard's loss scaling).
* **saving** (``save_model``): collective — every rank calls it (the Trainer does, from
  ``_save_checkpoint`` and at the end of a script) and rank 0 writes
  :func:`zeroshard.hf.save_pretrained`'s export: the Hugging Face format
  ``from_pretrained`` loads; for a peft model its adapter. The Trainer's own saves
  ``state_dict()`` on the saving rank alone, a collective at stage 3.
* **checkpoints** (``_save_optimizer_and_scheduler``, ``_load_optimizer_and_scheduler``,
  ``_load_from_checkpoint``, ``_load_best_model``): weights and optimizer state in
  zeroshard's sharded format (``checkpoint-N/zeroshard/``, torch.distributed.checkpoint),
  loadable at any world size and stage; the scheduler as the Trainer saves it. The
  Trainer's own keeps rank 0's ``optimizer.state_dict()`` and loads it on every rank.

The private methods overridden are those of transformers 5.x (tested: 5.24) and TRL
1.16; ``transformers`` is imported only when a trainer class is first built.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ZeroShardModel", "ZeroShardTrainer", "zeroshard_trainer"]  # noqa: F822 (module __getattr__)

#: Where, inside a Trainer checkpoint (``checkpoint-N/``), the sharded state lives.
CHECKPOINT_DIR = "zeroshard"

# shard() keywords beyond ShardConfig's options
_SHARD_KEYWORDS = ("stage", "units", "param_init", "device", "hybrid", "mesh", "param_groups",
                   "process_group")


class ZeroShardModel(nn.Module):
    """What the Trainer trains through: the sharded model, under another name, so that
    Accelerate does not wrap it in DDP (see [Note: the Trainer on zeroshard]). Attribute
    access falls through to the model (``config``, ``generate``, ``disable_adapter`` ...)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.module.no_sync():
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)


def _shard_options(options: dict[str, Any]) -> dict[str, Any]:
    """Check zeroshard's options before anything runs (names, values: ShardConfig)."""
    from ..config import ShardConfig

    known = set(ShardConfig.option_names()) | set(_SHARD_KEYWORDS)
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"zeroshard={{...}} has unknown option(s) {unknown}; zeroshard.shard takes "
                        f"{sorted(known)}")
    config = {k: v for k, v in options.items() if k in ShardConfig.option_names() or k == "stage"}
    ShardConfig(**config)  # raises naming the field, the value and the fix
    return dict(options)


def _check_args(args: Any, options: dict[str, Any]) -> dict[str, Any]:
    """TrainingArguments that conflict with zeroshard are refused before training; the
    precision flags become zeroshard's ``mixed_precision``."""
    if args is None:
        return options
    if getattr(args, "fsdp", None):
        raise ValueError(
            f"TrainingArguments(fsdp={args.fsdp!r}) asks for PyTorch FSDP, and ZeroShardTrainer "
            "shards the model itself: drop fsdp= (zeroshard's stage 3 is FSDP-style sharding: "
            "zeroshard={'stage': 3})")
    if getattr(args, "deepspeed", None):
        raise ValueError(
            "TrainingArguments(deepspeed=...) asks for DeepSpeed, and ZeroShardTrainer shards the "
            "model itself: drop deepspeed= and pick a ZeRO stage with zeroshard={'stage': N}")
    wanted = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    given = options.get("mixed_precision", wanted)
    if given != wanted:
        raise ValueError(
            f"zeroshard={{'mixed_precision': {given!r}}} conflicts with TrainingArguments("
            f"bf16={args.bf16}, fp16={args.fp16}); set the precision in one place (the "
            "TrainingArguments flags become zeroshard's mixed_precision)")
    return {**options, "mixed_precision": wanted}


def _sharded(model: nn.Module | None) -> bool:
    return getattr(model, "_zeroshard_engine", None) is not None


class ZeroShardTrainerMixin:
    """Put before a ``transformers.Trainer`` subclass in the bases (what
    :func:`zeroshard_trainer` does). Takes ``zeroshard={...}``: the options of
    :func:`zeroshard.shard` (``stage``, ``offload``, ``units``, ``bucket_bytes`` ...)."""

    def __init__(self, *args: Any, zeroshard: dict[str, Any] | None = None, **kwargs: Any) -> None:
        options = _shard_options(dict(zeroshard or {}))
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        self._zs_options = _check_args(training_args, options)
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self._zs_options = _check_args(self.args, options)  # the args the Trainer settled on
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ZeroShardTrainer needs torch.distributed: launch the script with torchrun "
                "(torchrun --nproc-per-node N train.py), which TrainingArguments picks up")
        self._shard_reference()

    def _shard_reference(self) -> None:
        """TRL's trainers (DPO, GRPO, RLOO ...) keep a reference model beside the policy
        (``self.ref_model``), forward-only. At stage 3 it is sharded too
        (``zeroshard.shard_for_inference``), or the memory stage 3 saves on the policy is
        spent again on a whole reference on every rank."""
        ref = getattr(self, "ref_model", None)
        if (not isinstance(ref, nn.Module) or _sharded(ref)
                or self._zs_options.get("stage", 0) != 3):
            return
        import zeroshard

        keep = ("mixed_precision", "timeout", "check_collectives", "prefetch",
                "generate_budget", "process_group", "hybrid", "mesh", "device")
        self.ref_model = zeroshard.shard_for_inference(
            ref, **{k: v for k, v in self._zs_options.items() if k in keep})

    # -- precision ---------------------------------------------------------------------------
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        out = super()._build_accelerator_args(**kwargs)  # type: ignore[misc]
        out["mixed_precision"] = "no"  # zeroshard's own: see [Note: the Trainer on zeroshard]
        return out

    # -- wrapping ----------------------------------------------------------------------------
    def _wrap_model(self, model: nn.Module, training: bool = True,
                    dataloader: Any = None) -> nn.Module:
        if isinstance(model, ZeroShardModel):
            return model if training else model.module
        if not training:
            return model
        import zeroshard

        from ..engine.optimizer import ShardedOptimizer

        if not _sharded(self.model):
            if self.optimizer is None:
                self.create_optimizer()
            _, self.optimizer = zeroshard.shard(self.model, self.optimizer, **self._zs_options)
        elif not isinstance(_inner_optimizer(self.optimizer), ShardedOptimizer):
            raise TypeError(
                "the model was sharded before the Trainer got it, but the optimizer was not the "
                "one zeroshard.shard returned: pass optimizers=(optimizer, None) with that one, "
                "or pass the unsharded model and let ZeroShardTrainer shard it")
        return ZeroShardModel(self.model)

    # -- saving ------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective: every rank calls it; rank 0 writes the Hugging Face format
        (``zeroshard.hf.save_pretrained``: for a peft model its adapter)."""
        if not _sharded(self.model):
            return super().save_model(output_dir, _internal_call)  # type: ignore[misc]
        from .. import full_state_dict
        from ..hf_export import _is_peft, _is_transformers_model, _original_class
        from ..hf_export import save_pretrained as export

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if _is_peft(self.model) or _is_transformers_model(_original_class(self.model)):
            export(self.model, output_dir)
        else:  # a plain module: its whole state dict, as the Trainer saves one
            state = full_state_dict(self.model)
            if self.args.should_save:
                from safetensors.torch import save_file

                os.makedirs(output_dir, exist_ok=True)
                save_file(state, os.path.join(output_dir, "model.safetensors"),
                          metadata={"format": "pt"})
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not _sharded(self.model):
            return super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
        import zeroshard

        zeroshard.save_checkpoint(Path(output_dir) / CHECKPOINT_DIR, self.model,
                                  _inner_optimizer(self.optimizer))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    # -- resuming ----------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: nn.Module | None = None) -> None:
        # Called before the model is sharded; the sharded checkpoint (weights included) is
        # loaded with the optimizer, once sharded (_load_optimizer_and_scheduler).
        if (Path(resume_from_checkpoint) / CHECKPOINT_DIR).is_dir():
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not _sharded(self.model):
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        import zeroshard

        path = Path(checkpoint) / CHECKPOINT_DIR
        if not path.is_dir():
            raise FileNotFoundError(
                f"{checkpoint!r} holds no zeroshard checkpoint ({CHECKPOINT_DIR}/): it was not "
                "written by ZeroShardTrainer. Resume it with the Trainer that wrote it, or "
                "start from its weights (model = AutoModel.from_pretrained(checkpoint))")
        zeroshard.load_checkpoint(path, self.model, _inner_optimizer(self.optimizer))
        scheduler = Path(checkpoint) / "scheduler.pt"
        if self.lr_scheduler is not None and scheduler.is_file():
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        if not _sharded(self.model):
            return super()._load_best_model()  # type: ignore[misc]
        import zeroshard

        best = self.state.best_model_checkpoint
        zeroshard.load_checkpoint(Path(best) / CHECKPOINT_DIR, self.model)  # weights only


def _inner_optimizer(optimizer: Any) -> Any:
    """The optimizer under Accelerate's ``AcceleratedOptimizer`` wrapper(s)."""
    while hasattr(optimizer, "optimizer") and not hasattr(optimizer, "engine"):
        optimizer = optimizer.optimizer
    return optimizer


@functools.cache
def zeroshard_trainer(trainer_cls: type) -> type:
    """``trainer_cls`` (a ``transformers.Trainer`` subclass: TRL's ``SFTTrainer``,
    your own; SFTTrainer is tested) on zeroshard: a subclass taking ``zeroshard={...}``."""
    import transformers

    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, transformers.Trainer)):
        raise TypeError(f"zeroshard_trainer takes a transformers.Trainer subclass, got "
                        f"{trainer_cls!r}")
    if issubclass(trainer_cls, ZeroShardTrainerMixin):
        return trainer_cls
    return type(f"ZeroShard{trainer_cls.__name__}", (ZeroShardTrainerMixin, trainer_cls),
                {"__module__": __name__})


def __getattr__(name: str) -> Any:
    if name == "ZeroShardTrainer":  # built on first use: transformers is imported then
        import transformers

        return zeroshard_trainer(transformers.Trainer)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
