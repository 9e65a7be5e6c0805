"""Where a stage-3 step's time goes on one GPU, zeroshard beside FSDP2 (the speed part of
benchmarks/gpu_check.py, profiled).

Same model, batch and recipe as gpu_check's ``speed`` part (llama-1b, bf16, selective
checkpointing, stage 3 at world 1, eager): three warm-up steps, then two steps under
``torch.profiler`` (CPU and CUDA). Prints, per system, the step's wall time, the GPU's busy
time (kernels and copies) and the top operators by their own device time and by their
own CPU time; writes the tables and a gzipped Chrome trace of one step each under --out.

    python benchmarks/gpu_profile.py --out benchmarks/gpu-check-h200
    python benchmarks/gpu_profile.py --dry-run     # CPU, gpt2-tiny: keeps the script working
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import _batches, _loss, _sync, _world1, speed_model  # noqa: E402


def _step(model, optim, x) -> None:
    _loss(model, x).backward()
    optim.step()
    optim.zero_grad()


def profile(system: str, preset: str, mb: int, seq: int, dev, out: Path | None) -> str:
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from zeroshard.models import get_preset

    model, optim = speed_model(system, preset, dev)
    xs = _batches(get_preset(preset).vocab, 5, mb, seq, dev)
    for x in xs[:3]:
        _step(model, optim, x)
    _sync(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    walls = []
    with torch_profile(activities=acts) as prof:
        for x in xs[3:]:
            t = time.perf_counter()
            _step(model, optim, x)
            _sync(dev)
            walls.append(time.perf_counter() - t)
    events = prof.key_averages()
    dev_key = "self_device_time_total"
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]  # kernels and copies
    busy = sum(e.self_device_time_total for e in kernels) / 1e6 / len(walls)
    lines = [f"## {system}: {preset}, micro-batch {mb} x {seq}, steps {[round(w, 4) for w in walls]}"
             f" s; device kernels+copies {busy:.4f} s per step ({busy / min(walls):.0%} of the faster)"]
    if dev.type == "cuda":
        lines.append(events.table(sort_by=dev_key, row_limit=25, max_name_column_width=60))
    lines.append(events.table(sort_by="self_cpu_time_total", row_limit=20,
                              max_name_column_width=60))
    if out is not None:
        raw = out / f"trace-{system}.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(f"{raw}.gz", "wb") as g:
            shutil.copyfileobj(f, g)
        raw.unlink()
    del model, optim
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, gpt2-tiny")
    p.add_argument("--out", type=Path, default=None, help="folder for profile.txt + traces")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1" if args.dry_run else "8")
    dev = _world1(args)
    preset, mb, seq = ("gpt2-tiny", 2, 64) if args.dry_run else ("llama-1b", 4, 2048)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join(profile(s, preset, mb, seq, dev, args.out)
                       for s in ("zeroshard", "fsdp2"))
    print(text, flush=True)
    if args.out is not None:
        (args.out / "profile.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
