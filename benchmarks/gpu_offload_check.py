"""GPU check for ZeRO-Offload (issue #10): a model that does not fit on the device trains
with offload; tokens/s, device memory, and the tracker's device vs host split.

One process, one GPU, NCCL. The device is capped (``--cap-gb``, with
``torch.cuda.set_per_process_memory_fraction``) so that the model's 16 bytes per
parameter of mixed-precision AdamW state do not fit, while its host copy still fits the
host's RAM (offload needs ~20 bytes per parameter there: docs/offload.md). Each
configuration runs in its own subprocess, so an out-of-memory one cannot poison the rest:

    stage 3, no offload          expected: out of memory under the cap
    stage 2, "optimizer"         ZeRO-Offload's configuration
    stage 3, "optimizer"
    stage 3, "optimizer+params"  weights on the host too

Run on a machine with a GPU (about 3-5 minutes for llama-1b):

    .venv/bin/python benchmarks/gpu_offload_check.py --out results/
    .venv/bin/python benchmarks/gpu_offload_check.py --dry-run   # CPU, tiny, forced copies

``--dry-run`` runs the same code on CPU with gloo, a tiny model and the offload copy path
forced (``engine._FORCE_HOST_COPIES``), to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CONFIGS = [
    {"stage": 3, "offload": None},
    {"stage": 2, "offload": "optimizer"},
    {"stage": 3, "offload": "optimizer"},
    {"stage": 3, "offload": "optimizer+params"},
]
PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one(args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    """One configuration, in this (child) process."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import zeroshard
    import zeroshard.engine.engine as engine_mod
    from zeroshard.checkpointing import apply_checkpointing
    from zeroshard.models import build_model, get_preset

    cuda = torch.cuda.is_available() and not args.dry_run
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0",
                      WORLD_SIZE="1")
    if cuda:
        torch.cuda.set_device(dev)
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb * 1e9 / total), dev)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    engine_mod._FORCE_HOST_COPIES = args.dry_run and cfg["offload"] is not None
    out: dict[str, Any] = {**cfg, "model": args.model, "device": str(dev)}
    try:
        model = build_model(args.model, device="meta" if cfg["stage"] == 3 else dev)
        apply_checkpointing(model, "full")  # activations are not what this check is about
        model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=cfg["stage"],
                                       mixed_precision="bf16", offload=cfg["offload"],
                                       lr=1e-4, weight_decay=0.1, device=dev)
        vocab = get_preset(args.model).vocab
        gen = torch.Generator().manual_seed(0)

        def step() -> float:
            x = torch.randint(0, vocab, (args.micro_batch, args.seq + 1), generator=gen).to(dev)
            t = time.perf_counter()
            logits = model(x[:, :-1])
            F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).backward()
            optim.clip_grad_norm_(1.0)
            optim.step()
            optim.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - t

        times = [step() for _ in range(args.steps)]
        med = statistics.median(times[2:] or times)
        tokens = args.micro_batch * args.seq
        cfg_model = get_preset(args.model)
        out.update(status="ok", step_s=times, median_step_s=med, tokens_per_s=tokens / med,
                   mfu=tokens / med * cfg_model.flops_per_token(args.seq) / PEAK_BF16_FLOPS,
                   offloaded=zeroshard.engine_of(model).offload)
        if cuda:
            out["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(dev)
            out["cuda_max_memory_reserved"] = torch.cuda.max_memory_reserved(dev)
        tracker = zeroshard.memory_tracker(model, optim)  # one more step, tracked
        with tracker:
            step()
        rep = tracker.report()
        out["tracker"] = {w: rep[w] for w in ("device", "host")}
    except torch.OutOfMemoryError as e:  # the expected outcome without offload
        out.update(status="oom", error=str(e).splitlines()[0])
    finally:
        dist.destroy_process_group()
    return out


def _table(results: list[dict[str, Any]], cap_gb: float) -> str:
    mib = 2**20
    lines = [f"device capped at {cap_gb:g} GB; bf16 AdamW, full activation checkpointing; "
             "memory in MiB",
             f"{'stage':>5} {'offload':<17} {'status':<6} {'tokens/s':>9} {'MFU':>7} "
             f"{'dev max':>9} {'dev peak':>9} {'host pk':>9}  device peak by category"]
    for r in results:
        if r.get("status") != "ok":
            lines.append(f"{r['stage']:>5} {r['offload'] or '-':<17} {r.get('status', '?'):<6} "
                         f"{r.get('error', '')[:90]}")
            continue
        t = r["tracker"]
        cats = ", ".join(f"{k} {v / mib:.1f}" for k, v in t["device"]["peak"].items() if v)
        lines.append(
            f"{r['stage']:>5} {r['offload'] or '-':<17} ok     {r['tokens_per_s']:>9,.0f} "
            f"{r['mfu']:>7.2%} {r.get('cuda_max_memory_allocated', 0) / mib:>9.1f} "
            f"{t['device']['peak_total'] / mib:>9.1f} {t['host']['peak_total'] / mib:>9.1f}  "
            f"{cats}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--cap-gb", type=float, default=16.0, help="device memory cap (10^9 B)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per configuration")
    p.add_argument("--out", type=Path, help="folder for results.json and results.txt")
    p.add_argument("--dry-run", action="store_true", help="CPU, gpt2-tiny, forced copies")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(_one(args, json.loads(args.one))), flush=True)
        return
    if args.dry_run:
        args.model, args.seq, args.micro_batch, args.steps = "gpt2-tiny", 32, 2, 3
    results = []
    for cfg in CONFIGS:
        cmd = [sys.executable, __file__, "--one", json.dumps(cfg), "--port", str(_free_port()),
               "--model", args.model, "--cap-gb", str(args.cap_gb), "--steps", str(args.steps),
               "--seq", str(args.seq), "--micro-batch", str(args.micro_batch),
               *(["--dry-run"] if args.dry_run else [])]
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            r = json.loads(found[-1][7:]) if found else {
                **cfg, "status": f"exit {proc.returncode}", "error": proc.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            r = {**cfg, "status": "timeout", "error": f"over {args.timeout:g} s"}
        r["wall_s"] = time.perf_counter() - t
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("step_s", "tracker")}),
              flush=True)
    text = _table(results, args.cap_gb)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        (args.out / "results.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
