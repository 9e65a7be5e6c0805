"""ZeRO-Offload: parity, no needless copies on CPU, fused host step, device vs host bytes.

On this CPU-only machine the device *is* the host, so the engine copies nothing
(asserted). The copy path itself — masters in host memory, gradients copied to host
buffers, updated weights copied back, and with offload="optimizer+params" the weight
slices on the host, copied up for each gather — is exercised by forcing it on CPU
(``engine._FORCE_HOST_COPIES``) and must give the same training as no offload.

Memory (notation of test_accounting.py: S = this rank's slice of the padded trainable
buckets, P = N·S, c = compute-dtype bytes, n_b = optimizer parameters), between steps, forced
copies, AdamW (fp32 master + 2 moments + a 4-byte step per bucket; without mixed
precision the master of stages 1-2 is its own copy once offloaded). The reduced gradient
slices live on the host only (stage 1 keeps its slice inside the whole gradient buffer
until zero_grad frees it):

    where   stage 1 ("optimizer")   stage 2          stage 3          stage 3, "optimizer+params"
    device  params c·P              params c·P       params c·S       (nothing)
    host    optim 12·S + 4·n_b, grads c·S (all)                       + params c·S
            + params c·S under bf16 (the pinned staging slice the updated weights are
              cast into, so they cross PCIe in 16 bits)

(fp32 "optimizer+params": the host weight slice is the master itself, so optim 8·S + 4·n_b.)
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch
from _training import loader, loss_of, make_model

import zeroshard
import zeroshard.engine.engine as engine_mod
from zeroshard.state import full_optimizer_state, load_checkpoint, save_checkpoint
from zeroshard.testing import run_ranks, sweep


def _shard(stage: int, mp: str | None, offload: str | None, kwargs: dict, seed: int = 0):
    return zeroshard.shard(make_model("gpt2-tiny", seed=seed), torch.optim.AdamW, stage=stage,
                           lr=1e-2, weight_decay=0.1, mixed_precision=mp, offload=offload,
                           **kwargs)


def _train(rank: int, world: int, root: str, stage: int, mp: str | None, offload: str | None,
           force: bool, default_optim: bool = False, accum: int = 1) -> dict:
    engine_mod._FORCE_HOST_COPIES = force
    # Parity runs pin fused=False so that they compare the offload path alone; the
    # default (fused host AdamW) is checked separately.
    kwargs = {} if default_optim else {"fused": False}
    model, optim = _shard(stage, mp, offload, kwargs)
    engine = zeroshard.engine_of(model)
    data = loader("gpt2-tiny", rank, world)
    tracker = zeroshard.memory_tracker(model, optim)
    with tracker:
        optim.step()  # no backward yet: zero gradients (weight decay still applies)
        optim.zero_grad()
        for _ in range(3):
            for _ in range(accum):  # accumulation without no_sync: slices add up
                x, y = next(data)
                loss_of(model, x, y).backward()
            optim.clip_grad_norm_(1.0)
            optim.step()
            optim.zero_grad()
        del x, y
    where = {w: {c.value: v for c, v in d.items() if v}
             for w, d in tracker.current_by_location().items()}
    masters_shared = [  # fp32 stages 1-2 without offload step their chunks of ``full``
        b.master_in_full if stage < 3
        else engine._same_memory(b.master, b.shard16) for b in engine.buckets
    ]
    out = {"state": zeroshard.full_state_dict(model), "offload": engine.offload,
           "fused": optim.param_groups[0].get("fused"),
           "host_grads": [b.host.grad is not None for b in engine.buckets],
           "masters_shared": masters_shared, "where": where,
           "P": sum(b.padded_numel for b in engine.buckets),
           "S": sum(b.shard_numel for b in engine.buckets), "n_b": len(engine.master_params())}
    if force:  # checkpoints from and into offloaded (host) masters and state
        path = Path(root) / f"s{stage}-{mp}-{offload}"
        save_checkpoint(path, model, optim)
        want = full_optimizer_state(model, optim)
        model2, optim2 = _shard(stage, mp, offload, kwargs, seed=5)
        load_checkpoint(path, model2, optim2)
        got = full_optimizer_state(model2, optim2)
        out["reloaded"] = zeroshard.full_state_dict(model2)
        out["optim_equal"] = got.keys() == want.keys() and all(
            torch.equal(torch.as_tensor(got[n][k]), torch.as_tensor(want[n][k]))
            for n in want for k in want[n])
    engine_mod._FORCE_HOST_COPIES = False
    return out


# (stage, mixed precision, offload mode): each is checked against the same stage and
# precision without offload, run as is (on CPU: no copies) and with forced host copies.
COMBOS = [(s, mp, mode) for s in (1, 2, 3) for mp in (None, "bf16")
          for mode in (("optimizer", "optimizer+params") if s == 3 else ("optimizer",))]
# The default run keeps every stage, precision and mode: stage 1 with the bf16 staging
# slice, stage 2's fp32 master as its own copy, stage 3 with both modes under bf16 and
# fp32 "optimizer+params" (the host slice is the master). The rest: make slow.
FAST_COMBOS = [(1, "bf16", "optimizer"), (2, None, "optimizer"), (3, "bf16", "optimizer"),
               (3, "bf16", "optimizer+params"), (3, None, "optimizer+params")]
MORE_COMBOS = [c for c in COMBOS if c not in FAST_COMBOS]
# Accumulation (bf16, 2 micro-batches): stage 1 sums in the whole gradient buffer and
# copies at the step, stages 2-3 add on the host; stage 2 (the same path as 3): make slow.
FAST_ACCUM = ((1, "optimizer"), (3, "optimizer+params"))
MORE_ACCUM = ((2, "optimizer"),)
# The default host optimizer (fused AdamW) is checked on one point of the default run.
FUSED = {"stage": 2, "mp": "bf16", "offload": "optimizer", "force": False,
         "default_optim": True}


def _grid(combos: list[tuple], accum: tuple[tuple[int, str], ...]) -> list[dict]:
    """The points ``combos`` and ``accum`` are checked on (each once)."""
    grid: list[dict] = []
    for stage, mp, mode in combos:
        for off, force in ((None, False), (mode, False), (mode, True)):
            point = {"stage": stage, "mp": mp, "offload": off, "force": force}
            if point not in grid:  # stage 3's two modes share one run without offload
                grid.append(point)
    for stage, mode in accum:
        grid += [{"stage": stage, "mp": "bf16", "offload": off, "force": off is not None,
                  "default_optim": False, "accum": 2} for off in (None, mode)]
    return grid


GRIDS = {"fast": [*_grid(FAST_COMBOS, FAST_ACCUM), FUSED],
         "more": _grid(MORE_COMBOS, MORE_ACCUM)}


def _all(rank: int, world: int, root: str, grid: list[dict]) -> list:
    return sweep(functools.partial(_train, rank, world, root), grid)


@functools.cache
def _results(part: str) -> dict[tuple, dict]:
    """The runs of ``GRIDS[part]`` (one ``run_ranks`` call, shared by that part's tests),
    by the point's values."""
    grid = GRIDS[part]
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_all, 2, root, grid, timeout=300)[0]
    return {tuple(p.values()): r for p, r in zip(grid, results)}


def _check_parity(by: dict[tuple, dict], combos: list[tuple]) -> None:
    for stage, mp, mode in combos:
        base = by[(stage, mp, None, False)]
        cpu, forced = by[(stage, mp, mode, False)], by[(stage, mp, mode, True)]
        # CPU run: host == device, nothing is copied; fp32 masters stay views
        assert cpu["offload"] is False and not any(cpu["host_grads"])
        assert cpu["masters_shared"] == base["masters_shared"]
        assert _state(cpu["where"]) == _state(base["where"]) and not cpu["where"]["host"]
        # forced copy path: separate host masters and host gradient buffers
        assert forced["offload"] is True and all(forced["host_grads"])
        if stage < 3 or mp == "bf16" or mode == "optimizer":
            assert not any(forced["masters_shared"])
        else:  # fp32 optimizer+params: the host slice is the master, one copy
            assert all(forced["masters_shared"])
        # a checkpoint of offloaded state reloads exactly (into offloaded state)
        assert forced["optim_equal"], (stage, mp, mode)
        for name, ref in forced["state"].items():
            assert torch.equal(forced["reloaded"][name], ref), (stage, mp, mode, name)
        for kind, other in (("cpu", cpu), ("forced", forced)):
            for name, ref in base["state"].items():
                # copies are exact and the operations the same: equal bit for bit
                assert torch.equal(other["state"][name], ref), (kind, stage, mp, mode, name)


def test_offload_parity_and_no_needless_copies() -> None:
    """Parity, no copies on CPU and checkpoints for FAST_COMBOS, and the fused host step;
    twin: test_offload_parity_and_no_needless_copies_more_configurations."""
    by = _results("fast")
    assert by[tuple(FUSED.values())]["fused"] is True  # fast host AdamW
    _check_parity(by, FAST_COMBOS)


@pytest.mark.slow
def test_offload_parity_and_no_needless_copies_more_configurations() -> None:
    """The same checks for MORE_COMBOS (stage 1 fp32, stage 2 bf16, stage 3 "optimizer"
    fp32); twin: test_offload_parity_and_no_needless_copies."""
    _check_parity(_results("more"), MORE_COMBOS)


def test_host_step_threads_undo_torchruns_single_thread(monkeypatch) -> None:
    """torchrun sets OMP_NUM_THREADS=1; the host step gets this rank's share of cores."""
    import os

    from zeroshard.engine.offload import host_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        monkeypatch.delenv("ZEROSHARD_HOST_THREADS", raising=False)
        cores = len(os.sched_getaffinity(0))
        with pytest.warns(UserWarning, match=f"host optimizer step runs on {cores} threads"):
            assert host_threads() == cores == torch.get_num_threads()
        monkeypatch.setenv("ZEROSHARD_HOST_THREADS", "1")  # the user's choice wins
        with pytest.warns(UserWarning, match="ZEROSHARD_HOST_THREADS"):
            assert host_threads() == 1 == torch.get_num_threads()
        monkeypatch.setenv("ZEROSHARD_HOST_THREADS", "many")
        with pytest.raises(ValueError, match="ZEROSHARD_HOST_THREADS='many' must be a positive"):
            host_threads()
        monkeypatch.delenv("ZEROSHARD_HOST_THREADS")
        torch.set_num_threads(2)  # already multi-threaded: left alone
        assert host_threads() == 2
    finally:
        torch.set_num_threads(before)


def _check_accumulation(by: dict[tuple, dict], accum: tuple[tuple[int, str], ...]) -> None:
    for stage, mode in accum:
        base = by[(stage, "bf16", None, False, False, 2)]
        forced = by[(stage, "bf16", mode, True, False, 2)]
        assert forced["offload"]
        for name, ref in base["state"].items():
            assert torch.equal(forced["state"][name], ref), (stage, name)


def test_offload_accumulation_adds_on_the_host() -> None:
    """Accumulation over 2 micro-batches at stages 1 and 3 (FAST_ACCUM) equals it without
    offload; twin: test_offload_accumulation_adds_on_the_host_more_configurations."""
    _check_accumulation(_results("fast"), FAST_ACCUM)


@pytest.mark.slow
def test_offload_accumulation_adds_on_the_host_more_configurations() -> None:
    """The same at stage 2 (MORE_ACCUM); twin: test_offload_accumulation_adds_on_the_host."""
    _check_accumulation(_results("more"), MORE_ACCUM)


def _state(where: dict) -> dict:
    """Model state by location: without "other" (the per-parameter "got a gradient" flags,
    4 bytes each, counted only when an in-place op on them happens to be seen)."""
    return {w: {k: v for k, v in d.items() if k != "other"} for w, d in where.items()}


def _expected_split(stage: int, mp: str | None, mode: str, r: dict) -> dict:
    """Bytes by location and category between steps (module docstring's table)."""
    c = 2 if mp else 4
    P, S, n_b = r["P"], r["S"], r["n_b"]
    device = {"params": c * (S if stage == 3 else P)}
    if mode == "optimizer+params":
        device.pop("params")  # between steps no unit is gathered: nothing on the device
    host = {"optim": 12 * S + 4 * n_b, "grads": c * S}
    if mode == "optimizer+params":
        host["params"] = c * S  # the weight slices themselves
        if not mp:  # fp32: the host weight slice *is* the master (filed as params)
            host["optim"] -= 4 * S
    elif mp:
        host["params"] = c * S  # the pinned staging slice: weights cross PCIe in 16 bits
    return {"device": device, "host": host}


def _check_tracker(by: dict[tuple, dict], combos: list[tuple]) -> None:
    for stage, mp, mode in combos:
        forced = by[(stage, mp, mode, True)]
        where = _state(forced["where"])
        assert where == _expected_split(stage, mp, mode, forced), (stage, mp, mode, where)


def test_tracker_reports_offloaded_state_on_the_host() -> None:
    """Exact bytes: master weights and optimizer state move from device to host
    (FAST_COMBOS); twin: test_tracker_reports_offloaded_state_on_the_host_more_configurations."""
    _check_tracker(_results("fast"), FAST_COMBOS)


@pytest.mark.slow
def test_tracker_reports_offloaded_state_on_the_host_more_configurations() -> None:
    """The same exact bytes for MORE_COMBOS; twin:
    test_tracker_reports_offloaded_state_on_the_host."""
    _check_tracker(_results("more"), MORE_COMBOS)
