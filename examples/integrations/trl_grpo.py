"""RL fine-tuning with TRL's GRPOTrainer (or RLOOTrainer), on zeroshard or on DDP.

    torchrun --nproc-per-node 2 examples/integrations/trl_grpo.py --stage 3 --out /tmp/grpo
    torchrun --nproc-per-node 2 examples/integrations/trl_grpo.py --ddp --out /tmp/grpo-ddp
    torchrun --nproc-per-node 2 examples/integrations/trl_grpo.py --trainer rloo --stage 3 --out /tmp/rloo

Each step the policy generates completions (``generate()``: at stage 3 each unit gathered
once per call, docs/generation.md), a reward function scores them, and the policy trains
on them against a reference model (``beta > 0``) that TRL keeps beside it — sharded too at
stage 3 (``zeroshard.shard_for_inference``) — and soft-updates after every step
(``sync_ref_model=True``). The one line that changes is the trainer's class:
``zeroshard_trainer(GRPOTrainer)`` with ``zeroshard={"stage": N}``. Nothing is downloaded
(the model and tokenizer are trl_sft_lora.py's, saved to ``--out`` because GRPO builds its
reference model from the policy's path); the losses, rewards and norms it logs are DDP's
(tests/test_integrations_hf.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import datasets
import torch
import torch.distributed as dist
import trl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_sft_lora import tiny_llama, tokenizer  # noqa: E402


def prompts(n: int = 16) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"prompt": [f"w{i} w{i + 1} w{i + 2}" for i in range(n)]})


def reward_length(completions: list[str], **_: object) -> list[float]:
    """A toy reward: longer completions score higher."""
    return [len(c) / 10 for c in completions]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ddp", action="store_true", help="the plain GRPOTrainer (DDP) baseline")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--trainer", choices=("grpo", "rloo"), default="grpo",
                   help="TRL's GRPOTrainer (default) or RLOOTrainer (same arguments)")
    p.add_argument("--no-reshard", action="store_true",
                   help="shard(reshard_after_forward=False): units stay gathered from a "
                        "forward to its backward, and after no_grad forwards (FSDP2's "
                        "setting; faster, more memory)")
    p.add_argument("--layers", type=int, default=2, help="the policy's blocks (default tiny)")
    p.add_argument("--hidden", type=int, default=64, help="the policy's width")
    a = p.parse_args(argv)
    tok = tokenizer()
    path = os.path.join(a.out, "initial")  # GRPO loads its reference model from here
    if int(os.environ.get("RANK", dist.get_rank() if dist.is_initialized() else 0)) == 0:
        tiny_llama(len(tok), a.layers, a.hidden).save_pretrained(path)
        tok.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    Trainer, Config = ((trl.GRPOTrainer, trl.GRPOConfig) if a.trainer == "grpo"
                       else (trl.RLOOTrainer, trl.RLOOConfig))
    config = Config(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, learning_rate=1e-2, beta=0.1, logging_steps=1,
        save_strategy="no", report_to=[], seed=0, data_seed=0,
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True, bf16=False,
        sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    kwargs = dict(model=path, reward_funcs=reward_length, args=config,
                  train_dataset=prompts(), processing_class=tok)
    if a.ddp:
        trainer = Trainer(**kwargs)
    else:
        from zeroshard.integrations.hf_trainer import zeroshard_trainer

        options = {"stage": a.stage} | ({"reshard_after_forward": False} if a.no_reshard else {})
        trainer = zeroshard_trainer(Trainer)(**kwargs, zeroshard=options)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    logs = [h for h in trainer.state.log_history if "loss" in h]
    ref = trainer.ref_model  # its bytes on this rank: the whole model's under DDP, 1/N at stage 3
    logs[-1]["reference bytes"] = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
        for p in ref.parameters())
    logs[-1]["train seconds"] = seconds
    if trainer.args.should_save:
        with open(f"{a.out}/logs.json", "w") as f:
            json.dump(logs, f)
    return logs


if __name__ == "__main__":
    main()
