"""The plan chooses itself: calibrate this machine once, then let ``shard`` pick the
stage and checkpointing that fit a memory budget and are predicted fastest.

    zeroshard calibrate --model gpt2-small --out profile.json     # once per machine/world
    torchrun --nproc-per-node 2 examples/train_auto.py --budget 300MiB --profile profile.json

Without ``--profile`` the ranks calibrate briefly first. docs/planning.md, "Choosing by
itself", has the method and how well its picks match measurements.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zeroshard
from zeroshard.data import SyntheticLanguage, TokenLoader
from zeroshard.models import build_model, get_preset


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2-small")
    parser.add_argument("--budget", default="300MiB", help="bytes per rank, e.g. 300MiB")
    parser.add_argument("--profile", default=None, help="a `zeroshard calibrate` profile")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    launched = not dist.is_initialized()  # under torchrun; tests call main() in ranks
    if launched:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = get_preset(args.model)
    model, optim = zeroshard.shard(
        build_model(args.model, seed=0), torch.optim.AdamW, lr=1e-3,
        stage="auto", memory_budget=args.budget, profile=args.profile,
        example_batch=(args.micro_batch, args.seq))  # rank 0 logs the table it chose from
    choice = zeroshard.engine_of(model).auto_choice.chosen
    data = TokenLoader(SyntheticLanguage(cfg.vocab, args.seq, seed=1),
                       global_batch=args.micro_batch * world, rank=rank, world_size=world)
    losses = []
    for _ in range(args.steps):
        x, y = next(data)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    if rank == 0:
        print(f"chose {choice.name}: traced peak {choice.peak_bytes / 2**20:,.1f} MiB, "
              f"predicted {choice.predicted_step_s:.3f} s/step; losses "
              + " ".join(f"{v:.4f}" for v in losses))
    if launched:
        dist.destroy_process_group()
    return {"stage": zeroshard.engine_of(model).config.stage, "choice": choice,
            "losses": losses}


if __name__ == "__main__":
    main()
