"""Supervised fine-tuning with TRL's SFTTrainer and LoRA, on zeroshard or on DDP.

    torchrun --nproc-per-node 2 examples/integrations/trl_sft_lora.py --stage 3 --out /tmp/sft
    torchrun --nproc-per-node 2 examples/integrations/trl_sft_lora.py --ddp --out /tmp/sft-ddp

The one line that changes is the trainer's class: ``zeroshard_trainer(SFTTrainer)`` with
``zeroshard={"stage": N}`` instead of ``SFTTrainer``. Nothing is downloaded: the model is
a 2-layer Llama built from a config and the tokenizer a word-level one built here; the
dataset is text in a small synthetic language. ``--out/final`` receives the LoRA adapter,
which ``PeftModel.from_pretrained(base, dir)`` loads (tests/test_integrations_hf.py).
"""

from __future__ import annotations

import argparse
import json

import datasets
import peft
import torch
import transformers
import trl

from zeroshard.data import SyntheticLanguage

VOCAB = 64


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the words w0..w63 (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"w{i}": i + 3 for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                eos_token="<eos>", unk_token="<unk>")


def dataset(n: int = 64, words: int = 15) -> datasets.Dataset:
    rows = SyntheticLanguage(VOCAB, words, seed=1).batch(0, n)
    return datasets.Dataset.from_dict({"text": [" ".join(f"w{int(t)}" for t in r) for r in rows]})


def tiny_llama(vocab: int, layers: int = 2, hidden: int = 64) -> transformers.PreTrainedModel:
    """A Llama of ``layers`` blocks of width ``hidden`` (default: 2 x 64, tiny)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=max(4, hidden // 64),
        num_key_value_heads=2, intermediate_size=2 * hidden, vocab_size=vocab,
        max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    return transformers.LlamaForCausalLM(cfg)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ddp", action="store_true", help="the plain SFTTrainer (DDP) baseline")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--bf16", action="store_true", help="TRL's default; off here for parity")
    a = p.parse_args(argv)
    tok = tokenizer()
    config = trl.SFTConfig(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=2, learning_rate=1e-2,
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        data_seed=0, use_cpu=not torch.cuda.is_available(), max_length=16,
        dataset_num_proc=None, disable_tqdm=True, bf16=a.bf16)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           task_type="CAUSAL_LM")
    torch.manual_seed(1)  # LoRA's A matrices: the same on every rank and in both runs
    kwargs = dict(model=tiny_llama(len(tok)), args=config, train_dataset=dataset(),
                  processing_class=tok, peft_config=lora)
    if a.ddp:
        trainer = trl.SFTTrainer(**kwargs)
    else:
        from zeroshard.integrations.hf_trainer import zeroshard_trainer

        trainer = zeroshard_trainer(trl.SFTTrainer)(**kwargs, zeroshard={"stage": a.stage})
    trainer.train()
    trainer.save_model(f"{a.out}/final")  # every rank: a collective under zeroshard
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if trainer.args.should_save:
        with open(f"{a.out}/logs.json", "w") as f:
            json.dump(logs, f)
    return logs


if __name__ == "__main__":
    main()
