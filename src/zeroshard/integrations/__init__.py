"""zeroshard inside the trainers people already use.

* :mod:`zeroshard.integrations.hf_trainer` — ``ZeroShardTrainer``, a
  ``transformers.Trainer`` subclass, and ``zeroshard_trainer(cls)`` for any Trainer
  subclass (TRL's ``SFTTrainer``, tested with LoRA) — docs/trainers-hf.md.

Each module imports its trainer only when used: ``import zeroshard`` never imports
``transformers``, ``accelerate`` or ``lightning``.
"""
