"""ZeRO over data parallelism, composed with torch's tensor parallelism (a 2-D mesh).

The order of calls is torchtitan's: build the model, make a (dp, tp) mesh, parallelise
the model on ``mesh["tp"]`` (here zeroshard's Llama with torchtitan's plan), optionally
checkpoint activations, then ``zeroshard.shard(model, ..., mesh=mesh)``, which shards each
rank's tensor-parallel pieces over ``mesh["dp"]``. The ranks of one tp group read the
same batch (their dp index picks it) and the loss runs under ``loss_parallel`` (the LM
head's logits are split over the vocabulary). Checkpoints are zeroshard's sharded ones:
they load into any dp x tp layout and stage, or into a run without tensor parallelism.
See docs/tensor-parallel.md.

    torchrun --nproc-per-node 4 examples/train_tp.py --tp 2 --stage 3 --out /tmp/tp
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

import zeroshard
from zeroshard.checkpointing import apply_checkpointing
from zeroshard.data import SyntheticLanguage, TokenLoader
from zeroshard.models import build_model, get_preset, parallelize_llama


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-tiny", help="a zeroshard Llama preset")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (1: none)")
    p.add_argument("--stage", type=int, default=3, choices=[1, 2, 3])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step, all ranks")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--checkpointing", default="none", help="none, full, selective, ...")
    p.add_argument("--save-at", type=int, default=None, help="save a checkpoint after this step")
    p.add_argument("--resume", default=None, help="a checkpoint directory to continue from")
    p.add_argument("--out", default=None, help="where checkpoints and losses.json go")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[float]:
    args = parse(argv)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tp > 1:
        mesh = init_device_mesh(device, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    else:
        mesh, dp, dp_rank = None, world, dist.get_rank()

    config = get_preset(args.model)
    torch.manual_seed(0)  # every rank builds the same weights
    model = build_model(config)
    if mesh is not None:
        parallelize_llama(model, mesh["tp"])  # before checkpointing, compiling, sharding
    apply_checkpointing(model, args.checkpointing)
    model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=args.stage, mesh=mesh,
                                   lr=3e-3, weight_decay=0.1)

    data = TokenLoader(SyntheticLanguage(config.vocab, args.seq, seed=0),
                       global_batch=args.global_batch, rank=dp_rank, world_size=dp)
    start = 0
    if args.resume:
        extra = zeroshard.load_checkpoint(args.resume, model, optim)
        start = extra["step"]
        data.load_state_dict(extra["data"])
    losses = []
    for step in range(start, args.steps):
        x, y = next(data)
        logits = model(x)
        with loss_parallel():  # logits are vocabulary shards under tp (a DTensor)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        optim.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad()
        mean = loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if dist.get_rank() == 0:
            print(f"step {step + 1}: loss {losses[-1]:.4f}", flush=True)
        if args.out and args.save_at == step + 1:
            zeroshard.save_checkpoint(os.path.join(args.out, "ckpt"), model, optim,
                                      extra={"step": step + 1, "data": data.state_dict()})
    if args.out and dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump(losses, f)
    return losses


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
