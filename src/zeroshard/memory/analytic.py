"""Closed-form memory, communication and time per rank for ZeRO stages 0-3.

Everything here is arithmetic on a parameter count Ψ, a data-parallel degree N and a
precision recipe; nothing allocates, so a 1T-parameter model prices in microseconds.
:mod:`zeroshard.memory.planner` combines these with activation estimates.

[Note: model state per rank]
Rajbhandari et al. 2020 (ZeRO), §3.1 and §5, Figure 1. With P bytes per 16-bit weight,
G per gradient and K of optimizer state per parameter (12 for mixed-precision Adam: fp32
master copy + momentum + variance, §3.1; 8 for pure-fp32 Adam, whose master *is* the
weight, so P = 4 already holds it):

    stage 0  (P + G + K) Ψ           nothing sharded (plain data parallelism)
    stage 1  (P + G) Ψ + K Ψ / N     optimizer state sharded     (ZeRO "P_os")
    stage 2  P Ψ + (G + K) Ψ / N     + gradients                 (ZeRO "P_os+g")
    stage 3  (P + G + K) Ψ / N       + parameters                (ZeRO "P_os+g+p")

Ψ = 7.5B, N = 64, K = 12 gives the paper's 120 / 31.4 / 16.6 / 1.9 GB. Our flat buffers
pad each parameter's dim-0 chunks to equal size; ``padded=True`` approximates that by
ceil(Ψ / N) elements per rank. Under pure fp32 (without offload) stages 1-2 step each
rank's chunks of the whole fp32 weights in place, keeping no slice apart (see [Note:
masters inside the weights] in engine/chunks.py), so the paper's K = 8 holds.

[Note: communication volume]
ZeRO §7, in the ledger's "logical bytes" (see [Note: logical vs wire bytes] in comm.py):
an all-reduce of S bytes counts 2S, a reduce-scatter or all-gather of a full tensor of S
bytes counts S. Stage 0 all-reduces gradients: 2ΨG. Stages 1-2 reduce-scatter gradients
(ΨG) and all-gather the updated weights (ΨP): 2Ψ when P = G (§7.2.1). Stage 3 gathers
weights in forward and again in backward and reduce-scatters gradients: 3Ψ (§7.2.2), or
2Ψ when gathered weights are kept from forward to backward (reshard_after_forward=False).
With a bandwidth-optimal ring each rank moves logical × (N-1)/N, so a collective takes
logical × (N-1)/N ÷ bus bandwidth (nccl-tests' "busbw" convention).

[Note: hybrid sharding, priced]
See [Note: hybrid sharding] in hybrid.py. With R nodes of G ranks (N = R·G) the model
state is sharded over G, so it costs what stage s costs at N = G; the shard group runs
stage s's collectives over G ranks on the intra-node links, and the replicate group adds
one all-reduce of each rank's reduced gradient slice (Ψ/G elements of the gradient
dtype): 2·Ψ·grad_bytes/G logical bytes over R ranks on the inter-node links, in backward
(the engine issues it as each bucket's reduce-scatter completes). Plain sharding over all
N ranks of several nodes sends all of its 2Ψ or 3Ψ through rings that cross nodes, so it
runs at the slower of the two links.

[Note: offload, priced]
See docs/offload.md. ``offload="optimizer"`` moves each rank's optimizer state (K·Ψ/N
bytes; under the fp32 recipe also the fp32 master copy of the slice, since K = 8 there
excludes it) to host memory, and the reduced gradient slice too (G·Ψ/N, plus its fp32
cast for the step under a 16-bit recipe): stages 2-3 keep no gradient on the device
between steps (stage 1 keeps its whole gradient buffer). Under a 16-bit recipe the host
also keeps a P·Ψ/N staging slice: updated weights are cast there, so 16-bit values cross
PCIe. Per step the reduced gradient slice goes device -> host
(G·Ψ/N bytes) and the updated weight slice host -> device (P·Ψ/N), over PCIe; the host
runs the optimizer over its K·Ψ/N bytes of state. The engine issues the copies after
backward and steps on the host before the next forward, so none of it overlaps with
compute: step = compute + exposed communication + offload time. The host step is priced
as the K·Ψ/N bytes touched at a host memory bandwidth per rank, 20 GB/s by default: a
rough figure. benchmarks/host_adamw.txt measured torch's fused CPU AdamW on 100M fp32
elements at 51 ms on 2 threads, i.e. 1.2 GB of (master, m, v) in 51 ms ≈ 24 GB/s in
this count; a server rank's share of cores and memory channels may be more or less.

``offload="optimizer+params"`` (stage 3) also keeps the compute-dtype weight slice
(P·Ψ/N) on the host — under the fp32 recipe that slice *is* the master, already counted —
and the device none between uses. The weight slice then goes host -> device before each
of a unit's two gathers (forward, backward) instead of once after the step: 2·P·Ψ/N over
PCIe per step; the step writes the host slice in place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from zeroshard.models.config import GPT2Config, ModelConfig

__all__ = [
    "RECIPES",
    "STAGES",
    "Collective",
    "ModelState",
    "OffloadTime",
    "Recipe",
    "Stage3Buffers",
    "Stage3Moment",
    "StepTime",
    "block_params",
    "break_even_tokens",
    "collective_time_s",
    "collectives_per_step",
    "comm_bytes_per_step",
    "compute_time_s",
    "get_recipe",
    "grad_bucket_bytes",
    "head_params",
    "host_grad_bytes",
    "host_optimizer_bytes",
    "host_param_bytes",
    "hybrid_collectives_per_step",
    "model_state_bytes",
    "offload_time_s",
    "recompute_flops_per_token",
    "root_params",
    "stage3_buffer_bytes",
    "stage3_moments",
    "step_time",
]

STAGES = (0, 1, 2, 3)
PCIE_GBPS = 25.0
"""Default host <-> device bandwidth per device (PCIe Gen4 x16 moves ~25 GB/s each way)."""
HOST_MEM_GBPS = 20.0
"""Default host memory bandwidth per rank for the host optimizer step (a rough figure;
see [Note: offload, priced])."""


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Bytes per parameter of each kind of model state, and of activations."""

    name: str
    """Short name used by the CLI, e.g. "bf16-adamw"."""
    param_bytes: int
    """P: the weights the model computes with (2 for 16-bit)."""
    grad_bytes: int
    """G: gradients as produced and reduced (2 for 16-bit)."""
    optim_bytes: int
    """K: optimizer state (12 = fp32 master + Adam m + v; 8 = Adam m + v, fp32 weights)."""
    act_bytes: int
    """Bytes per stored activation element (2 for 16-bit compute)."""
    master_in_optim: bool = True
    """K holds the fp32 master weights (16-bit recipes). Without mixed precision the
    weights are the master at every stage (stages 1-2 step each rank's chunks of the
    whole weights in place; see [Note: masters inside the weights] in engine/chunks.py);
    with offload that slice's master lives on the host (:func:`host_optimizer_bytes`)."""

    def __post_init__(self) -> None:
        for field in ("param_bytes", "grad_bytes", "optim_bytes", "act_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"Recipe.{field} must be an int >= 0 bytes per element, got {value!r}"
                )

    @property
    def bytes_per_param(self) -> int:
        """P + G + K: 16 for mixed-precision Adam (ZeRO §3.1)."""
        return self.param_bytes + self.grad_bytes + self.optim_bytes


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(name="bf16-adamw", param_bytes=2, grad_bytes=2, optim_bytes=12, act_bytes=2),
        # fp16 costs the same bytes; it adds dynamic loss scaling, not memory.
        Recipe(name="fp16-adamw", param_bytes=2, grad_bytes=2, optim_bytes=12, act_bytes=2),
        Recipe(name="fp32-adamw", param_bytes=4, grad_bytes=4, optim_bytes=8, act_bytes=4,
               master_in_optim=False),
    )
}


def get_recipe(recipe: str | Recipe) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; use one of {', '.join(RECIPES)}")
    return RECIPES[recipe]


def _check(stage: int, n: int) -> None:
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"data-parallel degree N={n!r} must be an int >= 1")


@dataclass(frozen=True, kw_only=True)
class ModelState:
    """Model state bytes held by one rank, by kind."""

    params: int
    grads: int
    optim: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim


def model_state_bytes(
    psi: int, *, stage: int, n: int, recipe: str | Recipe = "bf16-adamw", padded: bool = True
) -> ModelState:
    """Bytes of weights, gradients and optimizer state per rank; see [Note: model state
    per rank]. ``padded`` rounds the sharded part up to ceil(Ψ / N) elements per rank, as
    a flat buffer padded to a multiple of N holds; otherwise the exact share Ψ·bytes / N
    (rounded up to a byte)."""
    _check(stage, n)
    r = get_recipe(recipe)

    def share(nbytes: int, sharded: bool) -> int:
        if not sharded:
            return psi * nbytes
        return math.ceil(psi / n) * nbytes if padded else math.ceil(psi * nbytes / n)

    return ModelState(
        params=share(r.param_bytes, stage >= 3),
        grads=share(r.grad_bytes, stage >= 2),
        optim=share(r.optim_bytes, stage >= 1),
    )


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
    lifecycle] and [Note: prefetch]; engine.py ``_fold``, ``_MAX_PENDING_UNITS``), for a
    model of ``block``-parameter blocks and a ``root`` unit (everything else), of which
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

    * The root is reduced at the end of backward (engine.py, [Note: collective order in
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
    prefetch: int = 1,
    recipe: str | Recipe = "bf16-adamw",
    offload: bool = False,
) -> tuple[Stage3Moment, ...]:
    """[Note: stage-3 peak]
    ZeRO's model state counts every gradient slice (G·Ψ/N), as a rank holds them between
    backward and the optimizer step; stage 3's buffers ([Note: stage-3 buffers]) sit
    beside the activations. None of the three is whole at the same time. A unit's slice
    appears when its reduce-scatter is issued (the output of a native reduce-scatter,
    kept as ``grad_shard`` once it completes: engine.py ``_launch``, ``_complete``);
    ``zero_grad`` frees every slice before the next forward; backward frees each block's
    activations as it passes it. So the step's peak is the largest of four moments, each
    beside the weight and optimizer-state shards ((P + K)·Ψ/N), with ``blocks`` = L
    blocks of B parameters, k = ``prefetch``, A = ``activations`` (their peak, all alive)
    and A' = ``late_activations`` (those of the k+1 lowest blocks, with the recompute
    working set):

        backward begins      A  + backward                      no slice yet
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
    head's input, the loss's log-softmax) are freed by the head's backward, before it:
    A' leaves them out, with the embedding's token ids and the RoPE tables (kilobytes to
    megabytes). At the optimizer step the engine has cast each slice to an fp32 copy for
    the fp32 masters (engine.py ``prepare_grads``; a view of the slice under the fp32
    recipe, where G = 4 already is the masters' dtype) and freed every buffer; the
    activations are gone. ``offload``: the slices and their copies live on the host.

    A trace of llama-3-8B's shape (untied; N = 8, seq 2048, full checkpointing, bf16)
    peaks at the end of the blocks' backward at 20.91 GB: 29 slices complete and block
    2's in flight, two block inputs and block 1's recompute; this prices it at 21.02 GB,
    +0.5% (tests/test_traced.py). Counting every slice beside every activation and the
    backward window gave 22.48 GB (+7.5%); leaving the slices out of the start of
    backward alone, 20.47 GB (-2.1%, and not the moment of the peak). "backward begins"
    counts the head's saved activations beside the blocks' window, a little more than
    any one moment holds: the head's backward frees them before the first block's (the
    loss's own transients there are the activation estimate's to price). Stages 0-2 do
    not count the step's fp32 copies (docs/planning.md, "Traced estimates").
    """
    b = stage3_buffer_bytes(block=block, root=root, head=head, prefetch=prefetch,
                            recipe=recipe)
    _check(3, n)
    r = get_recipe(recipe)
    g = 0 if offload else r.grad_bytes
    copy = 0 if offload or r.grad_bytes >= 4 else 4  # fp32 masters, 16-bit gradients
    psi = root + blocks * block
    done = max(blocks - prefetch - 1, 0)

    def slices(elems: int) -> int:
        return g * math.ceil(elems / n)

    return (
        Stage3Moment(name="backward begins", grad_slices=0, activations=activations,
                     buffers=b.backward),
        Stage3Moment(name="end of the blocks' backward", grad_slices=slices(done * block),
                     activations=late_activations, buffers=b.backward),
        Stage3Moment(name="root's reduction", grad_slices=slices(blocks * block),
                     activations=0, buffers=b.root_reduce),
        Stage3Moment(name="optimizer step", grad_slices=slices(psi), activations=0,
                     buffers=copy * math.ceil(psi / n)),
    )


def grad_bucket_bytes(bucket_bytes: int, *, in_flight: int = 3) -> int:
    """Stage 2's transient whole-gradient buckets: each lives from its first gradient
    until its reduce-scatter completes. The engine lets 2 reductions be pending plus the
    one filling (``_MAX_PENDING + 1`` in engine.py). ``bucket_bytes``: the engine's
    (``zeroshard.config.auto_bucket_bytes`` unless set)."""
    return bucket_bytes * in_flight


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One kind of collective per step, with its ZeRO (logical) volume per rank."""

    op: str
    """"all_reduce" | "reduce_scatter" | "all_gather"."""
    phase: str
    """When it runs: "forward" and "backward" can hide behind compute, "step" cannot."""
    logical_bytes: int
    """Per rank: 2S for an all-reduce of S bytes, S for a reduce-scatter/all-gather."""
    group: str = "world"
    """Who takes part, as the ledger names groups: "world" (all N ranks) or, under hybrid
    sharding, "shard" (the G ranks of a node) or "replicate" (one rank per node)."""
    ranks: int | None = None
    """Ranks in the ring; None means the N passed to :func:`step_time`."""


def collectives_per_step(
    psi: int, *, stage: int, n: int, recipe: str | Recipe = "bf16-adamw",
    reshard_after_forward: bool = True,
) -> list[Collective]:
    """The per-step collectives of each stage; see [Note: communication volume]."""
    _check(stage, n)
    r = get_recipe(recipe)
    if n == 1:
        return []  # one rank: nothing to reduce or gather
    grads, params = psi * r.grad_bytes, psi * r.param_bytes
    if stage == 0:
        return [Collective(op="all_reduce", phase="backward", logical_bytes=2 * grads)]
    reduce = Collective(op="reduce_scatter", phase="backward", logical_bytes=grads)
    if stage in (1, 2):
        # The engine all-gathers updated weights after the optimizer step, before the
        # next forward, so this half cannot overlap with compute.
        return [reduce, Collective(op="all_gather", phase="step", logical_bytes=params)]
    out = [Collective(op="all_gather", phase="forward", logical_bytes=params)]
    if reshard_after_forward:
        out.append(Collective(op="all_gather", phase="backward", logical_bytes=params))
    return [*out, reduce]


def hybrid_collectives_per_step(
    psi: int, *, stage: int, shard: int, replicate: int, recipe: str | Recipe = "bf16-adamw",
    reshard_after_forward: bool = True,
) -> list[Collective]:
    """Stage ``stage`` sharded over ``shard`` ranks (group "shard") plus the all-reduce of
    each rank's reduced gradient slice over ``replicate`` ranks (group "replicate"); see
    [Note: hybrid sharding, priced]."""
    if stage not in (1, 2, 3):
        raise ValueError(f"hybrid sharding needs stage 1, 2 or 3, got stage={stage!r} "
                         "(stage 0 shards nothing)")
    _check(stage, replicate)
    r = get_recipe(recipe)
    intra = [
        Collective(op=c.op, phase=c.phase, logical_bytes=c.logical_bytes, group="shard",
                   ranks=shard)
        for c in collectives_per_step(psi, stage=stage, n=shard, recipe=r,
                                      reshard_after_forward=reshard_after_forward)
    ]
    if replicate == 1:
        return intra
    slice_bytes = math.ceil(psi / shard) * r.grad_bytes
    return [*intra, Collective(op="all_reduce", phase="backward", logical_bytes=2 * slice_bytes,
                               group="replicate", ranks=replicate)]


def comm_bytes_per_step(
    psi: int, *, stage: int, n: int = 2, recipe: str | Recipe = "bf16-adamw",
    reshard_after_forward: bool = True,
) -> int:
    """Logical bytes per rank per step: 2ΨG for stages 0-2, 3Ψ(2 bytes) for stage 3."""
    return sum(
        c.logical_bytes
        for c in collectives_per_step(
            psi, stage=stage, n=n, recipe=recipe, reshard_after_forward=reshard_after_forward
        )
    )


def collective_time_s(logical_bytes: float, *, n: int, bus_GBps: float) -> float:
    """Seconds for ``logical_bytes`` at bus bandwidth ``bus_GBps`` (10^9 B/s): each rank
    of a ring moves logical × (N-1)/N bytes (nccl-tests' busbw convention)."""
    if not bus_GBps > 0:
        raise ValueError(f"bus bandwidth {bus_GBps!r} GB/s must be > 0")
    return logical_bytes * (n - 1) / n / (bus_GBps * 1e9) if n > 1 else 0.0


def host_optimizer_bytes(psi: int, *, n: int, recipe: str | Recipe = "bf16-adamw") -> int:
    """Host memory per rank with the optimizer offloaded: K·ceil(Ψ/N) bytes of optimizer
    state, plus the fp32 master copy of the slice when K excludes it (fp32 recipe, where
    the device weights are the master); see [Note: offload, priced]."""
    _check(1, n)
    r = get_recipe(recipe)
    master = r.param_bytes if r.param_bytes >= 4 else 0
    return math.ceil(psi / n) * (r.optim_bytes + master)


@dataclass(frozen=True, kw_only=True)
class OffloadTime:
    """Per rank and step, none of it overlapped; see [Note: offload, priced]."""

    d2h_s: float
    """Reduced gradient slice, device -> host over PCIe."""
    h2d_s: float
    """Updated weight slice, host -> device over PCIe."""
    host_step_s: float
    """The optimizer step on the host CPU."""

    @property
    def total_s(self) -> float:
        return self.d2h_s + self.h2d_s + self.host_step_s


def host_grad_bytes(psi: int, *, n: int, recipe: str | Recipe = "bf16-adamw") -> int:
    """Host memory per rank for the offloaded gradient slice: G·ceil(Ψ/N) as reduced, plus
    its fp32 cast for the step under a 16-bit recipe (the optimizer steps fp32 masters)."""
    _check(1, n)
    r = get_recipe(recipe)
    return math.ceil(psi / n) * (r.grad_bytes + (4 if r.grad_bytes < 4 else 0))


def host_param_bytes(psi: int, *, n: int, recipe: str | Recipe = "bf16-adamw") -> int:
    """Host memory per rank for a compute-dtype weight slice (P·ceil(Ψ/N)): the staging
    buffer the updated weights are cast into before they cross PCIe (offload="optimizer"),
    or the slices themselves ("optimizer+params"); 0 under the fp32 recipe, where the
    weights are the master, already counted."""
    _check(1, n)
    r = get_recipe(recipe)
    return 0 if r.param_bytes >= 4 else math.ceil(psi / n) * r.param_bytes


def offload_time_s(
    psi: int, *, n: int, recipe: str | Recipe = "bf16-adamw", pcie_GBps: float = PCIE_GBPS,
    host_GBps: float = HOST_MEM_GBPS, params: bool = False,
) -> OffloadTime:
    """PCIe copies (G·Ψ/N down, P·Ψ/N up at ``pcie_GBps``; with ``params``, 2·P·Ψ/N up:
    one per gather) and the host step (the state's bytes at ``host_GBps``) of one
    optimizer step with offload."""
    for name, v, eg in (("pcie_GBps", pcie_GBps, PCIE_GBPS),
                        ("host_GBps", host_GBps, HOST_MEM_GBPS)):
        if not v > 0:
            raise ValueError(f"{name}={v!r} must be > 0 GB/s, e.g. {eg:g}")
    r = get_recipe(recipe)
    elems = math.ceil(psi / n)
    return OffloadTime(
        d2h_s=elems * r.grad_bytes / (pcie_GBps * 1e9),
        h2d_s=(2 if params else 1) * elems * r.param_bytes / (pcie_GBps * 1e9),
        host_step_s=host_optimizer_bytes(psi, n=n, recipe=r) / (host_GBps * 1e9),
    )


def compute_time_s(
    tokens: float, *, flops_per_token: float, mfu: float = 0.4, peak_flops: float = 989e12
) -> float:
    """tokens × FLOPs/token ÷ (MFU × peak); 989e12 is H100/H200 dense bf16 peak."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu!r} must be in (0, 1], e.g. 0.4")
    return tokens * flops_per_token / (mfu * peak_flops)


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """One optimizer step of one micro-batch; see [Note: step time]."""

    compute_s: float
    comm_s: float
    """All collectives of the step, overlapped or not."""
    exposed_comm_s: float
    """The part of ``comm_s`` that compute does not hide."""
    break_even_tokens: float
    """Tokens per device per step from which overlappable communication hides."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s


def step_time(
    collectives: list[Collective], *, n: int, bus_GBps: float, tokens: int,
    flops_per_token: float, recompute_flops_per_token: float = 0.0, mfu: float = 0.4,
    peak_flops: float = 989e12, first_unit_bytes: int = 0,
    bus_by_group: Mapping[str, float] | None = None,
) -> StepTime:
    """[Note: step time]
    compute = tokens × (flops_per_token + recompute) ÷ (MFU × peak). Forward is a third of
    the non-recompute work, backward (with the recompute) the rest. Each collective
    overlaps with its phase: gradient reductions with backward, stage 3's gathers with
    forward or backward; only the excess shows, plus what has nothing to hide behind: the
    "step" phase (stages 1-2's post-step all-gather) and ``first_unit_bytes`` (stage 3's
    first unit, gathered in forward and again in backward before any compute). step =
    compute + exposed communication. A collective runs over its own ``ranks`` (else
    ``n``) at ``bus_by_group[c.group]`` (else ``bus_GBps``): hybrid sharding's replicate
    all-reduce crosses the slower inter-node links.
    """
    fpt = flops_per_token + recompute_flops_per_token
    compute = compute_time_s(tokens, flops_per_token=fpt, mfu=mfu, peak_flops=peak_flops)
    window = {"forward": compute * flops_per_token / fpt / 3}
    window["backward"] = compute - window["forward"]
    comm = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    for c in collectives:
        bus = (bus_by_group or {}).get(c.group, bus_GBps)
        comm[c.phase] += collective_time_s(c.logical_bytes, n=c.ranks or n, bus_GBps=bus)
    # The first unit's gather (in each of forward and backward) is part of that phase's
    # communication but has nothing to hide behind; the rest overlaps the phase's compute.
    first = collective_time_s(first_unit_bytes, n=n, bus_GBps=bus_GBps)
    exposed = comm["step"]
    for p in window:
        f = min(first, comm[p])
        exposed += f + max(0.0, comm[p] - f - window[p])
    return StepTime(
        compute_s=compute, comm_s=sum(comm.values()), exposed_comm_s=exposed,
        break_even_tokens=max(comm[p] * tokens / window[p] for p in window),
    )


def break_even_tokens(
    comm_time_s: float, *, flops_per_token: float, mfu: float = 0.4,
    peak_flops: float = 989e12, window_fraction: float = 1.0,
) -> float:
    """Tokens per device per step at which ``comm_time_s`` fits inside the compute it
    overlaps with: ``window_fraction`` of the step's compute (2/3 for backward-only
    overlap, stages 0-2). Below this, communication shows in the step time."""
    return comm_time_s * mfu * peak_flops / (window_fraction * flops_per_token)


def block_params(config: ModelConfig) -> int:
    """Parameters of one transformer block (the stage-3 unit and the recompute region):
    GPT-2 ``12h^2 + 13h``, Llama ``2h^2 + 2h*kv_dim + 3hf + 2h`` (see models/config.py)."""
    h = config.hidden
    if isinstance(config, GPT2Config):
        return 12 * h * h + 13 * h
    kv = config.kv_heads * config.head_dim
    return 2 * h * h + 2 * h * kv + 3 * h * config.ffn_dim + 2 * h


def recompute_flops_per_token(config: ModelConfig, seq_len: int, policy: str) -> int:
    """Forward FLOPs per token re-run in backward (on top of ``config.flops_per_token``).

    Selective (Korthikanti et al. 2022, §4.2) re-runs the attention core, QK^T and AV:
    4hs per layer. Full re-runs each block's forward, 2 × block params + 4hs per layer
    (the LM head is not recomputed): about +33% on 6Ψ. "every-k" re-runs blocks k-1, 2k-1..;
    Chen et al.'s sqrt(n) segments (2016, §4) re-run every block once, like full.
    """
    layers, attn = config.n_layers, 4 * config.hidden * seq_len
    if policy == "none":
        return 0
    if policy == "selective":
        return layers * attn
    k = int(policy[6:]) if policy.startswith("every-") and policy[6:].isdigit() else 1
    return layers // k * (2 * block_params(config) + attn)  # blocks k-1, 2k-1, ...
