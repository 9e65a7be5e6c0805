"""torchtitan's tensor-parallel plan for zeroshard's Llama, for tests (issue #30).

Column-wise q/k/v and gate/up, row-wise out-projections into sequence shards, sequence-
parallel norms, the token table row-wise and the LM head column-wise into vocabulary
shards (use ``torch.distributed.tensor.parallel.loss_parallel`` around the loss).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def parallelize_llama(model: torch.nn.Module, tp_mesh: DeviceMesh) -> torch.nn.Module:
    """Apply the plan in place on ``tp_mesh`` (1-D); returns ``model``."""
    parallelize_module(model, tp_mesh, {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                   use_local_output=False),
    })
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {
            "norm1": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                       desired_input_layouts=(Replicate(), None, None)),
            "attn.q_proj": ColwiseParallel(),
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.out_proj": RowwiseParallel(output_layouts=Shard(1)),
            "norm2": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.out_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    return model
