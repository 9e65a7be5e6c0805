"""Two (or more) training configurations, step by step interleaved in the same processes.

Our machines vary by ±30% over minutes, so only interleaved comparisons mean anything:
every configuration trains the same model on the same batches and the order of the
configurations alternates each step (A B, B A, ...), so noise hits all alike.

Run: .venv/bin/python benchmarks/ab.py [--steps 20] [--model gpt2-small] [--seq 128]
         [--world 2] SPEC SPEC [SPEC ...]

A SPEC is ``ddp``, ``zro`` (DDP + ZeroRedundancyOptimizer), ``fsdp2`` (per-block
fully_shard, resharding after forward) or
``zs<stage>`` with zeroshard options after ``+``, e.g. ``zs3``,
``zs3+check_collectives=0``, ``zs2+mixed_precision=bf16``; ``@block`` or ``@whole``
compiles it (each block in place, or the whole model) with inductor, ``@block:aot_eager``
with another backend. Prints the median step time
of each, and each one's speed relative to the first (ratio of medians, and the median of
per-step ratios).

``old:SPEC`` builds SPEC with an older zeroshard vendored as the package ``zeroshard_old``
(to compare an engine before and after a change in the same processes): check the old
commit out (``git worktree add /tmp/wt_before REV``), copy its ``src/zeroshard`` to
``/tmp/oldpkg/zeroshard_old``, rename ``zeroshard`` to ``zeroshard_old`` in its import
lines (sed over its files) and run with ``PYTHONPATH=/tmp/oldpkg``. Each SPEC that also
ran as ``old:SPEC`` is then compared with it: wall-clock and CPU-time
(``time.process_time``, this rank's threads) per-step ratios; on a loaded machine the CPU
time is the steadier of the two.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def _value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(v, v)


def _compile(model, blocks, how: str | None):
    if how is None:
        return model
    how, _, backend = how.partition(":")
    backend = backend or "inductor"
    if how == "block":
        for b in blocks:
            b.compile(backend=backend)
        return model
    return torch.compile(model, backend=backend)


def _build(spec: str, cfg, rank: int):
    spec, _, how = spec.partition("@")
    model, opt = _build_eager(spec, cfg, rank)
    blocks = (model.module if hasattr(model, "module") else model).blocks
    return _compile(model, blocks, how or None), opt


def _build_eager(spec: str, cfg, rank: int):
    import importlib

    import torch.distributed as dist

    old = spec.startswith("old:")
    spec = spec.removeprefix("old:")
    zeroshard = importlib.import_module("zeroshard_old" if old else "zeroshard")
    build_model = importlib.import_module(zeroshard.__name__ + ".models").build_model

    model = build_model(cfg, seed=0)  # a preset name: either package builds it
    if spec in ("ddp", "zro"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        params = list(model.parameters())
        model = DDP(model)
        if spec == "zro":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return model, ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW,
                                                  lr=1e-4)
        return model, torch.optim.AdamW(params, lr=1e-4)
    if spec == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    if not spec.startswith("zs"):
        raise SystemExit(f"unknown spec {spec!r}: use ddp, zro, fsdp2 or "
                         "zs<stage>[+opt=value...]")
    stage, *opts = spec[2:].split("+")
    options = {k: _value(v) for k, v in (o.split("=", 1) for o in opts)}
    if "check_collectives" in options:
        options["check_collectives"] = bool(options["check_collectives"])
    return zeroshard.shard(model, torch.optim.AdamW, stage=int(stage), lr=1e-4, **options)


def _rank(rank: int, world: int, specs: list[str], model: str, seq: int, steps: int) -> dict:
    from zeroshard.data import SyntheticLanguage, TokenLoader
    from zeroshard.models import get_preset

    cfg = get_preset(model)
    runs = [(s, *_build(s, model, rank)) for s in specs]
    data = TokenLoader(SyntheticLanguage(cfg.vocab, seq, seed=0), global_batch=2 * world,
                       rank=rank, world_size=world)
    times: dict[str, list[float]] = {s: [] for s in specs}
    cpu: dict[str, list[float]] = {s: [] for s in specs}  # this rank's CPU seconds
    for i in range(steps + 2):
        x, y = next(data)
        order = runs if i % 2 == 0 else runs[::-1]
        for name, m, opt in order:
            t0, c0 = time.perf_counter(), time.process_time()
            F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    out = {k: v[2:] for k, v in times.items()}  # drop the warm-up steps
    out.update({"cpu:" + k: v[2:] for k, v in cpu.items()})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("specs", nargs="+")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--world", type=int, default=2)
    a = p.parse_args()
    from zeroshard.testing import run_ranks

    t = run_ranks(_rank, a.world, a.specs, a.model, a.seq, a.steps, timeout=3600)[0]
    base = a.specs[0]
    print(f"{a.model}, seq {a.seq}, world {a.world}, fp32 AdamW, {a.steps} interleaved "
          f"steps each (rank 0's step times)")
    for s in a.specs:
        med = statistics.median(t[s])
        ratio = statistics.median(t[s]) / statistics.median(t[base])
        pairs = statistics.median(x / y for x, y in zip(t[s], t[base]))
        print(f"  {s:<28} {med * 1e3:8.1f} ms   step time / {base}: {ratio:.3f} "
              f"(median of per-step ratios {pairs:.3f})")
    for s in a.specs:  # each configuration against its old engine, if both ran
        old = "old:" + s
        if old in t:
            pairs = statistics.median(x / y for x, y in zip(t[s], t[old]))
            cpus = statistics.median(x / y for x, y in zip(t["cpu:" + s], t["cpu:" + old]))
            print(f"  {s} / {old}: ratio of medians "
                  f"{statistics.median(t[s]) / statistics.median(t[old]):.3f}, "
                  f"median of per-step ratios {pairs:.3f} (wall), {cpus:.3f} (CPU time)")


if __name__ == "__main__":
    main()
