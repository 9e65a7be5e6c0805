"""Train a small GPT with Lightning Fabric, on zeroshard or on DDP.

    python examples/integrations/fabric.py --strategy zeroshard_stage_2 --out /tmp/fab
    python examples/integrations/fabric.py --strategy ddp --out /tmp/fab-ddp

The one line that changes is Fabric's ``strategy=`` (after ``import
zeroshard.integrations.lightning_fabric``, which registers the names). Fabric launches the
two CPU ranks itself. The loop accumulates gradients over 2 micro-batches with
``fabric.no_backward_sync``, clips by norm, saves a checkpoint with ``fabric.save`` at step
3 and can resume from it (``--resume``); it prints one JSON line per step (loss, gradient
norm) on rank 0.
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch
import torch.nn.functional as F

import zeroshard.integrations.lightning_fabric  # noqa: F401  (registers "zeroshard...")
from zeroshard.data import SyntheticLanguage, TokenLoader
from zeroshard.models import build_model, get_preset


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strategy", default="zeroshard_stage_2")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true", help="resume from --out/step-3")
    p.add_argument("--state-dict-type", default="sharded", choices=("sharded", "full"))
    p.add_argument("--empty-init", action="store_true",
                   help="build the model on the meta device (stage 3: materialised per unit)")
    a = p.parse_args(argv)
    strategy: object = a.strategy
    if a.strategy.startswith("zeroshard") and a.state_dict_type == "full":
        from zeroshard.integrations.lightning_fabric import ZeroShardStrategy

        strategy = ZeroShardStrategy(stage=int(a.strategy[-1]), state_dict_type="full")
    fabric = L.Fabric(accelerator="cpu", devices=a.devices, strategy=strategy,
                      precision=a.precision)
    fabric.launch()  # starts the other ranks (under torchrun: they exist already)
    torch.manual_seed(0)
    with fabric.init_module(empty_init=a.empty_init):
        model = build_model("gpt2-tiny", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    data = TokenLoader(SyntheticLanguage(get_preset("gpt2-tiny").vocab, 16, seed=1), global_batch=8,
                       rank=fabric.global_rank, world_size=fabric.world_size)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "data": data,
             "step": 0}
    if a.resume:
        fabric.load(f"{a.out}/step-3", state)
    logs = []
    while state["step"] < a.steps:
        micro = data.micro_batches(2)
        for i, (x, y) in enumerate(micro):
            with fabric.no_backward_sync(model, enabled=i < len(micro) - 1):
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) / len(micro)
                fabric.backward(loss)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["step"] += 1
        logs.append({"step": state["step"], "loss": loss.item() * len(micro),
                     "grad_norm": float(norm)})
        if state["step"] == 3:
            fabric.save(f"{a.out}/step-3", state)
    if fabric.global_rank == 0:
        for row in logs:
            print(json.dumps(row))
    return logs


if __name__ == "__main__":
    main()
