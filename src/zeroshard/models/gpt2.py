"""GPT-2 (Radford et al. 2019), written like nanoGPT, as a sharding reference model.

Module tree (the same names in ``llama.py``; sharding units, checkpoint policies and
state dicts rely on them)::

    tok_emb   nn.Embedding(vocab, hidden)      token table; IS lm_head.weight (tied)
    pos_emb   nn.Embedding(seq_len, hidden)    learned positions
    blocks    nn.ModuleList[GPT2Block]         pre-norm residual blocks:
      norm1     nn.LayerNorm                     before attention
      attn      GPT2Attention                    qkv -> core -> out_proj -> dropout
        qkv       nn.Linear(h, 3h)               fused query/key/value projection
        core      CoreAttention                  parameter-free SDPA (recompute boundary)
        out_proj  nn.Linear(h, h)                residual projection (scaled init)
      norm2     nn.LayerNorm                     before the MLP
      mlp       GPT2MLP                          fc -> GELU -> out_proj -> dropout
        fc        nn.Linear(h, 4h)
        out_proj  nn.Linear(4h, h)               residual projection (scaled init)
    norm_f    nn.LayerNorm                     final norm
    lm_head   nn.Linear(h, vocab, bias=False)  weight tied to tok_emb.weight

[Note: meta-first construction]
Both models build every submodule on the meta device, then, unless asked for a meta
model, call ``materialize``: allocate on the target device, recompute buffers, and run
``init_weights``. So ``GPT2(cfg, seed=s)`` and ``materialize(GPT2(cfg, device="meta"),
dev, s)`` run the same code and agree bit for bit, construction never touches the
global RNG, and no time is spent on PyTorch's default init that would be overwritten.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import CoreAttention
from .config import GPT2Config
from .init import materialize

__all__ = ["GPT2", "GPT2Attention", "GPT2Block", "GPT2MLP"]


class GPT2Attention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection and biases."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.core = CoreAttention(dropout_p=config.dropout)
        self.out_proj = nn.Linear(config.hidden, config.hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        # [B, T, 3h] -> three [B, heads, T, head_dim]
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, h // self.n_heads).permute(2, 0, 3, 1, 4)
        y = self.core(q, k, v)
        return self.dropout(self.out_proj(y.transpose(1, 2).reshape(b, t, h)))


class GPT2MLP(nn.Module):
    """Two-layer 4h MLP with the tanh-approximated GELU GPT-2 was trained with."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden, 4 * config.hidden)
        self.act = nn.GELU(approximate="tanh")
        self.out_proj = nn.Linear(4 * config.hidden, config.hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.out_proj(self.act(self.fc(x))))


class GPT2Block(nn.Module):
    """Pre-LayerNorm residual block (GPT-2 moved the norms to the sub-block inputs)."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.attn = GPT2Attention(config)
        self.norm2 = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT2(nn.Module):
    """GPT-2 language model: ``forward(idx[B, T]) -> logits[B, T, vocab]``.

    ``device`` defaults to ``torch.get_default_device()``; ``device="meta"`` returns an
    unallocated model for ``materialize`` (see [Note: meta-first construction]).
    Parameters are initialised by ``init_weights(model, seed)``.
    """

    def __init__(
        self, config: GPT2Config, *, device: torch.device | str | None = None, seed: int = 0
    ) -> None:
        super().__init__()
        if not isinstance(config, GPT2Config):
            raise TypeError(f"GPT2 needs a GPT2Config, got {type(config).__name__}")
        self.config = config
        with torch.device("meta"):
            self.tok_emb = nn.Embedding(config.vocab, config.hidden)
            self.pos_emb = nn.Embedding(config.seq_len, config.hidden)
            self.blocks = nn.ModuleList(GPT2Block(config) for _ in range(config.n_layers))
            self.norm_f = nn.LayerNorm(config.hidden, eps=config.norm_eps)
            self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        # One Parameter under two names (Press & Wolf 2017); named_parameters() and
        # state_dict consumers see it once as tok_emb.weight.
        self.lm_head.weight = self.tok_emb.weight
        target = torch.device(device) if device is not None else torch.get_default_device()
        if target.type != "meta":
            materialize(self, target, seed)

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers after ``to_empty``; GPT-2 has none."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        self.config.check_seq_len(t)
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm_f(x))
