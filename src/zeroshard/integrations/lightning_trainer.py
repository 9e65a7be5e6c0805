"""The Lightning ``Trainer`` on zeroshard: ``Trainer(strategy=ZeroShardStrategy(stage=3))``.

    import zeroshard.integrations.lightning_trainer  # registers "zeroshard", "zeroshard_stage_N"
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy="zeroshard_stage_3")

[Note: the Lightning Trainer on zeroshard]
The strategy is Lightning's DDP strategy (launcher, process group, samplers, collectives)
with the model's wrapping, stepping, accumulation and checkpoints replaced:

* **setup**: ``configure_optimizers`` runs as usual; the LightningModule is then sharded in
  place with its (single) optimizer, whose LR schedulers keep working (zeroshard's
  optimizer shares the groups of the one it replaces). The precision flag is Lightning's
  own, as under DDP (see [Note: Fabric on zeroshard] in lightning_fabric.py); zeroshard's
  16-bit recipe is ``ZeroShardStrategy(mixed_precision="bf16")`` with ``"32-true"``.
* **steps go through the module's ``__call__``**: zeroshard's hooks sit on the sharded
  module's forward (stage 3 gathers its root there; mixed precision swaps its weights), and
  Lightning calls ``training_step`` / ``validation_step`` directly unless the model is
  wrapped. The strategy redirects each step through the module (Lightning's own
  ``_ForwardRedirection``, as its DDP strategy does through DDP), so the hooks run.
* **accumulation** (``accumulate_grad_batches``) blocks synchronisation with the engine's
  ``no_sync()`` — Lightning's ``block_backward_sync`` knows DDP's only.
* **clipping** (``gradient_clip_val``) is Lightning's over the optimizer's parameters, whose
  gradients are DTensors at stages 1-3: the global norm, DDP's; by value, element by element.
* **checkpoints**: with ``state_dict_type="sharded"`` (the default) ``trainer.save_checkpoint``
  / ``ModelCheckpoint`` write a directory: zeroshard's sharded weights and optimizer state
  (``zeroshard.save_checkpoint``) and ``lightning.pt`` (the loops', callbacks' and LR
  schedulers' state, written by rank 0); ``fit(ckpt_path=...)`` restores them at any world
  size and stage. ``state_dict_type="full"`` keeps Lightning's one-file format with whole
  state dicts (gathered on every rank, written by rank 0), loadable by the DDP strategy.
  A one-file checkpoint (the DDP strategy's, or a "full" one) is restored too, weights and
  optimizer state, at any stage. For Lightning's own readers (the DDP strategy,
  ``LightningModule.load_from_checkpoint``) a sharded directory becomes one ``.ckpt`` with
  ``to_lightning_checkpoint`` (lightning_checkpoint.py).
"""

from __future__ import annotations

import shutil
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .lightning_checkpoint import LIGHTNING_STATE as _LIGHTNING_STATE
from .lightning_checkpoint import load_from_checkpoint, to_lightning_checkpoint, whole_state_dict
from .lightning_fabric import check_precision, one_optimizer, register, strategy_options

__all__ = ["ZeroShardStrategy", "load_from_checkpoint", "to_lightning_checkpoint"]


def _strategy_class() -> type:
    try:
        import lightning.pytorch as pl
    except ImportError as exc:
        raise ImportError(f"zeroshard's Lightning strategy needs lightning ({exc}); "
                          "pip install 'lightning>=2.6'") from None
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.strategies.strategy import _ForwardRedirection
    from lightning.pytorch.trainer.states import TrainerFn

    class ZeroShardStrategy(DDPStrategy):
        """Lightning's strategy for zeroshard; keywords are :func:`zeroshard.shard`'s options
        (``stage``, ``offload``, ``mixed_precision``, ``units``, ...) plus ``state_dict_type``
        ("sharded" or "full"). See [Note: the Lightning Trainer on zeroshard]."""

        strategy_name = "zeroshard"

        def __init__(self, stage: int = 0, *, state_dict_type: str = "sharded",
                     accelerator: Any = None, parallel_devices: Any = None,
                     cluster_environment: Any = None, checkpoint_io: Any = None,
                     precision_plugin: Any = None, process_group_backend: str | None = None,
                     start_method: str = "popen", **options: Any) -> None:
            self.shard_options = strategy_options(stage, state_dict_type, options)
            self.state_dict_type = state_dict_type
            super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                             cluster_environment=cluster_environment,
                             checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
                             process_group_backend=process_group_backend,
                             start_method=start_method)
            self._redirect = _ForwardRedirection()
            self._one_file = False  # the checkpoint being restored is one file

        # -- setup -----------------------------------------------------------------------
        def setup(self, trainer: Any) -> None:
            from lightning.fabric.utilities.optimizer import _optimizers_to_device

            import zeroshard

            check_precision(getattr(self.precision_plugin, "precision", "32-true"),
                            self.shard_options)
            self.accelerator.setup(trainer)
            self.model = self.precision_plugin.convert_module(self.model)
            sharded = getattr(self.lightning_module, "_zeroshard_engine", None) is not None
            if not sharded and not _on_meta(self.model):
                self.model_to_device()
            if trainer.state.fn == TrainerFn.FITTING:
                if sharded:
                    raise RuntimeError(
                        "this LightningModule was sharded by an earlier fit(); zeroshard shards "
                        "a model once: build a new one (or a new Trainer over the same "
                        "checkpoint: fit(ckpt_path=...))")
                self.setup_optimizers(trainer)
                # several (manual optimisation: Muon + AdamW) are sharded together; see
                # [Note: several optimizers] in engine/composite.py
                optimizer = (tuple(self.optimizers) if len(self.optimizers) > 1 else
                             one_optimizer(self.optimizers, "configure_optimizers returned"))
                try:
                    _, optimizer = zeroshard.shard(self.lightning_module, optimizer,
                                                   **self.shard_options)
                except Exception:
                    if _on_meta(self.lightning_module):  # so Lightning's teardown, which
                        self.lightning_module.to_empty(device="cpu")  # moves it, shows this
                    raise
                self.optimizers = list(optimizer) if isinstance(optimizer, tuple) else [optimizer]
            self.setup_precision_plugin()
            if trainer.state.fn == TrainerFn.FITTING:
                _optimizers_to_device(self.optimizers, self.root_device)

        @contextmanager
        def tensor_init_context(self, empty_init: bool | None = None
                                ) -> Generator[None, None, None]:
            """``trainer.init_module(empty_init=True)`` at stage 3: the meta device; setup's
            shard() materialises the model unit by unit (``param_init=``)."""
            if empty_init and self.shard_options.get("stage") == 3:
                with torch.device("meta"):
                    yield
                return
            with super().tensor_init_context(empty_init):
                yield

        # -- steps through the module's __call__ ----------------------------------------
        def _through_module(self, method: str, *args: Any, **kwargs: Any) -> Any:
            module = self.lightning_module
            if getattr(module, "_zeroshard_engine", None) is None:
                return getattr(module, method)(*args, **kwargs)
            return self._redirect(module, module, method, *args, **kwargs)

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            with self.precision_plugin.train_step_context():
                return self._through_module("training_step", *args, **kwargs)

        def validation_step(self, *args: Any, **kwargs: Any) -> Any:
            with self.precision_plugin.val_step_context():
                return self._through_module("validation_step", *args, **kwargs)

        def test_step(self, *args: Any, **kwargs: Any) -> Any:
            with self.precision_plugin.test_step_context():
                return self._through_module("test_step", *args, **kwargs)

        def predict_step(self, *args: Any, **kwargs: Any) -> Any:
            with self.precision_plugin.predict_step_context():
                return self._through_module("predict_step", *args, **kwargs)

        @contextmanager
        def block_backward_sync(self) -> Generator[None, None, None]:
            module = self.lightning_module
            if getattr(module, "_zeroshard_engine", None) is None:
                yield None
                return
            with module.no_sync():
                yield None

        # -- checkpoints -----------------------------------------------------------------
        @property
        def restore_checkpoint_after_setup(self) -> bool:
            return True  # the sharded model and optimizer must exist to load into

        @property
        def lightning_restore_optimizer(self) -> bool:
            # A one-file checkpoint (DDP's, or a "full" one) holds the optimizer state in
            # torch's format: Lightning loads it into zeroshard's optimizer, which takes
            # that format. A sharded one: load_checkpoint restored it already.
            return self.state_dict_type == "full" or self._one_file

        def lightning_module_state_dict(self) -> dict[str, Any]:
            if self.state_dict_type == "sharded":
                return {}  # written by save_checkpoint, each rank its shard
            return super().lightning_module_state_dict()  # whole; collective at stage 3

        def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
            if self.state_dict_type == "sharded":
                return {}
            return super().optimizer_state(optimizer)  # torch's format; a collective

        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                            storage_options: Any = None) -> None:
            if self.state_dict_type == "full":
                return super().save_checkpoint(checkpoint, filepath, storage_options)
            import zeroshard

            path = Path(self.broadcast(str(filepath)))
            if path.is_file():
                if self.is_global_zero:
                    path.unlink()
                self.barrier()
            zeroshard.save_checkpoint(path, self.lightning_module, _inner(self.optimizers))
            if self.is_global_zero:
                checkpoint = {k: v for k, v in checkpoint.items()
                              if k not in ("state_dict", "optimizer_states")}
                torch.save(checkpoint, path / _LIGHTNING_STATE)
            self.barrier()

        def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                            ) -> dict[str, Any]:
            path = Path(self.broadcast(str(checkpoint_path)))
            self._one_file = not (path / "zeroshard.json").is_file()
            if self._one_file:  # Lightning's format (the DDP strategy's, or "full")
                return super().load_checkpoint(path, weights_only=weights_only)
            import zeroshard

            checkpoint = torch.load(path / _LIGHTNING_STATE, weights_only=False)
            if getattr(self.lightning_module, "_zeroshard_engine", None) is None:
                # validate/test/predict: the module is not sharded; its whole weights,
                # read here one tensor at a time, are loaded by load_model_state_dict
                from zeroshard.state.consolidate import CheckpointReader

                checkpoint["state_dict"] = whole_state_dict(CheckpointReader(path))
                return checkpoint
            zeroshard.load_checkpoint(path, self.lightning_module, _inner(self.optimizers))
            checkpoint["state_dict"] = {}  # loaded above, into the shards
            return checkpoint

        def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
            # Whole weights (a one-file checkpoint, whatever this strategy saves): into
            # every rank's shards and masters (ShardedModule.load_state_dict) or, outside
            # fit, into the unsharded module. A sharded checkpoint's are loaded already.
            # Skipping them here once left fit(ckpt_path=<DDP's .ckpt>) on fresh weights.
            if checkpoint.get("state_dict"):
                return super().load_model_state_dict(checkpoint, strict)
            return None

        def remove_checkpoint(self, filepath: Any) -> None:
            path = Path(filepath)
            if self.is_global_zero and path.is_dir():
                shutil.rmtree(path)
            elif not path.is_dir():
                super().remove_checkpoint(filepath)

        @classmethod
        def register_strategies(cls, strategy_registry: Any) -> None:
            register(cls, strategy_registry)

    ZeroShardStrategy.__module__ = __name__
    ZeroShardStrategy.register_strategies(pl.strategies.StrategyRegistry)
    return ZeroShardStrategy


def _on_meta(module: torch.nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def _inner(optimizers: list[Any]) -> Any:
    """What zeroshard's checkpoint functions take for the strategy's optimizers (under
    Lightning's ``LightningOptimizer``): None, the one, or the tuple of several."""
    inner = [getattr(o, "_optimizer", o) for o in optimizers]
    return None if not inner else inner[0] if len(inner) == 1 else tuple(inner)


#: Built (and registered by name with Lightning) when this module is imported.
ZeroShardStrategy = _strategy_class()
