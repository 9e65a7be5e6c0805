"""Activation memory: the paper's formula and an itemised estimate for our models.

The bill is what autograd keeps for backward after the forward pass ("saved activations",
measured by :class:`~zeroshard.memory.SavedTensorCounter`), by term, so each number can be
set beside a measurement. Notation: s sequence, b micro-batch, h hidden, a heads, L
layers, V vocabulary, f MLP width, T = b*s tokens, d bytes per activation element.

[Note: Korthikanti et al. 2022, eq. 2]
One transformer layer with 16-bit activations, dropout, and attention that materialises
the s x s scores stores s*b*h*(34 + 5*a*s/h) bytes:
  attention  11sbh + 5as^2b: qkv input 2sbh; Q, K 4sbh; V 2sbh; out-proj input 2sbh;
             dropout mask sbh; softmax output 2as^2b; its dropout mask as^2b; dropout
             output 2as^2b (it feeds the AV matmul)
  MLP        19sbh: fc input 2sbh; GELU input 8sbh; GELU output 8sbh; dropout mask sbh
  LayerNorm  4sbh: the inputs of both norms
Full checkpointing keeps 2sbh (the layer input); selective recompute (sec. 4.2) drops the
5as^2b part and keeps 34sbh.

[Note: what differs in our models]
:func:`block_terms` and :func:`outside_terms` list what torch saves for our GPT-2 and
Llama (exact on the CPU in fp32; the tests check every policy to the byte). Differences:
* d: 2 in the paper, 4 for fp32 on the CPU: every activation term doubles.
* Masks: CUDA's fused dropout keeps a 1-byte bool mask; the CPU's dropout multiplies by a
  float noise tensor and keeps that (``mask_bytes=4``). No dropout, no masks.
* Fused attention (flash / memory-efficient SDPA; the CPU uses its flash kernel only when
  dropout is 0) stores no scores, only its output and a fp32 logsumexp (4*a*s*b bytes).
  Its output is laid out [b, s, a, hd], so the out-proj input is a view of it (1 term).
* LayerNorm also keeps fp32 mean and rstd (2 * 4 bytes per token); the paper ignores them.
* 16-bit activations (d = 2) keep some fp32 tensors, counted at 4 bytes whatever d is:
  torch's composite RMSNorm upcasts its input and saves the fp32 copy and x*rstd; the
  loss runs on fp32 logits (``logits.float()``), so its log-softmax output is fp32; the
  attention logsumexp and LayerNorm's mean/rstd are fp32 statistics (CUDA's kernels; the
  CPU's keeps LayerNorm's in the input dtype, a few bytes per token). Measured on
  llama-tiny and gpt2-tiny under zeroshard's bf16 (tests/test_traced.py).
* Llama: RMSNorm run as torch's composite also keeps x*rstd (+1 sbh per norm); RoPE keeps
  the rotated q (k, v after the GQA repeat are h wide too), so q/k/v stay 3sbh; SwiGLU
  keeps gate, up, silu(gate) and their product: 4*s*b*f instead of GELU's 8sbh (4h wide).
* Outside the blocks: token (and position) ids for the embedding backward, the final
  norm, the LM-head input, and cross-entropy's log-softmax output T*V*d (the logits
  themselves are not saved), its targets and a scalar.

[Note: activations under tensor parallelism]
With ``tp`` > 1 the bill is one rank's under torchtitan's plan for Llama, which
``parallelize_module`` applies on the tensor-parallel mesh dimension: q/k/v, gate and up
projections column-wise, both out-projections row-wise into sequence shards, the norms
sequence-parallel, the token table row-wise, the LM head column-wise into vocabulary
shards with ``loss_parallel`` (Korthikanti et al. 2022, sec. 4.2.2). What each term
becomes on one rank (tp must divide the heads and the sequence; for an MLP width or a
vocabulary it does not divide, rank 0's share, the largest):
* sequence shards (s/tp): the norms' inputs, statistics and x*rstd, blocks' and final;
* heads or MLP width / tp: q, k, v, the attention output, the logsumexp, the SwiGLU terms;
* vocabulary / tp: cross-entropy's log-softmax output;
* whole: the attention and MLP inputs (each norm's output, all-gathered over the
  sequence; torch's linear saves the gathered input for its weight gradient, where
  Megatron-LM gathers it again in backward: so the paper's 34sbh/t becomes 4sbh + 30sbh/t
  per layer in 16-bit), the LM head input (gathered the same way), token ids, targets and
  the RoPE tables.
A block's input kept by a checkpointed region is a sequence shard (s/tp). Measured on
llama-tiny at tp 2 (tests/test_tp_accounting.py): 2,053,380 bytes with no checkpointing
(b 2, s 64, fp32), equal to the estimate, and so for each policy it prices.
GPT-2's fused qkv projection cannot be split column-wise (a rank's rows would mix q and
k), so ``tp`` > 1 is for Llama only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zeroshard.checkpointing import (
    CheckpointPolicy,
    NoCheckpoint,
    Selective,
    SelectiveOps,
    parse_policy,
)
from zeroshard.models.config import GPT2Config, LlamaConfig, ModelConfig

__all__ = [
    "ActivationEstimate",
    "block_terms",
    "check_tp",
    "estimate_activation_bytes",
    "outside_terms",
    "paper_activation_bytes",
    "paper_layer_bytes",
]

ID_BYTES = 8  # int64 token ids / targets
STAT_BYTES = 4  # norm statistics and attention logsumexp are fp32 whatever d is
UPCAST_BYTES = 4  # what torch computes in fp32 under 16-bit activations (module notes)


def paper_layer_bytes(s: int, b: int, h: int, a: int) -> int:
    """s*b*h*(34 + 5*a*s/h): one layer, 16-bit, dropout, unfused (eq. 2 of the paper)."""
    return 34 * s * b * h + 5 * a * s * s * b


def paper_activation_bytes(
    s: int, b: int, h: int, a: int, n_layers: int, policy: str | CheckpointPolicy
) -> int:
    """The paper's per-layer bill for ``n_layers`` under a policy (blocks only)."""
    full, sel, inputs = _layer_counts(parse_policy(policy), n_layers)
    return full * paper_layer_bytes(s, b, h, a) + sel * 34 * s * b * h + inputs * 2 * s * b * h


def block_terms(
    config: ModelConfig,
    micro_batch: int,
    seq_len: int,
    *,
    dtype_bytes: int = 4,
    fused_attention: bool = True,
    dropout: bool = False,
    mask_bytes: int = 1,
    tp: int = 1,
) -> dict[str, int]:
    """Bytes one un-checkpointed block saves for backward, by term (see module notes).

    Terms whose name starts with ``"scores"`` are what selective recompute drops. ``tp``:
    one rank's bytes under tensor parallelism with sequence parallelism (see [Note:
    activations under tensor parallelism]).
    """
    if dropout and isinstance(config, LlamaConfig):
        raise ValueError("dropout=True, but the Llama model has no dropout; pass dropout=False")
    check_tp(config, tp, seq_len)
    b, s, h, a, d = micro_batch, seq_len, config.hidden, config.n_heads, dtype_bytes
    t = b * s
    ts = b * s // tp  # tokens of one sequence shard
    ha = a // tp  # a rank's heads (tp divides them)
    ah = h // tp  # their width
    llama = isinstance(config, LlamaConfig)
    nd = UPCAST_BYTES if llama else d  # RMSNorm saves fp32 copies (see the module notes)
    terms = {
        "norm inputs (2 norms)": 2 * ts * h * nd,
        "attention input (norm1 output)": t * h * d,
        "q, k, v (attention core inputs)": 3 * t * ah * d,
        "attention output (out-proj input)": t * ah * d,
        "mlp input (norm2 output)": t * h * d,
    }
    if fused_attention:
        terms["scores: logsumexp (fp32, fused SDPA)"] = b * ha * s * STAT_BYTES
    else:
        terms["scores: softmax output"] = b * ha * s * s * d
        if dropout:
            terms["scores: dropout mask"] = b * ha * s * s * mask_bytes
            terms["scores: dropout output"] = b * ha * s * s * d
    if isinstance(config, GPT2Config):
        terms["norm mean + rstd (fp32)"] = 2 * 2 * t * STAT_BYTES
        terms["mlp fc output (GELU input, 4h)"] = 4 * t * h * d
        terms["mlp GELU output (out-proj input, 4h)"] = 4 * t * h * d
        if dropout:
            terms["residual dropout masks (2)"] = 2 * t * h * mask_bytes
    else:
        f = math.ceil(config.ffn_dim / tp)
        terms["norm rstd (fp32)"] = 2 * ts * STAT_BYTES
        terms["norm x*rstd (composite RMSNorm)"] = 2 * ts * h * nd
        terms["mlp gate and up outputs (SwiGLU, f)"] = 2 * t * f * d
        terms["mlp silu(gate) (f)"] = t * f * d
        terms["mlp silu(gate)*up (out-proj input, f)"] = t * f * d
    return terms


def check_tp(config: ModelConfig, tp: int, seq_len: int | None = None) -> None:
    """Raise ValueError unless ``config``'s activations can be priced at tensor-parallel
    degree ``tp`` (see [Note: activations under tensor parallelism])."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive integer (the tensor-parallel degree)")
    if tp == 1:
        return
    if not isinstance(config, LlamaConfig):
        raise ValueError(f"tp={tp}: tensor parallelism is priced for Llama-style models only; "
                         "GPT-2's fused qkv projection cannot be split column-wise (a rank's "
                         "rows would mix q and k). Use a llama-* preset or tp=1")
    if config.n_heads % tp or config.kv_heads % tp:
        raise ValueError(f"tp={tp} does not divide the attention heads (n_heads="
                         f"{config.n_heads}, kv_heads={config.kv_heads}): column-wise q/k/v "
                         "give each rank whole heads; use a tp that divides both")
    if seq_len is not None and seq_len % tp:
        raise ValueError(f"tp={tp} does not divide seq_len={seq_len}: torch's sequence "
                         "parallelism assumes equal sequence shards (an all-gather of unequal "
                         "ones gives the wrong length); use a multiple of tp")


def outside_terms(
    config: ModelConfig, micro_batch: int, seq_len: int, *, dtype_bytes: int = 4, tp: int = 1
) -> dict[str, int]:
    """Bytes saved outside the blocks: embeddings, final norm, LM head, cross-entropy
    (``tp``: one rank's, see [Note: activations under tensor parallelism])."""
    check_tp(config, tp, seq_len)
    b, s, h, d = micro_batch, seq_len, config.hidden, dtype_bytes
    t, ts = b * s, b * s // tp
    terms = {"token ids (embedding backward)": t * ID_BYTES}
    if isinstance(config, GPT2Config):
        terms["position ids"] = s * ID_BYTES
        terms["final norm input"] = t * h * d
        terms["final norm mean + rstd (fp32)"] = 2 * t * STAT_BYTES
    else:
        # The whole [seq_len_max, head_dim] fp32 tables: a slice keeps its storage.
        # (buffers: cast with the weights under zeroshard's mixed precision)
        terms["RoPE cos/sin tables (whole buffers)"] = 2 * config.seq_len * config.head_dim * d
        terms["final norm input (fp32)"] = ts * h * UPCAST_BYTES
        terms["final norm x*rstd (fp32)"] = ts * h * UPCAST_BYTES
        terms["final norm rstd (fp32)"] = ts * STAT_BYTES
    terms["LM head input (final norm output)"] = t * h * d
    # the loss runs on fp32 logits (``logits.float()``, as the bench, the trace and the
    # examples compute it), so its log-softmax is fp32 whatever d is
    terms["cross-entropy log-softmax output (b*s*V, fp32)"] = (
        t * math.ceil(config.vocab / tp) * UPCAST_BYTES)
    terms["cross-entropy targets"] = t * ID_BYTES
    terms["cross-entropy total weight (scalar, fp32)"] = UPCAST_BYTES
    return terms


@dataclass(frozen=True)
class ActivationEstimate:
    """Saved-for-backward bytes of one micro-batch under a policy, itemised.

    ``block`` is one un-checkpointed block by term; ``full_blocks`` of them are stored
    whole, ``selective_blocks`` without their ``scores`` terms, and ``kept_inputs`` block
    inputs (``input_bytes`` each) are kept by checkpointed regions.
    """

    policy: str
    block: dict[str, int]
    outside: dict[str, int]
    input_bytes: int
    full_blocks: int
    selective_blocks: int
    kept_inputs: int

    @property
    def block_bytes(self) -> int:
        return sum(self.block.values())

    @property
    def scores_bytes(self) -> int:
        return sum(v for k, v in self.block.items() if k.startswith("scores"))

    @property
    def blocks_total(self) -> int:
        return (
            self.full_blocks * self.block_bytes
            + self.selective_blocks * (self.block_bytes - self.scores_bytes)
            + self.kept_inputs * self.input_bytes
        )

    @property
    def total(self) -> int:
        return self.blocks_total + sum(self.outside.values())


def estimate_activation_bytes(
    config: ModelConfig,
    micro_batch: int,
    seq_len: int | None = None,
    policy: str | CheckpointPolicy = "none",
    *,
    dtype_bytes: int = 4,
    fused_attention: bool = True,
    dropout: bool = False,
    mask_bytes: int = 1,
    tp: int = 1,
) -> ActivationEstimate:
    """Itemised saved-activation bytes of our GPT-2 / Llama for one micro-batch.

    Args:
        seq_len: tokens per sequence (default ``config.seq_len``).
        dtype_bytes: 4 for fp32 (the CPU default), 2 for bf16/fp16 activations.
        fused_attention: SDPA ran a fused kernel (no s x s scores stored). On the CPU,
            torch picks it only when dropout is 0.
        dropout: the model trains with dropout > 0 (GPT-2 only).
        mask_bytes: bytes per dropout-mask element: 1 on CUDA, 4 on the CPU.
        tp: tensor-parallel degree: one rank's bytes under torchtitan's plan with
            sequence and loss parallelism (see [Note: activations under tensor
            parallelism]; Llama only).
    """
    s = config.seq_len if seq_len is None else seq_len
    for name, v in (
        ("micro_batch", micro_batch),
        ("seq_len", s),
        ("dtype_bytes", dtype_bytes),
        ("mask_bytes", mask_bytes),
    ):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    config.check_seq_len(s)
    pol = parse_policy(policy)
    if isinstance(pol, SelectiveOps):  # its regions would price it as "full": far too low
        raise ValueError("policy 'selective-op' is not priced by this estimate (it keeps every "
                         "matmul's output, which the itemised terms do not split out); "
                         "measure it with SavedTensorCounter or a traced plan, or estimate "
                         "'selective' or 'full'")
    full, sel, inputs = _layer_counts(pol, config.n_layers)
    return ActivationEstimate(
        policy=getattr(pol, "name", type(pol).__name__),
        block=block_terms(
            config,
            micro_batch,
            s,
            dtype_bytes=dtype_bytes,
            fused_attention=fused_attention,
            dropout=dropout,
            mask_bytes=mask_bytes,
            tp=tp,
        ),
        outside=outside_terms(config, micro_batch, s, dtype_bytes=dtype_bytes, tp=tp),
        input_bytes=micro_batch * s // tp * config.hidden * dtype_bytes,
        full_blocks=full,
        selective_blocks=sel,
        kept_inputs=inputs,
    )


def _layer_counts(policy: CheckpointPolicy, n_layers: int) -> tuple[int, int, int]:
    """(blocks stored whole, blocks stored without scores, block inputs kept)."""
    if isinstance(policy, NoCheckpoint):
        return n_layers, 0, 0
    if isinstance(policy, Selective):
        return 0, n_layers, 0
    # Full, every-k, sqrt: each region keeps one input; blocks outside regions keep all.
    regions = policy.regions(list(range(n_layers)))  # type: ignore[arg-type]
    return n_layers - sum(len(r) for r in regions), 0, len(regions)
