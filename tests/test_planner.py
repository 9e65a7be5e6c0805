"""Closed-form accounting (memory/analytic.py) and the planner's ladder (memory/planner.py)."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

import pytest

from zeroshard.memory import analytic
from zeroshard.memory.analytic import recompute_flops_per_token
from zeroshard.memory.planner import config_from_params, plan, reserve_bytes
from zeroshard.models.config import PRESETS, LlamaConfig

GB = 10**9
LADDER = {"single-device", "data-parallel", "zero-1", "zero-2", "zero-3", "more-devices",
          "tensor-parallel"}


def _gb1(nbytes: int) -> float:
    """Decimal GB to one place, half up, as the paper's figure prints them."""
    return float(Decimal(nbytes / GB).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP))


def test_model_state_matches_zero_paper_figure_1() -> None:
    # Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N = 64, K = 12.
    got = [analytic.model_state_bytes(7_500_000_000, stage=s, n=64).total for s in range(4)]
    assert [_gb1(b) for b in got] == [120.0, 31.4, 16.6, 1.9]
    assert got == [120 * GB, 31_406_250_000, 16_640_625_000, 1_875_000_000]


def test_model_state_breakdown_padding_and_recipes() -> None:
    s2 = analytic.model_state_bytes(10, stage=2, n=4)  # ceil(10 / 4) = 3 elements per rank
    assert (s2.params, s2.grads, s2.optim) == (20, 6, 36)
    s2 = analytic.model_state_bytes(10, stage=2, n=4, padded=False)
    assert (s2.params, s2.grads, s2.optim) == (20, 5, 30)
    fp32 = analytic.model_state_bytes(1000, stage=0, n=8, recipe="fp32-adamw")
    assert (fp32.params, fp32.grads, fp32.optim) == (4000, 4000, 8000)
    one = [analytic.model_state_bytes(1000, stage=s, n=1).total for s in range(4)]
    assert one == [16_000] * 4
    with pytest.raises(ValueError, match="stage=4"):
        analytic.model_state_bytes(1000, stage=4, n=8)


def test_comm_volume_is_2psi_or_3psi() -> None:
    psi = 1_000_000
    vol = [analytic.comm_bytes_per_step(psi, stage=s, n=8) for s in range(4)]
    assert vol == [2 * psi * 2, 2 * psi * 2, 2 * psi * 2, 3 * psi * 2]
    assert analytic.comm_bytes_per_step(psi, stage=3, n=8, reshard_after_forward=False) == 4 * psi
    assert analytic.comm_bytes_per_step(psi, stage=0, n=1) == 0
    phases = [c.phase for c in analytic.collectives_per_step(psi, stage=2, n=8)]
    assert phases == ["backward", "step"]


def test_collective_compute_and_break_even_times() -> None:
    assert analytic.collective_time_s(8e9, n=8, bus_GBps=100) == pytest.approx(0.07)
    assert analytic.collective_time_s(8e9, n=1, bus_GBps=100) == 0.0
    t = analytic.compute_time_s(4096, flops_per_token=6e10, mfu=0.5, peak_flops=1e15)
    assert t == pytest.approx(4096 * 6e10 / 5e14)
    tokens = analytic.break_even_tokens(0.1, flops_per_token=6e10, mfu=0.5, peak_flops=1e15)
    assert analytic.compute_time_s(tokens, flops_per_token=6e10, mfu=0.5, peak_flops=1e15) == (
        pytest.approx(0.1)
    )


def test_stage3_and_bucket_buffers() -> None:
    assert analytic.unit_buffer_bytes(100, prefetch=1) == 2 * 100 * 4
    assert analytic.unit_buffer_bytes(100, prefetch=0, psi=1000, reshard_after_forward=False) == (
        1000 * 2 + 100 * 2
    )
    assert analytic.grad_bucket_bytes(25 * 2**20, in_flight=3) == 75 * 2**20


def test_shape_from_param_count_reproduces_llama2() -> None:
    for n, preset in ((7e9, "llama-7b"), (13e9, "llama-13b")):
        c, p = config_from_params(n), PRESETS[preset]
        assert (c.n_layers, c.hidden, c.ffn_dim, c.param_count()) == (
            p.n_layers, p.hidden, p.ffn_dim, p.param_count())


def test_recompute_flops() -> None:
    cfg = PRESETS["llama-7b"]
    base = cfg.flops_per_token(512)
    assert recompute_flops_per_token(cfg, 512, "none") == 0
    full = recompute_flops_per_token(cfg, 512, "full")
    assert 0.30 < full / base < 1 / 3  # about one more forward of the blocks (not the head)
    assert recompute_flops_per_token(cfg, 512, "selective") == 32 * 4 * 4096 * 512
    assert recompute_flops_per_token(cfg, 512, "every-2") == full // 2


def _plan(model: object, **kw: object):  # type: ignore[no-untyped-def]
    args = {"gpus": 8, "gpu_mem_bytes": 80 * GB, "seq_len": 4096, "micro_batch": 1,
            "interconnect_GBps": 400.0}
    return plan(model, **{**args, **kw})  # type: ignore[arg-type]


def test_llama_7b_on_8x80gb_rows_and_ladder() -> None:
    p = _plan("llama-7b")
    assert {(r.stage, r.activation_checkpointing) for r in p.rows} == {
        (s, c) for s in range(4) for c in ("none", "selective", "full")}
    for r in p.rows:
        assert r.total_bytes == r.model_state_bytes + r.activation_bytes + r.buffer_bytes
        assert r.fits == (r.total_bytes <= 80 * GB - reserve_bytes(80 * GB))
        assert r.step_time_s >= max(r.compute_time_s, 1e-12)
    assert not any(r.fits for r in p.rows if r.stage == 0)  # 16Ψ = 108 GB alone
    rec = p.recommendation
    assert rec.action in LADDER and rec.action in {"zero-1", "zero-2", "zero-3"}
    pick = (rec.stage, rec.activation_checkpointing)
    chosen = next(r for r in p.rows if (r.stage, r.activation_checkpointing) == pick)
    assert chosen.fits and rec.reason


def test_small_model_on_one_device_uses_one_device() -> None:
    p = _plan("llama-1b", gpus=1, seq_len=2048)
    assert (p.recommendation.action, p.recommendation.stage) == ("single-device", 0)
    assert all(r.comm_bytes_per_step == 0 for r in p.rows)
    p = _plan("llama-1b", gpus=8, seq_len=2048)
    assert (p.recommendation.action, p.recommendation.stage) == ("data-parallel", 0)


def test_layer_too_big_needs_tensor_parallelism() -> None:
    huge = LlamaConfig(n_layers=2, hidden=65536, n_heads=512, seq_len=4096, vocab=32000)
    p = _plan(huge, gpus=1024, seq_len=1024)
    assert p.recommendation.action == "tensor-parallel"
    assert p.recommendation.stage is None and "tensor parallelism" in p.recommendation.reason


def test_too_few_devices_says_how_many() -> None:
    p = _plan("llama-13b", gpus=1, gpu_mem_bytes=24 * GB, seq_len=1024, policies=("full",))
    assert p.recommendation.action == "more-devices"
    assert "devices" in p.recommendation.reason


def test_more_devices_make_a_cheaper_stage_fit() -> None:
    p = _plan("llama-13b", gpus=range(8, 65, 56), policies=("full",))
    fits = {(r.gpus, r.stage): r.fits for r in p.rows}
    assert not fits[8, 1] and fits[64, 1]
    assert "stage 1 fits from (devices, by checkpointing): full 64" in p.notes
    assert [r.gpus for r in p.by_gpus] == [8, 64]


@pytest.mark.parametrize(
    ("kw", "needle"),
    [({"gpus": 0}, "gpus=0"), ({"seq_len": 8192}, "seq_len=8192"),
     ({"interconnect_GBps": 0}, "interconnect_GBps=0"), ({"recipe": "sgd"}, "'sgd'")],
)
def test_plan_rejects_bad_inputs(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        _plan("llama-7b", **kw)


def test_step_time_overlap_model() -> None:
    """Backward-phase comm hides up to the backward compute; step-phase comm never does."""
    fpt, kw = 3e9, {"n": 2, "bus_GBps": 1.0, "mfu": 1.0, "peak_flops": 1e12}
    # 1000 tokens: compute 3 s, forward 1 s, backward 2 s.
    hidden = [analytic.Collective(op="all_reduce", phase="backward", logical_bytes=2 * 10**9)]
    t = analytic.step_time(hidden, tokens=1000, flops_per_token=fpt, **kw)  # 1 s of comm
    assert (t.compute_s, t.comm_s, t.exposed_comm_s) == pytest.approx((3.0, 1.0, 0.0))
    assert t.break_even_tokens == pytest.approx(500)
    late = [analytic.Collective(op="all_gather", phase="step", logical_bytes=2 * 10**9)]
    t = analytic.step_time(late, tokens=1000, flops_per_token=fpt, **kw)
    assert t.step_s == pytest.approx(4.0)
    fwd = [analytic.Collective(op="all_gather", phase="forward", logical_bytes=6 * 10**9)]
    t = analytic.step_time(fwd, tokens=1000, flops_per_token=fpt, **kw)  # 3 s vs 1 s window
    assert t.exposed_comm_s == pytest.approx(2.0)
