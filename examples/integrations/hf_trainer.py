"""Fine-tune a small Llama with the Hugging Face Trainer, on zeroshard or on DDP.

    torchrun --nproc-per-node 2 examples/integrations/hf_trainer.py --stage 2 --out /tmp/hf
    torchrun --nproc-per-node 2 examples/integrations/hf_trainer.py --ddp --out /tmp/hf-ddp

The one line that changes is the trainer's class (``ZeroShardTrainer`` with
``zeroshard={"stage": N}`` instead of ``Trainer``). The model is built from a config
(nothing is downloaded) and trained on a synthetic language; the losses and gradient
norms it logs are DDP's (tests/test_integrations_hf.py), and ``--out`` receives the
checkpoints and the final model, which ``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import argparse
import json

import torch
import transformers

from zeroshard.data import SyntheticLanguage


class Tokens(torch.utils.data.Dataset):
    """Sequences of a synthetic language (zeroshard.data), as a causal-LM dataset."""

    def __init__(self, vocab: int, seq: int, n: int) -> None:
        self.rows = SyntheticLanguage(vocab, seq, seed=1).batch(0, n)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def tiny_llama(seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=128, max_position_embeddings=32, bos_token_id=0,
        eos_token_id=0, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ddp", action="store_true", help="the plain Trainer (DDP) baseline")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--save-steps", type=int, default=3)
    p.add_argument("--resume", nargs="?", const=True, default=None,
                   help="resume from the last checkpoint in --out, or from this one")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (peft)")
    p.add_argument("--eval", action="store_true",
                   help="evaluate every 3 steps, then generate from a prompt (every rank)")
    p.add_argument("--checkpointing", action="store_true", help="gradient_checkpointing=True")
    p.add_argument("--selective", action="store_true",
                   help="zeroshard.hf.apply_checkpointing(model, 'selective') (zeroshard only)")
    a = p.parse_args(argv)
    args = transformers.TrainingArguments(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=a.accum, learning_rate=1e-2, weight_decay=0.1,
        max_grad_norm=1.0, logging_steps=1, save_steps=a.save_steps, report_to=[],
        bf16=a.bf16, fp16=a.fp16, use_cpu=not torch.cuda.is_available(), seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=a.checkpointing,
        eval_strategy="steps" if a.eval else "no", eval_steps=3, per_device_eval_batch_size=2)
    model, data = tiny_llama(), Tokens(128, 16, 64)
    if a.lora:
        import peft

        torch.manual_seed(1)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8,
                                                           target_modules=["q_proj", "v_proj"]))
    if a.selective:  # the Trainer calls the model with HF's default use_cache=True
        import zeroshard.hf

        zeroshard.hf.apply_checkpointing(model, "selective")
    if a.ddp:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                       eval_dataset=Tokens(128, 16, 8) if a.eval else None)
    else:
        from zeroshard.integrations.hf_trainer import ZeroShardTrainer

        trainer = ZeroShardTrainer(model=model, args=args, train_dataset=data,
                                   eval_dataset=Tokens(128, 16, 8) if a.eval else None,
                                   zeroshard={"stage": a.stage})
    trainer.train(resume_from_checkpoint=a.resume)
    trainer.save_model(f"{a.out}/final")  # every rank: a collective under zeroshard
    logs = [h for h in trainer.state.log_history if "loss" in h or "eval_loss" in h]
    if a.eval:  # greedy generation on every rank (a collective forward per token at stage 3)
        prompt = torch.tensor([[1, 2, 3, 4]])
        with torch.no_grad():
            out = trainer.model.generate(prompt, max_new_tokens=5, do_sample=False)
        logs.append({"generated": out[0].tolist()})
    if trainer.args.should_save:
        with open(f"{a.out}/logs.json", "w") as f:
            json.dump(logs, f)
    return logs


if __name__ == "__main__":
    main()
