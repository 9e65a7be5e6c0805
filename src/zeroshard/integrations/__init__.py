"""zeroshard inside the trainers people already use.

* :mod:`zeroshard.integrations.hf_trainer` — ``ZeroShardTrainer``, a
  ``transformers.Trainer`` subclass, and ``zeroshard_trainer(cls)`` for any Trainer
  subclass (TRL's ``SFTTrainer``, tested with LoRA) — docs/trainers-hf.md;
* :mod:`zeroshard.integrations.lightning_fabric` and
  :mod:`zeroshard.integrations.lightning_trainer` — ``ZeroShardStrategy`` for Lightning
  Fabric and the Lightning Trainer, registered as ``strategy="zeroshard_stage_N"`` on
  import — docs/trainers-lightning.md.

Each module imports its trainer only when used: ``import zeroshard`` never imports
``transformers``, ``accelerate`` or ``lightning``.
"""
