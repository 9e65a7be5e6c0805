"""The Hugging Face Trainer with a Muon optimizer (issue #45's ``optimizers=``): one
optimizer mixing Muon groups and AdamW groups (the MuonWithAuxAdam pattern; the Trainer
takes one optimizer), passed as ``optimizers=(optimizer, None)``. ZeroShardTrainer at
stage 3 logs the plain Trainer's (DDP) losses at world 2, bit for bit (no clipping: a
global norm summed from shards differs in its last bit, which Muon's bf16 Newton-Schulz
then amplifies; docs/optimizers.md).
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from zeroshard.testing import run_ranks  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "integrations" / "hf_trainer.py"
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "ACCELERATE_USE_CPU": "1"}


def _example():
    spec = importlib.util.spec_from_file_location("hf_trainer_example_muon", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _train(rank: int, world: int, out: str, stage: int | None) -> list[float]:
    import torch
    from test_whole_optimizers import MuonWithAuxAdam

    transformers.logging.set_verbosity_error()
    example = _example()
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=4, per_device_train_batch_size=2, learning_rate=3e-3,
        max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=not torch.cuda.is_available(), seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True)
    model, data = example.tiny_llama(), example.Tokens(128, 16, 64)
    hidden = [p for n, p in model.named_parameters()
              if p.ndim == 2 and "embed" not in n and "lm_head" not in n]
    rest = [p for p in model.parameters() if not any(p is q for q in hidden)]
    opt = MuonWithAuxAdam([{"params": hidden, "use_muon": True, "lr": 0.02},
                           {"params": rest, "use_muon": False, "lr": 3e-3}])
    if stage is None:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                       optimizers=(opt, None))
    else:
        from zeroshard.integrations.hf_trainer import ZeroShardTrainer

        trainer = ZeroShardTrainer(model=model, args=args, train_dataset=data,
                                   optimizers=(opt, None), zeroshard={"stage": stage})
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _both(rank: int, world: int, root: str) -> dict:
    return {"ddp": _train(rank, world, f"{root}/ddp", None),
            "s3": _train(rank, world, f"{root}/s3", 3)}


def test_hf_trainer_with_a_muon_optimizer_equals_ddp() -> None:
    root = tempfile.mkdtemp(prefix="zs-hf-muon-")
    out = run_ranks(_both, 2, root, timeout=600, env=ENV)[0]
    assert len(out["ddp"]) == 4
    assert out["s3"] == out["ddp"], out
