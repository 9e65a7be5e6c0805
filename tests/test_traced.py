"""Traced estimates (memory/traced.py): a real engine step on fake tensors and a fake group.

Four checks, each against something independent of the trace:

* **Analytic model state** (memory/analytic.py ``model_state_bytes``, ZeRO §5) vs traced
  params + grads + optimizer state between steps, within 2%. They differ for two reasons
  only:

  - padding: the analytic formula pads the whole model once, ceil(Ψ/N) elements per rank
    for a sharded part; the engine cuts *each parameter* into N dim-0 chunks of
    ceil(rows/N) rows (stage 0 shards nothing and pads nothing). That adds fewer than N
    rows per parameter, times the bytes per element (up to 16);
  - AdamW's ``step`` counter, one 4-byte tensor per optimizer parameter (one per
    bucket), which the 12 bytes/parameter of ZeRO's K leave out.

  For the presets, hidden sizes are multiples of 64, so only the vocabulary's rows pad:
  gpt2-124m's 50,257-row embedding becomes 50,304 rows at N = 64, 47 rows x 768 / 64
  elements per rank x 16 bytes, +0.03% of its model state.
  ``test_user_meta_model_with_its_own_loss_and_padding`` checks both terms to the byte
  at N = 7. Buffers that are not parameters (Llama's RoPE tables) are filed
  under ``other``, as on a real run, and are model state on neither side.
* **Stage 3's buffers** (stage3_buffers.py [Note: stage-3 buffers]: the root gathered all step,
  the head's gradients all backward, (k+1) blocks' weights and two blocks' gradients, the
  root's reduction) vs what the trace sees the engine hold beyond its shards, to the
  byte: small tied and untied Llamas, GPT-2, prefetch 0-2, fp32, and Llama-3-8B's shape
  (its blocks, root and head in 6 blocks here; the whole 32, ~20 s, in ``make slow``),
  whose planned stage-3 peak is then within 2% of the traced one.
* **A measured run** (``run_ranks`` at world 2 over gloo, real tensors, the same
  ``zeroshard.memory_tracker`` and the same ``run_steps`` loop): model state must agree
  to the byte and the peak total within 2%, the trace told to use gloo's collectives
  (``collectives="gloo"``): gloo's decomposed reduce-scatter reduces in place where a
  native one (NCCL, the default: a trace plans a GPU run) returns a new shard-sized
  tensor, which moves a stage-1 or stage-3 peak by up to 1/N of the gradients in flight.
  On the default bench (gpt2-small, world 2) every zeroshard configuration's traced peak
  is within 0.65% of the bench's measured one, five of seven to the byte.
* **Scale**: llama-7b at N=8 traces all stages and policies on 2 cores in minutes with
  a resident set far below the model's size (slow test).

Slow tests (``make slow``): the full analytic grid (gpt2-124m, llama-1b, llama-7b x
N in {1, 2, 8, 64} x stages 0-3), traced vs measured on the gpt2-small preset, and the
llama-7b N=8 traced plan. Split from ``make test`` with a cheaper twin left here (the same
checks): four of the eight gpt2-124m points, the [untied] stage-3 buffers point, the whole
Llama-3-8B stage-3 peak, and stage 2 without checkpointing traced vs measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.checkpointing import apply_checkpointing
from zeroshard.memory import analytic
from zeroshard.memory.activations import estimate_activation_bytes
from zeroshard.memory.traced import TraceError, grad_buffer_bytes, run_steps, trace_step
from zeroshard.models import GPT2Config, LlamaConfig, build_model, get_preset
from zeroshard.testing import run_ranks, sweep

# ~0.86M parameters, activations larger than model state at micro-batch 4 x seq 256, so
# the peak is set by backward (gpt2-small's, at the optimizer step: both are covered).
SMALL = GPT2Config(n_layers=4, hidden=128, n_heads=4, seq_len=256, vocab=256)
RECIPE = {"bf16": "bf16-adamw", None: "fp32-adamw"}


def _assert_state_agrees(r, tol: float = 0.02) -> float:
    want = analytic.model_state_bytes(r.params, stage=r.stage, n=r.world_size,
                                      recipe=RECIPE[r.mixed_precision]).total
    rel = (r.model_state_bytes - want) / want
    assert abs(rel) <= tol, (r.model, r.stage, r.world_size, r.model_state_bytes, want)
    return rel


# -- analytic vs traced ------------------------------------------------------------------
# gpt2-124m's widths and vocabulary (whose 50,257 rows pad) in 2 of its 12 blocks: the same
# shapes, a sixth of the ops to trace. The whole preset: the slow grid below.
GPT2_124M_2 = dataclasses.replace(get_preset("gpt2-124m"), n_layers=2)


# Each stage and each N keeps a point in ``make test``: stage 3 at N=1 (units gathered with
# nothing to shard) and at N=64 (the most padding); the other four points are marked slow.
def _slow_unless(kept: bool) -> tuple:
    return () if kept else (pytest.mark.slow,)


@pytest.mark.parametrize(("stage", "n"), [
    pytest.param(stage, n, id=f"{stage}-{n}",
                 marks=_slow_unless((stage, n) in {(1, 2), (1, 8), (3, 1), (3, 64)}))
    for stage in (1, 3) for n in (1, 2, 8, 64)])
def test_gpt2_124m_model_state_matches_analytic(stage: int, n: int) -> None:
    """Slow points (``make slow``): [1-1], [1-64], [3-2], [3-8], with the same checks."""
    # Model state exists in full after one step; a short sequence keeps the trace fast.
    r = trace_step(GPT2_124M_2, world_size=n, stage=stage, micro_batch=1, seq_len=64, steps=1)
    rel = _assert_state_agrees(r)
    # Padding and step counters only (module docstring): in 2 blocks the vocabulary's
    # padding is 6.8e-4 of model state at N = 64 (3e-4 in the whole preset's 12).
    assert abs(rel) < 1e-3
    assert r.peak_bytes >= r.model_state_bytes and r.activation_peak_bytes > 0
    assert (r.peak_unsharded_bytes > 0) == (stage == 3)  # gathered units, even at N=1
    assert (r.stage3_buffer_bytes >= r.stage3_backward_buffer_bytes > 0) == (stage == 3)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["gpt2-124m", "llama-1b", "llama-7b"])
def test_model_state_matches_analytic_full_grid(preset: str) -> None:
    for n in (1, 2, 8, 64):
        for stage in range(4):
            r = trace_step(preset, world_size=n, stage=stage, micro_batch=1, seq_len=64,
                           steps=1)
            assert abs(_assert_state_agrees(r)) < 5e-4  # see test_gpt2_124m_model_state_matches_analytic


def test_fp32_and_fp16_recipes() -> None:
    r = trace_step("gpt2-tiny", world_size=2, stage=2, mixed_precision=None, micro_batch=1,
                   seq_len=16, steps=1)
    _assert_state_agrees(r)
    r16 = trace_step("gpt2-tiny", world_size=2, stage=2, mixed_precision="fp16",
                     micro_batch=1, seq_len=16, steps=1)
    assert r16.mixed_precision == "bf16" and "fp16 traced as bf16" in r16.notes[0]
    _assert_state_agrees(r16)


# -- stage 3's buffers: analytic vs traced ------------------------------------------------
# A small untied Llama whose root (embedding + LM head: 4.2M) outweighs a block (0.79M), as
# an 8B Llama-3's does (1.05B vs 0.22B); every dim divides N = 8, so nothing pads.
LLAMA_UNTIED = LlamaConfig(n_layers=4, hidden=256, n_heads=4, n_kv_heads=2, seq_len=256,
                           vocab=8192)
LLAMA3_8B = LlamaConfig(n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, intermediate=14336,
                        seq_len=8192, vocab=128256, rope_theta=500000.0)


def _stage3_analytic(config, prefetch: int = 1, recipe: str = "bf16-adamw"):
    return analytic.stage3_buffer_bytes(
        block=analytic.block_params(config), root=analytic.root_params(config),
        head=analytic.head_params(config), prefetch=prefetch, recipe=recipe)


@pytest.mark.parametrize(
    ("config", "n", "prefetch", "precision", "root_sets_it"),
    # [untied] (prefetch 1, bf16, vocabulary 8192) is slow: each of its options is the
    # same in another point (prefetch 1: fp32, big-vocab, tied; untied bf16: prefetch 0/2).
    [pytest.param(LLAMA_UNTIED, 8, 1, "bf16", False, marks=pytest.mark.slow),
     (LLAMA_UNTIED, 8, 0, "bf16", True),
     (LLAMA_UNTIED, 8, 2, "bf16", False), (LLAMA_UNTIED, 8, 1, None, False),
     (dataclasses.replace(LLAMA_UNTIED, vocab=16384), 8, 1, "bf16", True),
     (dataclasses.replace(LLAMA_UNTIED, tie_embeddings=True), 8, 1, "bf16", False),
     (SMALL, 2, 1, "bf16", False)],
    ids=["untied", "untied-prefetch0", "untied-prefetch2", "untied-fp32", "untied-big-vocab",
         "tied", "gpt2"])
def test_stage3_buffers_match_analytic(config, n: int, prefetch: int, precision,
                                       root_sets_it: bool) -> None:
    """[Note: stage-3 buffers] in stage3_buffers.py, to the byte: the engine's most beyond its
    shards while the blocks run (root whole, head gradients, (k+1) blocks' weights, two
    blocks' gradients) and at the root's reduction (its gradients twice, its weights
    freed), which sets the most where the embedding outweighs the blocks' share (three
    blocks at prefetch 1, two at 0). [untied] runs in ``make slow``; its options run here in
    the other points."""
    r = trace_step(config, world_size=n, stage=3, micro_batch=2, seq_len=128, steps=1,
                   prefetch=prefetch, mixed_precision=precision)
    want = _stage3_analytic(config, prefetch, RECIPE[precision])
    assert (r.stage3_backward_buffer_bytes, r.stage3_buffer_bytes) == (want.backward, want.peak)
    assert (want.root_reduce > want.backward) == root_sets_it
    # The first step sees the units freed after shard() as a real run does (a fake view
    # used to regrow them: see [Note: how a trace works] in traced.py).
    assert r.max_per_category["params"] <= r.current["params"] + r.peak_unsharded_bytes


# llama-3-8B's widths in 6 of its 32 blocks at seq 512: the same blocks, root and head (so
# the same stage-3 buffers, to the byte) and the same peak moment, in a fifth of the ops.
LLAMA3_8B_6 = dataclasses.replace(LLAMA3_8B, n_layers=6)


def _check_untied_stage3_peak(config: LlamaConfig, seq: int) -> None:
    """The checks of test_llama_8b_untied_stage3_peak_matches_traced for ``config`` (llama-3-8B's
    blocks, root and head in any number of them) at ``seq`` with full checkpointing."""
    policy = "full"
    r = trace_step(config, world_size=8, stage=3, micro_batch=1, seq_len=seq,
                   checkpointing=policy)
    want = _stage3_analytic(config)
    assert (want.backward, want.root_reduce) == (4_896_931_840, 4_638_932_992)
    assert (r.stage3_backward_buffer_bytes, r.stage3_buffer_bytes) == (
        want.backward, want.peak)
    from zeroshard.memory.planner import plan

    p = plan(config, gpus=8, gpu_mem_bytes=80 * 10**9, seq_len=seq, micro_batch=1,
             interconnect_GBps=400.0, policies=(policy,))
    row = next(x for x in p.rows if x.stage == 3)
    # blocks L-1..2 (L - k - 1 of them, k = 1) hold their slices
    slices = (config.n_layers - 2) * 2 * analytic.block_params(config) // 8
    assert (row.peak_moment, row.buffer_bytes) == ("end of the blocks' backward", want.backward)
    est = estimate_activation_bytes(config, 1, seq, policy, dtype_bytes=2)
    late = 2 * est.input_bytes + est.block_bytes  # blocks 1 and 0's inputs, 1's recompute
    assert row.total_bytes == (row.params_bytes + row.optim_bytes + slices + late
                               + want.backward)
    assert abs(row.total_bytes - r.peak_bytes) <= 0.02 * r.peak_bytes, (row.total_bytes,
                                                                       r.peak_bytes)
    # The trace's peak is that moment: two block inputs (and the token ids) still saved.
    ids = est.outside["token ids (embedding backward)"]
    assert r.peak["activations"] == 2 * est.input_bytes + ids
    every = row.model_state_bytes + max(row.activation_bytes + want.backward, want.root_reduce)
    assert every - r.peak_bytes > 0.05 * r.peak_bytes  # every slice beside every activation
    old = row.model_state_bytes + row.activation_bytes + 2 * analytic.root_params(config) * 4
    assert old - r.peak_bytes > 0.1 * r.peak_bytes, (old, r.peak_bytes)  # the old term


@pytest.mark.slow
def test_llama_8b_untied_stage3_peak_matches_traced() -> None:
    """Issue: for an 8B Llama with untied embeddings the planner's stage-3 buffer term was
    8.4 GB, (k+1) x the largest unit (the root: embedding + LM head) x (P+G). The engine
    holds 4.90 GB while the blocks run backward and 4.64 GB at the root's reduction (its
    weights freed first); a trace at llama-3-8B's shape counts both to the byte (~20 s on
    2 cores). With full checkpointing at seq 2048 the step's peak is at the end of the
    blocks' backward (stage3_buffers.py [Note: stage-3 peak]): 29 gradient slices complete and
    block 2's in flight, two blocks' inputs and block 1's recompute, 20.91 GB traced. The
    plan prices that moment at 21.02 GB (+0.5%); counting every slice beside every
    activation gave 22.48 GB (+7.5%), and the old term 15% over. Twin in ``make test``:
    test_llama_8b_blocks_untied_stage3_peak_matches_traced (6 of the 32 blocks, seq 512)."""
    _check_untied_stage3_peak(LLAMA3_8B, seq=2048)


def test_llama_8b_blocks_untied_stage3_peak_matches_traced() -> None:
    """The checks of test_llama_8b_untied_stage3_peak_matches_traced (slow, its twin: the
    whole 32 blocks at seq 2048) on llama-3-8B's blocks, root and head in 6 blocks at seq
    512 (~3 s): the same buffers to the byte, the peak at the end of the blocks' backward
    (4 slices complete), planned within 2% (+0.4%), every slice beside every activation
    +6%, the old term +44%."""
    _check_untied_stage3_peak(LLAMA3_8B_6, seq=512)


# -- traced vs measured ------------------------------------------------------------------
def _measure(rank: int, world: int, config: GPT2Config, stage: int, checkpointing: str,
             micro_batch: int, seq_len: int) -> dict[str, int]:
    model = build_model(config, device="meta" if stage == 3 else None)
    if checkpointing != "none":
        apply_checkpointing(model, checkpointing)
    model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=stage, lr=1e-3,
                                   mixed_precision="bf16")
    tracker = zeroshard.memory_tracker(model, optim)
    engine = zeroshard.engine_of(model)
    seen = {}

    def after_step() -> None:  # model state after the last step, before zero_grad (as a
        seen.update(tracker.current())  # trace reads it), less the same gradient buffers
        seen["buffers"] = grad_buffer_bytes(engine)[0]

    with tracker:
        run_steps(model, optim, micro_batch=micro_batch, seq_len=seq_len, steps=2,
                  after_step=after_step)
    now = {getattr(c, "value", c): v for c, v in seen.items()}
    # A real run steps its masters in chunks, with AdamW's 4-byte step each; a trace keeps
    # one per parameter (engine/chunks.py): the one difference in model state.
    chunk_steps = 4 * (len(engine.master_params()) - sum(len(b.slots) for b in engine.buckets))
    return {"peak": tracker.peak_total(), "state": now["params"] + now["grads"] + now["optim"] - now["buffers"],
            "chunk_steps": chunk_steps}


def _measure_grid(rank: int, world: int, grid: list[dict]) -> list[dict[str, int]]:
    return sweep(lambda **point: _measure(rank, world, **point), grid)


# (stage, checkpointing): every stage without checkpointing, and stage 2 with full.
GRID = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "full")]


def _compare_with_measured(config: GPT2Config, micro_batch: int, seq_len: int,
                           points: list[tuple[int, str]] = GRID) -> None:
    grid = [{"stage": s, "checkpointing": c, "config": config, "micro_batch": micro_batch,
             "seq_len": seq_len} for s, c in points]
    # gpt2-small: ~505 s alone on 2 cores
    measured = run_ranks(_measure_grid, 2, grid, timeout=1200)[0]
    for point, m in zip(grid, measured):
        r = trace_step(config, world_size=2, stage=point["stage"], micro_batch=micro_batch,
                       seq_len=seq_len, checkpointing=point["checkpointing"], lr=1e-3,
                       collectives="gloo")  # the measured run's in-place gloo collectives
        assert r.model_state_bytes == m["state"] - m["chunk_steps"], (point, r.model_state_bytes,
                                                                      m)
        assert abs(r.peak_bytes - m["peak"]) <= 0.02 * m["peak"], (point, r.peak_bytes, m)


# SMALL in 2 blocks: activations still outweigh model state (both scale with blocks).
SMALL_2 = dataclasses.replace(SMALL, n_layers=2)


def test_traced_peak_matches_measured_small_config() -> None:
    """Stages 0, 1 and 3 without checkpointing and stage 2 with full; stage 2 without it
    is test_traced_peak_matches_measured_small_config_stage_2 (slow, the same checks)."""
    _compare_with_measured(SMALL_2, micro_batch=4, seq_len=256,
                           points=[(0, "none"), (1, "none"), (3, "none"), (2, "full")])


@pytest.mark.slow
def test_traced_peak_matches_measured_small_config_stage_2() -> None:
    """The rest of test_traced_peak_matches_measured_small_config (its twin): stage 2 without
    checkpointing (stage 2's path runs there with full checkpointing)."""
    _compare_with_measured(SMALL_2, micro_batch=4, seq_len=256, points=[(2, "none")])


@pytest.mark.slow
def test_traced_peak_matches_measured_gpt2_small() -> None:
    _compare_with_measured(get_preset("gpt2-small"), micro_batch=2, seq_len=256)


# -- whole-parameter optimizers (Muon + AdamW) -------------------------------------------
TINY_2 = dataclasses.replace(get_preset("gpt2-tiny"), n_layers=2)


def _measure_muon(rank: int, world: int) -> list[int]:
    from zeroshard.bench.muon import muon_optimizers

    peaks = []
    for stage in range(4):
        model = build_model(TINY_2, device="meta" if stage == 3 else None)
        model, opts = zeroshard.shard(model, muon_optimizers(model, 1e-3), stage=stage,
                                      mixed_precision="bf16")
        tracker = zeroshard.memory_tracker(model, opts)
        with tracker:
            run_steps(model, opts, micro_batch=4, seq_len=64, steps=2)
        peaks.append(tracker.peak_total())
    return peaks


def test_traced_peak_with_muon_matches_measured() -> None:
    """Muon over the hidden matrices + AdamW over the rest, world 2, stages 0-3: the trace
    (the real engine on fake tensors, optimizers=) gives each rank's measured peak — the
    owner's whole parameters and gradients at the step and the exchange's buffers
    included. On a quiet machine within 168 bytes at stages 0, 1 and 3 (stage 2 varies);
    asserted: stage 0 within 0.5%, stages 1-3 at most 0.5% over and at least 93% (90% at
    stage 2; a collective's buffers live until gloo's thread lets go of them: later under
    load, seen +7%).
    Before the exchange's input was kept until its completion (comm.py), stages 1-3 read
    9-10% low: the fake group's work is done at once and freed it."""
    import functools

    from zeroshard.bench.muon import muon_optimizers

    measured = run_ranks(_measure_muon, 2, timeout=300)
    build = functools.partial(muon_optimizers, lr=1e-3)
    for stage in range(4):
        for rank in range(2):
            r = trace_step(TINY_2, world_size=2, rank=rank, stage=stage, micro_batch=4,
                           seq_len=64, collectives="gloo", optimizers=build)
            want = measured[rank][stage]
            if stage > 0:  # a real run's collectives finish, and gloo's thread lets go of
                # their buffers, when it gets to them: under load one outlives what follows
                # (seen: +590 KB at stage 1, +656 KB at stage 2); the trace's complete at
                # once, the least a real step holds
                low = 0.9 if stage == 2 else 0.93  # without the fix: 0.907 (s1), 0.896 (s3)
                assert want * low <= r.peak_bytes <= want * 1.005, (stage, rank, r.peak_bytes,
                                                                    want)
                continue
            assert abs(r.peak_bytes - want) <= 0.005 * want, (stage, rank, r.peak_bytes, want)
    assert measured[0][1] != measured[1][1]  # the owners' shares differ: both ranks checked


# -- process groups, user models, errors -------------------------------------------------
def _trace_inside_a_group(rank: int, world: int) -> int:
    # A default (gloo) group exists here, so the trace must run in a spawned process.
    return trace_step("gpt2-tiny", world_size=4, stage=3, micro_batch=1, seq_len=16,
                      steps=1).model_state_bytes


def test_trace_with_an_existing_group_runs_in_a_subprocess() -> None:
    inside = run_ranks(_trace_inside_a_group, 1, timeout=300)[0]
    here = trace_step("gpt2-tiny", world_size=4, stage=3, micro_batch=1, seq_len=16, steps=1)
    assert inside == here.model_state_bytes


class _MLP(nn.Module):
    def __init__(self, d: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class _ReadsValues(_MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return x * 2 if x.sum() > 0 else x  # data-dependent: fake tensors have no values


def _mlp_loss(model: nn.Module, micro_batch: int, seq_len: int) -> torch.Tensor:
    return model(torch.randn(micro_batch, seq_len, 64)).square().mean()


def test_user_meta_model_with_its_own_loss_and_padding() -> None:
    with torch.device("meta"):
        model = _MLP()  # 3 x 4160 = 12,480 elements: not a multiple of N = 7
    psi, n, unit = sum(p.numel() for p in model.parameters()), 7, 64 * 64 + 64
    ceil = lambda a: -(-a // n)  # noqa: E731
    del unit
    # Stage 0 pads nothing; stage 3 cuts each weight (64 rows) and bias into 7 chunks of
    # ceil(64/7) = 10 rows: 10 x 64 + 10 elements per layer and rank.
    params = len(list(model.parameters()))
    for stage, padding in ((0, 0), (3, 3 * (ceil(64) * 64 + ceil(64)) - ceil(psi))):
        r = trace_step(model, world_size=n, stage=stage, micro_batch=2, seq_len=8,
                       loss_fn=_mlp_loss)
        assert r.params == psi and r.model == "_MLP"
        want = analytic.model_state_bytes(psi, stage=stage, n=n).total
        # Exactly the module docstring's two reasons: 16 bytes per padding element, and
        # one 4-byte AdamW step counter per parameter (engine/chunks.py).
        assert r.model_state_bytes - want == 16 * padding + 4 * params, stage
        if stage == 0:  # at stage 3, 64-row weights cut 7 ways pad 9% (exact above)
            _assert_state_agrees(r)
    assert all(p.is_meta for p in model.parameters())  # the caller's model is untouched


def test_failing_trace_names_model_stage_and_phase() -> None:
    with torch.device("meta"):
        model = _ReadsValues()
    with pytest.raises(TraceError, match=r"_ReadsValues at stage 2, world size 8 .* failed "
                       r"in forward of step 1: DataDependentOutputException") as info:
        trace_step(model, world_size=8, stage=2, micro_batch=1, seq_len=4, loss_fn=_mlp_loss)
    assert "fake tensors have shapes only" in str(info.value)
    assert not torch.distributed.is_initialized()  # the fake group was torn down
    with pytest.raises(ValueError, match="meta device"):
        trace_step(_MLP(), world_size=2, stage=0, micro_batch=1, seq_len=4, loss_fn=_mlp_loss)


# -- scale ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_llama_7b_trace_uses_little_real_memory() -> None:
    r = trace_step("llama-7b", world_size=8, stage=3, micro_batch=1, seq_len=4096,
                   subprocess=True)  # its own process: peak RSS is the trace's alone
    _assert_state_agrees(r)
    assert r.peak_bytes > 30e9  # what it would take on a device ...
    assert r.peak_rss_bytes < 2e9  # ... and what it took here


@pytest.mark.slow
def test_llama_7b_at_8_traced_plan_completes(record_property) -> None:
    # Run the CLI in a process that reports its own peak RSS (RUSAGE_CHILDREN would
    # include every rank any earlier test spawned).
    code = ("import resource, sys; from zeroshard.cli import main; rc = main(sys.argv[1:]); "
            "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
            "file=sys.stderr); sys.exit(rc)")
    cmd = [sys.executable, "-c", code, "plan", "--model", "llama-7b", "--gpus", "8",
           "--gpu-mem", "80GB", "--seq", "4096", "--micro-batch", "1", "--traced", "--json"]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.perf_counter() - start
    assert out.returncode == 0, out.stderr[-3000:]
    record_property("wall_s", round(wall, 1))
    print(f"llama-7b N=8 traced plan: {wall:.1f} s")
    rows = json.loads(out.stdout)["rows"]
    assert len(rows) == 12 and all(r["traced_peak_bytes"] for r in rows)
    for row in rows:
        rel = row["traced_model_state_bytes"] / row["model_state_bytes"] - 1
        assert abs(rel) < 1e-4, row
    rss = int(out.stderr.split("peak_rss_kib")[-1].split()[0]) * 1024
    assert rss < 2e9, rss


def test_plan_traced_columns_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    from zeroshard.cli import main

    base = ["plan", "--model", "gpt2-tiny", "--gpus", "2", "--seq", "64", "--traced",
            "--policies", "none,sqrt"]
    assert main([*base, "--json"]) == 0
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert "traced N=2 stage 0 none" in out.err  # progress goes to stderr
    for row in data["rows"]:
        if (row["stage"], row["activation_checkpointing"]) == (3, "sqrt"):  # refused by shard
            assert row["traced_peak_bytes"] is None
            continue
        assert row["traced_peak_bytes"] >= row["traced_model_state_bytes"] > 0
        assert abs(row["traced_model_state_bytes"] / row["model_state_bytes"] - 1) < 1e-3
    assert any("stage 3 sqrt: not traced" in n for n in data["recommendation"]["notes"])
    assert main(base) == 0
    table = capsys.readouterr().out
    assert "trace st GB" in table and "not traced" in table


# A Llama whose vocabulary outweighs its blocks, as llama-3's does: under bf16 its loss's
# backward sets the stage-3 peak (the two fp32 gradients of the log-softmax), and its
# RMSNorms save fp32 copies.
WIDE_VOCAB = LlamaConfig(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, intermediate=512,
                         seq_len=512, vocab=16384, tie_embeddings=False)


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_activations_and_stage3_peak_match_traced(stage: int) -> None:
    """Issue #43: the plan under-stated bf16 activations by 6-10% at stage 3 (RMSNorm's
    fp32 copies and the fp32 log-softmax priced at 2 bytes; the loss's backward not a
    moment). The saved activations at the end of forward equal the estimate to 0.5% at
    every stage (the same bytes: no sharding touches them), and stage 3's planned peak
    is the traced one within 2%, at the loss's backward."""
    from zeroshard.memory.planner import plan

    r = trace_step(WIDE_VOCAB, world_size=8, stage=stage, mixed_precision="bf16",
                   micro_batch=1, seq_len=512)
    est = estimate_activation_bytes(WIDE_VOCAB, 1, 512, "none", dtype_bytes=2)
    assert abs(r.activation_peak_bytes - est.total) <= 0.005 * est.total, (
        r.activation_peak_bytes, est.total)
    if stage != 3:
        return
    p = plan(WIDE_VOCAB, gpus=8, gpu_mem_bytes=80 * 10**9, seq_len=512, micro_batch=1,
             interconnect_GBps=400.0, policies=("none",))
    row = next(x for x in p.rows if x.stage == 3)
    assert row.peak_moment == "loss's backward", row.peak_moment
    assert abs(row.total_bytes - r.peak_bytes) <= 0.02 * r.peak_bytes, (
        row.total_bytes, r.peak_bytes)


@pytest.mark.parametrize("preset,seq", [("gpt2-tiny", 64), ("llama-tiny", 64)])
def test_stages_0_to_2_price_the_optimizer_steps_moment(preset: str, seq: int) -> None:
    """[Note: the step's moments, stages 0-2] (memory/planner.py): where activations are
    small the optimizer step is the peak — model state, the fp32 gradient copies the
    masters step with and stages 1-2's refresh buffer — which the plan used to leave
    out (stage 0 priced 20% under its trace). Priced within 0.5% of the trace there, and
    not under it at stages 0-2 (beyond the model's own buffers, e.g. RoPE tables: 0.2%)."""
    from zeroshard.memory.planner import plan

    p = plan(preset, gpus=2, gpu_mem_bytes=80 * 10**9, seq_len=seq, micro_batch=1,
             interconnect_GBps=400.0, policies=("none",))
    for stage in (0, 1, 2):
        row = next(x for x in p.rows if x.stage == stage)
        r = trace_step(preset, world_size=2, stage=stage, mixed_precision="bf16",
                       micro_batch=1, seq_len=seq)
        assert row.total_bytes >= 0.995 * r.peak_bytes, (stage, row.total_bytes, r.peak_bytes)
        if row.peak_moment == "optimizer step":
            assert abs(row.total_bytes - r.peak_bytes) <= 0.005 * r.peak_bytes, (
                stage, row.total_bytes, r.peak_bytes, r.peak)
    assert next(x for x in p.rows if x.stage == 0).peak_moment == "optimizer step"


@pytest.mark.parametrize("policy", ["none", "full"])
def test_stages_0_to_2_moments_match_traced(policy: str) -> None:
    """[Note: the step's moments, stages 0-2]: where activations are large, backward's
    start (every activation and the loss's fp32 gradients, no gradient yet) sets the
    peak — the plan used to add every gradient too (stage 1 of llama-7b on 8 devices:
    64.3 GB priced, 52.0 traced). Within 3% of the trace at stages 0-2 (stage 2 a little
    over: its buckets in flight counted at the start)."""
    from zeroshard.memory.planner import plan

    p = plan(WIDE_VOCAB, gpus=2, gpu_mem_bytes=80 * 10**9, seq_len=512, micro_batch=1,
             interconnect_GBps=400.0, policies=(policy,))
    for stage in (0, 1, 2):
        row = next(x for x in p.rows if x.stage == stage)
        r = trace_step(WIDE_VOCAB, world_size=2, stage=stage, mixed_precision="bf16",
                       micro_batch=1, seq_len=512, checkpointing=policy)
        assert row.peak_moment == "backward begins", (stage, row.peak_moment)
        assert -0.01 <= row.total_bytes / r.peak_bytes - 1 <= 0.03, (
            stage, row.total_bytes, r.peak_bytes)
