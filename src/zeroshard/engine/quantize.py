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
dtype (bf16 stays bf16), in fp32 arithmetic. The last block is padded with zeros to find
its scale, and only the payload is sent: any size works, and a slice of n elements moves
n + 4·⌈n/256⌉ bytes (int4, for gradients: ⌈n/2⌉ + 4·⌈n/256⌉, two values a byte). Master weights, gradients and the optimizer are untouched: only what the
forward and backward read is quantised, as in ZeRO++.

A gather outside training (a forward under ``torch.no_grad()`` or of a module in eval
mode, ``generate()``,
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
#: 1.6% of the int8 payload (3.1% of int4's) and the error per block small.
BLOCK = 256
#: The largest magnitude each kind represents after scaling (int4: -7..7, two a byte).
_QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}
KINDS = tuple(_QMAX)


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def _payload(numel: int, kind: str) -> int:
    return -(-numel // 2) if kind == "int4" else numel


def packed_numel(numel: int, kind: str = "int8") -> int:
    """uint8 bytes ``numel`` elements pack into: the payload (a byte per element, int4 half
    a byte) and a 4-byte scale per block — nothing padded on the wire."""
    return _payload(numel, kind) + 4 * _blocks(numel)


def quantize(x: torch.Tensor, kind: str) -> torch.Tensor:
    """A 1-D tensor -> one uint8 buffer: the payload, then the fp32 scales (blocks are
    padded with zeros to compute the scales; the padding is not sent)."""
    n, nb = x.numel(), _blocks(x.numel())
    v = torch.zeros(nb * BLOCK, dtype=torch.float32, device=x.device)
    v[:n] = x
    v = v.view(nb, BLOCK)
    scale = v.abs().amax(dim=1) / _QMAX[kind]
    v = (v / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]).reshape(-1)[:n]
    if kind == "fp8":
        q = v.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        q = torch.round(v).clamp_(-_QMAX[kind], _QMAX[kind]).to(torch.int8)
        if kind == "int4":  # two a byte: 1..15 (x + 8), even elements in the low nibble
            q = q.to(torch.uint8) + 8
            if n % 2:
                q = torch.cat([q, q.new_full((1,), 8)])
            q = q[0::2] | (q[1::2] << 4)
        q = q.view(torch.uint8)
    return torch.cat([q, scale.view(torch.uint8)])


def dequantize(packed: torch.Tensor, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``numel`` values in ``dtype``."""
    nb, p = _blocks(numel), _payload(numel, kind)
    payload, scale = packed[:p], packed[p : p + 4 * nb]
    if scale.storage_offset() % 4:  # a row of a gathered buffer: scales unaligned
        scale = scale.clone()
    scale = scale.view(torch.float32)
    if kind == "int4":
        q = torch.stack([payload & 15, payload >> 4], dim=1).reshape(-1)[:numel]
        q = q.to(torch.int16) - 8
    else:
        q = payload.view(torch.int8 if kind == "int8" else torch.float8_e4m3fn)
    v = torch.zeros(nb * BLOCK, dtype=torch.float32, device=packed.device)
    v[:numel] = q.float()
    return (v.view(nb, BLOCK) * scale[:, None]).reshape(-1)[:numel].to(dtype)
