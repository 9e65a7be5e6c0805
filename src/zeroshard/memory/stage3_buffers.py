"""Stage 3's buffers beyond its 1/N shards, priced: the gathered units, the gradient
buffer of the unit being reduced, the root's reduction, and the moments that bound the
step's peak. Arithmetic only (see analytic.py, which re-exports these)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from zeroshard.models.config import GPT2Config, ModelConfig

from .recipes import Recipe, check_stage, get_recipe

__all__ = ["Stage3Buffers", "Stage3Moment", "block_params", "root_params", "head_params",
           "stage3_buffer_bytes", "stage3_moments"]


@dataclass(frozen=True, kw_only=True)
class Stage3Buffers:
    """Stage 3's bytes beyond the 1/N shards at the two moments that bound them; see
    [Note: stage-3 buffers]."""

    backward: int
    """While the blocks run backward, their activations alive: the root's weights, the
    head's gradients, prefetch + 1 blocks' weights and two blocks' gradients."""
    root_reduce: int
    """At the end of backward, the activations freed: the root's weights and its
    gradients twice (autograd's, and the buffer they are copied into for the
    reduce-scatter), beside the first block's reduction in flight."""

    @property
    def peak(self) -> int:
        """The most held at once over a step."""
        return max(self.backward, self.root_reduce)

    def beside(self, activation_bytes: int) -> int:
        """The part of a stage-3 step's peak that no device count shrinks, less
        ``activation_bytes`` (the activations' own peak): the backward window, or the
        root's reduction if that alone is larger. With every gradient slice counted
        beside it, an upper bound of the step's peak (see [Note: stage-3 peak])."""
        return max(self.backward, self.root_reduce - activation_bytes)


def block_params(config: ModelConfig) -> int:
    """Parameters of one transformer block (the stage-3 unit and the recompute region):
    GPT-2 ``12h^2 + 13h``, Llama ``2h^2 + 2h*kv_dim + 3hf + 2h`` (see models/config.py)."""
    h = config.hidden
    if isinstance(config, GPT2Config):
        return 12 * h * h + 13 * h
    kv = config.kv_heads * config.head_dim
    return 2 * h * h + 2 * h * kv + 3 * h * config.ffn_dim + 2 * h


def root_params(config: ModelConfig) -> int:
    """Parameters outside the blocks, stage 3's root unit: embeddings, the LM head unless
    tied, the final norm."""
    return config.param_count() - config.n_layers * block_params(config)


def head_params(config: ModelConfig) -> int:
    """Root parameters whose gradient arrives at the start of backward: the LM head (for a
    tied model, the head's part of the shared table's gradient, a whole table) and the
    final norm. The rest of the root (the token and position embeddings) gets its
    gradient at the end of backward."""
    norm = 2 * config.hidden if isinstance(config, GPT2Config) else config.hidden
    return config.vocab * config.hidden + norm


def stage3_buffer_bytes(
    *,
    block: int,
    root: int,
    head: int,
    prefetch: int = 1,
    recipe: str | Recipe = "bf16-adamw",
) -> Stage3Buffers:
    """[Note: stage-3 buffers]
    What the engine holds beyond its 1/N shards at stage 3 (engine/units.py [Note: unit
    lifecycle] and [Note: prefetch]; engine/backward.py ``_fold``, engine/reduction.py
    ``_MAX_PENDING_UNITS``), for a model of ``block``-parameter blocks and a ``root`` unit
    (everything else), of which
    ``head`` parameters (:func:`head_params`) get their gradients first in backward. P, G
    bytes per weight and gradient, k = prefetch, B, R, H the three counts:

    * The root is gathered at the model's forward and freed only once all its gradients
      have arrived, at the end of backward: P·R for the whole step. The head's gradients
      (G·H) arrive first in backward and stay on their parameters until then, since the
      root is one bucket, reduced whole.
    * A block is gathered around its forward and again around its backward; entering one
      (and, in backward, its first parameter gradient) starts the gathers of the next k:
      (k+1)·P·B of block weights. Its gradients stay on its parameters until its
      backward is done (G·B), then are copied into one whole buffer for the
      reduce-scatter (G·B) after its weights are freed; one reduction may be in flight
      when the next unit allocates its buffer (G·B). So in backward, before a block's
      copy (k+1)·P·B + 2·G·B, and at it k·P·B + 3·G·B:

          backward    = P·R + G·H + max((k+1)·P + 2·G, k·P + 3·G)·B

    * The root is reduced at the end of backward (engine/backward.py, [Note: collective order in
      backward]), after every unit's weights are freed: its buffer (G·R) is allocated
      while autograd's gradients (G·R) are still on the parameters, beside the first
      block's reduction in flight; by then the activations are freed:

          root_reduce = 2·G·R + G·B

    A trace counts both to the byte (tests/test_traced.py; [Note: stage-3 buffers,
    traced] in traced.py): llama-3-8B's shape (untied, R = 1.05B, H = 0.53B, B = 0.22B)
    gives 4.90 GB and 4.64 GB in bf16, not the 8.4 GB of "(k+1) x the largest unit's
    weights and gradients" counted before, which priced the root like a block. What they
    come beside (gradient slices, activations) differs between the two moments: see
    [Note: stage-3 peak]. Counts are unpadded; the engine pads each parameter to a
    multiple of N rows.
    """
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch={prefetch!r} must be an int >= 0 (units gathered ahead)")
    r = get_recipe(recipe)
    p, g, k = r.param_bytes, r.grad_bytes, prefetch
    blocks = max((k + 1) * p + 2 * g, k * p + 3 * g) * block
    return Stage3Buffers(backward=p * root + g * head + blocks,
                         root_reduce=2 * g * root + g * block)


@dataclass(frozen=True, kw_only=True)
class Stage3Moment:
    """What a stage-3 rank holds at one moment of a step beyond its weight and
    optimizer-state shards; see [Note: stage-3 peak]."""

    name: str
    grad_slices: int
    """Its reduced gradient slices that exist by then."""
    activations: int
    """Activations (saved for backward, and the recompute working set) still alive."""
    buffers: int
    """Stage 3's buffers then (:class:`Stage3Buffers`); at the optimizer step, the fp32
    copies of the gradient slices that the optimizer steps with."""

    @property
    def total(self) -> int:
        return self.grad_slices + self.activations + self.buffers


def stage3_moments(
    *,
    block: int,
    blocks: int,
    root: int,
    head: int,
    n: int,
    activations: int,
    late_activations: int,
    head_activations: int = 0,
    saved_activations: int = 0,
    loss_gradients: int = 0,
    prefetch: int = 1,
    recipe: str | Recipe = "bf16-adamw",
    offload: bool = False,
    secondary: int = 0,
) -> tuple[Stage3Moment, ...]:
    """[Note: stage-3 peak]
    ZeRO's model state counts every gradient slice (G·Ψ/N), as a rank holds them between
    backward and the optimizer step; stage 3's buffers ([Note: stage-3 buffers]) sit
    beside the activations. None of the three is whole at the same time. A unit's slice
    appears when its reduce-scatter is issued (the output of a native reduce-scatter,
    kept as ``reduction.shard`` once it completes: engine/reduction.py ``Reducer.launch``, ``complete``);
    ``zero_grad`` frees every slice before the next forward; backward frees each block's
    activations as it passes it. So the step's peak is the largest of four moments, each
    beside the weight and optimizer-state shards ((P + K)·Ψ/N), with ``blocks`` = L
    blocks of B parameters, k = ``prefetch``, A = ``activations`` (their peak, all alive),
    A_h = ``head_activations`` (the head's share of A: the final norm's, the LM head's
    input, the loss's log-softmax), A_s = ``saved_activations`` (what forward saved: A
    without backward's recompute working set), L = ``loss_gradients`` (the two fp32
    gradients the loss's backward makes — of the log-softmax output and of its input, each
    as large as that output: 8·b·s·V bytes) and A' = ``late_activations`` (those of the
    k+1 lowest blocks, with the recompute working set):

        loss's backward      A_s + P·R + L                      only the root gathered
        backward begins      A - A_h + backward                 no slice yet
        end of the blocks'   A' + backward + G·⌈(L-k-1)·B/N⌉   every block above block k
          backward                                              issued its reduction
        root's reduction          root_reduce + G·⌈L·B/N⌉       every block's slice, not
                                                                the root's
        optimizer step            G·⌈Ψ/N⌉ + 4·⌈Ψ/N⌉             every slice, and its fp32
                                                                copy (16-bit gradients)

    Between the first two, each block's backward trades its saved activations for its
    slice (G·B/N), a straight line with its largest value at one end: the start where a
    block saves more than its slice (no checkpointing), the end where it saves less (full
    checkpointing keeps one block input, 2·s·b·h bytes: 16.8 MB against a 54.5 MB slice
    at llama-3-8B's shape, seq 2048, N = 8, bf16). The end is block k's backward, the
    last with k blocks to prefetch below it: past it the gathers stop, and k·P·B falls
    faster than slices grow. The head's saved activations (the final norm's, the LM
    head's input, the loss's log-softmax) are freed by the head's backward, before the
    first block's: "backward begins" (the first block's backward) and A' leave them out
    (A' also the embedding's token ids and the RoPE tables, kilobytes to megabytes). The
    loss's backward comes first, with only the root gathered: at a large vocabulary its
    two fp32 gradients (2·4·b·s·V bytes) make it the peak. At the optimizer step the engine has cast each slice to an fp32 copy for
    the fp32 masters (engine/step_grads.py ``StepGrads.prepare``; a view of the slice under the fp32
    recipe, where G = 4 already is the masters' dtype) and freed every buffer; the
    activations are gone. ``offload``: the slices and their copies live on the host.

    A trace of llama-3-8B's shape (untied; N = 8, seq 2048, full checkpointing, bf16)
    peaks at the end of the blocks' backward at 20.91 GB: 29 slices complete and block
    2's in flight, two block inputs and block 1's recompute; this prices it at 21.02 GB,
    +0.5% (tests/test_traced.py). Counting every slice beside every activation and the
    backward window gave 22.48 GB (+7.5%); leaving the slices out of the start of
    backward alone, 20.47 GB (-2.1%, and not the moment of the peak). At seq 4096 the same
    shape peaks at the loss's backward: 23.71 GB traced, 23.75 GB priced (+0.2%).
    Stages 0-2 do not count the step's fp32 copies (docs/planning.md, "Traced
    estimates").

    ``secondary`` = k (``reshard_after_forward=k``, engine/secondary.py): each block keeps
    P·⌈B/k⌉ from its forward until its backward is done — all L blocks' at the loss's
    backward and when backward begins, the L - done still to run at the end of the
    blocks' backward, none at the root's reduction.
    """
    b = stage3_buffer_bytes(block=block, root=root, head=head, prefetch=prefetch,
                            recipe=recipe)
    check_stage(3, n)
    r = get_recipe(recipe)
    g = 0 if offload else r.grad_bytes
    copy = 0 if offload or r.grad_bytes >= 4 else 4  # fp32 masters, 16-bit gradients
    psi = root + blocks * block
    done = max(blocks - prefetch - 1, 0)

    def slices(elems: int) -> int:
        return g * math.ceil(elems / n)

    kept = r.param_bytes * math.ceil(block / secondary) if secondary else 0  # per block
    return (
        Stage3Moment(name="loss's backward", grad_slices=0, activations=saved_activations,
                     buffers=r.param_bytes * root + loss_gradients + blocks * kept),
        Stage3Moment(name="backward begins", grad_slices=0,
                     activations=activations - head_activations,
                     buffers=b.backward + blocks * kept),
        Stage3Moment(name="end of the blocks' backward", grad_slices=slices(done * block),
                     activations=late_activations,
                     buffers=b.backward + (blocks - done) * kept),
        Stage3Moment(name="root's reduction", grad_slices=slices(blocks * block),
                     activations=0, buffers=b.root_reduce),
        Stage3Moment(name="optimizer step", grad_slices=slices(psi), activations=0,
                     buffers=copy * math.ceil(psi / n)),
    )
