"""torchtitan's tensor-parallel plan for zeroshard's Llama (docs/tensor-parallel.md).

Column-wise q/k/v and gate/up, row-wise out-projections into sequence shards,
sequence-parallel norms, the token table row-wise and the LM head column-wise into
vocabulary shards: the logits come out as a DTensor sharded on the vocabulary, so the
loss runs under ``torch.distributed.tensor.parallel.loss_parallel()``. Apply it before
``zeroshard.shard(model, ..., mesh=mesh)``, on ``mesh["tp"]``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["parallelize_llama"]


def parallelize_llama(model: nn.Module, tp_mesh: Any) -> nn.Module:
    """Apply the plan in place on ``tp_mesh`` (1-D); returns ``model``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from .llama import Llama

    if not isinstance(model, Llama):
        raise TypeError(f"parallelize_llama takes zeroshard's Llama, got {type(model).__name__}; "
                        "for another model write its plan with parallelize_module "
                        "(docs/tensor-parallel.md)")
    if model.lm_head.weight is model.tok_emb.weight:
        raise ValueError(
            "the model ties its token table and LM head (tie_embeddings=True); the plan "
            "splits them differently (rows of the table, columns of the head), so they would "
            "become two parameters that train apart. Build it with tie_embeddings=False")
    tp, attn = tp_mesh.size(), model.blocks[0].attn
    if attn.n_heads % tp or attn.n_kv_heads % tp:
        raise ValueError(f"tp={tp} does not divide the attention heads (n_heads="
                         f"{attn.n_heads}, kv heads {attn.n_kv_heads}); column-wise q/k/v give "
                         "each rank whole heads: use a tp dividing both")
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
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                      desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.out_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    return model
