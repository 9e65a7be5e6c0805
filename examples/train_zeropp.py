"""Bytes between nodes: stage 3 beside ZeRO++'s three (a secondary shard per node, int8
weight all-gathers, int4 two-hop gradients), on nodes you declare — logical ones on one
machine work the same — printing what each step sends inside and across nodes.

    torchrun --nproc-per-node 4 examples/train_zeropp.py --node-size 2 [--steps 10]

docs/links.md has the details (what each option keeps, what it costs, how exact it is).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zeroshard
from zeroshard.data import SyntheticLanguage, TokenLoader
from zeroshard.models import build_model, get_preset

PRESET = "gpt2-tiny"


def train(options: dict, steps: int, node_size: int) -> dict:
    """``steps`` steps of stage 3 with ``options``: the losses, and rank 0's bytes per
    step inside and across nodes (the ledger's last step)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = get_preset(PRESET)
    model, optim = zeroshard.shard(build_model(PRESET, seed=0), torch.optim.AdamW, lr=3e-3,
                                   stage=3, mixed_precision="bf16", node_size=node_size,
                                   **options)
    data = TokenLoader(SyntheticLanguage(cfg.vocab, cfg.seq_len, seed=1), global_batch=4 * world,
                       rank=rank, world_size=world)
    losses = []
    for _ in range(steps):
        x, y = next(data)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    ledger = zeroshard.engine_of(model).comm.ledger
    totals = ledger.totals(ledger.last_step())
    return {"losses": losses, "intra": totals["intra_wire_bytes"],
            "inter": totals["inter_wire_bytes"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--node-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    launched = not dist.is_initialized()  # under torchrun; tests call main() in ranks
    if launched:
        dist.init_process_group("gloo")
    k = args.node_size
    runs = {
        "stage 3": train({}, args.steps, k),
        f"+ hpZ (reshard_after_forward={k})": train({"reshard_after_forward": k}, args.steps, k),
        "+ int8 weights + int4 gradients": train(
            {"reshard_after_forward": k, "quantize_weights": "int8", "quantize_grads": "int4"},
            args.steps, k),
    }
    if dist.get_rank() == 0:
        print(f"{'run':<36} {'final loss':>10} {'intra KiB':>10} {'inter KiB':>10}")
        for name, r in runs.items():
            print(f"{name:<36} {r['losses'][-1]:>10.4f} {r['intra'] / 1024:>10.1f} "
                  f"{r['inter'] / 1024:>10.1f}")
    if launched:
        dist.destroy_process_group()
    return runs


if __name__ == "__main__":
    main()
