"""Tensor-parallel test helpers (issue #30): the plan (zeroshard.models.parallel) and training under it.

Column-wise q/k/v and gate/up, row-wise out-projections into sequence shards, sequence-
parallel norms, the token table row-wise and the LM head column-wise into vocabulary
shards (use ``torch.distributed.tensor.parallel.loss_parallel`` around the loss).
"""

from __future__ import annotations

import torch

from zeroshard.models.parallel import parallelize_llama

__all__ = ["parallelize_llama"]


# -- training under tp, against one process on the whole batch ---------------------------
LAYOUTS = {"dp2xtp2": ((2, 2), ("dp", "tp")),
           "rep2xshard1xtp2": ((2, 1, 2), ("replicate", "shard", "tp")),
           "dp1xtp4": ((1, 4), ("dp", "tp")),
           "rep2xshard2": ((2, 2), ("replicate", "shard")),  # hybrid, no tp
           "dp4": ((4,), ("dp",))}
BATCH, SEQ = 4, 32


def tp_mesh(layout: str):
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = LAYOUTS[layout]
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def dp_coordinate(mesh) -> tuple[int, int]:
    """(this rank's data-parallel index, the data-parallel degree) on ``mesh``."""
    names = [n for n in mesh.mesh_dim_names if n != "tp"]
    size, index = 1, 0
    for n in names:
        index = index * mesh[n].size() + mesh[n].get_local_rank()
        size *= mesh[n].size()
    return index, size


def batch(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, vocab, (BATCH, SEQ), generator=g),
            torch.randint(0, vocab, (BATCH, SEQ), generator=g))


def llama_config(vocab: int, intermediate: int | None = None):
    """llama-tiny with another vocabulary and MLP width, and a key/value head per query
    head (4: tp 4 divides them)."""
    import dataclasses

    from zeroshard.models import get_preset

    return dataclasses.replace(get_preset("llama-tiny"), vocab=vocab, intermediate=intermediate,
                               n_kv_heads=4)


def tp_loss(model, idx, y) -> torch.Tensor:
    """The mean token loss; under loss_parallel where the logits are vocabulary shards."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    out = model(idx)
    if isinstance(out, DTensor):
        with loss_parallel():
            return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def backward(loss: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    if isinstance(loss, DTensor):
        with loss_parallel():
            loss.backward()
    else:
        loss.backward()


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t
