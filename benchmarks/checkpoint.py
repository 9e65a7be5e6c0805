"""Checkpoints at scale, measured (issue #64, item 4): save and load seconds, bytes written,
per-rank peak host RSS during save and load, and the training loop's stall during an
asynchronous save — zeroshard stage 3 beside FSDP2 + DCP (sync and async, default sharded
options, DCP's FileSystemWriter) and a DDP script's rank-0 ``torch.save``.

    python benchmarks/checkpoint.py                       # every system, table to stdout
    python benchmarks/checkpoint.py --systems zs,fsdp2 --world 4 --json out.json

Each system runs in processes of its own (torchrun, gloo, one thread per rank), so no
system's allocations or patches reach another's figures. Definitions (docs/checkpoints.md):

* save / load seconds: the slowest rank's wall time of the call (a synchronous save
  returns once committed; an asynchronous one is timed until its ``wait()``/``result()``);
* blocked: the slowest rank's wall time until the save call returns (the training
  thread's share: all of a synchronous save, the staging copy of an asynchronous one);
* peak: the RSS high-water mark during the call minus the RSS just before it (VmHWM reset
  through /proc/self/clear_refs), per rank; for asynchronous saves the largest repeat's
  (zeroshard keeps its staging copy for the next save: the first one allocates it);
* stall: wall time of the K steps spanning a save (the call included; an asynchronous
  save's final wait not) minus that of the K steps just before it without a save, measured
  on a second save of the same repeat (the first one is the one timed alone, for the peak);
* medians of ``--rounds`` x ``--repeats`` (default 2 x 2) of each: each round runs every
  system once, in turn, so the machine's drift over minutes reaches them alike.

The model is GPT-2 medium's shape (24 layers, hidden 1024, vocab 50304: 355M parameters;
``--layers``/``--hidden`` to change), AdamW, fp32, micro-batch 1 x 16 tokens (the step's
time is not what is measured).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SYSTEMS = ("zs", "fsdp2", "ddp")


def _model(layers: int, hidden: int):
    from zeroshard.models import GPT2Config, build_model

    cfg = GPT2Config(n_layers=layers, hidden=hidden, n_heads=hidden // 64, seq_len=64,
                     vocab=50304)
    return build_model(cfg, seed=0)


def _build(system: str, layers: int, hidden: int):
    import torch

    model = _model(layers, hidden)
    if system == "zs":
        import zeroshard

        return zeroshard.shard(model, torch.optim.AdamW, stage=3, lr=1e-4, timeout=600)
    if system == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model, optim, rank: int) -> None:
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 50304, (1, 16), generator=g)
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    optim.step()
    optim.zero_grad()


def _hwm_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)


class _Save:
    """One system's save and load calls."""

    def __init__(self, system: str, model, optim, rank: int) -> None:
        self.system, self.model, self.optim, self.rank = system, model, optim, rank
        self.group = None

    def save(self, path: str, async_save: bool = False):
        import torch
        import torch.distributed as dist

        if self.system == "zs":
            from zeroshard.state import save_checkpoint

            return save_checkpoint(path, self.model, self.optim, async_save=async_save)
        if self.system == "fsdp2":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(self.model, self.optim)
            state = {"model": msd, "optim": osd}
            if not async_save:
                return dcp.save(state, checkpoint_id=path)
            if self.group is None:
                self.group = dist.new_group(backend="gloo")
            return dcp.async_save(state, checkpoint_id=path, process_group=self.group)
        if self.rank == 0:  # DDP: rank 0 saves whole state dicts with torch.save
            os.makedirs(path, exist_ok=True)
            torch.save({"model": self.model.module.state_dict(),
                        "optim": self.optim.state_dict()}, f"{path}/checkpoint.pt")
        dist.barrier()
        return None

    def load(self, path: str, model, optim, verify: bool = True) -> None:
        import torch

        if self.system == "zs":
            from zeroshard.state import load_checkpoint

            load_checkpoint(path, model, optim, verify=verify)
        elif self.system == "fsdp2":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            msd, osd = get_state_dict(model, optim)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, optim, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        else:  # every rank reads rank 0's file, as a DDP script does
            sd = torch.load(f"{path}/checkpoint.pt", map_location="cpu", weights_only=True)
            model.module.load_state_dict(sd["model"])
            optim.load_state_dict(sd["optim"])


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _per_rank(value: int) -> list[int]:
    import torch
    import torch.distributed as dist

    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([value], dtype=torch.int64))
    return [int(t) for t in out]


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optim = _build(a.system, a.layers, a.hidden)
    psi = sum(p.numel() for p in model.parameters())
    for _ in range(2):  # warm-up: optimizer state exists
        _step(model, optim, rank)
    times = []
    for _ in range(a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        _step(model, optim, rank)
        times.append(_slowest(time.perf_counter() - t0))
    median_step = statistics.median(times)
    saver = _Save(a.system, model, optim, rank)
    root = Path(a.root)
    out: dict[str, Any] = {"system": a.system, "world": dist.get_world_size(), "psi": psi,
                           "median_step_s": median_step, "save": [], "async": [], "load": []}
    modes = ["sync", "async"] if a.system != "ddp" else ["sync"]
    for mode in modes:
        for r in range(a.repeats):
            # 1. the save alone: its time until committed, bytes, peak RSS increase
            path = str(root / f"{mode}-{r}")
            _trim()
            dist.barrier()
            before = _rss()
            _hwm_reset()
            t0 = time.perf_counter()
            handle = saver.save(path, async_save=mode == "async")
            call = time.perf_counter() - t0
            if mode == "async":
                (handle.wait if hasattr(handle, "wait") else handle.result)()
            total = time.perf_counter() - t0
            peak = _per_rank(_hwm() - before)
            dist.barrier()
            written = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
            # 2. the loop around a save: K steps spanning it (the call included), against
            # the K steps just before it without a save (paired: the machine's drift
            # between repeats cancels; a median step from the start of the run did not
            # resolve a 1 s stall in 12 s steps)
            stall_path = str(root / f"{mode}-{r}-stall")
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(a.k):
                _step(model, optim, rank)
            plain = _slowest(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            handle = saver.save(stall_path, async_save=mode == "async")
            for _ in range(a.k):
                _step(model, optim, rank)
            span = time.perf_counter() - t0
            if mode == "async":
                (handle.wait if hasattr(handle, "wait") else handle.result)()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(stall_path, ignore_errors=True)
                if (mode, r) != ("sync", 0):  # the loads read sync-0
                    shutil.rmtree(path, ignore_errors=True)
            out["save" if mode == "sync" else "async"].append({
                "call_s": _slowest(call), "seconds": _slowest(total),
                "stall_s": _slowest(span) - plain, "plain_s": plain, "peak_bytes": peak,
                "bytes_written": written})
    fresh, fresh_optim = _build(a.system, a.layers, a.hidden)
    _step(fresh, fresh_optim, rank)  # its optimizer state exists, as a resumed run's would
    # zeroshard checks every file's CRC before reading (verify=True); verify=False checks
    # sizes only, as DCP does
    for key, verify in (("load", True), ("load_unverified", False)):
        if key == "load_unverified" and a.system != "zs":
            continue
        out[key] = []
        for _ in range(a.repeats):
            _trim()
            dist.barrier()
            before = _rss()
            _hwm_reset()
            t0 = time.perf_counter()
            saver.load(str(root / "sync-0"), fresh, fresh_optim, verify=verify)
            out[key].append({"seconds": _slowest(time.perf_counter() - t0),
                             "peak_bytes": _per_rank(_hwm() - before)})
    if rank == 0:
        Path(a.json).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _med_peak(rows: list[dict]) -> float:
    return statistics.median(max(r["peak_bytes"]) for r in rows)


def _save_peak(mode: str, saves: list[dict]) -> float:
    """An asynchronous save's staging copy may be kept for the next one (zeroshard's
    keep_staging, the default): only the first save allocates it, so its peak is the
    largest of the repeats', not their median — the memory is held, not freed."""
    if mode == "async":
        return max(max(r["peak_bytes"]) for r in saves)
    return _med_peak(saves)


def table(results: list[dict]) -> str:
    mib = 2**20
    counts = ", ".join(f"{r['system']} {len(r['save'])}" for r in results)
    lines = [f"AdamW fp32; medians of the repeats ({counts}); peak = max over "
             "ranks of the RSS increase during the call (async: the largest repeat's)",
             f"{'system':<22} {'params':>7} {'world':>5} {'save s':>8} {'blocked':>8} "
             f"{'stall s':>8} {'load s':>8} "
             f"{'MiB written':>12} {'save peak MiB':>14} {'load peak MiB':>14} {'step s':>7}"]
    for r in results:
        rows = [("sync", r["save"])] + ([("async", r["async"])] if r["async"] else [])
        for mode, saves in rows:
            lines.append(
                f"{r['system'] + ' ' + mode:<22} {r['psi'] / 1e6:>6.0f}M {r['world']:>5} "
                f"{_med(saves, 'seconds'):>8.2f} {_med(saves, 'call_s'):>8.2f} "
                f"{_med(saves, 'stall_s'):>8.2f} "
                f"{_med(r['load'], 'seconds') if mode == 'sync' else float('nan'):>8.2f} "
                f"{_med(saves, 'bytes_written') / mib:>12,.0f} {_save_peak(mode, saves) / mib:>14,.0f} "
                f"{_med_peak(r['load']) / mib if mode == 'sync' else float('nan'):>14,.0f} "
                f"{r['median_step_s']:>7.2f}")
        if r.get("load_unverified"):
            lines.append(f"{r['system'] + ' load, verify=False':<22} {r['psi'] / 1e6:>6.0f}M "
                         f"{r['world']:>5} {'':>8} {'':>8} {'':>8} "
                         f"{_med(r['load_unverified'], 'seconds'):>8.2f} {'':>12} {'':>14} "
                         f"{_med_peak(r['load_unverified']) / mib:>14,.0f}")
    return "\n".join(lines)


def _merge(results: list[dict], kept: int, new: dict) -> None:
    """A round's figures joined to the same system's earlier rounds (their repeats
    together; the median step over every round's steps), or a new row."""
    row = next((r for r in results[kept:] if r["system"] == new["system"]), None)
    if row is None:
        results.append({**new, "steps_s": [new["median_step_s"]]})
        return
    for key in ("save", "async", "load", "load_unverified"):
        if new.get(key):
            row.setdefault(key, []).extend(new[key])
    row["steps_s"].append(new["median_step_s"])
    row["median_step_s"] = statistics.median(row["steps_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", dest="system", default=None, help=argparse.SUPPRESS)
    p.add_argument("--systems", default="zs,fsdp2,ddp")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--ddp-world", type=int, default=2,
                   help="DDP keeps the whole state on every rank: 4 x 355M does not fit 23 GiB")
    p.add_argument("--ddp-layers", type=int, default=None,
                   help="a smaller model for DDP (labelled in the table)")
    p.add_argument("--ddp-hidden", type=int, default=768)
    p.add_argument("--keep", default="",
                   help="systems whose figures in --json are kept (not run again)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2, help="per round")
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of each system, alternating between the systems")
    p.add_argument("--steps", type=int, default=3, help="steps timed without a save")
    p.add_argument("--k", type=int, default=1, help="steps spanning a save (stall)")
    p.add_argument("--root", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.system is not None:
        return worker(a)
    done = json.loads(Path(a.json).read_text()) if a.json and Path(a.json).exists() else []
    results = [r for r in done if a.keep and r["system"] in a.keep.split(",")]
    kept = len(results)
    # rounds alternate the systems (zs, fsdp2, zs, fsdp2, ...): this machine drifts by
    # tens of percent over minutes, and a system run after the other would carry it
    for system in a.systems.split(",") * a.rounds:
        root = tempfile.mkdtemp(prefix=f"zs-ckpt-bench-{system}-")
        out = Path(root) / "result.json"
        world = a.ddp_world if system == "ddp" else a.world
        layers, hidden = ((a.ddp_layers, a.ddp_hidden) if system == "ddp" and a.ddp_layers
                          else (a.layers, a.hidden))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(world), __file__, "--worker", system, "--root", root,
               "--json", str(out), "--layers", str(layers), "--hidden", str(hidden),
               "--repeats", str(a.repeats), "--steps", str(a.steps), "--k", str(a.k)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env)
        _merge(results, kept, json.loads(out.read_text()))
        shutil.rmtree(root, ignore_errors=True)
        if a.json:  # each system's figures as soon as it is done
            Path(a.json).write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
