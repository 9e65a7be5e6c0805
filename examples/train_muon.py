"""Muon on a sharded model: each matrix is orthogonalised once in the job, by its owner
rank, and the result is DDP + Muon's (this script trains both and compares).

    torchrun --nproc-per-node 2 examples/train_muon.py [--stage 3] [--steps 10]

torch's Muon takes 2-D parameters only: here it steps the matrices and the 1-D
parameters (norms) stay as built, in both runs. docs/optimizers.md has the details.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard
from zeroshard.data import SyntheticLanguage, TokenLoader
from zeroshard.models import build_model, get_preset

PRESET = "llama-tiny"


def muon(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02,
                            weight_decay=0.1)


def train(model, optimizer, steps: int, rank: int, world: int) -> list[float]:
    cfg = get_preset(PRESET)
    data = TokenLoader(SyntheticLanguage(cfg.vocab, 32, seed=1), global_batch=8, rank=rank,
                       world_size=world)
    losses = []
    for _ in range(steps):
        x, y = next(data)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    launched = not dist.is_initialized()  # under torchrun; tests call main() in ranks
    if launched:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = build_model(PRESET, seed=0)
    model, optimizer = zeroshard.shard(model, muon(model), stage=args.stage)
    losses = train(model, optimizer, args.steps, rank, world)
    weights = zeroshard.full_state_dict(model)  # collective: every rank calls it
    owned = sum(1 for st in optimizer.state.values() if st)  # momentum held on this rank

    reference = build_model(PRESET, seed=0)
    ref_optimizer = muon(reference)
    ref_losses = train(DDP(reference), ref_optimizer, args.steps, rank, world)
    worst = max((weights[k] - v).abs().max().item() for k, v in reference.state_dict().items())

    print(f"rank {rank}: stage {args.stage}, owns {owned} of "
          f"{len(ref_optimizer.param_groups[0]['params'])} matrices; last loss "
          f"{losses[-1]:.4f} (DDP {ref_losses[-1]:.4f}); largest weight difference from "
          f"DDP + Muon: {worst:.1e}")
    if launched:
        dist.destroy_process_group()
    return {"losses": losses, "ddp_losses": ref_losses, "worst": worst, "owned": owned}


if __name__ == "__main__":
    main()
