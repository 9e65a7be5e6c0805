"""Stage 3's quantised weight all-gather (ZeRO++'s qwZ): ``quantize_weights="int8" | "fp8"``.

[Note: quantised weights]
Before a training gather (a forward with gradients, a backward, a recompute), each rank
quantises its compute-dtype slice in blocks of :data:`BLOCK` elements, symmetric around
zero with one fp32 scale per block (int8: scale = max|x| / 127, values rounded to
-127..127; fp8: scale = max|x| / 448, values cast to float8_e4m3fn), and packs the
payload and the scales into one uint8 buffer: the all-gather moves that buffer, so the
scales travel with the data in the same collective (gloo cannot all-gather float8
tensors, "Invalid scalar type": fp8 travels as its bytes). Every rank then dequantises
every slice — its own too, so all ranks compute with the same weights — into the compute
dtype (bf16 stays bf16), in fp32 arithmetic. The last block is padded with zeros: any
size works. Master weights, gradients and the optimizer are untouched: only what the
forward and backward read is quantised, as in ZeRO++.

A gather outside training (a forward under ``torch.no_grad()``, ``generate()``,
``gathered()``, ``model.unshard()``) gathers the exact weights: evaluation and generation
see the model as it is. With the secondary shard (hpZ), backward reads the forward's
dequantised weights from it, so forward and backward compute with the same values.

Bytes per element on the wire: 1 + 4/BLOCK (int8 and fp8) against 2 for bf16 and 4 for
fp32.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "KINDS", "packed_numel", "quantize", "dequantize"]

#: Elements per scale: ZeRO++ quantises in groups of this order; 256 keeps the scales at
#: 1.6% of the int8 payload and the error per block small.
BLOCK = 256
#: The largest magnitude each kind represents after scaling.
_QMAX = {"int8": 127.0, "fp8": 448.0}
KINDS = tuple(_QMAX)


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def packed_numel(numel: int) -> int:
    """uint8 bytes one rank's quantised slice of ``numel`` elements packs into."""
    nb = _blocks(numel)
    return nb * BLOCK + 4 * nb


def quantize(x: torch.Tensor, kind: str) -> torch.Tensor:
    """A 1-D tensor -> one uint8 buffer: the payload (a byte per element, blocks padded
    with zeros), then the fp32 scales."""
    n, nb = x.numel(), _blocks(x.numel())
    v = torch.zeros(nb * BLOCK, dtype=torch.float32, device=x.device)
    v[:n] = x
    v = v.view(nb, BLOCK)
    scale = v.abs().amax(dim=1) / _QMAX[kind]
    v = v / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
    if kind == "int8":
        q = torch.round(v).clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        q = v.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([q.reshape(-1), scale.view(torch.uint8)])


def dequantize(packed: torch.Tensor, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``numel`` values in ``dtype``."""
    nb = _blocks(numel)
    payload = packed[: nb * BLOCK].view(nb, BLOCK)
    scale = packed[nb * BLOCK : nb * BLOCK + 4 * nb].view(torch.float32)
    q = payload.view(torch.int8 if kind == "int8" else torch.float8_e4m3fn)
    return (q.float() * scale[:, None]).reshape(-1)[:numel].to(dtype)
