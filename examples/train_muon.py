"""Muon on a sharded model, the way Muon is trained: Muon for the hidden matrices, AdamW
for the embeddings, the head and the norms — two optimizers, handed to shard() together.
Each matrix is orthogonalised once in the job, by its owner rank, and the result is
DDP + Muon + AdamW's (this script trains both and compares).

    torchrun --nproc-per-node 2 examples/train_muon.py [--stage 3] [--steps 10]

docs/optimizers.md has the details (and the one-optimizer form, MuonWithAuxAdam's
``use_muon`` groups).
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


def optimizers(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, ...]:
    """Muon for the hidden matrices; AdamW for the embeddings, the head and the norms."""
    hidden = [p for n, p in model.named_parameters()
              if p.ndim == 2 and not n.startswith(("tok_emb", "lm_head"))]
    rest = [p for p in model.parameters() if not any(p is q for q in hidden)]
    return (torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1),
            torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01))


def train(model, opts, steps: int, rank: int, world: int) -> list[float]:
    cfg = get_preset(PRESET)
    data = TokenLoader(SyntheticLanguage(cfg.vocab, 32, seed=1), global_batch=8, rank=rank,
                       world_size=world)
    losses = []
    for _ in range(steps):
        x, y = next(data)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
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
    model, (muon, adamw) = zeroshard.shard(model, optimizers(model), stage=args.stage)
    losses = train(model, (muon, adamw), args.steps, rank, world)
    weights = zeroshard.full_state_dict(model)  # collective: every rank calls it
    owned = sum(1 for st in muon.state.values() if st)  # momentum held on this rank

    reference = build_model(PRESET, seed=0)
    ref_opts = optimizers(reference)
    ref_losses = train(DDP(reference), ref_opts, args.steps, rank, world)
    worst = max((weights[k] - v).abs().max().item() for k, v in reference.state_dict().items())

    print(f"rank {rank}: stage {args.stage}, owns {owned} of "
          f"{len(ref_opts[0].param_groups[0]['params'])} matrices; last loss "
          f"{losses[-1]:.4f} (DDP {ref_losses[-1]:.4f}); largest weight difference from "
          f"DDP + Muon: {worst:.1e}")
    if launched:
        dist.destroy_process_group()
    return {"losses": losses, "ddp_losses": ref_losses, "worst": worst, "owned": owned}


if __name__ == "__main__":
    main()
