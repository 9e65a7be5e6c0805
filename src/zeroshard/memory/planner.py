"""``plan()``: does a model fit, at which stage and checkpointing policy, and how fast?

Every (device count N, stage 0-3, checkpointing policy) gets a :class:`PlanRow` built
from :mod:`zeroshard.memory.analytic` (model state, buffers, communication, step time)
and :mod:`zeroshard.memory.activations`; then the ladder of mission.md §3 picks one.

[Note: what "fits" means]
A row fits when total = model state + activations + buffers <= usable memory, where
usable = device memory - reserve and reserve = max(10% of device memory, 1.5 GB). The
reserve stands for what no formula here counts: the CUDA context and kernels (~0.5-1 GB),
NCCL's channel buffers, and allocator fragmentation (caching-allocator blocks that are
free but cannot be split for a larger request), commonly 5-10% at peak.

Step time: see [Note: step time] in analytic.py. tokens/s = N × micro_batch × seq / step,
one optimizer step per micro-batch (gradient accumulation would amortise stages 0-2's
reductions), the worst case for communication.

[Note: recommendation]
Among fitting rows of one N: the best estimated tokens/s; on a tie (stages 1 and 2 move
the same bytes) the one using less memory, then the lower stage. Stage 3 must beat the
best fitting stage <= 2 by more than 10%: its per-unit gathers cost launch latency,
copies and compute-stream contention this model does not price (anchors.md: "Stage 3 by
default is a common mistake"). Nothing fits: if one block's 16-bit weights, gradients and
activations (micro-batch 1) exceed a device, no sharding helps -> tensor parallelism;
else the device count at which stage 3 would fit. Over several N, the best tokens/s per
device wins (more devices always add throughput; this asks what each one buys).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from zeroshard.memory import analytic
from zeroshard.models.config import GPT2Config, LlamaConfig, ModelConfig, get_preset

__all__ = ["Plan", "PlanRow", "Recommendation", "config_from_params", "plan", "reserve_bytes"]

DEFAULT_POLICIES = ("none", "selective", "full")
RESERVE_FRACTION, RESERVE_MIN_BYTES = 0.10, 1_500_000_000
STAGE3_MARGIN = 0.10


def reserve_bytes(gpu_mem_bytes: int) -> int:
    """Memory kept back from planning; see [Note: what "fits" means]."""
    return max(int(RESERVE_FRACTION * gpu_mem_bytes), RESERVE_MIN_BYTES)


def config_from_params(
    n_params: float, *, seq_len: int = 4096, vocab: int = 32000
) -> LlamaConfig:
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


def _activation_bytes(config: ModelConfig, *, micro_batch: int, seq_len: int, policy: str,
                      dtype_bytes: int) -> tuple[int, int]:
    """(peak activation bytes, one block's un-checkpointed bytes) from
    :func:`zeroshard.memory.activations.estimate_activation_bytes`.

    That estimate is what forward leaves saved for backward, with a fused (flash) attention
    kernel as on GPUs. Backward's peak adds the recompute working set: one checkpointed
    region re-run whole (one block for full / every-k, ceil(sqrt(L)) blocks for sqrt), or
    one block's attention scores for selective.
    """
    from zeroshard.checkpointing import Selective, parse_policy
    from zeroshard.memory.activations import estimate_activation_bytes

    est = estimate_activation_bytes(config, micro_batch, seq_len, policy, dtype_bytes=dtype_bytes)
    pol = parse_policy(policy)
    if isinstance(pol, Selective):
        transient = est.scores_bytes
    else:
        regions = pol.regions(list(range(config.n_layers)))  # type: ignore[arg-type]
        transient = max((len(r) for r in regions), default=0) * est.block_bytes
    return est.total + transient, est.block_bytes


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
    traced_model_state_bytes: int | None = None
    """Model state of a traced step (memory/traced.py, ``plan --traced``); else None."""
    traced_peak_bytes: int | None = None
    """Peak total of a traced step, transients included; None unless traced."""


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


def _with(x: PlanRow) -> str:
    p = x.activation_checkpointing
    return f"stage {x.stage} with {'no' if p == 'none' else p} activation checkpointing"


@dataclass(frozen=True, kw_only=True)
class _Setup:
    """Everything a row needs that does not vary with (N, stage, policy)."""

    cfg: ModelConfig
    recipe: analytic.Recipe
    psi: int
    seq_len: int
    micro_batch: int
    usable: int
    mfu: float
    peak_flops: float
    bus_GBps: float
    bucket_bytes: int
    prefetch: int
    act: dict[str, int]
    """Activation bytes per policy (same at every stage: no sharding touches them)."""
    layer_bytes: int
    """One block's 16-bit weights + gradients + activations at micro-batch 1."""

    @property
    def unit(self) -> int:
        """Largest stage-3 unit: a block, or everything outside the blocks (embeddings)."""
        block = analytic.block_params(self.cfg)
        return max(block, self.psi - self.cfg.n_layers * block)


def _row(su: _Setup, *, n: int, stage: int, policy: str) -> PlanRow:
    r, psi = su.recipe, su.psi
    state = analytic.model_state_bytes(psi, stage=stage, n=n, recipe=r)
    buffers = 0
    if n > 1 and stage == 1:  # the engine's reduced-slice buffer, grad_shard (engine.py)
        buffers = math.ceil(psi / n) * r.grad_bytes
    elif n > 1 and stage == 2:
        buffers = analytic.grad_bucket_bytes(su.bucket_bytes)
    elif n > 1 and stage == 3:
        buffers = analytic.unit_buffer_bytes(su.unit, prefetch=su.prefetch, recipe=r, psi=psi)
    total = state.total + su.act[policy] + buffers
    tokens = su.micro_batch * su.seq_len
    colls = analytic.collectives_per_step(psi, stage=stage, n=n, recipe=r)
    t = analytic.step_time(
        colls, n=n, bus_GBps=su.bus_GBps, tokens=tokens, mfu=su.mfu, peak_flops=su.peak_flops,
        flops_per_token=su.cfg.flops_per_token(su.seq_len),
        recompute_flops_per_token=analytic.recompute_flops_per_token(su.cfg, su.seq_len, policy),
        first_unit_bytes=su.unit * r.param_bytes if stage == 3 else 0,
    )
    return PlanRow(
        gpus=n, stage=stage, activation_checkpointing=policy,
        params_bytes=state.params, grads_bytes=state.grads, optim_bytes=state.optim,
        model_state_bytes=state.total, activation_bytes=su.act[policy], buffer_bytes=buffers,
        total_bytes=total, usable_bytes=su.usable, fits=total <= su.usable,
        comm_bytes_per_step=sum(c.logical_bytes for c in colls), comm_time_s=t.comm_s,
        exposed_comm_time_s=t.exposed_comm_s, compute_time_s=t.compute_s,
        step_time_s=t.step_s, tokens_per_s=n * tokens / t.step_s,
        break_even_tokens=t.break_even_tokens,
    )


def _nothing_fits(su: _Setup, rows: list[PlanRow], n: int) -> Recommendation:
    if su.layer_bytes > su.usable:
        why = (f"One transformer block needs {_gb(su.layer_bytes)} (16-bit weights and "
               f"gradients plus its activations at micro-batch 1) but a device has "
               f"{_gb(su.usable)} usable, so no amount of sharding fits it: tensor "
               "parallelism is needed.")
        return Recommendation(gpus=n, stage=None, activation_checkpointing=None,
                              action="tensor-parallel", reason=why)
    lean = min((x for x in rows if x.stage == 3), key=lambda x: x.total_bytes)
    rest = lean.total_bytes - lean.model_state_bytes  # does not shrink with N
    if su.usable > rest:
        need = math.ceil(su.psi * su.recipe.bytes_per_param / (su.usable - rest))
        fix = f"{_with(lean)} fits on {need}+ devices"
    else:
        fix = ("activations alone exceed a device: lower the micro-batch or sequence length, "
               "or use tensor/sequence parallelism")
    why = f"Nothing fits on {n} device(s) with {_gb(su.usable)} usable; {fix}."
    return Recommendation(gpus=n, stage=None, activation_checkpointing=None,
                          action="more-devices", reason=why)


def _recommend(su: _Setup, rows: list[PlanRow], n: int) -> Recommendation:
    """[Note: recommendation]"""
    fitting = [x for x in rows if x.fits]
    if not fitting:
        return _nothing_fits(su, rows, n)

    def key(x: PlanRow) -> tuple[float, int, int]:  # equal speed: less memory, lower stage
        return (x.tokens_per_s, -x.total_bytes, -x.stage)

    best = max(fitting, key=key)
    low = [x for x in fitting if x.stage <= 2]
    alt = max(low, key=key) if low else None
    if best.stage == 3 and alt and best.tokens_per_s <= (1 + STAGE3_MARGIN) * alt.tokens_per_s:
        best = alt
    how = (f"{_with(best)}: {_gb(best.total_bytes)} of {_gb(su.usable)} usable, "
           f"~{best.tokens_per_s:,.0f} tokens/s")
    s0 = _gb(min(x.total_bytes for x in rows if x.stage == 0))
    if n == 1:
        action, why = "single-device", f"It fits on one device ({how}): use one device."
    elif best.stage == 0:
        action = "data-parallel"
        why = f"A full replica fits on each device: plain data parallelism is fastest ({how})."
    elif best.stage in (1, 2):
        action = f"zero-{best.stage}"
        why = (f"A full replica does not fit (stage 0 needs at least {s0}); sharding optimizer "
               f"state{' and gradients' if best.stage == 2 else ''} gives the best estimated "
               f"throughput that fits ({how}).")
    elif alt is None:
        action = "zero-3"
        s2 = _gb(min(x.total_bytes for x in rows if x.stage == 2))
        why = (f"Stages 0-2 do not fit (stage 2 needs at least {s2}), so parameters must be "
               f"sharded too ({how}); measure its throughput cost, don't assume it.")
    else:
        action = "zero-3"
        gain = (f"sharding the weights leaves room to recompute less than "
                f"{alt.activation_checkpointing} checkpointing does"
                if best.activation_checkpointing != alt.activation_checkpointing else
                f"stage {alt.stage}'s post-step all-gather cannot overlap")
        why = (f"Stage 3 is estimated {best.tokens_per_s / alt.tokens_per_s - 1:.1%} faster than "
               f"the best stage 0-2 option ({_with(alt)}, ~{alt.tokens_per_s:,.0f} tokens/s): "
               f"{gain} ({how}); confirm by measuring.")
    return Recommendation(gpus=n, stage=best.stage, action=action, reason=why,
                          activation_checkpointing=best.activation_checkpointing,
                          tokens_per_s=best.tokens_per_s)


def _resolve(model: ModelConfig | str | float, seq_len: int) -> tuple[str, ModelConfig]:
    if isinstance(model, str):
        return model, get_preset(model)
    if isinstance(model, (GPT2Config, LlamaConfig)):
        return "custom", model
    cfg = config_from_params(model, seq_len=seq_len)
    return f"llama-like {cfg.param_count() / 1e9:.2f}B (L={cfg.n_layers}, h={cfg.hidden})", cfg


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
    ``interconnect_GBps``: all-reduce bus bandwidth per device in 10^9 B/s.
    """
    name, cfg = _resolve(config_or_params, seq_len)
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

    def act(p: str, b: int = micro_batch) -> tuple[int, int]:
        return _activation_bytes(cfg, micro_batch=b, seq_len=seq_len, policy=p,
                                 dtype_bytes=r.act_bytes)

    su = _Setup(
        cfg=cfg, recipe=r, psi=cfg.param_count(), seq_len=seq_len, micro_batch=micro_batch,
        usable=gpu_mem_bytes - reserve_bytes(gpu_mem_bytes), mfu=mfu, peak_flops=peak_flops,
        bus_GBps=interconnect_GBps, bucket_bytes=bucket_bytes, prefetch=prefetch,
        act={p: act(p)[0] for p in policies},
        layer_bytes=analytic.block_params(cfg) * (r.param_bytes + r.grad_bytes)
        + act("none", 1)[1],
    )
    rows: list[PlanRow] = []
    recs: list[Recommendation] = []
    for n in counts:
        mine = [_row(su, n=n, stage=s, policy=p) for s in analytic.STAGES for p in policies]
        rows += mine
        recs.append(_recommend(su, mine, n))
    notes = []
    if len(counts) > 1:
        for s in analytic.STAGES:  # the fewest devices on which each policy fits
            first = {p: min((x.gpus for x in rows if (x.stage, x.activation_checkpointing,
                                                     x.fits) == (s, p, True)), default=None)
                     for p in policies}
            notes.append(f"stage {s} fits from (devices, by checkpointing): " + ", ".join(
                f"{p} {n or 'never'}" for p, n in first.items()))
    ok = [x for x in recs if x.tokens_per_s] or recs[-1:]
    best = max(ok, key=lambda x: ((x.tokens_per_s or 0) / x.gpus, -x.gpus))
    return Plan(model=name, params=su.psi, config=cfg, recipe=r, seq_len=seq_len,
                micro_batch=micro_batch, gpu_mem_bytes=gpu_mem_bytes,
                interconnect_GBps=interconnect_GBps, rows=tuple(rows), by_gpus=tuple(recs),
                recommendation=best, notes=tuple(notes))
