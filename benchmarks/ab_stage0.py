"""Stage 0 vs torch DDP, step by step interleaved in the same processes (issue #3's
"stage 0 within 3% of DDP"). Both train the same gpt2-small (fp32, AdamW, world 2, gloo)
on the same batches; steps alternate A B A B ..., so machine noise hits both alike.

Run: .venv/bin/python benchmarks/ab_stage0.py [steps] [stage] [chunk]
Prints the median step time of each, the ratio of medians, and the median of per-pair
ratios; also the optimizer step alone. ``chunk`` overrides the optimizer chunk size
(engine/chunks.py; e.g. 1073741824 for one chunk per master, as before chunking).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F


def _rank(rank: int, world: int, steps: int, stage: int, chunk: int | None) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zeroshard
    import zeroshard.engine.chunks as chunks
    from zeroshard.data import SyntheticLanguage, TokenLoader
    from zeroshard.models import build_model, get_preset

    if chunk is not None:
        chunks.CHUNK = chunk
    cfg = get_preset("gpt2-small")
    ddp = DDP(build_model(cfg, seed=0))
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    zs, zs_opt = zeroshard.shard(build_model(cfg, seed=0), torch.optim.AdamW, stage=stage,
                                 lr=1e-4)
    data = TokenLoader(SyntheticLanguage(cfg.vocab, 128, seed=0), global_batch=2 * world,
                       rank=rank, world_size=world)
    times: dict[str, list[float]] = {"ddp": [], "zs": [], "ddp_opt": [], "zs_opt": []}

    def step(name: str, model, opt, x, y) -> None:
        t0 = time.perf_counter()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        times[name].append(t2 - t0)
        times[name + "_opt"].append(t2 - t1)

    for i in range(steps + 2):
        x, y = next(data)
        for name, model, opt in (("ddp", ddp, ddp_opt), ("zs", zs, zs_opt))[:: 1 - 2 * (i % 2)]:
            step(name, model, opt, x, y)
    return {k: v[2:] for k, v in times.items()}  # drop the warm-up steps


def main(steps: int = 30, stage: int = 0, chunk: int | None = None) -> None:
    from zeroshard.testing import run_ranks

    t = run_ranks(_rank, 2, steps, stage, chunk, timeout=1800)[0]
    med = {k: statistics.median(v) for k, v in t.items()}
    pairs = statistics.median(d / z for d, z in zip(t["ddp"], t["zs"]))
    print(f"gpt2-small fp32, world 2, {steps} interleaved steps each; zeroshard stage {stage}"
          + (f", optimizer chunk {chunk}" if chunk else ""))
    print(f"  step      ddp {med['ddp'] * 1e3:7.1f} ms   zeroshard {med['zs'] * 1e3:7.1f} ms   "
          f"speed zs/ddp {med['ddp'] / med['zs']:.3f} (median of pair ratios {pairs:.3f})")
    print(f"  opt.step  ddp {med['ddp_opt'] * 1e3:7.1f} ms   zeroshard {med['zs_opt'] * 1e3:7.1f} ms")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
