"""Lightning Fabric on zeroshard: ``Fabric(strategy=ZeroShardStrategy(stage=2))``.

    import zeroshard.integrations.lightning_fabric  # registers "zeroshard", "zeroshard_stage_N"
    fabric = lightning.Fabric(accelerator="cpu", devices=2, strategy="zeroshard_stage_2")
    model, optimizer = fabric.setup(model, optimizer)          # together, as with DeepSpeed

[Note: Fabric on zeroshard]
The strategy is Fabric's DDP strategy (launcher, process group, collectives, samplers)
with the model's wrapping replaced:

* ``setup_module_and_optimizers`` shards the model with its optimizer
  (``zeroshard.shard(model, optimizer, **options)``); setting the model up alone is refused
  (the optimizer steps the shards), as under DeepSpeed.
* precision stays Lightning's: ``"32-true"``, ``"bf16-mixed"`` / ``"16-mixed"`` (autocast, and
  for fp16 a GradScaler, over fp32 weights, as under the DDP strategy), ``"bf16-true"`` /
  ``"16-true"`` (a 16-bit model). zeroshard's own recipe — 16-bit compute weights beside
  fp32 masters, which halves the weights' memory — is ``ZeroShardStrategy(mixed_precision=
  "bf16")`` with ``precision="32-true"``; combining it with a mixed flag is refused (the
  inputs would be cast twice).
* ``fabric.no_backward_sync(model)`` is the engine's ``no_sync()``; ``clip_gradients`` clips
  ``optimizer``'s parameters, whose DTensor gradients (stages 1-3) give the global norm;
  by value, each element is clamped, as under DDP.
* ``fabric.save`` / ``fabric.load`` write and read zeroshard's sharded checkpoints
  (``state_dict_type="sharded"``, the default: loadable at any world size and stage) or,
  with ``state_dict_type="full"``, one ``torch.save`` file holding whole state dicts, the
  DDP strategy's format (rank 0 writes; every rank reads).
* ``fabric.init_module(empty_init=True)`` builds the model on the meta device at stage 3,
  to be materialised unit by unit by ``shard`` (``param_init=``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["ZeroShardStrategy"]

_REFUSED_PRECISION = ("64-true", "transformer-engine", "transformer-engine-float16")


def strategy_options(stage: int, state_dict_type: str, options: dict[str, Any]
                     ) -> dict[str, Any]:
    """zeroshard's options of a Lightning strategy, checked when it is built."""
    from .hf_trainer import _shard_options

    if state_dict_type not in ("sharded", "full"):
        raise ValueError(f"state_dict_type={state_dict_type!r}: use 'sharded' (zeroshard's "
                         "checkpoints, any world size and stage) or 'full'")
    return _shard_options({"stage": stage, **options})


def check_precision(flag: str, options: dict[str, Any]) -> None:
    """Lightning's precision flag beside zeroshard's options (see [Note: Fabric on
    zeroshard])."""
    if flag in _REFUSED_PRECISION:
        raise ValueError(f"precision={flag!r} is not supported with zeroshard; use '32-true', "
                         "'bf16-mixed', '16-mixed', 'bf16-true' or '16-true'")
    if options.get("mixed_precision") and flag != "32-true":
        raise ValueError(
            f"ZeroShardStrategy(mixed_precision={options['mixed_precision']!r}) is zeroshard's "
            f"own 16-bit recipe; with precision={flag!r} the model would be cast twice. Use "
            "precision='32-true' with it, or drop mixed_precision= and keep Lightning's "
            "precision flag")


def one_optimizer(optimizers: list[Any], where: str) -> Any:
    if len(optimizers) != 1:
        raise ValueError(f"ZeroShardStrategy shards a model with one optimizer; {where} "
                         f"{len(optimizers)}. Put the parameters in one optimizer (its param "
                         "groups may differ)")
    return optimizers[0]


def register(cls: type, registry: Any) -> None:
    """``strategy="zeroshard"`` (stage 0) and ``"zeroshard_stage_N"``."""
    registry.register("zeroshard", cls, description="zeroshard, ZeRO stage 0", override=True)
    for s in range(4):
        registry.register(f"zeroshard_stage_{s}", cls, stage=s, override=True,
                          description=f"zeroshard, ZeRO stage {s}")


def _lightning() -> Any:
    try:
        import lightning.fabric as fabric
    except ImportError as exc:
        raise ImportError(f"zeroshard's Fabric strategy needs lightning ({exc}); "
                          "pip install 'lightning>=2.6'") from None
    return fabric


def _strategy_class() -> type:
    fabric = _lightning()
    from lightning.fabric.strategies import DDPStrategy
    from lightning.fabric.strategies.strategy import _BackwardSyncControl

    class _NoSync(_BackwardSyncControl):
        def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
            if not enabled:
                return nullcontext()
            if getattr(module, "_zeroshard_engine", None) is None:
                raise TypeError(f"no_backward_sync needs the module fabric.setup returned; got "
                                f"{type(module).__name__}")
            return module.no_sync()

    class ZeroShardStrategy(DDPStrategy):
        """Fabric's strategy for zeroshard; keywords are :func:`zeroshard.shard`'s options
        (``stage``, ``offload``, ``mixed_precision``, ``units``, ``param_init``, ...) plus
        ``state_dict_type`` ("sharded" or "full"). See [Note: Fabric on zeroshard]."""

        def __init__(self, stage: int = 0, *, state_dict_type: str = "sharded",
                     accelerator: Any = None, parallel_devices: Any = None,
                     cluster_environment: Any = None, checkpoint_io: Any = None,
                     precision: Any = None, process_group_backend: str | None = None,
                     start_method: str = "popen", **options: Any) -> None:
            self.shard_options = strategy_options(stage, state_dict_type, options)
            self.state_dict_type = state_dict_type
            super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                             cluster_environment=cluster_environment,
                             checkpoint_io=checkpoint_io, precision=precision,
                             process_group_backend=process_group_backend,
                             start_method=start_method)
            self._backward_sync_control = _NoSync()

        # -- setup ---------------------------------------------------------------------
        def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Any],
                                        scheduler: Any = None) -> tuple[nn.Module, list[Any], Any]:
            import zeroshard

            check_precision(getattr(self.precision, "precision", "32-true"), self.shard_options)
            # several (fabric.setup(model, muon, adamw)) are sharded together; see [Note:
            # several optimizers] in engine/composite.py
            optimizer = (tuple(optimizers) if len(optimizers) > 1
                         else one_optimizer(optimizers, "fabric.setup got"))
            module, optimizer = zeroshard.shard(module, optimizer, **self.shard_options)
            return module, list(optimizer) if isinstance(optimizer, tuple) else [optimizer], \
                scheduler

        def setup_module(self, module: nn.Module) -> nn.Module:
            raise NotImplementedError(self._err_msg_joint_setup_required())

        def setup_optimizer(self, optimizer: Any) -> Any:
            raise NotImplementedError(self._err_msg_joint_setup_required())

        def module_to_device(self, module: nn.Module) -> None:
            if any(p.is_meta for p in module.parameters()):
                return  # shard() materialises it on the device, unit by unit
            super().module_to_device(module)

        def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
            if empty_init and self.shard_options.get("stage") == 3:
                return torch.device("meta")  # materialised unit by unit by shard()
            return super().module_init_context(empty_init)

        # -- checkpoints ---------------------------------------------------------------
        def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                            filter: Any = None) -> None:
            if filter:
                raise ValueError("fabric.save(..., filter=) is not supported by ZeroShardStrategy")
            model, optimizer, extra = _split(state)
            if self.state_dict_type == "full" or model is None:
                return super().save_checkpoint(path, state, storage_options)
            import zeroshard

            zeroshard.save_checkpoint(Path(path), model, optimizer, extra=extra)

        def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                            weights_only: bool | None = None) -> dict[str, Any]:
            path = Path(path)
            if not (path / "zeroshard.json").is_file():  # a full (DDP-format) checkpoint
                return super().load_checkpoint(path, state, strict, weights_only)
            import zeroshard

            model, optimizer, wanted = _split(state if isinstance(state, dict) else {})
            if model is None:
                raise ValueError(f"{str(path)!r} is a sharded zeroshard checkpoint: pass the "
                                 "model to load it into (fabric.load(path, {'model': model, ...}))")
            extra = zeroshard.load_checkpoint(path, model, optimizer)
            missing = [k for k in wanted if k not in extra]
            if strict and missing:
                raise KeyError(f"{str(path)!r} holds no {missing}; saved: {sorted(extra)}")
            for k in wanted:
                if k in extra and isinstance(state, dict):
                    if hasattr(state[k], "load_state_dict") and isinstance(extra[k], dict):
                        state[k].load_state_dict(extra[k])
                    else:
                        state[k] = extra[k]
            return {k: v for k, v in extra.items() if k not in wanted}

        def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
            return module.state_dict()  # whole: a collective at stage 3 (every rank saves)

        @classmethod
        def register_strategies(cls, strategy_registry: Any) -> None:
            register(cls, strategy_registry)

    ZeroShardStrategy.__module__ = __name__
    ZeroShardStrategy.register_strategies(fabric.strategies.STRATEGY_REGISTRY)
    return ZeroShardStrategy


def _split(state: dict[str, Any]) -> tuple[nn.Module | None, Any, dict[str, Any]]:
    """(the sharded model, its optimizer — or the tuple of several, in shard()'s order —,
    everything else) of a Fabric state dict."""
    model = None
    optimizers: list[Any] = []
    extra: dict[str, Any] = {}
    for k, v in state.items():
        if getattr(v, "_zeroshard_engine", None) is not None:
            if model is not None:
                raise ValueError("ZeroShardStrategy checkpoints one sharded model per file")
            model = v
        elif getattr(v, "engine", None) is not None and isinstance(v, torch.optim.Optimizer):
            optimizers.append(v)
        else:
            extra[k] = v.state_dict() if hasattr(v, "state_dict") else v
    if len(optimizers) > 1:  # parts of one shard(): zeroshard's functions take them in order
        return model, tuple(sorted(optimizers, key=lambda o: getattr(o, "index", 0))), extra
    return model, (optimizers[0] if optimizers else None), extra


#: Built (and registered by name with Fabric) when this module is imported.
ZeroShardStrategy = _strategy_class()
