"""Model configs, their closed-form sizes, and the preset table.

Each config is a frozen, keyword-only dataclass validated on construction: a bad value
fails here, naming the field, the value and the fix, not deep inside a matmul.

Sizes are closed forms, so a planner can price a 13B model without allocating it; the
tests check every formula against a built (or meta-built) model.

[Note: non-embedding parameters]
Kaplan et al. (2020, sec. 2.1) leave *all* embeddings out of N. We follow nanoGPT and
torchtitan instead: leave out only the tables that are looked up and never multiplied.
So GPT-2 (tied) drops the position embedding (nanoGPT's ``get_num_params``), and an
untied Llama drops the token embedding (torchtitan's ``exclude_embedding``). A tied
token embedding is also the LM head's matmul weight, so it stays in. This way ``6 * N``
includes the LM-head matmul, which can be a large share of small models' FLOPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["GPT2Config", "LlamaConfig", "ModelConfig", "PRESETS", "get_preset"]


def _require_positive(cls: str, field: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(
            f"{cls}.{field} must be a positive integer, got {value!r}; set {field} >= 1"
        )


def _require_divides(cls: str, small: str, s: int, big: str, b: int) -> None:
    if b % s != 0:
        options = [d for d in range(1, b + 1) if b % d == 0 and d <= 2 * s][-3:]
        raise ValueError(
            f"{cls}.{small}={s} does not divide {big}={b} ({big} % {small} = {b % s}); "
            f"choose {small} dividing {big}, e.g. one of {options}"
        )


@dataclass(frozen=True, kw_only=True)
class _TransformerConfig:
    """Shape fields shared by both reference models."""

    n_layers: int
    """Number of transformer blocks (L)."""
    hidden: int
    """Residual stream width (h, ``d_model``)."""
    n_heads: int
    """Attention (query) heads; must divide ``hidden``."""
    seq_len: int
    """Longest sequence the model accepts (position table / RoPE table length)."""
    vocab: int
    """Vocabulary size (V)."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    init_std: float = 0.02
    """Std of the normal init of linear and embedding weights (GPT-2 paper, sec. 2.3)."""

    def __post_init__(self) -> None:
        cls = type(self).__name__
        for name in ("n_layers", "hidden", "n_heads", "seq_len", "vocab"):
            _require_positive(cls, name, getattr(self, name))
        _require_divides(cls, "n_heads", self.n_heads, "hidden", self.hidden)
        for name in ("norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"{cls}.{name} must be > 0, got {getattr(self, name)!r}; "
                    f"use e.g. {_TransformerConfig.__dataclass_fields__[name].default}"
                )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    def check_seq_len(self, seq_len: int) -> None:
        """Raise the user-facing error for an input longer than the model supports."""
        if seq_len > self.seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds the model's maximum "
                f"seq_len={self.seq_len}; raise seq_len in the config or shorten the input"
            )

    def param_count(self) -> int:
        raise NotImplementedError

    def largest_param(self) -> int:
        """Elements of the model's largest parameter (the planner's bound on a bucket: a
        parameter larger than the bucket size gets a bucket of its own)."""
        raise NotImplementedError

    def non_embedding_param_count(self) -> int:
        raise NotImplementedError

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token: ``6 * N + 12 * L * h * s``.

        ``6 * N`` is forward (2 FLOPs per multiply-add) plus backward (twice forward) over
        the matmul weights N = ``non_embedding_param_count()``. ``12 * L * h * s`` is the
        two attention matmuls (QK^T and AV, ``2 * 2 * s * h`` per layer and token, times
        3 for training). This is PaLM's appendix B and torchtitan's
        ``get_num_flop_per_token``. It counts the full s x s score matrix, as they do,
        although a causal mask needs only half: MFU numbers stay comparable.
        ``seq_len`` defaults to ``config.seq_len``.
        """
        s = self.seq_len if seq_len is None else seq_len
        return 6 * self.non_embedding_param_count() + 12 * self.n_layers * self.hidden * s


@dataclass(frozen=True, kw_only=True)
class GPT2Config(_TransformerConfig):
    """GPT-2 (Radford et al. 2019): learned positions, pre-LayerNorm, GELU MLP, tied head."""

    dropout: float = 0.0
    """Dropout on attention probabilities and after both residual projections, in [0, 1)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(
                f"GPT2Config.dropout must be in [0, 1), got {self.dropout!r}; "
                "use 0.0 to disable dropout"
            )

    def param_count(self) -> int:
        """Exact count. The tied token embedding / LM head weight is counted once.

        Per block: qkv ``3h^2 + 3h``, attention out ``h^2 + h``, MLP ``8h^2 + 5h``, two
        LayerNorms ``4h``, so ``12h^2 + 13h``; plus ``V*h + s*h`` embeddings and the final
        LayerNorm ``2h``. gpt2-124m gives 124,439,808.
        """
        h = self.hidden
        block = 12 * h * h + 13 * h
        return self.vocab * h + self.seq_len * h + self.n_layers * block + 2 * h

    def largest_param(self) -> int:
        """The token table (tied LM head), the MLP's 4h x h matrices, qkv's 3h x h or the
        position table, whichever is largest."""
        h = self.hidden
        return max(self.vocab * h, 4 * h * h, 3 * h * h, self.seq_len * h)

    def non_embedding_param_count(self) -> int:
        """All parameters except the position table; see [Note: non-embedding parameters]."""
        return self.param_count() - self.seq_len * self.hidden


@dataclass(frozen=True, kw_only=True)
class LlamaConfig(_TransformerConfig):
    """Llama (Touvron et al. 2023): RMSNorm, SwiGLU MLP, rotary positions, no biases."""

    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (Ainslie et al. 2023); None = n_heads."""
    intermediate: int | None = None
    """SwiGLU hidden size; None = Llama's rule, see ``ffn_dim``."""
    multiple_of: int = 256
    """Round the default SwiGLU size up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Scale applied to the default SwiGLU size before rounding (Llama-3 uses it)."""
    rope_theta: float = 10000.0
    """RoPE base (Su et al. 2021, sec. 3.4.2); Llama-3 uses 500000."""
    tie_embeddings: bool = False
    """Share the token embedding with the LM head (Llama-3.2-1B does)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_kv_heads is not None:
            _require_positive("LlamaConfig", "n_kv_heads", self.n_kv_heads)
            _require_divides("LlamaConfig", "n_kv_heads", self.n_kv_heads, "n_heads", self.n_heads)
        if self.intermediate is not None:
            _require_positive("LlamaConfig", "intermediate", self.intermediate)
        _require_positive("LlamaConfig", "multiple_of", self.multiple_of)
        if self.ffn_dim_multiplier is not None and not self.ffn_dim_multiplier > 0:
            raise ValueError(
                f"LlamaConfig.ffn_dim_multiplier must be > 0, got {self.ffn_dim_multiplier!r}; "
                "use None for Llama's default MLP size"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"LlamaConfig head_dim = hidden / n_heads = {self.head_dim} is odd; RoPE rotates "
                "pairs of channels, so choose hidden and n_heads with an even quotient"
            )
        if not self.rope_theta > 0:
            raise ValueError(
                f"LlamaConfig.rope_theta must be > 0, got {self.rope_theta!r}; use e.g. 10000.0"
            )

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_dim(self) -> int:
        """SwiGLU width: ``intermediate`` or Llama's rule, 2/3 of 4h rounded up.

        The 2/3 keeps the three-matrix SwiGLU at the parameter count of a two-matrix 4h
        MLP (Shazeer 2020, sec. 2); 4096 -> 11008 for Llama-2-7B.
        """
        if self.intermediate is not None:
            return self.intermediate
        dim = int(2 * (4 * self.hidden) / 3)
        if self.ffn_dim_multiplier is not None:
            dim = int(self.ffn_dim_multiplier * dim)
        return self.multiple_of * math.ceil(dim / self.multiple_of)

    def param_count(self) -> int:
        """Exact count: per block ``2h^2 + 2h*kv_dim`` attention, ``3*h*f`` SwiGLU, ``2h``
        RMSNorm; plus the token embedding, an LM head unless tied, and the final norm.
        Llama-2-7B gives 6,738,415,616."""
        h, f = self.hidden, self.ffn_dim
        kv_dim = self.kv_heads * self.head_dim
        block = 2 * h * h + 2 * h * kv_dim + 3 * h * f + 2 * h
        heads = 1 if self.tie_embeddings else 2
        return heads * self.vocab * h + self.n_layers * block + h

    def largest_param(self) -> int:
        """The token table (or LM head), a SwiGLU matrix or an attention projection,
        whichever is largest."""
        h = self.hidden
        return max(self.vocab * h, self.ffn_dim * h, h * h)

    def non_embedding_param_count(self) -> int:
        """All but an untied token embedding; see [Note: non-embedding parameters]."""
        lookup_only = 0 if self.tie_embeddings else self.vocab * self.hidden
        return self.param_count() - lookup_only


ModelConfig = GPT2Config | LlamaConfig

PRESETS: dict[str, ModelConfig] = {
    # Test sizes: well under a second to build and run on one CPU core.
    "gpt2-tiny": GPT2Config(n_layers=2, hidden=128, n_heads=4, seq_len=64, vocab=256),
    "llama-tiny": LlamaConfig(
        n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, seq_len=64, vocab=256
    ),
    # CPU benchmark sizes (~25M): compute-bound blocks, byte-level vocab.
    "gpt2-small": GPT2Config(n_layers=8, hidden=512, n_heads=8, seq_len=256, vocab=256),
    "llama-small": LlamaConfig(
        n_layers=8, hidden=512, n_heads=8, n_kv_heads=4, seq_len=256, vocab=256
    ),
    # Published shapes. GPT-2: Radford et al. 2019, table 2 (HF gpt2, gpt2-xl).
    "gpt2-124m": GPT2Config(n_layers=12, hidden=768, n_heads=12, seq_len=1024, vocab=50257),
    "gpt2-1.5b": GPT2Config(n_layers=48, hidden=1600, n_heads=25, seq_len=1024, vocab=50257),
    # Llama-3.2-1B (HF config.json). Llama-3's long-context RoPE frequency scaling is not
    # implemented; it changes nothing at or below the 8192 original context.
    "llama-1b": LlamaConfig(
        n_layers=16,
        hidden=2048,
        n_heads=32,
        n_kv_heads=8,
        intermediate=8192,
        seq_len=2048,
        vocab=128256,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    # Llama-2: Touvron et al. 2023b, table 1 / HF config.json.
    "llama-7b": LlamaConfig(
        n_layers=32, hidden=4096, n_heads=32, intermediate=11008, seq_len=4096, vocab=32000
    ),
    "llama-13b": LlamaConfig(
        n_layers=40, hidden=5120, n_heads=40, intermediate=13824, seq_len=4096, vocab=32000
    ),
}


def get_preset(name: str) -> ModelConfig:
    """The preset config called ``name``; configs are frozen, so it is safe to share."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; available presets: {', '.join(PRESETS)}"
        ) from None
