"""ZeRO-Offload (offload="optimizer"): parity, no needless copies on CPU, fused host step.

On this CPU-only machine the device *is* the host, so the engine copies nothing
(asserted). The copy path itself — masters in host memory, gradients copied to host
buffers, updated weights copied back — is exercised by forcing it on CPU
(``engine._FORCE_HOST_COPIES``) and must give the same training as no offload.
"""

from __future__ import annotations

import functools

import torch
from _training import loader, loss_of, make_model

import zeroshard
import zeroshard.engine.engine as engine_mod
from zeroshard.testing import run_ranks, sweep


def _train(rank: int, world: int, stage: int, mp: str | None, offload: str | None,
           force: bool, default_optim: bool = False) -> dict:
    engine_mod._FORCE_HOST_COPIES = force
    # Parity runs pin fused=False so that they compare the offload path alone; the
    # default (fused host AdamW) is checked separately.
    kwargs = {} if default_optim else {"fused": False}
    model, optim = zeroshard.shard(make_model("gpt2-tiny"), torch.optim.AdamW, stage=stage,
                                   lr=1e-2, weight_decay=0.1, mixed_precision=mp,
                                   offload=offload, **kwargs)
    engine = zeroshard.engine_of(model)
    data = loader("gpt2-tiny", rank, world)
    for _ in range(3):
        x, y = next(data)
        loss_of(model, x, y).backward()
        optim.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad()
    masters_shared = [
        engine._same_memory(b.master, b.shard_of(b.full)) if stage < 3
        else engine._same_memory(b.master, b.shard16) for b in engine.buckets
    ]
    return {"state": zeroshard.full_state_dict(model), "offload": engine.offload,
            "fused": optim.param_groups[0].get("fused"),
            "host_grads": [b.host_grad is not None for b in engine.buckets],
            "masters_shared": masters_shared}


GRID = [{"stage": s, "mp": mp, "offload": off, "force": force}
        for s in (1, 2, 3) for mp in (None, "bf16")
        for off, force in ((None, False), ("optimizer", False), ("optimizer", True))]
GRID.append({"stage": 2, "mp": "bf16", "offload": "optimizer", "force": False,
             "default_optim": True})


def _all(rank: int, world: int) -> list:
    return sweep(functools.partial(_train, rank, world), GRID)


def test_offload_parity_and_no_needless_copies() -> None:
    results = run_ranks(_all, 2, timeout=300)[0]
    by = {tuple(p.values()): r for p, r in zip(GRID, results)}
    assert by[(2, "bf16", "optimizer", False, True)]["fused"] is True  # fast host AdamW
    for stage in (1, 2, 3):
        for mp in (None, "bf16"):
            base = by[(stage, mp, None, False)]
            cpu = by[(stage, mp, "optimizer", False)]
            forced = by[(stage, mp, "optimizer", True)]
            # CPU run: host == device, nothing is copied; fp32 masters stay views
            assert cpu["offload"] is False and not any(cpu["host_grads"])
            assert cpu["masters_shared"] == base["masters_shared"]
            # forced copy path: separate host masters and host gradient buffers
            assert forced["offload"] is True and all(forced["host_grads"])
            assert not any(forced["masters_shared"])
            for kind, other in (("cpu", cpu), ("forced", forced)):
                for name, ref in base["state"].items():
                    # copies are exact and the operations the same: equal bit for bit
                    assert torch.equal(other["state"][name], ref), (kind, stage, mp, name)
