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

from zeroshard.engine.policy import StagePolicy
from zeroshard.models.config import ModelConfig

from .recipes import RECIPES, STAGES, Recipe, get_recipe
from .recipes import check_stage as _check
from .stage3_buffers import (
    Stage3Buffers,
    Stage3Moment,
    block_params,
    head_params,
    root_params,
    stage3_buffer_bytes,
    stage3_moments,
)

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

PCIE_GBPS = 25.0
"""Default host <-> device bandwidth per device (PCIe Gen4 x16 moves ~25 GB/s each way)."""
HOST_MEM_GBPS = 20.0
"""Default host memory bandwidth per rank for the host optimizer step (a rough figure;
see [Note: offload, priced])."""


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

    policy = StagePolicy(stage)  # the engine's answers, not a second reading of the stage
    return ModelState(
        params=share(r.param_bytes, policy.shard_params),
        grads=share(r.grad_bytes, not policy.keep_full_grads),
        optim=share(r.optim_bytes, policy.shard_optimizer),
    )


def grad_bucket_bytes(bucket_bytes: int, *, in_flight: int = 3) -> int:
    """Stage 2's transient whole-gradient buckets: each lives from its first gradient
    until its reduce-scatter completes. The engine lets 2 reductions be pending plus the
    one filling (``_MAX_PENDING + 1`` in engine/reduction.py). ``bucket_bytes``: the engine's
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
    reshard_after_forward: bool | int = True,
) -> list[Collective]:
    """The per-step collectives of each stage; see [Note: communication volume]. An int
    ``reshard_after_forward`` k (the secondary shard, engine/secondary.py): backward's
    all-gather runs over k ranks of a node (group "secondary")."""
    _check(stage, n)
    r = get_recipe(recipe)
    if n == 1:
        return []  # one rank: nothing to reduce or gather
    grads, params = psi * r.grad_bytes, psi * r.param_bytes
    policy = StagePolicy(stage)
    if policy.reduce_op == "all_reduce":
        return [Collective(op="all_reduce", phase="backward", logical_bytes=2 * grads)]
    reduce = Collective(op="reduce_scatter", phase="backward", logical_bytes=grads)
    if policy.gather_after_step:
        # The engine all-gathers updated weights after the optimizer step, before the
        # next forward, so this half cannot overlap with compute.
        return [reduce, Collective(op="all_gather", phase="step", logical_bytes=params)]
    out = [Collective(op="all_gather", phase="forward", logical_bytes=params)]
    if reshard_after_forward is True or reshard_after_forward is False:
        if reshard_after_forward:
            out.append(Collective(op="all_gather", phase="backward", logical_bytes=params))
    else:
        out.append(Collective(op="all_gather", phase="backward", logical_bytes=params,
                              group="secondary", ranks=reshard_after_forward))
    return [*out, reduce]


#: Bytes per element of a quantised collective: the payload and a 4-byte scale per 256
#: (engine/quantize.py).
QUANTISED_BYTES = {"int8": 1 + 4 / 256, "int4": 0.5 + 4 / 256}


def zeropp_collectives_per_step(psi: int, *, n: int, g: int,
                                recipe: str | Recipe = "bf16-adamw") -> list[Collective]:
    """Stage 3 over N = M·g ranks with ZeRO++'s three (docs/links.md): the forward
    all-gather in int8 over all N, backward's from the secondary shard over the g ranks of
    a node (compute dtype), and the gradients' two int4 hops — inside the node ((g-1)/g of
    them per rank) and across nodes (1/g of them over the M nodes)."""
    _check(3, n)
    if n % g or n // g < 2:
        raise ValueError(f"ZeRO++'s rows need several nodes of g={g} in N={n}")
    r = get_recipe(recipe)
    grads = psi * QUANTISED_BYTES["int4"]
    return [
        Collective(op="all_gather", phase="forward",
                   logical_bytes=math.ceil(psi * QUANTISED_BYTES["int8"])),
        Collective(op="all_gather", phase="backward", logical_bytes=psi * r.param_bytes,
                   group="secondary", ranks=g),
        Collective(op="all_to_all", phase="backward", logical_bytes=math.ceil(grads),
                   group="grad-node", ranks=g),
        Collective(op="all_to_all", phase="backward", logical_bytes=math.ceil(grads / g),
                   group="grad-across", ranks=n // g),
    ]


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
