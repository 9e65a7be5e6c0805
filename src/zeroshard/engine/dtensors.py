"""DTensors over the engine's own memory, built without torch's per-call checks.

The user parameters and gradients are DTensor views of flat buffers
([Note: parameters the user sees] in params.py); they are rebuilt every step, so their
construction must cost a Python object, not a collective or an autograd node.
"""

from __future__ import annotations

import torch

__all__ = ["make_spec", "dtensor"]


def make_spec(mesh, placements: tuple, shape: torch.Size, dtype: torch.dtype):
    """The DTensorSpec of a dim-0-sharded parameter (built once, reused per step)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    stride = torch.empty(shape, device="meta").stride()
    return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(shape, stride, dtype))


def dtensor(local: torch.Tensor, spec) -> torch.Tensor:
    """A DTensor over ``local`` without ``DTensor.from_local``'s autograd function and
    checks (~100x cheaper; FSDP2's ``_from_local_no_grad`` does the same)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=False)
