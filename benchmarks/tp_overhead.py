"""Where a tensor-parallel step's time goes: FSDP2 + TP, zeroshard stage 3 + TP and the
same model under TP alone (no data parallelism), interleaved step by step on 4 CPU ranks
(dp 2 x tp 2, llama-small, 4 sequences per tp group x seq 128). Prints two ranks' median
forward / backward / optimizer-step milliseconds (benchmarks/tp-results.txt).

    .venv/bin/python benchmarks/tp_overhead.py
"""

from __future__ import annotations

import statistics
import time

import torch

from zeroshard.testing import run_ranks

STEPS, WARMUP = 6, 2


def _systems(mesh) -> dict:
    from torch.distributed.fsdp import fully_shard

    import zeroshard
    from zeroshard.models import build_model, get_preset, parallelize_llama

    out = {}
    for name in ("fsdp2", "zeroshard", "tp only"):
        model = build_model(get_preset("llama-small"))
        parallelize_llama(model, mesh["tp"])
        if name == "fsdp2":
            for block in model.blocks:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        elif name == "zeroshard":
            model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=3, mesh=mesh, lr=1e-3)
        else:
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out[name] = (model, optim)
    return out


def one(rank: int, world: int) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    systems = _systems(mesh)
    x, y = torch.randint(0, 1000, (4, 128)), torch.randint(0, 1000, (4, 128))
    times: dict = {n: {"forward": [], "backward": [], "step": []} for n in systems}
    for i in range(STEPS):
        for name, (model, optim) in systems.items():
            dist.barrier()
            t0 = time.perf_counter()
            out = model(x)
            with loss_parallel():
                loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
                t1 = time.perf_counter()
                loss.backward()
            t2 = time.perf_counter()
            optim.step()
            optim.zero_grad()
            t3 = time.perf_counter()
            if i >= WARMUP:
                for phase, secs in (("forward", t1 - t0), ("backward", t2 - t1), ("step", t3 - t2)):
                    times[name][phase].append(secs)
    return {n: {p: round(statistics.median(v) * 1000, 1) for p, v in d.items()}
            for n, d in times.items()}


if __name__ == "__main__":
    for r in run_ranks(one, 4, timeout=600)[:2]:
        print(r)
