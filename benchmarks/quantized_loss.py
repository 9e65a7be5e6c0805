"""Loss over a long run with quantised communication (issue #61's loss goal).

Trains one GPT at world 4 (2 logical nodes x 2, gloo) in bf16 with AdamW for ``--steps``
steps on the same global batches: DDP (torch's, under bf16 autocast) with two seeds for
the run-to-run gap, zeroshard stage 3, and stage 3 with int8 / fp8 weight all-gathers
(qwZ), int8 / int4 two-hop gradient reduce-scatters (qgZ, with and without error
feedback) and all three of ZeRO++'s with the secondary shard (hpZ). Prints each final loss (mean of the last 20 steps)
and its gap to DDP's, beside DDP-vs-DDP; writes the table and a JSON.

    OMP_NUM_THREADS=1 python benchmarks/quantized_loss.py --steps 300 \\
        --out benchmarks/quantized_loss.txt --json benchmarks/quantized_loss.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zeroshard
from zeroshard.data import SyntheticLanguage, TokenLoader
from zeroshard.models import build_model, get_preset
from zeroshard.testing import run_ranks

SYSTEMS = {
    "ddp": {},
    "zs-s3": {"stage": 3},
    "zs-s3-w8": {"stage": 3, "quantize_weights": "int8"},
    "zs-s3-wf8": {"stage": 3, "quantize_weights": "fp8"},
    "zs-s3-hpz2-w8": {"stage": 3, "quantize_weights": "int8", "reshard_after_forward": 2},
    "zs-s3-w8-g8": {"stage": 3, "quantize_weights": "int8", "quantize_grads": "int8",
                    "grad_error_feedback": True},
    "zs-s3-g4": {"stage": 3, "quantize_grads": "int4", "grad_error_feedback": True},
    "zs-s3-g4-no-feedback": {"stage": 3, "quantize_grads": "int4", "grad_error_feedback": False},
    "zs-s3-hpz2-w8-g4": {"stage": 3, "quantize_weights": "int8", "quantize_grads": "int4",
                         "reshard_after_forward": 2, "grad_error_feedback": True},
}


def _train(rank: int, world: int, system: str, seed: int, a: dict) -> dict:
    cfg = get_preset(a["model"])
    model = build_model(a["model"], seed=seed)
    data = TokenLoader(SyntheticLanguage(cfg.vocab, cfg.seq_len, seed=1),
                       global_batch=a["batch"] * world, rank=rank, world_size=world)
    if system == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=a["lr"])
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    else:
        model, opt = zeroshard.shard(model, torch.optim.AdamW, node_size=2,
                                     mixed_precision="bf16", lr=a["lr"], **SYSTEMS[system])
        autocast = torch.autocast("cpu", enabled=False)
    losses, inter = [], 0
    t0 = time.perf_counter()
    for _ in range(a["steps"]):
        x, y = next(data)
        with autocast:
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    if system != "ddp":
        ledger = zeroshard.engine_of(model).comm.ledger
        inter = ledger.totals(ledger.last_step())["inter_wire_bytes"]
    return {"losses": losses, "inter_bytes_last_step": inter,
            "seconds": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--out", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    args = vars(a)
    runs = {}
    for system in a.systems.split(","):
        for seed in ((0, 1) if system == "ddp" else (0,)):
            got = run_ranks(_train, 4, system, seed, args, timeout=3600)[0]
            runs[f"{system}" + (f" seed {seed}" if system == "ddp" else "")] = got
            print(f"{system} seed {seed}: final {statistics.fmean(got['losses'][-20:]):.4f} "
                  f"({got['seconds']:.0f} s)", flush=True)
    final = {k: statistics.fmean(v["losses"][-20:]) for k, v in runs.items()}
    ref = final["ddp seed 0"]
    first = statistics.fmean(runs["ddp seed 0"]["losses"][:5])
    lines = [f"{a.model}, world 4 (2 logical nodes x 2, gloo), bf16, AdamW lr {a.lr}, "
             f"{a.steps} steps of {4 * a.batch} sequences; final = mean loss of the last 20 "
             f"steps; DDP's loss fell {100 * (1 - ref / first):.0f}% (first 5 steps "
             f"{first:.4f})", "",
             f"{'run':<22} {'final loss':>10} {'vs ddp seed 0':>14} {'inter MiB/step':>15}"]
    for k, v in final.items():
        inter = runs[k]["inter_bytes_last_step"]
        lines.append(f"{k:<22} {v:>10.4f} {100 * (v - ref) / ref:>+13.2f}% "
                     f"{inter / 2**20 if inter else float('nan'):>15.2f}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": args, "final": final, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
