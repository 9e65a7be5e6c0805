"""Stages 0-1 keep their whole gradient buffers from step to step, as DDP keeps its buckets
and ZeroRedundancyOptimizer DDP's (reduction.py: ``Reducer.retire_grad``).

A new buffer each step cost a page fault per 4 KiB page of it, every step (gpt2-small:
~17,000 minor faults per step and rank, DDP 8). The cheap check follows the buffers'
storages over steps; the fault count itself is compared with DDP's and
ZeroRedundancyOptimizer's in fresh single-rank processes (each system alone, so one's
heap does not serve the other) whose allocator is made deterministic: with
``MALLOC_MMAP_THRESHOLD_`` fixed at 1 MiB, glibc maps every allocation from 1 MiB up
afresh and unmaps it when freed (a fixed threshold turns off its adaptive one, and with
it the heap trimming that made counts swing by thousands between runs), so each step's
faults are the pages of the large tensors it allocated: activations, autograd's and
AdamW's temporaries — the same for all four — plus any per-step buffer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch
from torch import nn

import zeroshard
from zeroshard.testing import run_ranks, sweep


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank))


def _buffers(rank: int, world: int, grid: list[dict]) -> list:
    def point(stage: int, **options) -> dict:
        model, optim = zeroshard.shard(_mlp(), torch.optim.AdamW, stage=stage, lr=1e-2,
                                       bucket_bytes=1024, **options)
        engine = zeroshard.api.engine_of(model)
        ptrs, held = [], None
        for step in range(4):
            model(_batch(rank, step)).square().mean().backward()
            ptrs.append([b.grad.data_ptr() if b.grad is not None else None
                         for b in engine.buckets])
            optim.step()
            if step == 2:  # the user keeps a gradient: its values must stay
                p = next(model.parameters())
                held = (p.grad, p.grad.clone())
            optim.zero_grad()
        kept = torch.equal(held[0], held[1])
        return {"ptrs": ptrs, "kept": kept, "buckets": len(engine.buckets)}

    return sweep(point, grid)


GRID = [{"stage": 0}, {"stage": 1}, {"stage": 1, "mixed_precision": "bf16"}, {"stage": 2}]


def test_gradient_buffers_persist_at_stages_0_and_1() -> None:
    for point, got in zip(GRID, run_ranks(_buffers, 2, GRID, timeout=120)[0]):
        ptrs = got["ptrs"]
        assert got["buckets"] > 1, point
        assert got["kept"], f"{point}: a .grad the user held was overwritten"
        if point["stage"] == 2:  # reduced into slices: no whole buffer outlives backward
            continue
        assert None not in ptrs[0], point
        # steps 1-2 reuse step 0's buffers; step 3 replaces the one a held .grad views
        # (under mixed precision .grad is the fp32 master gradient, not a view: none)
        assert ptrs[1] == ptrs[0] and ptrs[2] == ptrs[0], f"{point}: {ptrs}"
        changed = [i for i, (a, b) in enumerate(zip(ptrs[2], ptrs[3])) if a != b]
        assert len(changed) == (0 if "mixed_precision" in point else 1), f"{point}: {ptrs}"


_FAULTS = textwrap.dedent('''
    import json, resource, sys, tempfile, torch
    import torch.distributed as dist
    from torch import nn
    which = sys.argv[1]
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0,
                            world_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
    if which in ("ddp", "zro"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, gradient_as_bucket_view=True)
        if which == "zro":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), lr=1e-3,
                                          optimizer_class=torch.optim.AdamW)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        import zeroshard
        model, opt = zeroshard.shard(model, torch.optim.AdamW, stage=int(which[-1]), lr=1e-3)
    faults = []
    for i in range(9):
        x = torch.randn(4, 1024)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps(sorted(faults[3:])[3]))
''')


def _faults(which: str) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
           "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    out = subprocess.run([sys.executable, "-c", _FAULTS, which], env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_page_faults_per_step_at_most_ddps_and_zero_redundancy_optimizers() -> None:
    """Median minor faults per step after 3 warm-up steps; 16 MiB of gradients (4,096
    pages). Measured: DDP 12,300-12,304, ZRO 12,302-12,306, zs-s0 and zs-s1 12,325; with a
    new buffer each step (the previous engine) 16,425. The 64 pages (256 KiB) allowed hold
    the ~25 more that zeroshard's steps touch below the threshold (on the heap); a
    per-step allocation above it would be 256 pages or more."""
    got = {w: _faults(w) for w in ("ddp", "zs-s0", "zro", "zs-s1")}
    assert got["zs-s0"] <= got["ddp"] + 64, got
    assert got["zs-s1"] <= got["zro"] + 64, got
