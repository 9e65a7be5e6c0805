"""Activation checkpointing: gradient parity, saved bytes to the byte, FLOP ratios, errors.

Single process, CPU. Sizes: gpt2-tiny / llama-tiny (L=2, h=128, a=4), b=2, s=64, fp32.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zeroshard.checkpointing import (
    EveryK,
    FullCheckpoint,
    NoCheckpoint,
    Selective,
    SqrtSegments,
    apply_checkpointing,
    checkpointed_modules,
    find_blocks,
    offload_to_host,
    parse_policy,
    remove_checkpointing,
)
from zeroshard.flops import FlopCounter
from zeroshard.memory import SavedTensorCounter
from zeroshard.memory.activations import (
    block_terms,
    estimate_activation_bytes,
    paper_activation_bytes,
    paper_layer_bytes,
)
from zeroshard.models import GPT2Block, ModelConfig, build_model, get_preset

POLICIES = ["none", "full", "every-2", "selective", "sqrt"]
B, S = 2, 64


def _config(preset: str = "gpt2-tiny", dropout: float = 0.1) -> ModelConfig:
    cfg = get_preset(preset)
    return dataclasses.replace(cfg, dropout=dropout) if preset.startswith("gpt2") else cfg


def _step(
    cfg: ModelConfig, policy: str, *, seed: int = 0, offload: bool = False
) -> tuple[int, dict[str, torch.Tensor], torch.Tensor]:
    """One forward (under a SavedTensorCounter) + backward; returns (saved bytes, grads, loss)."""
    model = apply_checkpointing(build_model(cfg), policy, offload_activations=offload)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab, (B, S), generator=g)
    targets = torch.randint(0, cfg.vocab, (B, S), generator=g)
    torch.manual_seed(seed)  # same dropout stream for every policy
    with SavedTensorCounter() as counter:
        loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
    loss.backward()
    return counter.bytes, {n: p.grad for n, p in model.named_parameters()}, loss.detach()


@pytest.fixture(scope="module")
def measured() -> dict[tuple[str, float, str], tuple[int, dict, torch.Tensor]]:
    """Every policy on GPT-2 with dropout (math SDPA), GPT-2 without (fused SDPA), Llama."""
    runs = [("gpt2-tiny", 0.1), ("gpt2-tiny", 0.0), ("llama-tiny", 0.0)]
    return {(p, d, pol): _step(_config(p, d), pol) for p, d in runs for pol in POLICIES}


# -- gradients ------------------------------------------------------------------------------
@pytest.mark.parametrize("preset,dropout", [("gpt2-tiny", 0.1), ("llama-tiny", 0.0)])
@pytest.mark.parametrize("policy", POLICIES[1:])
def test_gradients_bitwise_equal(measured, preset: str, dropout: float, policy: str) -> None:
    # No tolerance needed for any policy: recompute replays the same ops in the same
    # order on the same inputs, and preserve_rng_state replays the dropout masks.
    _, ref, ref_loss = measured[(preset, dropout, "none")]
    _, grads, loss = measured[(preset, dropout, policy)]
    assert torch.equal(loss, ref_loss)
    for name, g in ref.items():
        assert torch.equal(grads[name], g), f"{policy}: {name} differs"


def test_dropout_is_live_so_parity_tests_rng_replay() -> None:
    # Another seed changes the gradients: the bitwise parity above is not vacuous.
    _, g0, _ = _step(_config(), "none", seed=0)
    _, g1, _ = _step(_config(), "none", seed=1)
    assert not torch.equal(g0["blocks.0.mlp.fc.weight"], g1["blocks.0.mlp.fc.weight"])


def test_offload_on_cpu_copies_nothing_and_changes_nothing() -> None:
    # torch's save_on_cpu(pin_memory=True) copies even CPU tensors into a new buffer;
    # offload_to_host keeps CPU tensors as they are.
    x = torch.randn(4, 4, requires_grad=True)
    with offload_to_host(pin_memory=True):
        h = x * 2
        y = h.sin()  # sin saves its input
    assert y.grad_fn._saved_self.data_ptr() == h.data_ptr()
    bytes_, grads, _ = _step(_config(), "full", offload=True)
    ref_bytes, ref, _ = _step(_config(), "full")
    assert bytes_ == ref_bytes
    assert all(torch.equal(grads[n], g) for n, g in ref.items())


# -- saved-for-backward bytes ----------------------------------------------------------------
def test_saved_bytes_order_and_full_is_exactly_block_inputs(measured) -> None:
    cfg = _config()
    saved = {pol: measured[("gpt2-tiny", 0.1, pol)][0] for pol in POLICIES}
    assert saved["none"] > saved["selective"] > saved["every-2"] > saved["full"] > saved["sqrt"]
    L, h, V, d = cfg.n_layers, cfg.hidden, cfg.vocab, 4
    outside = (
        B * S * 8  # token ids (int64), kept by the embedding backward
        + S * 8  # position ids
        + B * S * h * d  # final LayerNorm input (= last block's output)
        + 2 * B * S * 4  # its fp32 mean and rstd
        + B * S * h * d  # LM-head input (final norm output); the tied weight is a param
        + B * S * V * d  # cross-entropy's log-softmax output
        + B * S * 8  # targets, kept by nll_loss
        + d  # nll_loss total_weight (a scalar)
    )
    assert outside == 265_732
    assert saved["full"] == L * B * S * h * d + outside == 396_804
    assert saved["sqrt"] == 1 * B * S * h * d + outside  # one segment of ceil(sqrt 2) = 2


@pytest.mark.parametrize(
    "preset,dropout", [("gpt2-tiny", 0.1), ("gpt2-tiny", 0.0), ("llama-tiny", 0.0)]
)
def test_selective_op_keeps_the_matmul_outputs_only(measured, preset: str, dropout: float) -> None:
    """[Note: op-level selective checkpointing]: bitwise the same gradients as none; saved
    bytes between full and none, and on GPT-2 exactly the block input plus the outputs of
    the four linear layers (qkv 3, attention out 1, fc 4, MLP out 1: b*s*h units), plus,
    with the fused kernel (no dropout), its output (1) and log-sum-exp (b*a*s fp32)."""
    cfg = _config(preset, dropout)
    got, grads, loss = _step(cfg, "selective-op")
    ref_bytes, ref, ref_loss = measured[(preset, dropout, "none")]
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[n], g) for n, g in ref.items())
    assert measured[(preset, dropout, "full")][0] < got < ref_bytes
    if preset.startswith("gpt2"):
        L, h, a, d = cfg.n_layers, cfg.hidden, cfg.n_heads, 4
        per_block = (1 + 3 + 1 + 4 + 1) * B * S * h * d
        if dropout == 0:
            per_block += B * S * h * d + B * a * S * 4
        assert got == L * per_block + 265_732  # + outside, as for full


@pytest.mark.parametrize(
    "preset,dropout", [("gpt2-tiny", 0.1), ("gpt2-tiny", 0.0), ("llama-tiny", 0.0)]
)
def test_estimate_matches_measurement_exactly(measured, preset: str, dropout: float) -> None:
    cfg = _config(preset, dropout)
    # The CPU runs SDPA's fused kernel only without dropout, and its dropout keeps a
    # float32 noise tensor as the mask (4 bytes, not CUDA's 1-byte bool).
    kw = dict(fused_attention=dropout == 0, dropout=dropout > 0, mask_bytes=4)
    est = {pol: estimate_activation_bytes(cfg, B, S, pol, **kw) for pol in POLICIES}
    got = {pol: measured[(preset, dropout, pol)][0] for pol in POLICIES}
    assert {p: e.total for p, e in est.items()} == got
    # The differences pin single terms down:
    e, L = est["none"], cfg.n_layers
    assert got["none"] - got["selective"] == L * e.scores_bytes  # scores (or logsumexp)
    assert got["full"] - got["sqrt"] == (L - 1) * e.input_bytes  # one input per segment
    assert got["full"] - L * e.input_bytes == sum(e.outside.values())
    assert got["none"] - got["every-2"] == e.block_bytes - e.input_bytes  # block 1 only


def test_estimate_bad_inputs() -> None:
    with pytest.raises(ValueError, match="micro_batch"):
        estimate_activation_bytes(get_preset("gpt2-tiny"), 0, 64)
    with pytest.raises(ValueError, match="exceeds"):
        estimate_activation_bytes(get_preset("gpt2-tiny"), 1, 65)
    with pytest.raises(ValueError, match="no dropout"):
        estimate_activation_bytes(get_preset("llama-tiny"), 1, 64, dropout=True)
    with pytest.raises(ValueError, match="supported"):
        estimate_activation_bytes(get_preset("gpt2-tiny"), 1, 64, "every-0")


def test_paper_formula_is_ours_at_16_bit_minus_norm_stats() -> None:
    cfg = get_preset("gpt2-124m")
    b, s, h, a = 4, 1024, cfg.hidden, cfg.n_heads
    terms = block_terms(cfg, b, s, dtype_bytes=2, fused_attention=False, dropout=True)
    # Our only extra term: LayerNorm's fp32 mean and rstd, which the paper leaves out.
    stats = terms.pop("norm mean + rstd (fp32)")
    assert stats == 2 * 2 * b * s * 4
    assert sum(terms.values()) == paper_layer_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s // h)
    L = cfg.n_layers
    assert paper_activation_bytes(s, b, h, a, L, "full") == L * 2 * s * b * h
    assert paper_activation_bytes(s, b, h, a, L, "selective") == L * 34 * s * b * h
    half = paper_activation_bytes(s, b, h, a, L, "every-2")
    assert half == L // 2 * (paper_layer_bytes(s, b, h, a) + 2 * s * b * h)
    assert paper_activation_bytes(s, b, h, a, L, "sqrt") == 3 * 2 * s * b * h  # 12 -> 3 x 4


# -- FLOPs ------------------------------------------------------------------------------------
def _flops(cfg: ModelConfig, policy: str, batch: int, device: str) -> int:
    model = apply_checkpointing(build_model(cfg, device=device), policy)
    idx = torch.zeros(batch, cfg.seq_len, dtype=torch.long, device=device)
    with FlopCounter() as fc:
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    return fc.total


def test_flop_ratios_gpt2_small() -> None:
    # Meta tensors: FlopCounterMode needs shapes only. Meta SDPA runs the math path (two
    # bmm), as the CPU does with dropout; test_meta_flops_equal_real_flops checks the match.
    # Measured: full 1.3317, every-2 1.1659, selective 1.0128, sqrt 1.3317.
    cfg, b = dataclasses.replace(get_preset("gpt2-small"), dropout=0.1), 8
    L, h, s, V = cfg.n_layers, cfg.hidden, cfg.seq_len, cfg.vocab
    flops = {p: _flops(cfg, p, b, "meta") for p in POLICIES}
    block, head = 24 * h * h + 4 * s * h, 2 * h * V  # forward FLOPs per token
    assert flops["none"] == 3 * (L * block + head) * b * s
    ratio = {p: flops[p] / flops["none"] for p in POLICIES}
    assert 1.30 <= ratio["full"] <= 1.36
    assert ratio["full"] == pytest.approx(1 + L * block / (3 * (L * block + head)), abs=1e-12)
    assert ratio["sqrt"] == ratio["full"]
    assert ratio["every-2"] == pytest.approx(1 + L // 2 * block / (3 * (L * block + head)))
    # Selective recomputes QK^T only: torch's early stop ends the recompute once the last
    # tensor needed is rebuilt, so the AV matmul (whose output nothing saved) is skipped.
    assert ratio["selective"] == pytest.approx(1 + L * 2 * s * h / (3 * (L * block + head)))
    assert ratio["selective"] < 1.02  # measured 1.0128
    # Without dropout early stop also skips each block's last matmul (MLP out-proj, 8h^2).
    nodrop = dataclasses.replace(cfg, dropout=0.0)
    r = _flops(nodrop, "full", b, "meta") / _flops(nodrop, "none", b, "meta")
    assert r == pytest.approx(1 + L * (block - 8 * h * h) / (3 * (L * block + head)))  # 1.2297


def test_meta_flops_equal_real_flops() -> None:
    cfg = _config()
    for policy in ("none", "full"):
        assert _flops(cfg, policy, 2, "meta") == _flops(cfg, policy, 2, "cpu")


# -- API ----------------------------------------------------------------------------------------
def test_parse_policy_and_bad_inputs() -> None:
    assert parse_policy("none") == NoCheckpoint() and parse_policy("full") == FullCheckpoint()
    assert parse_policy("every-3") == EveryK(3) and parse_policy("sqrt") == SqrtSegments()
    assert parse_policy("selective") == Selective() and parse_policy(EveryK(2)) == EveryK(2)
    for bad in ("every-0", "every--1", "every-k", "Full", "offload"):
        with pytest.raises(ValueError, match="every-<k>|>= 1"):
            parse_policy(bad)
    for k in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="EveryK.k"):
            EveryK(k)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="segment_size"):
        SqrtSegments(segment_size=0)
    with pytest.raises(TypeError):
        parse_policy(2)  # type: ignore[arg-type]


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_blocks_found_and_selective_error_names_the_fix() -> None:
    model = _Plain()
    assert find_blocks(model) is model.layers
    with pytest.raises(ValueError, match=r"Selective\(match=\.\.\.\).*'full'"):
        apply_checkpointing(model, "selective")
    assert not list(checkpointed_modules(model))  # nothing half-applied
    apply_checkpointing(model, Selective(match=nn.GELU))
    assert len(list(checkpointed_modules(model))) == 4
    with pytest.raises(ValueError, match="pass blocks="):
        find_blocks(nn.Linear(2, 2))


def test_wrapping_keeps_names_survives_deepcopy_and_undoes() -> None:
    model = build_model(_config(dropout=0.0))
    keys = list(model.state_dict())
    apply_checkpointing(model, "every-2")
    assert [n for n, _ in checkpointed_modules(model)] == ["blocks.1"]
    assert list(model.state_dict()) == keys and isinstance(model.blocks[1], GPT2Block)
    apply_checkpointing(model, "selective")  # replaces the previous policy
    assert [n for n, _ in checkpointed_modules(model)] == [
        "blocks.0.attn.core",
        "blocks.1.attn.core",
    ]
    twin = copy.deepcopy(model)
    idx = torch.randint(0, 256, (B, S))
    twin(idx).sum().backward()
    assert twin.tok_emb.weight.grad is not None and model.tok_emb.weight.grad is None
    remove_checkpointing(model)
    assert type(model.blocks[0].attn.core).__name__ == "CoreAttention"


def test_sqrt_follower_called_alone_and_no_grad() -> None:
    model = build_model(dataclasses.replace(_config(dropout=0.0), n_layers=8))  # 3+3+2 blocks
    ref = copy.deepcopy(model)
    apply_checkpointing(model, "sqrt")
    x = torch.randn(1, 8, 128, requires_grad=True)
    assert torch.equal(model.blocks[1](x), ref.blocks[1](x))  # not in a chain: runs itself
    idx = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        assert torch.equal(model(idx), ref(idx))


# -- in-place writes into a kept matmul output (issue #65, zeroshard/sac_policy.py) --------
class _SplitLinear(torch.autograd.Function):
    """DeepSpeed ZeRO-3's memory-efficient linear (``zero3_linear_wrap``), which replaces
    ``F.linear`` process-wide: ``input.matmul(w.t())`` (``mm`` + ``_unsafe_view`` on 3-D
    input) and the bias added in place."""

    @staticmethod
    def forward(x, w, b):  # type: ignore[override]
        out = x.matmul(w.t())
        out += b
        return out

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[override]
        ctx.save_for_backward(inputs[0], inputs[1])

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        return g @ w, g2.t() @ x.reshape(-1, x.shape[-1]), g2.sum(0)


class _WritingBlock(nn.Module):
    """Two linears and a nonlinearity; ``how`` picks the linear: torch's F.linear on a
    non-contiguous 3-D input (at::linear's own matmul + add_), DeepSpeed's, or one that
    reads the kept matmul before writing into it (cannot be recomputed exactly)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def _linear(self, x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
        if self.how == "transposed":
            return F.linear(x.transpose(0, 1), lin.weight, lin.bias).transpose(0, 1)
        if self.how == "deepspeed":
            return _SplitLinear.apply(x, lin.weight, lin.bias)
        out = x.matmul(lin.weight.t())  # "read-then-write"
        seen = torch.tanh(out)
        out += lin.bias
        return out + seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self._linear(torch.tanh(self._linear(x, self.a)), self.b)


class _Writing(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_WritingBlock(how), _WritingBlock(how)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _writing_grads(how: str, policy: str) -> list[torch.Tensor]:
    model = _Writing(how)
    apply_checkpointing(model, policy)
    x = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1))
    model(x).square().sum().backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("how", ["transposed", "deepspeed"])
def test_selective_op_is_exact_when_a_kept_matmul_is_written_in_place(how: str) -> None:
    """The kept ``mm`` output is written by ``+= bias`` through an ``_unsafe_view`` (a
    version counter of its own, so torch's guard misses it): the recompute added the bias
    twice (gradients 3.8 off). The write is kept too: bitwise the unchecked gradients."""
    want = _writing_grads(how, "none")
    for got in (_writing_grads(how, "selective-op"), _writing_grads(how, "full")):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_selective_op_refuses_a_write_it_cannot_recompute() -> None:
    """A recomputed op read the kept matmul before the write: the recompute would hand it
    the written values. Refused in the forward, naming the op and the way out."""
    with pytest.raises(RuntimeError, match="aten.add_.Tensor writes in place into the output "
                       "of a kept matmul that aten.tanh.default read.*'full'"):
        _writing_grads("read-then-write", "selective-op")
    assert _writing_grads("read-then-write", "full")  # full checkpointing recomputes all


def test_selective_op_refuses_a_kept_output_written_after_the_forward() -> None:
    """torch's guard, kept: a kept output written after the region returned it."""

    class Out(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8, bias=False)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.blocks[0](x)  # the block's output is the kept mm output itself
            y.mul_(2)
            return y.sum()

    model = Out()
    apply_checkpointing(model, "selective-op")
    loss = model(torch.randn(4, 8, requires_grad=True))
    with pytest.raises(RuntimeError, match="aten.mm.default kept by selective activation "
                       "checkpointing was written in place after the forward kept it"):
        loss.backward()
