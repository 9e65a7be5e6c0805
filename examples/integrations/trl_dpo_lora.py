"""Preference tuning with TRL's DPOTrainer and LoRA, on zeroshard or on DDP.

    torchrun --nproc-per-node 2 examples/integrations/trl_dpo_lora.py --stage 3 --out /tmp/dpo
    torchrun --nproc-per-node 2 examples/integrations/trl_dpo_lora.py --ddp --out /tmp/dpo-ddp

As in TRL's ``trl/scripts/dpo.py --use_peft``: with a LoRA adapter there is no separate
reference model; each step's reference pass runs the same model with its adapters
disabled (peft's ``disable_adapter()``, which flips the adapters' ``requires_grad`` under
``torch.no_grad()``). The one line that changes is the trainer's class:
``zeroshard_trainer(DPOTrainer)`` with ``zeroshard={"stage": N}``. Nothing is downloaded
(the model, tokenizer and data are those of trl_sft_lora.py); the losses and rewards it
logs are DDP's (tests/test_integrations_hf.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import datasets
import peft
import torch
import trl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_sft_lora import tiny_llama, tokenizer  # noqa: E402

from zeroshard.data import SyntheticLanguage  # noqa: E402

VOCAB = 64


def preferences(n: int = 32) -> datasets.Dataset:
    """Prompts with a chosen continuation (the synthetic language's own) and a rejected one
    (the same words reversed)."""
    rows = SyntheticLanguage(VOCAB, 12, seed=2).batch(0, n)
    words = [[f"w{int(t)}" for t in r] for r in rows]
    return datasets.Dataset.from_dict({
        "prompt": [" ".join(w[:4]) for w in words],
        "chosen": [" ".join(w[4:]) for w in words],
        "rejected": [" ".join(reversed(w[4:])) for w in words]})


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ddp", action="store_true", help="the plain DPOTrainer (DDP) baseline")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--bf16", action="store_true", help="TRL's default; off here for parity")
    p.add_argument("--full", action="store_true",
                   help="no LoRA: full fine-tuning against a separate reference model "
                        "(sharded too at stage 3)")
    p.add_argument("--sync-ref", action="store_true",
                   help="with --full: TRL's sync_ref_model, a soft update of the reference "
                        "(alpha 0.5) after every step")
    a = p.parse_args(argv)
    tok = tokenizer()
    config = trl.DPOConfig(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=2, learning_rate=1e-2,
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        data_seed=0, use_cpu=not torch.cuda.is_available(), max_length=16,
        dataset_num_proc=None, disable_tqdm=True, bf16=a.bf16,
        sync_ref_model=a.sync_ref, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           task_type="CAUSAL_LM")
    torch.manual_seed(1)  # LoRA's A matrices: the same on every rank and in both runs
    kwargs = dict(model=tiny_llama(len(tok)), args=config, train_dataset=preferences(),
                  processing_class=tok, peft_config=lora)
    if a.full:  # the reference: the policy's starting weights, forward-only
        kwargs.update(peft_config=None, ref_model=tiny_llama(len(tok)))
    if a.ddp:
        trainer = trl.DPOTrainer(**kwargs)
    else:
        from zeroshard.integrations.hf_trainer import zeroshard_trainer

        trainer = zeroshard_trainer(trl.DPOTrainer)(**kwargs, zeroshard={"stage": a.stage})
    trainer.train()
    trainer.save_model(f"{a.out}/final")  # every rank: a collective under zeroshard
    logs = [h for h in trainer.state.log_history if "loss" in h]
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:  # its bytes on this rank: the whole model's under DDP, 1/N at stage 3
        logs[-1]["reference bytes"] = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
            for p in ref.parameters())
    if trainer.args.should_save:
        with open(f"{a.out}/logs.json", "w") as f:
            json.dump(logs, f)
    return logs


if __name__ == "__main__":
    main()
