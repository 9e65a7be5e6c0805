"""The attention core shared by both reference models.

[Note: CoreAttention is the selective-recompute boundary]
Korthikanti et al. (2022, sec. 4.2) observe that the attention score path (QK^T,
softmax, dropout, weighted sum of V) stores O(s^2) activations per head but costs few
FLOPs, so recomputing just that path in backward saves most activation memory for a few
percent of compute. ``CoreAttention`` holds exactly that path and nothing else: no
parameters, no projections, no reshapes, no RoPE. The activation-checkpoint policy wraps
this module by type, so anything added here is recomputed too; keep it minimal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CoreAttention"]


class CoreAttention(nn.Module):
    """Causal scaled-dot-product attention over ``[B, heads, T, head_dim]`` tensors.

    q, k and v must have the same number of heads (grouped-query attention repeats k/v
    before this module, so the recomputed region is the same for both models).
    ``dropout_p`` is applied to the attention probabilities in training mode only.
    """

    def __init__(self, dropout_p: float = 0.0) -> None:
        super().__init__()
        self.dropout_p = dropout_p

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout_p if self.training else 0.0
        )

    def extra_repr(self) -> str:
        return f"dropout_p={self.dropout_p}"
