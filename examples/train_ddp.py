"""A DDP training script of the usual shape (nanoGPT-style), for CPU ranks over gloo.

Its zeroshard twin, train_zeroshard.py, differs only in the wrap line (and evaluates on
every rank); tests/test_examples.py runs both and checks they agree step by step.

    torchrun --nproc-per-node 2 examples/train_ddp.py --steps 20 --out /tmp/ddp
    torchrun --nproc-per-node 2 examples/train_ddp.py --steps 20 --out /tmp/ddp2 \\
        --resume /tmp/ddp/ckpt.pt

What it does, as such scripts do: a small decoder LM whose ``configure_optimizers``
builds AdamW with decay / no-decay groups; the learning rate set through
``optimizer.param_groups`` every iteration; gradient accumulation through
``model.require_backward_grad_sync``; ``torch.nn.utils.clip_grad_norm_``; evaluation;
``torch.save({"model": ..., "optimizer": ...})`` from rank 0; resume with
``load_state_dict`` before wrapping.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, block_size: int = 32, n_layer: int = 2,
                 n_head: int = 4, n_embd: int = 64) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay: float, lr: float,
                             betas: tuple[float, float]) -> torch.optim.AdamW:
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        no_decay = [p for p in params.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=betas)


def get_lr(it: int, max_lr: float, warmup: int, total: int) -> float:
    if it < warmup:
        return max_lr * (it + 1) / warmup
    ratio = (it - warmup) / max(1, total - warmup)
    return 0.1 * max_lr + 0.45 * max_lr * (1 + math.cos(math.pi * ratio))


def get_batch(split: str, step: int, micro: int, rank: int, world: int, batch: int,
              block: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of a deterministic global batch: each sequence counts up from a
    random start by a random stride (mod vocab), with a little noise: learnable."""
    seed = (0 if split == "train" else 10**6) + 1000 * step + micro
    g = torch.Generator().manual_seed(seed)
    n = batch * world
    start = torch.randint(vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + stride * torch.arange(block + 1)) % vocab
    noise = torch.rand(n, block + 1, generator=g) < 0.05
    seq = torch.where(noise, torch.randint(vocab, seq.shape, generator=g), seq)
    rows = seq[rank * batch : (rank + 1) * batch]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


@torch.no_grad()
def evaluate(model: nn.Module, rank: int, world: int, args: argparse.Namespace) -> float:
    model.eval()
    losses = []
    for i in range(2):
        x, y = get_batch("val", 0, i, rank, world, args.batch, args.block, args.vocab)
        losses.append(model(x, y)[1].item())
    model.train()
    return sum(losses) / len(losses)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-interval", type=int, default=5)
    p.add_argument("--save-at", type=int, default=6, help="checkpoint after this step")
    p.add_argument("--resume", default=None, help="a checkpoint this script saved")
    p.add_argument("--out", default=None, help="directory for ckpt.pt and log.jsonl")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1337)
    model = GPT(vocab=args.vocab, block_size=args.block)
    optimizer = model.configure_optimizers(0.1, args.lr, (0.9, 0.95))
    start = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu", weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start = ckpt["step"]
    model = DDP(model)
    raw_model = model.module
    log = []
    for step in range(start, args.steps):
        lr = get_lr(step, args.lr, warmup=3, total=args.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        val = None
        if step % args.eval_interval == 0 and rank == 0:
            val = evaluate(raw_model, rank, world, args)
        total = 0.0
        for micro in range(args.accum):
            model.require_backward_grad_sync = micro == args.accum - 1
            x, y = get_batch("train", step, micro, rank, world, args.batch, args.block,
                             args.vocab)
            _, loss = model(x, y)
            (loss / args.accum).backward()
            total += loss.item() / args.accum
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.append({"step": step + 1, "loss": total, "norm": float(norm), "lr": lr, "val": val})
        if step + 1 == args.save_at and args.out:
            # State dicts on every rank, the file from one.
            ckpt = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                    "step": step + 1}
            if rank == 0:
                os.makedirs(args.out, exist_ok=True)
                torch.save(ckpt, os.path.join(args.out, "ckpt.pt"))
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "log.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in log)
    return log


if __name__ == "__main__":
    for row in main():
        if dist.get_rank() == 0:
            print(row)
    dist.destroy_process_group()
