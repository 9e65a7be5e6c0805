"""Llama (Touvron et al. 2023), written like torchtitan, as a sharding reference model.

Module tree (names shared with ``gpt2.py``)::

    tok_emb   nn.Embedding(vocab, hidden)       token table (no position table: RoPE)
    blocks    nn.ModuleList[LlamaBlock]         pre-norm residual blocks:
      norm1     nn.RMSNorm                        before attention
      attn      LlamaAttention                    q/k/v -> RoPE -> repeat kv -> core -> out
        q_proj    nn.Linear(h, heads*hd)
        k_proj    nn.Linear(h, kv_heads*hd)       fewer heads under GQA
        v_proj    nn.Linear(h, kv_heads*hd)
        core      CoreAttention                   parameter-free SDPA (recompute boundary)
        out_proj  nn.Linear(heads*hd, h)          residual projection (scaled init)
      norm2     nn.RMSNorm                        before the MLP
      mlp       LlamaMLP                          SwiGLU: out_proj(silu(gate) * up)
        gate_proj nn.Linear(h, f)
        up_proj   nn.Linear(h, f)
        out_proj  nn.Linear(f, h)                 residual projection (Llama's down_proj)
    norm_f    nn.RMSNorm                        final norm
    lm_head   nn.Linear(h, vocab)               untied unless config.tie_embeddings
    rope_cos, rope_sin                          [seq_len, hd] float32, non-persistent

No linear layer has a bias. Construction is meta-first, as described in [Note:
meta-first construction] in ``gpt2.py``.

[Note: RoPE tables are buffers, not state]
The rotary tables are a pure function of the config, so they are registered with
``persistent=False``: they stay out of state dicts and checkpoints, and sharding engines
leave them alone. ``to_empty`` leaves them as garbage, so ``materialize`` calls
``reset_buffers()``. They are built in float64 on the CPU then stored as float32, so
every device gets the same table. ``model.to(torch.bfloat16)`` casts them too; the
attention casts them to q's dtype anyway, and ``reset_buffers()`` restores float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import CoreAttention
from .config import LlamaConfig
from .init import materialize

__all__ = ["Llama", "LlamaAttention", "LlamaBlock", "LlamaMLP", "apply_rope", "rope_tables"]


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each ``[seq_len, head_dim]`` float32 on the CPU.

    Channel pair i rotates at frequency ``theta^(-2i/head_dim)`` (Su et al. 2021,
    eq. 15). Pairs are (i, i + head_dim/2), the "rotate half" layout of GPT-NeoX and
    Hugging Face Llama, so each frequency appears twice along the last dim.
    """
    f64 = {"dtype": torch.float64, "device": "cpu"}  # explicit: ignore any default device
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, **f64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, **f64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[B, heads, T, hd]`` by position; cos/sin are ``[T, hd]`` in x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class LlamaAttention(nn.Module):
    """Causal self-attention with RoPE and grouped-query attention (Ainslie et al. 2023)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = config.n_heads, config.kv_heads
        self.head_dim = config.head_dim
        h, q_dim, kv_dim = config.hidden, config.hidden, config.kv_heads * config.head_dim
        self.q_proj = nn.Linear(h, q_dim, bias=False)
        self.k_proj = nn.Linear(h, kv_dim, bias=False)
        self.v_proj = nn.Linear(h, kv_dim, bias=False)
        self.core = CoreAttention()
        self.out_proj = nn.Linear(q_dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Heads from the projections' width: under tensor parallelism (q/k/v column-wise)
        # a rank holds n_heads / tp of them, as in torchtitan's attention.
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        hd = self.head_dim  # (not -1 for the heads: a view of 0 elements cannot infer it)
        q = q.view(b, t, q.shape[-1] // hd, hd).transpose(1, 2)
        k = k.view(b, t, k.shape[-1] // hd, hd).transpose(1, 2)
        v = v.view(b, t, v.shape[-1] // hd, hd).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            # Query head j reads kv head j // group, as in Hugging Face's repeat_kv.
            group = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = self.core(q, k, v)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, y.shape[1] * hd))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``out_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.hidden, config.ffn_dim, bias=False)
        self.out_proj = nn.Linear(config.ffn_dim, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-RMSNorm residual block (Zhang & Sennrich 2019 RMSNorm)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.attn = LlamaAttention(config)
        self.norm2 = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class Llama(nn.Module):
    """Llama language model: ``forward(idx[B, T]) -> logits[B, T, vocab]``.

    ``device`` defaults to ``torch.get_default_device()``; ``device="meta"`` returns an
    unallocated model for ``materialize``. Parameters are initialised by
    ``init_weights(model, seed)``.
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(
        self, config: LlamaConfig, *, device: torch.device | str | None = None, seed: int = 0
    ) -> None:
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"Llama needs a LlamaConfig, got {type(config).__name__}")
        self.config = config
        with torch.device("meta"):
            self.tok_emb = nn.Embedding(config.vocab, config.hidden)
            self.blocks = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layers))
            self.norm_f = nn.RMSNorm(config.hidden, eps=config.norm_eps)
            self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
            shape = (config.seq_len, config.head_dim)
            self.register_buffer("rope_cos", torch.empty(shape), persistent=False)
            self.register_buffer("rope_sin", torch.empty(shape), persistent=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        target = torch.device(device) if device is not None else torch.get_default_device()
        if target.type != "meta":
            materialize(self, target, seed)

    def reset_buffers(self) -> None:
        """Recompute the RoPE tables in float32 on their current device (meta stays meta)."""
        device = self.rope_cos.device
        cfg = self.config
        if device.type == "meta":
            shape = (cfg.seq_len, cfg.head_dim)
            cos, sin = torch.empty(shape, device=device), torch.empty(shape, device=device)
        else:
            cos, sin = rope_tables(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        self.config.check_seq_len(t)
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm_f(x))
