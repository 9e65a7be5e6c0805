"""Muon on shards: step time, Newton–Schulz time and bytes per step, interleaved step by
step, 2 CPU ranks (gloo). zeroshard's llama-tiny preset by default (``--preset``),
micro-batch 4 x the preset's seq_len per rank, fp32, ``torch.optim.Muon`` (lr 0.02) over the 2-D
parameters (the 1-D ones are not stepped in any row). Not the default bench model
(gpt2-small): torch runs Newton–Schulz in bf16, and bf16 matrix products on our CPUs
run at ~0.1-0.2 GFLOP/s (one 2048x512 matrix: 27 s), so a DDP + Muon step of
gpt2-small takes minutes there. Rows:

* ``ddp``    — torch DDP + Muon: every rank orthogonalises every matrix;
* ``naive``  — sharded Muon as Megatron's distributed optimizer and Moonlight do it:
  zeroshard stage 1's layout, each bucket's full gradient all-gathered on every rank
  (the same ``Comm`` layer), Newton–Schulz on every rank with torch's Muon (the same
  function), each rank keeps its rows;
* ``zs-s0``, ``zs-s1``, ``zs-s3`` — zeroshard: each matrix stepped whole by its owner
  rank ([Note: whole-parameter updates] in engine/whole.py).

Prints rank 0's median step time, tokens/s and its ratio to DDP's, the median time in
Muon's step (Newton–Schulz and the update) and its share of the step, the logical
collective bytes per step from the ledger, the Newton–Schulz matrices per rank per
step, and the largest loss deviation from DDP (benchmarks/muon.txt).

    .venv/bin/python benchmarks/muon.py [--preset llama-tiny]
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from zeroshard.bench.muon import make_naive
from zeroshard.testing import run_ranks

ROWS = ("ddp", "naive", "zs-s0", "zs-s1", "zs-s3")
MICRO, WARMUP, TIMED = 4, 2, 8
PRESET = "llama-tiny"


def _muon(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)


class _Timed:
    """Seconds spent in an optimizer's ``step`` (its hooks), per outer step."""

    def __init__(self, optim: torch.optim.Optimizer) -> None:
        self.spent = 0.0
        optim.register_step_pre_hook(self._start)
        optim.register_step_post_hook(self._stop)

    def _start(self, *_) -> None:
        self.t0 = time.perf_counter()

    def _stop(self, *_) -> None:
        self.spent += time.perf_counter() - self.t0

    def take(self) -> float:
        out, self.spent = self.spent, 0.0
        return out


def _systems(rank: int, world: int) -> dict:
    import zeroshard
    from zeroshard.models import build_model

    out = {}
    for row in ROWS:
        model = build_model(PRESET, seed=0)
        if row == "ddp":
            optim = _muon(model)
            out[row] = (nn.parallel.DistributedDataParallel(model), optim, None, optim)
            continue
        stage = {"naive": 1, "zs-s0": 0, "zs-s1": 1, "zs-s3": 3}[row]
        model, optim = zeroshard.shard(model, _muon(model), stage=stage)
        engine = zeroshard.engine_of(model)
        if row == "naive":
            make_naive(optim)  # zeroshard.bench.muon: the same naive scheme as the bench's
        out[row] = (model, optim, engine, optim.optim)
    return out


def _bench(rank: int, world: int) -> dict:
    from zeroshard.models import get_preset

    global PRESET
    PRESET = os.environ.get("MUON_BENCH_PRESET", PRESET)
    vocab, seq = get_preset(PRESET).vocab, get_preset(PRESET).seq_len
    systems = _systems(rank, world)
    timers = {row: _Timed(s[3]) for row, s in systems.items()}
    gen = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {r: [] for r in ROWS}
    muon: dict[str, list[float]] = {r: [] for r in ROWS}
    losses: dict[str, list[float]] = {r: [] for r in ROWS}
    comm: dict[str, int] = {}
    for i in range(WARMUP + TIMED):
        x = torch.randint(0, vocab, (MICRO, seq + 1), generator=gen)
        for row in ROWS:  # interleaved: one step per row per round
            model, optim, engine, _ = systems[row]
            t0 = time.perf_counter()
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            optim.step()
            optim.zero_grad()
            dt = time.perf_counter() - t0
            spent = timers[row].take()
            losses[row].append(loss.item())
            if i >= WARMUP:
                times[row].append(dt)
                muon[row].append(spent)
            if engine is not None:
                comm[row] = sum(r.logical_bytes for r in engine.comm.ledger.last_step())
    whole = {row: s[1].whole for row, s in systems.items() if s[2] is not None}
    ns = {row: len(w.work_done) // (WARMUP + TIMED) for row, w in whole.items()}
    ns["ddp"] = len(systems["ddp"][3].param_groups[0]["params"])
    psi = sum(p.numel() * 4 for p in systems["ddp"][0].module.parameters())
    comm["ddp"] = 2 * psi  # DDP's all-reduce: 2 Psi logical (comm.py's convention)
    dloss = {row: max(abs(a - b) / abs(b) for a, b in zip(losses[row], losses["ddp"]))
             for row in ROWS}
    return {"step": {r: statistics.median(v) for r, v in times.items()},
            "muon": {r: statistics.median(v) for r, v in muon.items()},
            "comm": comm, "ns": ns, "dloss": dloss, "params": psi // 4}


def main() -> None:
    import argparse

    global PRESET
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default=PRESET)
    PRESET = parser.parse_args().preset
    from zeroshard.models import get_preset

    r = run_ranks(_bench, 2, timeout=3600, env={"MUON_BENCH_PRESET": PRESET})[0]
    tokens = 2 * MICRO * get_preset(PRESET).seq_len
    base = r["step"]["ddp"]
    lines = [f"Muon, 2 CPU ranks (gloo), {PRESET} preset ({r['params'] / 1e6:.1f}M params), "
             f"{tokens} tokens/step, "
             f"fp32; median of {TIMED} interleaved steps after {WARMUP} warm-up (rank 0)", "",
             f"{'row':<7} {'step s':>7} {'tokens/s':>9} {'x ddp':>6} {'muon s':>7} "
             f"{'muon %':>7} {'comm MiB/step':>14} {'NS mats/rank':>13} {'dloss':>8}"]
    for row in ROWS:
        step, muon = r["step"][row], r["muon"][row]
        lines.append(f"{row:<7} {step:>7.3f} {tokens / step:>9.0f} {base / step:>6.2f} "
                     f"{muon:>7.3f} {100 * muon / step:>6.0f}% "
                     f"{r['comm'][row] / 2**20:>14.0f} {r['ns'][row]:>13} "
                     f"{r['dloss'][row]:>8.1e}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
