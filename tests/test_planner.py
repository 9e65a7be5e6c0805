"""Closed-form accounting (memory/analytic.py) and the planner's ladder (memory/planner.py)."""

from __future__ import annotations

import re
from decimal import ROUND_HALF_UP, Decimal

import pytest

from zeroshard.memory import analytic
from zeroshard.memory.activations import estimate_activation_bytes
from zeroshard.memory.analytic import recompute_flops_per_token
from zeroshard.memory.planner import config_from_params, plan, reserve_bytes
from zeroshard.models.config import PRESETS, LlamaConfig

GB = 10**9
# Llama-3-8B's shape (HF config.json): untied embeddings, GQA, vocab 128256.
LLAMA3_8B = LlamaConfig(n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, intermediate=14336,
                        seq_len=8192, vocab=128256, rope_theta=500000.0)
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
    """[Note: stage-3 buffers]: the root held whole all step, its head's gradients all
    backward; (k+1) blocks' weights and two blocks' gradients in backward; the root's
    gradients twice at its reduction, its weights freed (tests/test_traced.py checks both
    against a trace)."""
    b3 = analytic.stage3_buffer_bytes(block=100, root=40, head=30, prefetch=1)  # bf16: P = G = 2
    assert b3.backward == 2 * 40 + 2 * 30 + (2 * 2 + 2 * 2) * 100
    assert b3.root_reduce == 2 * 2 * 40 + 2 * 100
    assert b3.peak == b3.backward == 940
    # The planner adds what they put on top of the activations' peak.
    assert b3.beside(10**6) == b3.backward
    big_root = analytic.stage3_buffer_bytes(block=10, root=1000, head=500, prefetch=1)
    assert big_root.root_reduce == 4 * 1000 + 2 * 10 > big_root.backward == 2000 + 1000 + 80
    assert big_root.beside(0) == big_root.root_reduce
    assert big_root.beside(500) == big_root.root_reduce - 500
    assert big_root.beside(10**6) == big_root.backward
    fp32 = analytic.stage3_buffer_bytes(block=100, root=0, head=0, prefetch=2, recipe="fp32-adamw")
    assert fp32.backward == (3 * 4 + 2 * 4) * 100
    with pytest.raises(ValueError, match="prefetch=-1"):
        analytic.stage3_buffer_bytes(block=1, root=1, head=1, prefetch=-1)
    assert analytic.grad_bucket_bytes(25 * 2**20, in_flight=3) == 75 * 2**20


def test_stage3_root_and_head_of_the_presets() -> None:
    """The root is everything outside the blocks; the head is what gets its gradient first
    in backward: the LM head (for a tied table, its head part: the whole table) and the
    final norm."""
    llama, gpt2 = PRESETS["llama-7b"], PRESETS["gpt2-124m"]
    assert analytic.root_params(llama) == 2 * 32000 * 4096 + 4096  # embedding, head, norm
    assert analytic.head_params(llama) == 32000 * 4096 + 4096
    tied = PRESETS["llama-1b"]
    assert analytic.root_params(tied) == analytic.head_params(tied) == 128256 * 2048 + 2048
    assert analytic.root_params(gpt2) == 50257 * 768 + 1024 * 768 + 2 * 768  # wte, wpe, ln_f
    assert analytic.head_params(gpt2) == 50257 * 768 + 2 * 768


def test_stage3_peak_moments() -> None:
    """[Note: stage-3 peak]: the buffers beside what else exists at each moment. Backward
    begins with every activation and no gradient slice; by the end of the blocks'
    backward (block k running) the L-k-1 blocks above have issued their slices and freed
    their activations; the root's reduction comes after every block's slice, the
    optimizer step after every slice and its fp32 copy."""
    kw = {"block": 100, "blocks": 4, "root": 40, "head": 30, "n": 10}
    b3 = analytic.stage3_buffer_bytes(block=100, root=40, head=30, prefetch=1)
    ms = analytic.stage3_moments(**kw, activations=5000, late_activations=300,
                                 head_activations=400, saved_activations=4900,
                                 loss_gradients=200)
    assert [(m.name, m.grad_slices, m.activations, m.buffers) for m in ms] == [
        ("loss's backward", 0, 4900, 2 * 40 + 200),  # only the root gathered (bf16)
        ("backward begins", 0, 5000 - 400, b3.backward),  # the head's freed
        ("end of the blocks' backward", 2 * 2 * 100 // 10, 300, b3.backward),  # 2 blocks
        ("root's reduction", 2 * 400 // 10, 0, b3.root_reduce),  # all 4, not the root's
        ("optimizer step", 2 * 44, 0, 4 * 44)]  # ceil(440 / 10) = 44 elements per rank
    assert max(ms, key=lambda m: m.total).name == "backward begins"
    # A vocabulary far larger than the blocks: the loss's two fp32 gradients decide.
    wide = analytic.stage3_moments(**kw, activations=5000, late_activations=300,
                                   head_activations=3000, saved_activations=4900,
                                   loss_gradients=4000)
    assert max(wide, key=lambda m: m.total).name == "loss's backward"
    # Small activations: the slices decide, at the end of the blocks' backward.
    small = analytic.stage3_moments(**kw, activations=20, late_activations=10)
    peak = max(small, key=lambda m: m.total)
    assert (peak.name, peak.total) == ("end of the blocks' backward", 40 + 10 + b3.backward)
    # No gathered block below block k: its end is the start (prefetch >= blocks - 1).
    deep = analytic.stage3_moments(**kw, activations=50, late_activations=10, prefetch=3)
    assert deep[2].grad_slices == 0
    # fp32: the masters step the slices themselves (no copy); offload: all on the host.
    fp32 = analytic.stage3_moments(**kw, activations=0, late_activations=0,
                                   recipe="fp32-adamw")
    assert (fp32[4].grad_slices, fp32[4].buffers) == (4 * 44, 0)
    off = analytic.stage3_moments(**kw, activations=0, late_activations=0, offload=True)
    assert all(m.grad_slices == 0 for m in off) and off[4].buffers == 0
    with pytest.raises(ValueError, match="N=0"):
        analytic.stage3_moments(**{**kw, "n": 0}, activations=0, late_activations=0)


def test_stage3_late_activations_by_policy() -> None:
    """What is still saved when block k runs backward: the k+1 lowest blocks' share under
    the policy, beside the same recompute working set as at the peak."""
    from zeroshard.memory.planner import _activation_bytes

    cfg = PRESETS["llama-7b"]
    est = estimate_activation_bytes(cfg, 1, 1024, "none", dtype_bytes=2)
    blk, inp, scores = est.block_bytes, est.input_bytes, est.scores_bytes

    def late(policy: str, prefetch: int = 1) -> int:
        return _activation_bytes(cfg, micro_batch=1, seq_len=1024, policy=policy,
                                 dtype_bytes=2, prefetch=prefetch)[1]

    assert late("none") == 2 * blk
    assert late("full") == 2 * inp + blk and late("full", prefetch=0) == inp + blk
    assert late("selective") == 2 * (blk - scores) + scores
    assert late("every-2") == blk + inp + blk  # block 0 whole, block 1 checkpointed


def test_llama_8b_untied_stage3_buffers() -> None:
    """Issue: an 8B Llama with untied embeddings priced its stage-3 buffers at 8.4 GB,
    "(k+1) x the largest unit (the root: embeddings + LM head) x (P+G)". The engine holds
    4.90 GB while the blocks run backward and 4.64 GB at the root's reduction, after the
    weights are freed (traced to the byte: tests/test_traced.py). Beside the activations'
    peak no gradient slice exists yet; with full checkpointing the end of the blocks'
    backward, 30 slices and two blocks' inputs, holds more (traced within 1%)."""
    p = _plan(LLAMA3_8B, seq_len=2048, policies=("none", "full"))
    b3 = analytic.stage3_buffer_bytes(block=218_112_000, root=1_050_677_248, head=525_340_672)
    assert (b3.backward, b3.root_reduce) == (4_896_931_840, 4_638_932_992)
    shards = (2 + 12) * LLAMA3_8B.param_count() // 8  # weights and optimizer state
    moment = {"none": "loss's backward", "full": "end of the blocks' backward"}
    for r in (r for r in p.rows if r.stage == 3):
        assert r.peak_moment == moment[r.activation_checkpointing]
        loss = 2 * 2048 * 128256 * 4  # the loss's two fp32 gradients, at its backward
        assert r.buffer_bytes == {"none": 2 * 1_050_677_248 + loss, "full": b3.backward}[
            r.activation_checkpointing] < 8.4 * GB  # the loss's: the root gathered alone
        assert r.total_bytes < r.model_state_bytes + r.activation_bytes + r.buffer_bytes
    none, full = (next(r for r in p.rows if (r.stage, r.activation_checkpointing) == (3, c))
                  for c in ("none", "full"))
    # no checkpointing: the loss's backward, everything forward saved beside the loss's
    # two fp32 gradients (each as large as its log-softmax) and the gathered root
    saved = estimate_activation_bytes(LLAMA3_8B, 1, 2048, "none", dtype_bytes=2)
    lsm = saved.outside["cross-entropy log-softmax output (b*s*V, fp32)"]
    assert lsm == 2048 * 128256 * 4
    assert none.total_bytes == shards + saved.total + 2 * lsm + 2 * 1_050_677_248
    est = estimate_activation_bytes(LLAMA3_8B, 1, 2048, "full", dtype_bytes=2)
    late = 2 * est.input_bytes + est.block_bytes  # blocks 1 and 0's inputs, 1's recompute
    assert full.total_bytes == shards + 30 * 218_112_000 * 2 // 8 + late + b3.backward
    small = analytic.stage3_buffer_bytes(block=1_000, root=10_000, head=5_000)
    assert small.root_reduce > small.backward  # a root far above the blocks': its reduction
    assert small.beside(0) == small.root_reduce and small.beside(10**9) == small.backward


def test_nothing_fits_names_the_terms_that_exceed_a_device() -> None:
    """Issue: a 1T model on 8 x 80 GB said "activations alone exceed a device" while its own
    figures showed 35.6 GB of activations in 72 GB usable: activations plus stage 3's
    buffers do not fit, whatever the device count."""
    p = _plan(1e12, policies=("none", "full"))
    full = next(r for r in p.rows if (r.stage, r.activation_checkpointing) == (3, "full"))
    cfg = p.config
    b3 = analytic.stage3_buffer_bytes(block=analytic.block_params(cfg),
                                      root=analytic.root_params(cfg),
                                      head=analytic.head_params(cfg))
    fixed = b3.beside(full.activation_bytes)  # the buffers' share of the peak no N shrinks
    assert full.activation_bytes < 72 * GB < full.activation_bytes + fixed
    reason = p.recommendation.reason
    assert "alone" not in reason and "no device count will" in reason
    assert "when backward begins, before any model state, more than the 72.0 GB usable" in reason
    assert f"+ stage-3 gathered units and unit gradients {fixed / GB:.1f} GB" in reason
    # Activations alone over a device: said so, and the buffers named as what comes on top.
    huge = _plan(1e12, policies=("none",)).recommendation.reason
    assert "activations (no checkpointing)" in huge and "by themselves" in huge
    assert "before stage-3 gathered units and unit gradients" in huge


def test_no_device_count_helps_is_tensor_parallel_with_followable_advice() -> None:
    """Issue: 1T on 8 (or 8-1024) x 80 GB said "Recommendation: more devices" with a reason
    saying more devices will not help, and advised lowering a micro-batch already at 1."""
    p = _plan(1e12, gpus=[8, 1024])
    assert [r.action for r in p.by_gpus] == ["tensor-parallel"] * 2
    rec = p.recommendation
    assert (rec.action, rec.gpus, rec.stage) == ("tensor-parallel", 1024, None)
    why = rec.reason
    assert "more-devices" not in why and "more devices shrink only the model state" in why
    assert "tensor parallelism" in why and "micro-batch" not in why  # it is 1 already
    assert "--policies full" not in why  # full checkpointing is planned, and is the leanest
    assert "a shorter sequence (--seq)" in why and "offload_activations=True" in why
    assert "bring the activations under 21.2 GB (72.0 GB less 50.8 GB)" in why
    # prefetch 0 is priced, not promised; optimizer offload moves only model state.
    assert "cuts the buffers to 39.2 GB: 74.7 GB, still over" in why
    assert "--offload does not help" in why
    # A micro-batch above 1 and no full checkpointing planned: both are advised.
    two = _plan(1e12, micro_batch=2, policies=("none",)).recommendation
    assert two.action == "tensor-parallel"
    assert "a smaller micro-batch than 2 (--micro-batch)" in two.reason
    assert "full checkpointing (--policies full" in two.reason
    # A root whose reduction alone exceeds a device: no activation advice at all.
    vocab = LlamaConfig(n_layers=4, hidden=1024, n_heads=8, seq_len=4096, vocab=1_000_000)
    root = _plan(vocab, gpus=1, gpu_mem_bytes=8 * GB, seq_len=128, policies=("full",))
    assert root.recommendation.action == "tensor-parallel"
    assert "at the root's reduction" in root.recommendation.reason
    assert "--seq" not in root.recommendation.reason


_AT = {"backward begins": "when backward begins",
       "end of the blocks' backward": "at the end of the blocks' backward",
       "root's reduction": "at the root's reduction",
       "optimizer step": "at the optimizer step"}


@pytest.mark.parametrize(("model", "kw", "need", "moment"), [
    (1e12, {"gpu_mem_bytes": 80 * GB, "seq_len": 512}, 841, "backward begins"),
    (70e9, {}, 20, "optimizer step"),
    ("llama-13b", {"gpus": 1, "gpu_mem_bytes": 24 * GB, "seq_len": 1024}, 13,
     "optimizer step"),
    ("llama-7b", {"gpus": 1, "gpu_mem_bytes": 8 * GB, "seq_len": 128,
                  "policies": ("full",)}, 27, "end of the blocks' backward"),
    (LlamaConfig(n_layers=4, hidden=1024, n_heads=8, seq_len=4096, vocab=1_000_000),
     {"gpus": 1, "gpu_mem_bytes": 12 * GB, "seq_len": 128, "policies": ("full",)}, 13,
     "root's reduction"),
])
def test_more_devices_figures_are_the_rows_at_that_count(model: object, kw: dict[str, object],
                                                         need: int, moment: str) -> None:
    """Issue: "fits on 842+ devices ... leave 16.7 GB for its model state (16Ψ/N)" gave 962
    by its own arithmetic, and the 70B one named 9.7 GB of buffers where the row at N=20
    has 14.2 GB: the search uses the stage-3 peak (the largest of its moments), the text
    divided a remainder by 16Ψ. Now every figure is the row's at that N, or sums to it."""
    rec = _plan(model, **kw).recommendation
    why = rec.reason
    assert rec.action == "more-devices" and f"fits on {need}+ devices" in why
    assert "leave" not in why and "16Ψ/N bytes" not in why
    pol = re.search(r"with (\S+) activation checkpointing fits", why).group(1)
    pol = "none" if pol == "no" else pol
    rows = _plan(model, **{**kw, "gpus": [need - 1, need]}).rows
    prev, row = (next(r for r in rows if (r.gpus, r.stage, r.activation_checkpointing,
                                          r.hybrid) == (k, 3, pol, None))
                 for k in (need - 1, need))
    assert row.fits and not prev.fits and row.peak_moment == moment
    assert f"On {need} devices it peaks {_AT[moment]}" in why
    d = len(re.search(r" = \d+\.(\d+) GB \(the state", why).group(1))

    def f(b: int) -> str:
        return f"{b / GB:.{d}f} GB"

    assert f"model state {f(row.model_state_bytes)} (16Ψ/N)" in why
    assert f"{f(row.buffer_bytes)} = {f(row.total_bytes)} (the state" in why
    assert f"on {need - 1} devices, {f(prev.total_bytes)}." in why
    if moment == "backward begins":  # the head's freed: of the row's act column
        assert f"(of {f(row.activation_bytes)} at their peak)" in why
    # The signed terms add up to the total, to the rounding of each.
    body = why.split(f"it peaks {_AT[moment]}")[1].split(": ", 1)[1].split(" (the state")[0]
    terms, total = body.rsplit(" = ", 1)
    nums = [(-1 if sign == "−" else 1) * float(re.search(r"(\d+\.\d+) GB", t).group(1))
            for sign, t in zip(["+", *re.findall(r" ([+−]) ", terms)],
                               re.split(r" [+−] ", terms))]
    assert abs(sum(nums) - float(total.split()[0])) <= (len(nums) + 1) * 0.5 * 10**-d


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
        held = r.model_state_bytes + r.activation_bytes + r.buffer_bytes
        if r.stage < 3:  # [Note: the step's moments, stages 0-2]
            begins = r.params_bytes + r.optim_bytes + r.activation_bytes
            assert r.total_bytes >= max(begins, r.model_state_bytes)
            if r.peak_moment == "backward begins":  # no gradient yet; the loss's two fp32
                assert r.total_bytes < held         # gradients beside the activations
            else:  # the optimizer step's: no activations, the fp32 copies
                assert r.peak_moment == "optimizer step"
                assert r.total_bytes == r.model_state_bytes + r.buffer_bytes
        else:  # one moment's, at which not every gradient slice or activation exists
            assert r.total_bytes < held and r.peak_moment is not None
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
    assert "fits on 13+ devices" in p.recommendation.reason
    # ... the fewest on which its row fits: at 12 the optimizer step (16Ψ/N of model state
    # and the 4Ψ/N fp32 gradient copies) is over the 21.6 GB usable.
    fits = {n: next(r for r in _plan("llama-13b", gpus=n, gpu_mem_bytes=24 * GB,
                                     seq_len=1024, policies=("full",)).rows
                    if r.stage == 3) for n in (12, 13)}
    assert not fits[12].fits and fits[13].fits and fits[12].peak_moment == "optimizer step"


def test_more_devices_make_a_cheaper_stage_fit() -> None:
    p = _plan("llama-13b", gpus=range(8, 65, 56), policies=("full",))
    fits = {(r.gpus, r.stage): r.fits for r in p.rows}
    assert not fits[8, 1] and fits[64, 1]
    assert "stage 1 fits from (devices, by checkpointing): full 64" in p.notes
    assert [r.gpus for r in p.by_gpus] == [8, 64]


@pytest.mark.parametrize(
    ("kw", "needle"),
    [({"gpus": 0}, "gpus=0"), ({"seq_len": 8192}, "seq_len=8192"),
     ({"interconnect_GBps": 0}, "interconnect_GBps=0"), ({"recipe": "sgd"}, "'sgd'"),
     ({"peak_flops": 0}, "peak_flops=0")],
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


def test_stage1_reduces_into_its_gradient_buffer() -> None:
    """Stage 1 keeps its reduced slice inside the whole gradient buffer ([Note: buffer
    lifetimes] in engine.py): no buffer beyond the (P+G)Ψ + KΨ/N of model state."""
    p = _plan("llama-7b")
    psi = p.params
    for r in p.rows:  # without checkpointing the peak is where backward begins
        if r.stage == 1 and r.peak_moment == "backward begins":
            assert r.buffer_bytes == 0 and r.model_state_bytes == 4 * psi + 12 * psi // 8
        if r.stage == 2 and r.peak_moment == "backward begins":
            assert r.buffer_bytes == 3 * 25 * 2**20
    assert {r.peak_moment for r in p.rows if r.stage in (1, 2)
            and r.activation_checkpointing == "none"} == {"backward begins"}
    # with full checkpointing the optimizer step is the larger moment: its buffers are
    # the fp32 gradient copies and one bucket of the refresh (the token table's, larger
    # than 25 MiB: a bucket of its own) — see [Note: the step's moments, stages 0-2]
    cfg = p.config
    full = {r.stage: r for r in p.rows if r.activation_checkpointing == "full"}
    table = 2 * cfg.vocab * cfg.hidden
    assert full[0].buffer_bytes == 4 * psi and full[0].peak_moment == "optimizer step"
    for stage in (1, 2):
        assert full[stage].buffer_bytes == 4 * -(-psi // 8) + table
        assert full[stage].peak_moment == "optimizer step"


def test_hybrid_collectives_and_group_bandwidths() -> None:
    psi = 8_000_000
    colls = analytic.hybrid_collectives_per_step(psi, stage=3, shard=8, replicate=4)
    assert [(c.op, c.phase, c.group, c.ranks) for c in colls] == [
        ("all_gather", "forward", "shard", 8), ("all_gather", "backward", "shard", 8),
        ("reduce_scatter", "backward", "shard", 8), ("all_reduce", "backward", "replicate", 4)]
    assert colls[-1].logical_bytes == 2 * psi * 2 // 8  # the Ψ/G slice, all-reduced
    assert sum(c.logical_bytes for c in colls[:-1]) == 3 * psi * 2
    assert len(analytic.hybrid_collectives_per_step(psi, stage=2, shard=8, replicate=1)) == 2
    with pytest.raises(ValueError, match="stage=0"):
        analytic.hybrid_collectives_per_step(psi, stage=0, shard=8, replicate=4)
    # The replicate ring runs over its own ranks at its own bandwidth.
    kw = {"tokens": 1000, "flops_per_token": 3e9, "mfu": 1.0, "peak_flops": 1e12}
    t = analytic.step_time(colls[-1:], n=8, bus_GBps=100.0, bus_by_group={"replicate": 1.0}, **kw)
    assert t.comm_s == pytest.approx(colls[-1].logical_bytes * 3 / 4 / 1e9)


def test_hybrid_sharding_on_4_nodes_of_8() -> None:
    """llama-7b, 4 nodes x 8 devices, 400 GB/s NVLink inside a node, 50 GB/s between.

    Figures (estimates, seq 4096, micro-batch 1, MFU 0.4):
      stage 3 full over 32:   comm 40.4 GB, all across nodes, 0.783 s; step 0.804 s
      stage 3 hybrid 4 x 8:   comm 43.8 GB, 3.4 GB across nodes, 0.139 s; step 0.479 s
      stage 2 full over 32:   comm 27.0 GB, 0.522 s; step 0.738 s
      stage 2 hybrid 4 x 8:   comm 30.3 GB, 3.4 GB across nodes, 0.109 s; step 0.507 s
    Hybrid stage 3 is only ~6% faster than hybrid stages 1-2 (under the 10% stage-3 bar),
    so the pick is hybrid stage 1 without checkpointing (51.9 GB of 72 GB: stages 1 and 2
    peak alike where backward begins, every activation and no gradient yet, and stage 1
    is the lower; [Note: the step's moments, stages 0-2]).
    """
    p = _plan("llama-7b", gpus=32, gpus_per_node=8, inter_GBps=50.0)
    psi = p.params
    row = {(r.stage, r.activation_checkpointing, r.hybrid, r.secondary, r.zeropp): r
           for r in p.rows}
    full, hyb = row[3, "none", None, None, False], row[3, "none", "4 x 8", None, False]
    assert {r.hybrid for r in p.rows} == {None, "4 x 8"}
    assert not any(r.hybrid for r in p.rows if r.stage == 0)
    # Full sharding: every collective crosses nodes, at the slower link.
    assert full.cross_node_bytes_per_step == full.comm_bytes_per_step == 3 * psi * 2
    assert full.comm_time_s == pytest.approx(3 * psi * 2 * 31 / 32 / 50e9)
    assert full.cross_node_time_s == full.comm_time_s
    # Hybrid: 3Ψ inside the node at 400 GB/s over 8, plus 2Ψ·2/8 across nodes over 4.
    assert hyb.cross_node_bytes_per_step == 2 * psi * 2 // 8
    assert hyb.comm_bytes_per_step == 3 * psi * 2 + 2 * psi * 2 // 8
    assert hyb.cross_node_time_s == pytest.approx(2 * psi * 2 / 8 * 3 / 4 / 50e9)
    assert hyb.comm_time_s == pytest.approx(3 * psi * 2 * 7 / 8 / 400e9 + hyb.cross_node_time_s)
    assert (round(full.comm_time_s, 3), round(hyb.comm_time_s, 3)) == (0.783, 0.139)
    # Memory: sharded over the 8 devices of a node, as stage 3 on 8.
    assert hyb.model_state_bytes == _plan("llama-7b").rows[9].model_state_bytes == 16 * psi // 8
    assert hyb.tokens_per_s == pytest.approx(32 * 4096 / hyb.step_time_s)
    # The pick: hybrid, because its step time is better than any fitting full-sharding row.
    rec = p.recommendation
    best_full = min(r.step_time_s for r in p.rows if r.fits and r.hybrid is None
                    and r.secondary is None)
    best_hyb = min(r.step_time_s for r in p.rows if r.fits and r.hybrid)
    assert best_hyb < best_full
    assert (rec.hybrid, rec.stage, rec.activation_checkpointing, rec.action) == (
        "4 x 8", 1, "none", "zero-1")
    assert "hybrid sharding (4 x 8" in rec.reason.lower() and "instead of 2Ψ" in rec.reason
    assert "0.109 s vs 0.522 s of communication" in rec.reason
    assert any("stage 3 on 32 devices" in n and "0.783 s" in n and "0.139 s" in n
               for n in p.notes)
    # Stage 3 with a secondary shard per node (hpZ, k = 8): backward's all-gather over the
    # 8 devices of a node at 400 GB/s; the forward all-gather and the reduce-scatter still
    # cross nodes; each block keeps 1/8 of its bf16 weights from forward to its backward.
    hpz = row[3, "none", None, 8, False]
    assert hpz.cross_node_bytes_per_step == 2 * psi * 2
    assert hpz.comm_bytes_per_step == full.comm_bytes_per_step
    assert hpz.comm_time_s == pytest.approx(2 * psi * 2 * 31 / 32 / 50e9
                                            + psi * 2 * 7 / 8 / 400e9)
    from zeroshard.memory.analytic import block_params
    from zeroshard.models import get_preset

    cfg = get_preset("llama-7b")
    kept = cfg.n_layers * 2 * -(-block_params(cfg) // 8)
    assert hpz.peak_moment == full.peak_moment
    assert hpz.total_bytes - full.total_bytes == kept


def test_single_node_rows_have_no_cross_node_traffic() -> None:
    p = _plan("llama-7b", gpus=[8, 16], gpus_per_node=8, inter_GBps=50.0)
    assert not any(r.hybrid or r.cross_node_bytes_per_step for r in p.rows if r.gpus == 8)
    assert {r.hybrid for r in p.rows if r.gpus == 16} == {None, "2 x 8"}
    # Without gpus_per_node every count is one node: the old plan, unchanged.
    assert all(r.hybrid is None and r.cross_node_time_s == 0 for r in _plan("llama-7b").rows)


@pytest.mark.parametrize(
    ("kw", "needles"),
    [({"gpus": 12, "gpus_per_node": 8}, ["gpus=12", "gpus_per_node=8", "gpus=8 or 16"]),
     ({"inter_GBps": 50.0}, ["inter_GBps=50.0", "gpus_per_node"]),
     ({"gpus_per_node": 0}, ["gpus_per_node=0"]),
     ({"host_mem_bytes": 10**12}, ["host_mem_bytes", "offload=True"]),
     ({"offload": True, "pcie_GBps": 0}, ["pcie_GBps=0"])],
)
def test_hybrid_and_offload_reject_bad_inputs(kw: dict[str, object], needles: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        _plan("llama-7b", **kw)
    for needle in needles:
        assert needle in str(err.value)


def test_offload_moves_optimizer_state_to_the_host() -> None:
    p = _plan("llama-7b", offload=True, pcie_GBps=25.0, host_GBps=20.0)
    psi, n = p.params, 8
    for r in p.rows:
        if r.stage == 0:  # nothing to offload: plain data parallelism keeps it all
            assert not r.offload and r.host_bytes == 0 and r.offload_time_s == 0
            continue
        assert r.offload and r.optim_bytes == 0
        # fp32 master + Adam m + v (12Ψ/N), the bf16 gradient slice and its fp32 cast (6Ψ/N),
        # the bf16 staging slice for the updated weights (2Ψ/N)
        assert r.host_bytes == 20 * psi // n
        device = {1: (2 + 2) * psi, 2: 2 * psi, 3: 2 * psi // n}  # no gradient at stages 2-3
        assert r.model_state_bytes == device[r.stage]
        transfer = (2 * psi // n + 2 * psi // n) / 25e9  # gradient slice down, weights up
        assert r.offload_time_s == pytest.approx(transfer + 12 * psi // n / 20e9)
        assert r.step_time_s == pytest.approx(
            r.compute_time_s + r.exposed_comm_time_s + r.offload_time_s)
    ot = analytic.offload_time_s(psi, n=n, pcie_GBps=25.0, host_GBps=20.0)
    assert (ot.d2h_s, ot.h2d_s) == pytest.approx((2 * psi / n / 25e9,) * 2)
    # fp32 AdamW: K = 8 (m, v) excludes the master, which the host keeps as a 4-byte copy.
    assert analytic.host_optimizer_bytes(1000, n=8, recipe="fp32-adamw") == 125 * 12
    assert analytic.host_grad_bytes(1000, n=8, recipe="fp32-adamw") == 125 * 4  # no cast
    # On 8 x 80 GB stage 2 fits without offload and is faster: the reason says so.
    assert "Without offload" in p.recommendation.reason and p.recommendation.offload


def test_offload_params_moves_stage3_weights_to_the_host() -> None:
    # llama-13b on one 80 GB device: "optimizer" still keeps 2Ψ of weights (26 GB) at
    # stage 3; "optimizer+params" keeps no model state there, only a gathered unit or two.
    p = _plan("llama-13b", gpus=1, offload="optimizer+params", pcie_GBps=25.0)
    psi = p.params
    for r in p.rows:
        if r.stage != 3:
            assert not r.offload_params
            continue
        assert r.offload_params and r.model_state_bytes == 0 and r.buffer_bytes > 0
        assert r.host_bytes == 12 * psi + 6 * psi + 2 * psi  # state, gradient, weights
        ot = analytic.offload_time_s(psi, n=1, pcie_GBps=25.0, params=True)
        assert ot.h2d_s == pytest.approx(2 * 2 * psi / 25e9)  # up once per gather, twice
    assert p.offload_mode == "optimizer+params"
    plain = _plan("llama-13b", gpus=1, offload=True)
    s3 = next(r for r in plain.rows if r.stage == 3)
    assert s3.model_state_bytes == 2 * psi and not s3.offload_params
    with pytest.raises(ValueError, match="offload='params' is not an offload mode"):
        _plan("llama-7b", offload="params")


def test_offload_host_memory_check_and_single_device() -> None:
    # llama-7b on one 80 GB device: only offload fits (16Ψ = 108 GB; (P+G)Ψ = 27 GB).
    p = _plan("llama-7b", gpus=1, offload=True, host_mem_bytes=256 * GB)
    rec = p.recommendation
    assert (rec.action, rec.offload) == ("single-device", True)
    assert any("134.8 GB per node of 256.0 GB" in n for n in p.notes)
    # 8 ranks of a node share its host memory: 8 x 20Ψ/8 = 134.8 GB > 64 GB.
    small = _plan("llama-7b", offload=True, host_mem_bytes=64 * GB)
    assert not any(r.fits for r in small.rows if r.offload)
    assert all(r.total_bytes <= r.usable_bytes for r in small.rows if r.offload)
    assert small.recommendation.action == "more-devices"
    assert "host memory" in small.recommendation.reason


# -- tensor parallelism planned (issue #30) ----------------------------------------------
def test_plan_tp_rows_price_one_tp_rank() -> None:
    """Each tp row prices one rank: the state of its tp piece sharded over N / tp, its
    sequence-parallel activations, its tp collectives (all exposed) and 1/tp of the
    compute; tokens/s counts N / tp replicas. No stage-0 rows (zeroshard refuses it)."""
    from zeroshard.memory.planner import _activation_bytes
    from zeroshard.memory.tensor_parallel import tp_collectives_per_step, tp_param_count

    cfg, n, tp, seq = LLAMA3_8B, 16, 4, 4096
    p = plan(cfg, gpus=n, gpu_mem_bytes=80 * GB, seq_len=seq, micro_batch=2,
             interconnect_GBps=400, tp=tp)
    plain = plan(cfg, gpus=n // tp, gpu_mem_bytes=80 * GB, seq_len=seq, micro_batch=2,
                 interconnect_GBps=400)
    assert {x.stage for x in p.rows} == {1, 2, 3} and {x.tp for x in p.rows} == {tp}
    assert p.params == cfg.param_count() and p.tp_params == tp_param_count(cfg, tp)
    for x in p.rows:
        state = analytic.model_state_bytes(tp_param_count(cfg, tp), stage=x.stage, n=n // tp)
        assert x.model_state_bytes == state.total
        act = _activation_bytes(cfg, micro_batch=2, seq_len=seq, policy=x.activation_checkpointing,
                                dtype_bytes=2, tp=tp)[0]
        assert x.activation_bytes == act
        colls = tp_collectives_per_step(cfg, micro_batch=2, seq_len=seq, tp=tp, act_bytes=2,
                                        policy=x.activation_checkpointing, norm_grad_bytes=2)
        assert x.tp_comm_bytes_per_step == sum(c.logical_bytes for c in colls) > 0
        assert x.tp_comm_time_s > 0
        assert x.tokens_per_s == pytest.approx((n // tp) * 2 * seq / x.step_time_s)
        same = next(y for y in plain.rows if (y.stage, y.activation_checkpointing) ==
                    (x.stage, x.activation_checkpointing))
        assert x.compute_time_s == pytest.approx(same.compute_time_s / tp)  # 1/tp of the work
        if x.stage < 3:  # the dp volume: the rank's tp piece over N / tp ranks
            assert x.comm_bytes_per_step == sum(c.logical_bytes for c in analytic.collectives_per_step(
                tp_param_count(cfg, tp), stage=x.stage, n=n // tp))


def test_plan_tp_one_is_the_plain_plan() -> None:
    kw = {"gpus": [8, 16], "gpu_mem_bytes": 80 * GB, "seq_len": 4096, "micro_batch": 1,
          "interconnect_GBps": 400}
    assert plan(LLAMA3_8B, **kw) == plan(LLAMA3_8B, **kw, tp=1)


def test_plan_tp_more_devices_counts_whole_tp_groups() -> None:
    """Where nothing fits, the fewest devices named is a multiple of tp (N / tp replicas)."""
    cfg = config_from_params(56e9)  # 66 heads: tp 2 divides them
    p = plan(cfg, gpus=8, gpu_mem_bytes=80 * GB, seq_len=4096, micro_batch=1,
             interconnect_GBps=400, tp=2)
    rec = p.recommendation
    assert rec.action == "more-devices"
    need = int(re.search(r"fits on (\d+)\+ devices", rec.reason).group(1))
    assert need % 2 == 0
    at = plan(cfg, gpus=[need - 2, need], gpu_mem_bytes=80 * GB, seq_len=4096, micro_batch=1,
              interconnect_GBps=400, tp=2)
    fits = {n: any(x.fits for x in at.rows if x.gpus == n) for n in (need - 2, need)}
    assert fits == {need - 2: False, need: True}


@pytest.mark.parametrize("kw, match", [
    ({"gpus": 6, "tp": 4}, "not multiples of tp=4"),
    ({"gpus": 8, "tp": 2, "offload": True}, "offload with tp > 1"),
    ({"gpus": 16, "tp": 8, "gpus_per_node": 4}, "must stay inside a node"),
    ({"gpus": 8, "tp": 0}, "must be a positive integer"),
    ({"gpus": 8, "tp": 3}, "does not divide the attention heads"),
])
def test_plan_tp_refusals(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan(LLAMA3_8B, gpu_mem_bytes=80 * GB, seq_len=4096, micro_batch=1,
             interconnect_GBps=400, **kw)


def test_zeropp_rows_price_each_collective_on_its_link() -> None:
    """Stage 3 with ZeRO++'s three on 4 nodes of 8 at 12.5 GB/s between nodes (100 Gbps):
    the forward all-gather in int8 across all 32 devices, backward's from the secondary
    shard over a node at 400 GB/s, the gradients' int4 hops inside the node and across
    it; the plan says so where the inter-node link dominates stage 3's step."""
    p = _plan("llama-7b", gpus=32, gpus_per_node=8, inter_GBps=12.5)
    psi = p.params
    row = {(r.stage, r.activation_checkpointing, r.hybrid, r.secondary, r.zeropp): r
           for r in p.rows}
    plain, hpz, zpp = (row[3, "none", None, s, z] for s, z in
                       ((None, False), (8, False), (8, True)))
    w8, g4 = psi * (1 + 4 / 256), psi * (0.5 + 4 / 256)
    assert zpp.cross_node_bytes_per_step == pytest.approx(w8 + g4 / 8, abs=2)
    assert zpp.comm_time_s == pytest.approx(
        w8 * 31 / 32 / 12.5e9 + psi * 2 * 7 / 8 / 400e9 + g4 * 7 / 8 / 400e9
        + g4 / 8 * 3 / 4 / 12.5e9, rel=1e-6)
    assert zpp.total_bytes == hpz.total_bytes  # error feedback off: no residuals
    assert plain.tokens_per_s < hpz.tokens_per_s < zpp.tokens_per_s
    assert any("inter-node link dominates" in n and "reshard_after_forward=8" in n
               and "quantize_grads='int4'" in n for n in p.notes)
    one_node = _plan("llama-7b", gpus=8, gpus_per_node=8)
    assert not any(r.secondary for r in one_node.rows)  # one node: nothing to keep inside


def test_given_activations_pose_the_classic_exercise() -> None:
    """plan --activations 25GB: a 13B model on 80 GB devices with ~25 GB for activations
    and buffers — stage 3 on 8 (stage 2 misses: 73.8 GB), stage 2 on 16 (62.4 GB)."""
    from zeroshard.memory.planner import plan

    p = plan("llama-13b", gpus=[8, 16], gpu_mem_bytes=80 * 10**9, seq_len=4096, micro_batch=1,
             interconnect_GBps=400, activation_bytes=25 * 10**9)
    rows = {(r.gpus, r.stage): r for r in p.rows if r.activation_checkpointing == "none"}
    for (_n, _stage), r in rows.items():
        assert r.total_bytes == r.model_state_bytes + 25 * 10**9
        assert r.activation_bytes == 25 * 10**9 and r.buffer_bytes == 0
        assert r.peak_moment == "given"
    assert not rows[(8, 2)].fits and rows[(8, 3)].fits
    assert round(rows[(8, 2)].total_bytes / 1e9, 1) == 73.8
    assert round(rows[(8, 3)].total_bytes / 1e9, 1) == 51.0
    assert rows[(16, 2)].fits and round(rows[(16, 2)].total_bytes / 1e9, 1) == 62.4
    picks = {r.gpus: (r.stage, r.activation_checkpointing) for r in p.by_gpus}
    assert picks == {8: (3, "none"), 16: (2, "none")}
    assert any("as given (--activations)" in n for n in p.notes)
