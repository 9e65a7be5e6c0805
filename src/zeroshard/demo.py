"""``zeroshard demo``: a short sharded training run on local ranks, loss printed as it falls.

The smallest end-to-end use of the library: N ranks (gloo on CPU, NCCL on GPUs), the tiny
GPT preset on the synthetic language, ``zeroshard.shard`` at the chosen stage, and on
rank 0 the loss, per-rank model-state bytes and bytes on the wire per step.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

__all__ = ["DemoSettings", "add_arguments", "run"]


@dataclass(frozen=True, kw_only=True)
class DemoSettings:
    world_size: int = 2
    stage: int = 2
    steps: int = 60
    model: str = "gpt2-tiny"
    lr: float = 3e-3


def _rank_main(settings: DemoSettings) -> list[float]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import zeroshard
    from zeroshard.data import SyntheticLanguage, TokenLoader
    from zeroshard.models import build_model, get_preset

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    cfg = get_preset(settings.model)
    model = build_model(cfg, device=device)
    model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=settings.stage,
                                   lr=settings.lr)
    source = SyntheticLanguage(cfg.vocab, min(cfg.seq_len, 64), seed=0)
    loader = TokenLoader(source, global_batch=8 * world, rank=rank, world_size=world)
    ledger = zeroshard.engine_of(model).comm.ledger
    losses: list[float] = []
    if rank == 0:
        print(f"zeroshard demo: {settings.model} on {world} ranks "
              f"({'nccl' if cuda else 'gloo'}), ZeRO stage {settings.stage}; the loss "
              f"floor of the synthetic language is {source.entropy_bound():.2f}")
    t0 = time.perf_counter()
    for step in range(1, settings.steps + 1):
        x, y = (t.to(device) if device else t for t in next(loader))
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        optim.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
        if rank == 0 and (step % 10 == 0 or step == 1):
            wire = sum(r.logical_bytes for r in ledger.last_step()
                       if r.phase in ("forward", "backward", "step"))
            print(f"step {step:4d}  loss {loss.item():.3f}  "
                  f"comm {wire / 2**20:.2f} MiB/step  {time.perf_counter() - t0:.1f} s")
    dist.destroy_process_group()
    return losses


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2, help="local ranks (default 2)")
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--model", default="gpt2-tiny", help="a preset (default gpt2-tiny)")


def run(args: argparse.Namespace) -> int:
    from zeroshard.errors import UsageError
    from zeroshard.launch import run_ranks_local
    from zeroshard.models import get_preset

    if args.world_size < 1 or args.steps < 1:
        raise UsageError(f"--world-size {args.world_size} and --steps {args.steps} must be >= 1")
    try:
        get_preset(args.model)
    except ValueError as e:
        raise UsageError(str(e)) from None
    settings = DemoSettings(world_size=args.world_size, stage=args.stage, steps=args.steps,
                            model=args.model)
    losses = run_ranks_local(_rank_main, settings.world_size, settings, name="zeroshard-demo")
    if losses:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    return 0
