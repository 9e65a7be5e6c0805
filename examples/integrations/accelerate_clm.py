"""A hand-written Accelerate loop (transformers' run_clm_no_trainer.py, shortened), on
zeroshard or on DDP.

    torchrun --nproc-per-node 2 examples/integrations/accelerate_clm.py --stage 3 --out /tmp/acc
    torchrun --nproc-per-node 2 examples/integrations/accelerate_clm.py --ddp --out /tmp/acc-ddp

The one line that changes is ``accelerator.prepare(model, optimizer, loader, scheduler)``:
``zeroshard.integrations.accelerate.prepare(accelerator, model, optimizer, loader,
scheduler, stage=N)`` shards the model with its optimizer and prepares the rest with
Accelerate. Everything else is Accelerate's: ``accumulate``, ``backward``,
``clip_grad_norm_``, ``save_state`` at step 3 (``--resume`` continues from it, at any
stage), ``unwrap_model(model).save_pretrained`` at the end. Nothing is downloaded: a
2-layer Llama built from a config, trained on a synthetic language. Rank 0 writes each
step's loss and clipped norm to ``--out/logs.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import transformers
from accelerate import Accelerator

from zeroshard.data import SyntheticLanguage

VOCAB, SEQ, ROWS = 128, 16, 48


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.rows = SyntheticLanguage(VOCAB, SEQ, seed=1).batch(0, ROWS)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def tiny_llama() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0))


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ddp", action="store_true", help="plain Accelerate (DDP): the baseline")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--bf16", action="store_true", help="Accelerator(mixed_precision='bf16')")
    p.add_argument("--resume", metavar="DIR", help="load_state(DIR) (a save_state at step 3)")
    a = p.parse_args(argv)
    accelerator = Accelerator(gradient_accumulation_steps=2,
                              mixed_precision="bf16" if a.bf16 else "no")
    model = tiny_llama()
    # run_clm_no_trainer.py's parameter groups: no weight decay on biases and norms
    no_decay = ["bias", "norm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters()
                    if not any(nd in n for nd in no_decay)], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters()
                    if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2, shuffle=False)
    scheduler = transformers.get_scheduler("linear", optimizer, num_warmup_steps=1,
                                           num_training_steps=a.steps)
    if a.ddp:
        model, optimizer, loader, scheduler = accelerator.prepare(
            model, optimizer, loader, scheduler)
    else:
        from zeroshard.integrations.accelerate import prepare

        model, optimizer, loader, scheduler = prepare(
            accelerator, model, optimizer, loader, scheduler, stage=a.stage)
    step, logs = 0, []
    batches = loader
    if a.resume:
        accelerator.load_state(a.resume)
        step = 3
        batches = accelerator.skip_first_batches(loader, step * 2)
    model.train()
    for batch in batches:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            logs.append({"step": step, "loss": loss.item(), "grad_norm": float(norm)})
            if step == 3 and not a.resume:
                accelerator.save_state(os.path.join(a.out, "step_3"))  # every rank
            if step == a.steps:
                break
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(os.path.join(a.out, "final"),
                              is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    if accelerator.is_main_process:
        with open(os.path.join(a.out, "logs.json"), "w") as f:
            json.dump(logs, f)
    return logs


if __name__ == "__main__":
    main()
