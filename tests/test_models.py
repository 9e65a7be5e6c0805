"""Reference models: closed-form sizes, tying, deterministic meta init, forward/backward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from zeroshard.models import (
    GPT2,
    PRESETS,
    CoreAttention,
    GPT2Config,
    Llama,
    LlamaConfig,
    build_model,
    get_preset,
    init_weights,
    materialize,
    param_count,
)
from zeroshard.models.llama import apply_rope, rope_tables

TINY = ["gpt2-tiny", "llama-tiny"]
SMALL = ["gpt2-small", "llama-small"]
REAL = ["gpt2-124m", "gpt2-1.5b", "llama-1b", "llama-7b", "llama-13b"]
# Published sizes: GPT-2 (HF gpt2 / gpt2-xl), Llama-3.2-1B, Llama-2-7B/13B.
PUBLISHED = {
    "gpt2-124m": 124.44e6,
    "gpt2-1.5b": 1.558e9,
    "llama-1b": 1.236e9,
    "llama-7b": 6.738e9,
    "llama-13b": 13.016e9,
}


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _assert_bitwise_equal(a: nn.Module, b: nn.Module) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert torch.equal(ta[name], tb[name]), name


def test_preset_table_is_complete() -> None:
    assert set(PRESETS) == set(TINY + SMALL + REAL)


@pytest.mark.parametrize("name", TINY + SMALL)
def test_closed_form_param_count_matches_built_model(name: str) -> None:
    model = build_model(name)
    cfg = get_preset(name)
    assert param_count(model) == cfg.param_count()
    assert sum(p.numel() for p in model.parameters()) == cfg.param_count()


@pytest.mark.parametrize("name", REAL)
def test_real_presets_on_meta_match_closed_form_and_published(name: str) -> None:
    model = build_model(name, device="meta")
    assert all(p.is_meta for p in model.parameters())
    cfg = get_preset(name)
    assert param_count(model) == cfg.param_count()
    assert abs(cfg.param_count() / PUBLISHED[name] - 1) < 0.01


def test_exact_published_counts() -> None:
    assert get_preset("gpt2-124m").param_count() == 124_439_808
    assert get_preset("llama-7b").param_count() == 6_738_415_616


def test_llama_default_intermediate_follows_llama_rule() -> None:
    cfg = dataclasses.replace(get_preset("llama-7b"), intermediate=None)
    assert cfg.ffn_dim == 11008


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-1b"])
def test_tied_embedding_is_one_tensor(name: str) -> None:
    model = build_model(name, device="meta" if name == "llama-1b" else None)
    assert model.lm_head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names
    all_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert len(list(model.parameters())) == len(all_names) - 1
    if name == "gpt2-tiny":
        assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()


def test_llama_untied_by_default() -> None:
    model = build_model("llama-tiny")
    assert model.lm_head.weight is not model.tok_emb.weight


def test_rope_buffers_are_non_persistent() -> None:
    model = build_model("llama-tiny")
    assert {n for n, _ in model.named_buffers()} == {"rope_cos", "rope_sin"}
    assert not any(k.startswith("rope") for k in model.state_dict())
    assert model.rope_cos.dtype == torch.float32


@pytest.mark.parametrize("name", TINY)
def test_every_block_has_parameter_free_core_attention(name: str) -> None:
    model = build_model(name)
    for block in model.blocks:
        assert isinstance(block.attn.core, CoreAttention)
        assert list(block.attn.core.parameters()) == []
        for sub in ("norm1", "norm2", "mlp"):
            assert hasattr(block, sub)


@pytest.mark.parametrize("name", TINY)
def test_meta_build_then_materialize_is_bitwise_equal(name: str) -> None:
    direct = build_model(name, seed=7)
    meta = build_model(name, device="meta", seed=7)
    assert all(t.is_meta for t in _tensors(meta).values())
    materialize(meta, "cpu", seed=7)
    _assert_bitwise_equal(direct, meta)
    if isinstance(direct.config, GPT2Config) or direct.config.tie_embeddings:
        assert meta.lm_head.weight is meta.tok_emb.weight


def test_materialize_retie_for_tied_llama() -> None:
    cfg = dataclasses.replace(get_preset("llama-tiny"), tie_embeddings=True)
    meta = Llama(cfg, device="meta", seed=3)
    materialize(meta, "cpu", seed=3)
    assert meta.lm_head.weight is meta.tok_emb.weight
    _assert_bitwise_equal(Llama(cfg, seed=3), meta)


@pytest.mark.parametrize("name", TINY)
def test_different_seeds_differ(name: str) -> None:
    a, b = build_model(name, seed=0), build_model(name, seed=1)
    assert not torch.equal(a.tok_emb.weight, b.tok_emb.weight)
    assert not torch.equal(a.blocks[0].attn.out_proj.weight, b.blocks[0].attn.out_proj.weight)


def test_construction_does_not_touch_global_rng() -> None:
    state = torch.random.get_rng_state()
    build_model("gpt2-tiny")
    build_model("llama-tiny")
    assert torch.equal(state, torch.random.get_rng_state())


@pytest.mark.parametrize("name", TINY)
def test_subset_init_matches_full_init_in_any_order(name: str) -> None:
    full = build_model(name, seed=5)
    names = [n for n, _ in full.named_parameters()][::-3]  # a reversed, strided subset
    partial = build_model(name, seed=99)
    init_weights(partial, seed=5, names=names)
    ref, got = dict(full.named_parameters()), dict(partial.named_parameters())
    for n in names:
        assert torch.equal(ref[n], got[n]), n


def test_init_scheme() -> None:
    cfg = get_preset("gpt2-small")
    model = build_model(cfg)
    block = model.blocks[0]
    assert torch.equal(block.norm1.weight, torch.ones_like(block.norm1.weight))
    assert torch.equal(block.attn.qkv.bias, torch.zeros_like(block.attn.qkv.bias))
    assert abs(block.attn.qkv.weight.std().item() - 0.02) < 1e-3
    resid = 0.02 / (2 * cfg.n_layers) ** 0.5
    assert abs(block.mlp.out_proj.weight.std().item() - resid) < 1e-3 * resid * 10


def test_init_unknown_name_raises() -> None:
    with pytest.raises(ValueError, match="no_such.weight"):
        init_weights(build_model("gpt2-tiny"), seed=0, names=["no_such.weight"])


@pytest.mark.parametrize("name", TINY)
def test_forward_shape_and_backward(name: str) -> None:
    model = build_model(name)
    cfg = model.config
    idx = torch.randint(0, cfg.vocab, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    logits = model(idx)
    assert logits.shape == (2, cfg.seq_len, cfg.vocab) and logits.dtype == torch.float32
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model(idx[:, :5]).shape == (2, 5, cfg.vocab)


def test_dropout_is_active_only_in_training() -> None:
    cfg = dataclasses.replace(get_preset("gpt2-tiny"), dropout=0.5)
    model = GPT2(cfg)
    idx = torch.zeros(1, 8, dtype=torch.long)
    model.eval()
    assert torch.equal(model(idx), model(idx))
    model.train()
    assert not torch.equal(model(idx), model(idx))


@pytest.mark.parametrize("name", TINY)
def test_too_long_sequence_raises(name: str) -> None:
    model = build_model(name)
    idx = torch.zeros(1, model.config.seq_len + 1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"exceeds the model's maximum seq_len=64"):
        model(idx)


@pytest.mark.parametrize("name", TINY)
def test_bf16_forward(name: str) -> None:
    model = build_model(name).to(torch.bfloat16)
    logits = model(torch.zeros(2, 16, dtype=torch.long))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"n_layers": 0}, r"n_layers must be a positive integer, got 0"),
        ({"hidden": -128}, r"hidden must be a positive integer, got -128"),
        ({"n_heads": 5}, r"n_heads=5 does not divide hidden=128"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\), got 1.0"),
    ],
)
def test_bad_gpt2_config_raises(kwargs: dict[str, object], pattern: str) -> None:
    base = dict(n_layers=2, hidden=128, n_heads=4, seq_len=64, vocab=256)
    with pytest.raises(ValueError, match=pattern):
        GPT2Config(**{**base, **kwargs})


def test_bad_llama_config_raises() -> None:
    base = dict(n_layers=2, hidden=128, n_heads=4, seq_len=64, vocab=256)
    with pytest.raises(ValueError, match=r"n_kv_heads=3 does not divide n_heads=4"):
        LlamaConfig(**base, n_kv_heads=3)
    with pytest.raises(ValueError, match=r"intermediate must be a positive integer, got 0"):
        LlamaConfig(**base, intermediate=0)


def test_configs_are_frozen_and_keyword_only() -> None:
    cfg = get_preset("gpt2-tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        GPT2Config(2, 128, 4, 64, 256)  # type: ignore[misc]


def test_unknown_preset_lists_available() -> None:
    with pytest.raises(ValueError, match=r"unknown model preset 'gpt5'.*gpt2-tiny.*llama-13b"):
        get_preset("gpt5")
    with pytest.raises(ValueError, match="gpt5"):
        build_model("gpt5")


@pytest.mark.parametrize("name", list(PRESETS))
def test_flops_per_token_formula(name: str) -> None:
    cfg = get_preset(name)
    n = cfg.non_embedding_param_count()
    assert cfg.flops_per_token() == 6 * n + 12 * cfg.n_layers * cfg.hidden * cfg.seq_len
    assert cfg.flops_per_token(seq_len=128) == 6 * n + 12 * cfg.n_layers * cfg.hidden * 128


def test_non_embedding_convention() -> None:
    gpt = get_preset("gpt2-124m")  # nanoGPT: drop the position table only (tied head)
    assert gpt.non_embedding_param_count() == gpt.param_count() - gpt.seq_len * gpt.hidden
    llama = get_preset("llama-7b")  # torchtitan: drop the (untied) token table
    assert llama.non_embedding_param_count() == llama.param_count() - llama.vocab * llama.hidden
    tied = get_preset("llama-1b")  # the tied table is the head's matmul weight: kept
    assert tied.non_embedding_param_count() == tied.param_count()


def test_model_classes_reject_wrong_config() -> None:
    with pytest.raises(TypeError):
        GPT2(get_preset("llama-tiny"))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", TINY)
def test_causal_future_tokens_do_not_change_past_logits(name: str) -> None:
    model = build_model(name).eval()
    a = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    b = a.clone()
    b[:, 10:] = (b[:, 10:] + 1) % 256
    torch.testing.assert_close(model(a)[:, :10], model(b)[:, :10])
    assert not torch.allclose(model(a)[:, 10:], model(b)[:, 10:])


def test_rope_scores_depend_only_on_relative_position() -> None:
    cos, sin = rope_tables(head_dim=16, seq_len=32, theta=10000.0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(16, generator=g), torch.randn(16, generator=g)

    def score(m: int, n: int) -> torch.Tensor:
        qm = apply_rope(q.view(1, 1, 1, 16), cos[m : m + 1], sin[m : m + 1])
        kn = apply_rope(k.view(1, 1, 1, 16), cos[n : n + 1], sin[n : n + 1])
        return (qm * kn).sum()

    torch.testing.assert_close(score(3, 1), score(20, 18))
    torch.testing.assert_close(score(0, 0), (q * k).sum())


def test_gqa_equals_mha_with_repeated_kv_weights() -> None:
    gqa = build_model("llama-tiny")  # 4 query heads, 2 kv heads
    cfg = dataclasses.replace(gqa.config, n_kv_heads=None)
    mha = Llama(cfg)
    state = gqa.state_dict()
    hd = cfg.head_dim
    for i in range(cfg.n_layers):
        for proj in ("k_proj", "v_proj"):
            key = f"blocks.{i}.attn.{proj}.weight"
            state[key] = state[key].view(2, hd, -1).repeat_interleave(2, dim=0).reshape(-1, 128)
    mha.load_state_dict(state)
    idx = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(gqa(idx), mha(idx))


def test_ambient_meta_default_device_builds_a_meta_model() -> None:
    with torch.device("meta"):
        model = build_model("llama-tiny")
    assert all(t.is_meta for t in _tensors(model).values())
    materialize(model, "cpu", seed=0)
    _assert_bitwise_equal(model, build_model("llama-tiny"))
