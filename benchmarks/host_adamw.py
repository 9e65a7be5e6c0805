"""Host AdamW step on a 100M-element fp32 shard: torch's fused CPU kernel vs foreach=False.

ZeRO-Offload's bottleneck is the optimizer step on the host; its paper reports > 5x for
its CPU Adam over PyTorch's. Run: .venv/bin/python benchmarks/host_adamw.py [elements]
Interleaved (A B A B ...), median of 5 after 1 warm-up step each.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def main(n: int = 100_000_000) -> None:
    g = torch.randn(n)
    runs = {}
    for name, kw in (("foreach=False", {"foreach": False}), ("fused=True", {"fused": True})):
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = g
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, **kw)
        opt.step()  # warm-up: allocates the moments
        runs[name] = (opt, [])
    for _ in range(5):
        for opt, times in runs.values():
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)
    base = statistics.median(runs["foreach=False"][1])
    print(f"AdamW step, {n:,} fp32 elements, {torch.get_num_threads()} threads")
    for name, (_, times) in runs.items():
        med = statistics.median(times)
        print(f"  {name:14s} median {med * 1e3:8.1f} ms  speed-up x{base / med:.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000_000)
