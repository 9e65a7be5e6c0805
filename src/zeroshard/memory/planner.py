"""``plan()``: does a model fit, at which stage and checkpointing policy, and how fast?

Every (device count N, stage 0-3, checkpointing policy) gets a :class:`PlanRow` built
from :mod:`zeroshard.memory.analytic` (model state, buffers, communication) and the
activation estimate of :mod:`zeroshard.memory.activations`; then the ladder of
mission.md §3 picks one (see [Note: recommendation]).

[Note: what "fits" means]
A row fits when total = model state + activations + buffers <= usable memory, where
usable = device memory - reserve and reserve = max(10% of device memory, 1.5 GB). The
reserve stands for what no formula here counts: the CUDA context and kernels (~0.5-1 GB),
NCCL's channel buffers, and allocator fragmentation (caching-allocator blocks that are
free but cannot be split for a larger request), commonly 5-10% at peak.

[Note: step time]
compute = tokens × (6N + 12Lhs + recompute FLOPs per token) ÷ (MFU × peak); forward is
a third of the non-recompute part, backward (with recompute) the rest. Communication
overlaps with the phase it belongs to: gradient reductions with backward, stage 3's
gathers with forward or backward. Only the excess shows, plus what cannot overlap: the
post-step all-gather of stages 1-2 and stage 3's first-unit gathers (nothing to prefetch
behind). step = compute + exposed communication; tokens/s = N × micro_batch × seq / step.
One optimizer step per micro-batch (no gradient accumulation), the worst case for
communication.

[Note: recommendation]
Among fitting rows of one N: the best estimated tokens/s; on a tie (stages 1 and 2 move
the same bytes) the one using less memory, then the lower stage. Stage 3
must beat the best fitting stage <= 2 by more than 10%: its per-unit gathers cost launch
latency, copies and compute-stream contention this model does not price (anchors: "Stage 3
by default is a common mistake"). Nothing fits: if one block's 16-bit weights, gradients
and activations (micro-batch 1) exceed a device, no sharding helps -> tensor parallelism;
else the device count at which stage 3 would fit. Over several N, the best tokens/s per
device wins (more devices always add throughput; this asks what each one buys).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace

from zeroshard.memory import analytic
from zeroshard.models.config import GPT2Config, LlamaConfig, ModelConfig, get_preset

__all__ = ["Plan", "PlanRow", "Recommendation", "config_from_params", "plan", "reserve_bytes"]

DEFAULT_POLICIES = ("none", "selective", "full")
RESERVE_FRACTION, RESERVE_MIN_BYTES = 0.10, 1_500_000_000
STAGE3_MARGIN = 0.10


def reserve_bytes(gpu_mem_bytes: int) -> int:
    """Memory kept back from planning; see [Note: what "fits" means]."""
    return max(int(RESERVE_FRACTION * gpu_mem_bytes), RESERVE_MIN_BYTES)


def config_from_params(n_params: float, *, seq_len: int = 4096, vocab: int = 32000) -> LlamaConfig:
    """The Llama-2-like shape whose parameter count is nearest ``n_params`` (in ratio).

    Head dim 128 and hidden = 128 × layers, the aspect ratio of Llama-2 7B (4096, 32) and
    13B (5120, 40), which this rule reproduces exactly; full multi-head attention, the
    Llama SwiGLU width rule, vocab 32000, max sequence max(4096, seq_len).
    """
    if not n_params > 0:
        raise ValueError(f"parameter count {n_params!r} must be > 0, e.g. 13e9")
    shapes = (
        LlamaConfig(n_layers=n, hidden=128 * n, n_heads=n, seq_len=max(4096, seq_len), vocab=vocab)
        for n in range(1, 513)
    )
    return min(shapes, key=lambda c: abs(math.log(c.param_count() / n_params)))


def _block_params(config: ModelConfig) -> int:
    h = config.hidden
    if isinstance(config, GPT2Config):
        return 12 * h * h + 13 * h
    kv = config.kv_heads * config.head_dim
    return 2 * h * h + 2 * h * kv + 3 * h * config.ffn_dim + 2 * h


def _activation_bytes(config: ModelConfig, *, micro_batch: int, seq_len: int, policy: str,
                      dtype_bytes: int) -> int:
    """Adapter over ``activations.estimate_activation_bytes`` (owned elsewhere). Until it
    exists: Korthikanti et al. 2022 Eq. (1)-(2), sbh(34 + 5as/h) bytes per layer at 16
    bits, scaled to ``dtype_bytes``; full keeps each block's input (2sbh) plus one layer."""
    try:
        from zeroshard.memory.activations import estimate_activation_bytes
    except ImportError:
        s, b, h, a, n = seq_len, micro_batch, config.hidden, config.n_heads, config.n_layers
        layer = s * b * h * (34 + 5 * a * s / h) * dtype_bytes / 2
        kept = {"none": n * layer, "selective": n * s * b * h * 34 * dtype_bytes / 2}
        return int(kept.get(policy, n * s * b * h * dtype_bytes + layer))
    return int(estimate_activation_bytes(config, micro_batch, seq_len, policy,
                                         dtype_bytes=dtype_bytes))


def recompute_flops_per_token(config: ModelConfig, seq_len: int, policy: str) -> int:
    """Extra forward FLOPs per token in backward: selective recomputes the attention core
    (QK^T and AV, 4hs per layer), full a whole block (2 × block params + 4hs per layer),
    "every-k" one block in k. Chen's sqrt(n) segments recompute every block: as full."""
    layers, attn = config.n_layers, 4 * config.hidden * seq_len
    if policy == "none":
        return 0
    if policy == "selective":
        return layers * attn
    k = int(policy.split("-", 1)[1]) if policy.startswith("every-") and policy[6:].isdigit() else 1
    return math.ceil(layers / k) * (2 * _block_params(config) + attn)


@dataclass(frozen=True, kw_only=True)
class PlanRow:
    """One (N, stage, policy) estimate. Bytes are per device; times per optimizer step."""

    gpus: int
    stage: int
    activation_checkpointing: str
    params_bytes: int
    grads_bytes: int
    optim_bytes: int
    model_state_bytes: int
    activation_bytes: int
    buffer_bytes: int
    total_bytes: int
    usable_bytes: int
    fits: bool
    comm_bytes_per_step: int
    comm_time_s: float
    exposed_comm_time_s: float
    compute_time_s: float
    step_time_s: float
    tokens_per_s: float
    break_even_tokens: float


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    gpus: int
    stage: int | None
    activation_checkpointing: str | None
    action: str
    """single-device | data-parallel | zero-1 | zero-2 | zero-3 | more-devices | tensor-parallel"""
    reason: str
    tokens_per_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: str
    params: int
    config: ModelConfig
    recipe: analytic.Recipe
    seq_len: int
    micro_batch: int
    gpu_mem_bytes: int
    interconnect_GBps: float
    rows: tuple[PlanRow, ...]
    by_gpus: tuple[Recommendation, ...]
    recommendation: Recommendation
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: ``{"rows": [...], "recommendation": {...}}``."""
        rec = asdict(self.recommendation)
        rec["by_gpus"] = [asdict(r) for r in self.by_gpus]
        rec["notes"] = list(self.notes)
        return {"rows": [asdict(r) for r in self.rows], "recommendation": rec}


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _row(cfg: ModelConfig, *, n: int, stage: int, policy: str, psi: int, usable: int,
         opts: dict) -> PlanRow:
    r, seq, mb = opts["recipe"], opts["seq_len"], opts["micro_batch"]
    state = analytic.model_state_bytes(psi, stage=stage, n=n, recipe=r)
    act = opts["act"][policy]
    unit = max(_block_params(cfg), psi - cfg.n_layers * _block_params(cfg))
    buffers = {
        1: math.ceil(psi / n) * r.grad_bytes,  # engine's reduced-slice buffer (grad_shard)
        2: analytic.grad_bucket_bytes(opts["bucket_bytes"]),
        3: analytic.unit_buffer_bytes(unit, prefetch=opts["prefetch"], recipe=r, psi=psi),
    }.get(stage, 0) if n > 1 else 0
    total = state.total + act + buffers

    tokens = mb * seq
    base_fpt = cfg.flops_per_token(seq)
    fpt = base_fpt + recompute_flops_per_token(cfg, seq, policy)
    timing = {"mfu": opts["mfu"], "peak_flops": opts["peak_flops"]}
    compute = analytic.compute_time_s(tokens, flops_per_token=fpt, **timing)
    window = {"forward": compute * base_fpt / fpt / 3}
    window["backward"] = compute - window["forward"]
    comm = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    colls = analytic.collectives_per_step(psi, stage=stage, n=n, recipe=r)
    for c in colls:
        comm[c.phase] += analytic.collective_time_s(c.logical_bytes, n=n, bus_GBps=opts["bw"])
    exposed = comm["step"] + sum(max(0.0, comm[p] - window[p]) for p in window)
    if stage == 3 and n > 1:  # the first unit's gather in forward and backward
        exposed += 2 * analytic.collective_time_s(unit * r.param_bytes, n=n, bus_GBps=opts["bw"])
    step = compute + exposed
    return PlanRow(
        gpus=n, stage=stage, activation_checkpointing=policy,
        params_bytes=state.params, grads_bytes=state.grads, optim_bytes=state.optim,
        model_state_bytes=state.total, activation_bytes=act, buffer_bytes=buffers,
        total_bytes=total, usable_bytes=usable, fits=total <= usable,
        comm_bytes_per_step=sum(c.logical_bytes for c in colls),
        comm_time_s=sum(comm.values()), exposed_comm_time_s=exposed,
        compute_time_s=compute, step_time_s=step, tokens_per_s=n * tokens / step,
        break_even_tokens=max([comm[p] * tokens / window[p] for p in window], default=0.0),
    )


def _recommend(rows: list[PlanRow], *, n: int, cfg: ModelConfig, psi: int, opts: dict) -> Recommendation:
    fitting = [r for r in rows if r.fits]
    usable = rows[0].usable_bytes
    if not fitting:
        r = opts["recipe"]
        layer = _block_params(cfg) * (r.param_bytes + r.grad_bytes) + opts["layer_act"]
        if layer > usable:
            return Recommendation(gpus=n, stage=None, activation_checkpointing=None,
                                  action="tensor-parallel", reason=(
                f"One transformer block needs {_gb(layer)} (16-bit weights and gradients plus "
                f"its activations at micro-batch 1) but a device has {_gb(usable)} usable, so no "
                "amount of sharding fits it: tensor parallelism is needed."))
        lean = min((x for x in rows if x.stage == 3), key=lambda x: x.total_bytes)
        rest = lean.total_bytes - lean.model_state_bytes
        need = math.ceil(psi * r.bytes_per_param / (usable - rest)) if usable > rest else None
        fix = (f"stage 3 with {lean.activation_checkpointing} checkpointing would fit on {need} "
               "or more devices" if need else "activations alone exceed a device: lower "
               "--micro-batch or --seq, or use tensor/sequence parallelism")
        return Recommendation(gpus=n, stage=None, activation_checkpointing=None,
                              action="more-devices", reason=(
            f"Nothing fits on {n} device(s) with {_gb(usable)} usable each; {fix}."))
    def key(x: PlanRow) -> tuple[float, int, int]:  # equal speed: less memory, lower stage
        return (x.tokens_per_s, -x.total_bytes, -x.stage)

    best = max(fitting, key=key)
    low = [x for x in fitting if x.stage <= 2]
    if best.stage == 3 and low:
        alt = max(low, key=key)
        if best.tokens_per_s <= (1 + STAGE3_MARGIN) * alt.tokens_per_s:
            best = alt
    s0 = min(x.total_bytes for x in rows if x.stage == 0)
    s2 = min(x.total_bytes for x in rows if x.stage == 2)
    how = (f"stage {best.stage} with {best.activation_checkpointing} checkpointing: "
           f"{_gb(best.total_bytes)} of {_gb(usable)} usable, ~{best.tokens_per_s:,.0f} tokens/s")
    if n == 1:
        action, why = "single-device", f"It fits on one device ({how}): use one device."
    elif best.stage == 0:
        action, why = "data-parallel", (f"A full replica fits on each device, so plain data "
                                        f"parallelism has the best estimated throughput ({how}).")
    elif best.stage in (1, 2):
        action, why = f"zero-{best.stage}", (
            f"A full replica does not fit (stage 0 needs at least {_gb(s0)}); sharding "
            f"optimizer state{' and gradients' if best.stage == 2 else ''} gives the best "
            f"estimated throughput that fits ({how}).")
    else:
        action = "zero-3"
        why = (f"Stages 0-2 do not fit (stage 2 needs at least {_gb(s2)}), so parameters "
               f"must be sharded too ({how}); measure its throughput cost, don't assume it."
               if not low else
               f"Stage 3 is estimated {best.tokens_per_s / alt.tokens_per_s - 1:.0%} faster than "
               f"the best stage 0-2 option (stage {alt.stage} with {alt.activation_checkpointing} "
               f"checkpointing, ~{alt.tokens_per_s:,.0f} tokens/s), whose post-step all-gather "
               f"cannot overlap ({how}); confirm by measuring before committing.")
    return Recommendation(gpus=n, stage=best.stage, activation_checkpointing=best.activation_checkpointing,
                          action=action, reason=why, tokens_per_s=best.tokens_per_s)


def plan(
    config_or_params: ModelConfig | str | float,
    *,
    gpus: int | Iterable[int],
    gpu_mem_bytes: int,
    seq_len: int,
    micro_batch: int,
    interconnect_GBps: float,
    peak_flops: float = 989e12,
    mfu: float = 0.4,
    policies: Sequence[str] = DEFAULT_POLICIES,
    recipe: str | analytic.Recipe = "bf16-adamw",
    bucket_bytes: int = 25 * 2**20,
    prefetch: int = 1,
) -> Plan:
    """Estimate every (N in ``gpus``) × stage 0-3 × policy and recommend one.

    ``config_or_params``: a model config, a preset name, or a parameter count (shape from
    :func:`config_from_params`). ``gpus``: an int or any iterable of ints (e.g. a range).
    """
    if isinstance(config_or_params, str):
        name, cfg = config_or_params, get_preset(config_or_params)
    elif isinstance(config_or_params, (GPT2Config, LlamaConfig)):
        name, cfg = "custom", config_or_params
    else:
        cfg = config_from_params(config_or_params, seq_len=seq_len)
        name = f"llama-like {cfg.param_count() / 1e9:.2f}B (L={cfg.n_layers}, h={cfg.hidden})"
    counts = sorted({gpus} if isinstance(gpus, int) else set(gpus))
    for label, v in (("gpus", counts[0] if counts else 0), ("seq_len", seq_len),
                     ("micro_batch", micro_batch), ("gpu_mem_bytes", gpu_mem_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{label}={v!r} must be a positive integer")
    if seq_len > cfg.seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds the model's maximum sequence length "
                         f"{cfg.seq_len}; use seq_len <= {cfg.seq_len}")
    if not interconnect_GBps > 0:
        raise ValueError(f"interconnect_GBps={interconnect_GBps!r} must be > 0, e.g. 400 (NVLink)")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu!r} must be in (0, 1], e.g. 0.4")
    r = analytic.get_recipe(recipe)
    psi = cfg.param_count()
    act = {p: _activation_bytes(cfg, micro_batch=micro_batch, seq_len=seq_len, policy=p,
                                dtype_bytes=r.act_bytes) for p in policies}
    one = _activation_bytes(replace(cfg, n_layers=1), micro_batch=1, seq_len=seq_len,
                            policy="none", dtype_bytes=r.act_bytes)
    opts = {"recipe": r, "seq_len": seq_len, "micro_batch": micro_batch, "mfu": mfu,
            "peak_flops": peak_flops, "bw": interconnect_GBps, "act": act, "layer_act": one,
            "bucket_bytes": bucket_bytes, "prefetch": prefetch}
    usable = gpu_mem_bytes - reserve_bytes(gpu_mem_bytes)
    rows, recs = [], []
    for n in counts:
        mine = [_row(cfg, n=n, stage=s, policy=p, psi=psi, usable=usable, opts=opts)
                for s in analytic.STAGES for p in policies]
        rows += mine
        recs.append(_recommend(mine, n=n, cfg=cfg, psi=psi, opts=opts))
    notes = []
    if len(counts) > 1:
        for s in analytic.STAGES:
            ns = sorted({x.gpus for x in rows if x.stage == s and x.fits})
            notes.append(f"stage {s} fits from {ns[0]} devices" if ns else
                         f"stage {s} fits on none of {counts}")
    ok = [x for x in recs if x.tokens_per_s] or recs[-1:]
    best = max(ok, key=lambda x: ((x.tokens_per_s or 0) / x.gpus, -x.gpus))
    return Plan(model=name, params=psi, config=cfg, recipe=r, seq_len=seq_len,
                micro_batch=micro_batch, gpu_mem_bytes=gpu_mem_bytes,
                interconnect_GBps=interconnect_GBps, rows=tuple(rows), by_gpus=tuple(recs),
                recommendation=best, notes=tuple(notes))
