"""``zeroshard calibrate``: measure this machine for the time model (docs/planning.md)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--model", default="gpt2-small",
      help="preset whose matrix-product and attention shapes are timed exactly "
           "(default gpt2-small; other shapes are read from a grid by their FLOPs)")
    a("--world-size", type=int, default=2,
      help="local ranks to start (default 2); under torchrun, its world")
    a("--micro-batch", type=int, default=2, help="sequences per rank per step (default 2)")
    a("--seq", type=int, default=128, help="sequence length (default 128)")
    a("--mixed-precision", choices=["bf16", "fp16"], default=None,
      help="16-bit compute (default fp32): the dtype the products are timed in")
    a("--out", required=True, metavar="PATH", help="the JSON profile to write")
    a("--quick", action="store_true", help="fewer sizes and repeats (a rough profile)")


def _rank(probes: dict[str, tuple], quick: bool) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from zeroshard.timing.calibrate import calibrate

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if torch.cuda.is_available():
        import os

        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    prof = calibrate(**probes, device=device, quick=quick)
    rank = dist.get_rank()
    if own:
        dist.destroy_process_group()
    return prof.to_dict() if rank == 0 else None


def probes_of(model: str, world: int, micro_batch: int, seq: int,
              mixed_precision: str | None) -> dict[str, tuple]:
    """What a step of ``model`` runs (stage 0's and 3's traces: checkpointing repeats
    shapes, it adds none; stages 1-2's buckets are stage 0's)."""
    import torch

    from zeroshard.memory.traced import trace_step
    from zeroshard.timing.calibrate import probes

    backend = "native" if torch.cuda.is_available() else "gloo"
    return probes(trace_step(model, world_size=world, stage=stage,
                             mixed_precision=mixed_precision, micro_batch=micro_batch,
                             seq_len=seq, record_ops=True, collectives=backend)
                  for stage in (0, 1, 2, 3))


def run(args: argparse.Namespace) -> int:
    from zeroshard.launch import run_ranks_local, under_torchrun
    from zeroshard.timing.profile import Profile

    for name in ("world_size", "micro_batch", "seq"):
        v = getattr(args, name)
        if v < 1:
            print(f"zeroshard calibrate: --{name.replace('_', '-')} {v} must be >= 1",
                  file=sys.stderr)
            return 2
    start = time.perf_counter()
    try:
        found = probes_of(args.model, args.world_size, args.micro_batch, args.seq,
                          args.mixed_precision)
    except ValueError as exc:
        print(f"zeroshard calibrate: {exc}", file=sys.stderr)
        return 2
    world = None if under_torchrun() else args.world_size
    d = run_ranks_local(_rank, world or 1, found, args.quick, name="zeroshard-calibrate")
    if d is None:  # a torchrun rank other than 0
        return 0
    prof = Profile(**d)
    prof.save(args.out)
    print(summary(prof))
    print(f"wrote {args.out} ({time.perf_counter() - start:.0f} s)")
    return 0


def summary(prof: Any) -> str:
    """A few lines: what the profile says about this machine."""
    best = max(prof.gemm, key=lambda r: 2 * r[0] * r[1] * r[2] * r[3] / r[7])
    rate = 2 * best[0] * best[1] * best[2] * best[3] / best[7] / 1e9
    copy = prof.memory["copy"][-1]
    lines = [f"calibrated {prof.backend} world {prof.world_size}, {prof.threads} thread(s) per "
             f"rank, {prof.machine['device']} ({prof.machine['host_cpu']}), torch "
             f"{prof.machine['torch']}: {prof.wall_s:.1f} s",
             f"  matrix products: {len(prof.gemm)} shapes, up to {rate:,.0f} GFLOP/s per rank",
             f"  copy {copy[0] / copy[1] / 1e9:.1f} GB/s at {copy[0] / 2**20:.0f} MiB; first "
             f"touch {prof.first_touch_s_per_byte * 4096 * 1e6:.2f} us per 4 KiB page",
             f"  AdamW {prof.optimizer_s_per_element['AdamW'] * 1e9:.2f} ns per element"]
    for op, by in prof.collectives.items():
        for g, pts in by.items():
            b, s = pts[-1]
            lines.append(f"  {op} over {g}: {b / s / 1e9:.2f} GB/s at {b / 2**20:.0f} MiB, "
                         f"{pts[0][1] * 1e3:.2f} ms at {pts[0][0] / 2**10:.0f} KiB")
    if prof.collectives:
        lines.append(f"  compute beside a collective hides {100 * prof.overlap:.0f}% of it")
    return "\n".join(lines)
