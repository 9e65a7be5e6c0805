"""Tensor parallelism priced: one rank's parameters and the tp collectives of a step.

Groundwork for composing ZeRO with tensor parallelism (issue #30); the activations are
in :mod:`zeroshard.memory.activations` ([Note: activations under tensor parallelism]).
Both follow torchtitan's plan for Llama (tests/_tp.py): q/k/v and gate/up column-wise,
the out-projections row-wise into sequence shards, the norms sequence-parallel, the
token table row-wise (vocabulary rows), the LM head column-wise with ``loss_parallel``.

[Note: tp collectives, priced]
Korthikanti et al. 2022, sec. 4.2.2: with sequence parallelism a layer's two all-reduces
become an all-gather before each column-wise pair (attention, MLP) and a reduce-scatter
after each row-wise projection, each of the full activation S = b*s*h*d; the ledger's
logical volume (an all-gather or reduce-scatter of a full tensor of S bytes counts S) is
what a ring moves anyway (S (tp-1)/tp per rank). Per step, with L layers:
  forward   all-gather (2L + 1) S   (each block's two, the LM head's input)
            reduce-scatter (2L + 1) S   (each block's two, the token table's output)
            all-reduce 3 x 2 b*s*d   (loss_parallel: max, sum of exponentials, target logit)
  backward  the transpose of each: reduce-scatter (2L + 1) S, all-gather (2L + 1) S
  recompute a checkpointed region of k blocks re-runs their forward as far as backward
            needs: 2k all-gathers and 2k - 1 reduce-scatters (torch's non-reentrant
            checkpoint stops early, before the last MLP's, whose output nothing saved);
            full checkpointing: + 2L S all-gather, + L S reduce-scatter. Selective
            recomputes the attention core only: none.
The replicated norm weights' gradients are left as ``Partial`` DTensors by torch's
backward; zeroshard's engine sums them over tp before its dp reduction
(``TensorParallel.local_grads``, engine/tensor_parallel.py; at stage 3 one all-reduce
per unit, at stages 1-2 one per norm): (2L + 1) h elements in the gradients' dtype, in
backward (an all-reduce of S bytes counts 2S, as the loss's do). Measured on llama-tiny
at tp 2 with a dispatch counter (tests/test_tp_accounting.py): every op's bytes, in
forward and in backward, equal; composed with zeroshard, torch's collectives equal the
dispatch counter's and the norms' all-reduces zeroshard's ledger (tests/test_tp.py).
"""

from __future__ import annotations

import math

from zeroshard.memory.activations import check_tp
from zeroshard.memory.analytic import Collective
from zeroshard.models.config import ModelConfig

__all__ = ["tp_collectives_per_step", "tp_param_count", "tp_parts"]


def tp_parts(config: ModelConfig, tp: int) -> tuple[int, int, int]:
    """(one block's, the root's, the LM head's and final norm's) parameters on tp rank 0,
    stage 3's units as :func:`~zeroshard.memory.stage3_buffers.block_params` and its
    neighbours count them for the whole model."""
    total = tp_param_count(config, tp)
    v, h = math.ceil(config.vocab / tp), config.hidden
    root = 2 * v * h + h
    return (total - root) // config.n_layers, root, v * h + h


def tp_param_count(config: ModelConfig, tp: int) -> int:
    """Parameters rank 0 holds under the plan (the largest share where tp does not divide
    the MLP width or the vocabulary); the norms are whole on every rank."""
    check_tp(config, tp)
    if tp > 1 and config.tie_embeddings:  # check_tp: a LlamaConfig
        raise ValueError(f"tp={tp} with tie_embeddings=True: parallelize_module gives the token "
                         "table and the LM head separate parameters, which breaks the tie (they "
                         "would train apart); untie them (tie_embeddings=False) or use tp=1")
    h, f, v = config.hidden, math.ceil(config.ffn_dim / tp), math.ceil(config.vocab / tp)
    kv = config.kv_heads * config.head_dim // tp
    block = h * (h // tp) * 2 + 2 * h * kv + 3 * h * f + 2 * h
    return 2 * v * h + config.n_layers * block + h


def tp_collectives_per_step(
    config: ModelConfig, *, micro_batch: int, seq_len: int, tp: int, act_bytes: int,
    policy: str = "none", norm_grad_bytes: int = 0,
) -> list[Collective]:
    """The tensor-parallel collectives of one step, per rank; see [Note: tp collectives,
    priced]. Group "tp", ``tp`` ranks. They sit on the critical path (each feeds the next
    op), so none of them hides behind compute. ``norm_grad_bytes``: bytes per element of
    the sequence-parallel norms' weight gradients, which zeroshard all-reduces over tp
    in backward (engine/tensor_parallel.py); 0 where nothing reduces them (plain TP)."""
    from zeroshard.checkpointing import Selective, parse_policy

    check_tp(config, tp, seq_len)
    if tp == 1:
        return []
    layers, tokens = config.n_layers, micro_batch * seq_len
    s = tokens * config.hidden * act_bytes
    pol = parse_policy(policy)
    # Selective recomputes the attention core only (no collective); the others re-run
    # their regions' blocks, up to the last block's MLP (see the note).
    regions = [] if isinstance(pol, Selective) else pol.regions(list(range(layers)))  # type: ignore[arg-type]
    regathered = sum(2 * len(r) for r in regions)
    rescattered = sum(2 * len(r) - 1 for r in regions)

    def c(op: str, phase: str, n: int) -> Collective:
        return Collective(op=op, phase=phase, logical_bytes=n, group="tp", ranks=tp)

    return [
        c("all_gather", "forward", (2 * layers + 1) * s),
        c("reduce_scatter", "forward", (2 * layers + 1) * s),
        c("all_reduce", "forward", 3 * 2 * tokens * act_bytes),
        c("reduce_scatter", "backward", (2 * layers + 1) * s),
        c("all_gather", "backward", (2 * layers + 1 + regathered) * s),
        c("reduce_scatter", "backward", rescattered * s),
        c("all_reduce", "backward", 2 * (2 * layers + 1) * config.hidden * norm_grad_bytes),
    ]
