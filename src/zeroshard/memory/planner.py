"""``plan()``: does a model fit, at which stage and checkpointing policy, and how fast?

Every (device count N, stage 0-3, checkpointing policy) gets a :class:`PlanRow` built
from :mod:`zeroshard.memory.analytic` (model state, buffers, communication, step time)
and :mod:`zeroshard.memory.activations`; then the ladder of mission.md §3 picks one.

[Note: what "fits" means]
A row fits when total <= usable memory, total being what the step holds at its fullest (stage 3:
the most held at one moment of the step, with its buffers then, which never holds every
gradient slice beside every activation: [Note: stage-3 peak] in stage3_buffers.py;
stages 0-2: the largest of three moments, [Note: the step's moments, stages 0-2]), where
usable = device memory - reserve and reserve = max(10% of device memory, 1.5 GB). The
reserve stands for what no formula here counts: the CUDA context and kernels (~0.5-1 GB),
NCCL's channel buffers, and allocator fragmentation (caching-allocator blocks that are
free but cannot be split for a larger request), commonly 5-10% at peak. With offload and
``host_mem_bytes`` given, a row also needs host bytes × ranks per node <= host memory.

[Note: the step's moments, stages 0-2]
Stages 0-2 hold the most at one of three moments, and a row's total is the largest
(``peak_moment`` names it; ``buf`` is that moment's buffers):
* backward begins: the weights and optimizer state, every activation forward saved with
  the loss's two fp32 gradients beside them (or backward's recompute working set, if
  larger) — and no gradient yet: zeroshard allocates a bucket's gradient buffer when its
  first gradient arrives, while backward frees activations as it goes (so between the two
  ends the sum moves monotonically between them, layer by layer); stage 2's buckets in
  flight counted here too;
* backward ends: every gradient (model state), the activations freed;
* the optimizer step: under a 16-bit recipe every gradient the masters step with has an
  fp32 copy (engine/step_grads.py: 4·Ψ at stage 0, 4·Ψ/N at stages 1-2), and stages 1-2's
  refresh gathers the updated weights into one bucket-sized buffer at a time
  (engine/refresh.py; a parameter larger than the bucket gets a bucket of its own, so the
  largest parameter bounds it too).
Before, the plan added every gradient to every activation (stage 1 of llama-7b on 8
devices, seq 4096, no checkpointing: 64.3 GB priced, 52.0 traced) and left the step out
(stage 0: 110.4 GB priced with full checkpointing, 134.8 traced). Now, against traces:
llama-7b N = 8 seq 4096: stage 0 134.8 / 134.8 GB, stage 1 none 52.0 / 52.0, full
40.7 / 40.7, stage 2 none 52.1 / 52.0, full 28.9 / 28.9; a wide-vocabulary Llama at
N = 2 and 8, stages 0-2, with and without checkpointing: −0.3% to +2.5%
(tests/test_traced.py); gpt2-small N = 2, micro-batch 1, where the step is the peak:
−0.2% to +0.5%. Tiny models (a few MB) are over-priced by the 1 MiB minimum bucket.

[Note: a given activation budget]
``plan --activations 25GB`` poses the classic exercise as it is posed ("a 13B model on 80
GB devices with ~25 GB for activations and buffers: which stage fits on 8, on 16?"): each
row's total is its model state + the given bytes, the computed activations, buffers and
moments are set aside (``peak_moment`` "given"). llama-13b on 8: stage 2 48.8 + 25 = 73.8
GB (over the 72.0 usable), stage 3 26.0 + 25 = 51.0 GB; on 16: stage 2 37.4 + 25 = 62.4
GB fits, and is kept over stage 3 (which moves 1.5× the bytes and must win by 10%).

Step time: see [Note: step time] in analytic.py. tokens/s = N × micro_batch × seq / step,
one optimizer step per micro-batch (gradient accumulation would amortise stages 0-2's
reductions), the worst case for communication.

Several nodes (``gpus_per_node`` given, N > G): plain rows' rings cross nodes and run at
min(intra, inter) bandwidth, and hybrid rows (stages 1-3, R x G) are added; see
[Note: hybrid sharding, priced] in analytic.py. ``offload=True`` moves stages 1-3's
optimizer state to host memory and adds the PCIe copies and host step to the step time;
see [Note: offload, priced]. The recommendation: [Note: recommendation] in recommend.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple

from zeroshard.config import auto_bucket_bytes
from zeroshard.engine.policy import StagePolicy
from zeroshard.memory import analytic
from zeroshard.memory.activations import check_tp
from zeroshard.memory.plan_rows import PlanRow, Setup
from zeroshard.memory.recommend import Recommendation, describe, gb, ranks_per_node, recommend
from zeroshard.memory.tensor_parallel import tp_collectives_per_step, tp_param_count, tp_parts
from zeroshard.models.config import GPT2Config, LlamaConfig, ModelConfig, get_preset

__all__ = ["Plan", "PlanRow", "Recommendation", "config_from_params", "plan", "reserve_bytes"]

DEFAULT_POLICIES = ("none", "selective", "full")
RESERVE_FRACTION, RESERVE_MIN_BYTES = 0.10, 1_500_000_000


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


class _Acts(NamedTuple):
    peak: int  # saved activations + backward's recompute working set
    late: int  # alive at the end of stage 3's blocks' backward
    block: int  # one block's un-checkpointed bytes
    head: int  # what the head's backward frees before the first block's: the final
    #            norm's, the LM head's input, the loss's
    saved: int  # all that forward saved (no recompute working set)
    loss_grads: int  # the loss's backward's two fp32 gradients, each its log-softmax's size


def _activation_bytes(config: ModelConfig, *, micro_batch: int, seq_len: int, policy: str,
                      dtype_bytes: int, prefetch: int = 1, tp: int = 1) -> _Acts:
    """Activation bytes at the moments the plan prices (:class:`_Acts`), from
    :func:`zeroshard.memory.activations.estimate_activation_bytes`.

    That estimate is what forward leaves saved for backward, with a fused (flash) attention
    kernel as on GPUs. Backward's peak adds the recompute working set: one checkpointed
    region re-run whole (one block for full / every-k, ceil(sqrt(L)) blocks for sqrt), or
    one block's attention scores for selective. At the end of the blocks' backward (block
    ``prefetch`` running, see [Note: stage-3 peak] in stage3_buffers.py) only the
    ``prefetch`` + 1 lowest blocks' saved bytes are left, beside the same working set.
    """
    from zeroshard.checkpointing import Selective, parse_policy
    from zeroshard.memory.activations import estimate_activation_bytes

    est = estimate_activation_bytes(config, micro_batch, seq_len, policy, dtype_bytes=dtype_bytes,
                                    tp=tp)
    pol = parse_policy(policy)
    layers = range(config.n_layers)
    saved = dict.fromkeys(layers, est.block_bytes)  # what each block leaves saved
    if isinstance(pol, Selective):
        transient = est.scores_bytes
        saved = dict.fromkeys(layers, est.block_bytes - est.scores_bytes)
    else:
        regions = pol.regions(list(layers))  # type: ignore[arg-type]
        transient = max((len(r) for r in regions), default=0) * est.block_bytes
        for r in regions:  # a region keeps its first block's input, nothing else
            saved.update(dict.fromkeys(r, 0))
            saved[r[0]] = est.input_bytes
    late = sum(saved[i] for i in layers[: prefetch + 1]) + transient
    kept = ("token ids", "position ids", "RoPE")  # the embedding's, alive to the end
    head = sum(v for k, v in est.outside.items() if not k.startswith(kept))
    # The loss's backward: nll_loss's gradient and log-softmax's, both fp32 and as large
    # as its saved output, beside everything forward saved (no recompute yet).
    lsm = next(v for k, v in est.outside.items() if k.startswith("cross-entropy log-softmax"))
    return _Acts(est.total + transient, late, est.block_bytes, head, est.total, 2 * lsm)


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
    """Intra-node bus bandwidth (the only one on a single node)."""
    rows: tuple[PlanRow, ...]
    by_gpus: tuple[Recommendation, ...]
    recommendation: Recommendation
    notes: tuple[str, ...]
    gpus_per_node: int | None = None
    inter_GBps: float | None = None
    """Inter-node bus bandwidth; None when no count spans several nodes."""
    offload: bool = False
    offload_mode: str | None = None
    """None, "optimizer" or "optimizer+params" (the latter applies to stage 3 rows)."""
    host_mem_bytes: int | None = None
    pcie_GBps: float = analytic.PCIE_GBPS
    host_GBps: float = analytic.HOST_MEM_GBPS
    tp: int = 1
    """Tensor-parallel degree (rows: N = dp × tp devices)."""
    tp_params: int | None = None
    """Parameters one tp rank holds (``params`` at tp 1)."""

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: ``{"rows": [...], "recommendation": {...}}``."""
        rec = asdict(self.recommendation)
        rec["by_gpus"] = [asdict(r) for r in self.by_gpus]
        rec["notes"] = list(self.notes)
        return {"rows": [asdict(r) for r in self.rows], "recommendation": rec}


def _row(su: Setup, *, n: int, stage: int, policy: str, hybrid: bool = False,
         secondary: int = 0, zeropp: bool = False) -> PlanRow:
    r, psi, nodes = su.recipe, su.psi, su.nodes(n)
    shard = (su.gpus_per_node or n) if hybrid else n  # ranks one copy of the state spans
    stage_policy = StagePolicy(stage)  # the engine's answers to what each stage keeps
    off = su.offload and stage_policy.shard_optimizer
    offp = su.offload_params and stage_policy.shard_params
    state = su.device_state(n=shard, stage=stage, offload=off, offload_params=offp)
    dp = su.dp(shard)  # ranks the state is sharded over (shard / tp)
    host = 0
    if off:
        host = (analytic.host_optimizer_bytes(psi, n=shard, recipe=r)
                + analytic.host_grad_bytes(psi, n=shard, recipe=r)
                + analytic.host_param_bytes(psi, n=shard, recipe=r))
    buffers = 0  # stage 1 reduces into its whole gradient buffer ([Note: buffer lifetimes])
    moment = None
    if shard > 1 and not stage_policy.keep_full_grads and not stage_policy.shard_params:
        # stage 2's whole-bucket buffers in flight, never more than the whole gradient
        buffers = min(analytic.grad_bucket_bytes(su.bucket_bytes), psi * r.grad_bytes)
    total = state.total + su.act[policy] + buffers
    if stage_policy.shard_params:  # units are gathered into whole buffers even at N=1
        total, peak = su.stage3_peak(n=shard, policy=policy, offload=off, offload_params=offp,
                                     secondary=secondary)
        buffers, moment = peak.buffers, peak.name  # [Note: stage-3 peak] in stage3_buffers.py
    else:  # [Note: the step's moments, stages 0-2]
        moment, total, buffers = max(
            su.moments(n=shard, stage=stage, policy=policy, state=state, buffers=buffers,
                       offload=off), key=lambda m: m[1])
    if su.given_act is not None:  # [Note: a given activation budget]
        total, buffers, moment = state.total + su.given_act, 0, "given"
    if hybrid:
        colls = analytic.hybrid_collectives_per_step(psi, stage=stage, shard=shard,
                                                     replicate=nodes, recipe=r)
    elif zeropp:
        colls = analytic.zeropp_collectives_per_step(psi, n=n, g=secondary, recipe=r)
    else:
        colls = analytic.collectives_per_step(psi, stage=stage, n=su.dp(n), recipe=r,
                                              reshard_after_forward=secondary or True)
    bus = su.intra_GBps if hybrid or nodes == 1 else min(su.intra_GBps, su.inter_GBps)
    tokens = su.micro_batch * su.seq_len
    t = analytic.step_time(  # a tp rank computes 1/tp of every matmul
        colls, n=dp, bus_GBps=bus, tokens=tokens,
        bus_by_group={"replicate": su.inter_GBps, "secondary": su.intra_GBps,
                      "grad-node": su.intra_GBps, "grad-across": su.inter_GBps},
        mfu=su.mfu, peak_flops=su.peak_flops,
        flops_per_token=su.cfg.flops_per_token(su.seq_len) / su.tp,
        recompute_flops_per_token=analytic.recompute_flops_per_token(
            su.cfg, su.seq_len, policy) / su.tp,
        first_unit_bytes=su.unit * r.param_bytes if stage_policy.shard_params else 0,
    )
    tp_colls = tp_collectives_per_step(su.cfg, micro_batch=su.micro_batch, seq_len=su.seq_len,
                                       tp=su.tp, act_bytes=r.act_bytes, policy=policy,
                                       norm_grad_bytes=r.grad_bytes)
    tp_s = sum(analytic.collective_time_s(c.logical_bytes, n=su.tp, bus_GBps=su.intra_GBps)
               for c in tp_colls)
    cross = [c for c in colls if nodes > 1 and c.group not in ("secondary", "grad-node")
             and (not hybrid or c.group == "replicate")]
    cross_bytes = sum(c.logical_bytes for c in cross)
    cross_s = sum(analytic.collective_time_s(c.logical_bytes, n=c.ranks or n,
                                             bus_GBps=su.inter_GBps if hybrid
                                             or c.group == "grad-across" else bus)
                  for c in cross)
    off_s = analytic.offload_time_s(psi, n=shard, recipe=r, pcie_GBps=su.pcie_GBps,
                                    host_GBps=su.host_GBps, params=offp).total_s if off else 0.0
    host_ok = su.host_mem is None or host * ranks_per_node(su, n) <= su.host_mem
    step = t.step_s + off_s + tp_s
    return PlanRow(
        gpus=n, stage=stage, activation_checkpointing=policy,
        params_bytes=state.params, grads_bytes=state.grads, optim_bytes=state.optim,
        model_state_bytes=state.total, buffer_bytes=buffers,
        activation_bytes=su.act[policy] if su.given_act is None else su.given_act,
        total_bytes=total, usable_bytes=su.usable, fits=total <= su.usable and host_ok,
        peak_moment=moment,
        comm_bytes_per_step=sum(c.logical_bytes for c in colls), comm_time_s=t.comm_s + tp_s,
        exposed_comm_time_s=t.exposed_comm_s + tp_s, compute_time_s=t.compute_s,
        step_time_s=step, tokens_per_s=su.dp(n) * tokens / step,
        break_even_tokens=t.break_even_tokens,
        hybrid=f"{nodes} x {shard}" if hybrid else None, cross_node_bytes_per_step=cross_bytes,
        secondary=secondary or None, zeropp=zeropp,
        cross_node_time_s=cross_s, offload=off, offload_params=offp, host_bytes=host,
        offload_time_s=off_s, tp=su.tp,
        tp_comm_bytes_per_step=sum(c.logical_bytes for c in tp_colls), tp_comm_time_s=tp_s,
    )


def _rows(su: Setup, n: int, policies: Sequence[str]) -> list[PlanRow]:
    """Stages 0-3 × policies at N, then hybrid stages 1-3 when N spans several nodes."""
    # With tensor parallelism zeroshard shards at stages 1-3 (stage 0 is refused).
    stages = analytic.STAGES if su.tp == 1 else analytic.STAGES[1:]
    out = [_row(su, n=n, stage=s, policy=p) for s in stages for p in policies]
    if su.nodes(n) > 1 and (su.gpus_per_node or 0) > 1 and su.tp == 1:
        out += [_row(su, n=n, stage=s, policy=p, hybrid=True)
                for s in analytic.STAGES[1:] for p in policies]
        # ZeRO++'s hpZ: stage 3 with a secondary shard over each node's devices
        out += [_row(su, n=n, stage=3, policy=p, secondary=su.gpus_per_node, zeropp=z)
                for z in (False, True) for p in policies]
    return out


def _resolve(model: ModelConfig | str | float, seq_len: int) -> tuple[str, ModelConfig]:
    if isinstance(model, str):
        return model, get_preset(model)
    if isinstance(model, (GPT2Config, LlamaConfig)):
        return "custom", model
    cfg = config_from_params(model, seq_len=seq_len)
    return f"llama-like {cfg.param_count() / 1e9:.2f}B (L={cfg.n_layers}, h={cfg.hidden})", cfg


def _check_nodes(counts: list[int], gpus_per_node: int | None, inter_GBps: float | None) -> None:
    g = gpus_per_node
    if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
        raise ValueError(f"gpus_per_node={g!r} must be a positive integer, e.g. 8")
    if inter_GBps is not None and g is None:
        raise ValueError(f"inter_GBps={inter_GBps!r} needs gpus_per_node (devices per node) to "
                         "know which collectives cross nodes; pass gpus_per_node=8, say")
    if inter_GBps is not None and not inter_GBps > 0:
        raise ValueError(f"inter_GBps={inter_GBps!r} must be > 0, e.g. 50 (InfiniBand)")
    for n in counts:
        if g is not None and n > g and n % g:
            raise ValueError(
                f"gpus={n} is not a multiple of gpus_per_node={g}: several nodes must be whole "
                f"nodes; use gpus={n // g * g} or {(n // g + 1) * g}, or a gpus_per_node that "
                f"divides {n}")


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
    bucket_bytes: int | None = None,
    prefetch: int = 1,
    gpus_per_node: int | None = None,
    inter_GBps: float | None = None,
    offload: bool | str | None = False,
    host_mem_bytes: int | None = None,
    pcie_GBps: float = analytic.PCIE_GBPS,
    host_GBps: float = analytic.HOST_MEM_GBPS,
    tp: int = 1,
    activation_bytes: int | None = None,
) -> Plan:
    """Estimate every (N in ``gpus``) × stage 0-3 × policy and recommend one.

    ``activation_bytes``: activations and buffers per device as given (the classic
    exercise's "~25 GB for activations and buffers"), in place of the computed ones;
    see [Note: a given activation budget].

    ``config_or_params``: a model config, a preset name, or a parameter count (shape from
    :func:`config_from_params`). ``gpus``: an int or any iterable of ints (e.g. a range).
    ``interconnect_GBps``: all-reduce bus bandwidth per device in 10^9 B/s inside a node.
    ``gpus_per_node``: devices per node; an N above it spans N / gpus_per_node nodes (N
    must be a multiple), linked at ``inter_GBps`` (default: ``interconnect_GBps``), and
    gets hybrid rows for stages 1-3. ``offload`` (True = "optimizer"): stages 1-3 keep
    the optimizer state and step on the host (``host_mem_bytes`` per node, if given, must
    hold it); copies run at ``pcie_GBps`` per device and the host step at ``host_GBps``
    per rank. "optimizer+params" also moves stage 3's weight slices to the host.
    ``tp``: tensor-parallel degree (Llama under torchtitan's plan): each of the N devices
    holds 1/tp of the blocks, ZeRO shards over N / tp; see [Note: tensor parallelism,
    planned].
    """
    mode = _offload_mode(offload)
    offload = mode is not None
    name, cfg = _resolve(config_or_params, seq_len)
    counts = sorted({gpus} if isinstance(gpus, int) else set(gpus))
    for label, v in (("gpus", counts[0] if counts else 0), ("seq_len", seq_len),
                     ("micro_batch", micro_batch), ("gpu_mem_bytes", gpu_mem_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{label}={v!r} must be a positive integer")
    if gpu_mem_bytes <= reserve_bytes(gpu_mem_bytes):
        raise ValueError(
            f"gpu_mem_bytes={gpu_mem_bytes} ({gpu_mem_bytes / 1e9:.2f} GB) leaves nothing after "
            f"the {reserve_bytes(gpu_mem_bytes) / 1e9:.1f} GB reserve (CUDA context, NCCL, "
            "fragmentation: max(10%, 1.5 GB)); plan for a device with more memory")
    if seq_len > cfg.seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds the model's maximum sequence length "
                         f"{cfg.seq_len}; use seq_len <= {cfg.seq_len}")
    if not interconnect_GBps > 0:
        raise ValueError(f"interconnect_GBps={interconnect_GBps!r} must be > 0, e.g. 400 (NVLink)")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu!r} must be in (0, 1], e.g. 0.4")
    if not (peak_flops > 0 and math.isfinite(peak_flops)):
        raise ValueError(f"peak_flops={peak_flops!r} must be > 0 FLOP/s, e.g. 989e12 (H100 bf16)")
    _check_nodes(counts, gpus_per_node, inter_GBps)
    if host_mem_bytes is not None and not offload:
        raise ValueError(f"host_mem_bytes={host_mem_bytes!r} only matters with offload=True; "
                         "pass offload=True or drop host_mem_bytes")
    if host_mem_bytes is not None and (isinstance(host_mem_bytes, bool) or
                                       not isinstance(host_mem_bytes, int) or host_mem_bytes < 1):
        raise ValueError(f"host_mem_bytes={host_mem_bytes!r} must be a positive integer")
    analytic.offload_time_s(1, n=1, pcie_GBps=pcie_GBps, host_GBps=host_GBps)  # validates
    r = analytic.get_recipe(recipe)
    _check_tp(tp, cfg, counts, gpus_per_node, offload, seq_len)
    psi = tp_param_count(cfg, tp) if tp > 1 else cfg.param_count()
    block, root, head = (tp_parts(cfg, tp) if tp > 1 else (
        analytic.block_params(cfg), analytic.root_params(cfg), analytic.head_params(cfg)))

    def act(p: str, b: int = micro_batch) -> _Acts:
        return _activation_bytes(cfg, micro_batch=b, seq_len=seq_len, policy=p,
                                 dtype_bytes=r.act_bytes, prefetch=prefetch, tp=tp)

    acts = {p: act(p) for p in policies}
    multi = gpus_per_node is not None and counts[-1] > gpus_per_node
    su = Setup(
        cfg=cfg, recipe=r, psi=psi, seq_len=seq_len, micro_batch=micro_batch,
        usable=gpu_mem_bytes - reserve_bytes(gpu_mem_bytes), mfu=mfu, peak_flops=peak_flops,
        intra_GBps=interconnect_GBps, inter_GBps=inter_GBps or interconnect_GBps,
        gpus_per_node=gpus_per_node, offload=offload,
        offload_params=mode == "optimizer+params", pcie_GBps=pcie_GBps, host_GBps=host_GBps,
        host_mem=host_mem_bytes, prefetch=prefetch,
        bucket_bytes=bucket_bytes or auto_bucket_bytes(psi * r.grad_bytes),
        full_grad_bucket_bytes=bucket_bytes or auto_bucket_bytes(psi * r.grad_bytes,
                                                                 keep_full_grads=True),
        act={p: a.peak for p, a in acts.items()},
        act_late={p: a.late for p, a in acts.items()},
        act_head={p: a.head for p, a in acts.items()},
        act_saved={p: a.saved for p, a in acts.items()},
        loss_grads={p: a.loss_grads for p, a in acts.items()},
        layer_bytes=block * (r.param_bytes + r.grad_bytes) + act("none", 1).block,
        stage3=analytic.stage3_buffer_bytes(block=block, root=root, head=head,
                                            prefetch=prefetch, recipe=r),
        tp=tp, parts=(block, root, head) if tp > 1 else None, given_act=activation_bytes,
    )
    rows: list[PlanRow] = []
    recs: list[Recommendation] = []
    for n in counts:
        mine = _rows(su, n, policies)
        rows += mine
        recs.append(recommend(su, mine, n))
        if offload:  # is offload needed at all?
            recs[-1] = _versus_no_offload(
                recs[-1], replace(su, offload=False, offload_params=False, host_mem=None), n,
                policies)
    notes = []
    if len(counts) > 1:
        for s in analytic.STAGES[(tp > 1):]:  # the fewest devices on which each policy fits
            first = {p: min((x.gpus for x in rows if (x.stage, x.activation_checkpointing,
                                                     x.fits, x.hybrid) == (s, p, True, None)),
                            default=None)
                     for p in policies}
            # stage 0 keeps a whole replica whatever N: "never"; the others may fit on
            # more devices than were asked about
            none = "never" if s == 0 else f"not on {counts[-1]} or fewer"
            notes.append(f"stage {s} fits from (devices, by checkpointing): " + ", ".join(
                f"{p} {n or none}" for p, n in first.items()))
    ok = [x for x in recs if x.tokens_per_s] or recs[-1:]
    best = max(ok, key=lambda x: ((x.tokens_per_s or 0) / x.gpus, -x.gpus))
    if activation_bytes is not None:
        notes.append(f"activations and buffers: {activation_bytes / 1e9:.1f} GB per device as "
                     "given (--activations), not computed from the shape; total = model "
                     "state + that")
    notes += _hybrid_notes(su, rows, counts)
    notes += _zeropp_notes(rows, counts)
    if offload:
        notes += _host_notes(su, rows, recs)
    return Plan(model=name, params=cfg.param_count(), config=cfg, tp=tp, tp_params=su.psi, recipe=r, seq_len=seq_len,
                micro_batch=micro_batch, gpu_mem_bytes=gpu_mem_bytes,
                interconnect_GBps=interconnect_GBps, rows=tuple(rows), by_gpus=tuple(recs),
                recommendation=best, notes=tuple(notes), gpus_per_node=gpus_per_node,
                inter_GBps=su.inter_GBps if multi else None, offload=offload,
                offload_mode=mode, host_mem_bytes=host_mem_bytes, pcie_GBps=pcie_GBps, host_GBps=host_GBps)


def _check_tp(tp: int, cfg: ModelConfig, counts: list[int], gpus_per_node: int | None,
              offload: bool, seq_len: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive integer, e.g. 2")
    if tp == 1:
        return
    check_tp(cfg, tp, seq_len)  # Llama only, tp dividing the heads and the sequence
    if offload:
        raise ValueError("offload with tp > 1 is not priced; plan tp without --offload")
    bad = [n for n in counts if n % tp]
    if bad:
        raise ValueError(f"gpus {bad} are not multiples of tp={tp}: N devices make N / tp "
                         f"data-parallel groups of tp; use multiples of {tp}")
    if gpus_per_node is not None and gpus_per_node % tp:
        raise ValueError(f"tp={tp} does not divide gpus_per_node={gpus_per_node}: a tp group "
                         "must stay inside a node (its collectives are on the critical path)")


def _offload_mode(offload: bool | str | None) -> str | None:
    if offload is True:
        return "optimizer"
    if offload is False or offload is None:
        return None
    if offload in ("optimizer", "optimizer+params"):
        return str(offload)
    raise ValueError(f"offload={offload!r} is not an offload mode; use True/'optimizer', "
                     "'optimizer+params' (stage 3 weights too) or False")


def _versus_no_offload(rec: Recommendation, su: Setup, n: int,
                       policies: Sequence[str]) -> Recommendation:
    """Say so when the same N runs faster without offload (the host step is slow)."""
    alt = recommend(su, _rows(su, n, policies), n)
    if alt.tokens_per_s is None or alt.tokens_per_s <= (rec.tokens_per_s or 0):
        return rec
    where = f"hybrid {alt.hybrid} " if alt.hybrid else ""
    ckpt = alt.activation_checkpointing
    more = (f" Without offload, {where}stage {alt.stage} with "
            f"{'no' if ckpt == 'none' else ckpt} activation checkpointing fits, at "
            f"~{alt.tokens_per_s:,.0f} tokens/s"
            + (f" ({alt.tokens_per_s / rec.tokens_per_s - 1:.0%} faster)" if rec.tokens_per_s
               else "") + ": offload only what does not fit.")
    return replace(rec, reason=rec.reason + more)


def _hybrid_notes(su: Setup, rows: list[PlanRow], counts: list[int]) -> list[str]:
    """Full vs hybrid sharding's communication per step, for each N spanning nodes."""
    out = []
    for n in (n for n in counts if su.nodes(n) > 1):
        for stages in ((1, 2), (3,)):
            full, hyb = (next((x for x in rows if x.gpus == n and x.stage == stages[-1] and
                               (x.hybrid is not None) == h), None) for h in (False, True))
            if full is None or hyb is None:
                continue
            which = "stages 1-2" if len(stages) == 2 else "stage 3"
            out.append(
                f"{which} on {n} devices, communication per step: full sharding "
                f"{gb(full.comm_bytes_per_step)} ({gb(full.cross_node_bytes_per_step)} across "
                f"nodes) in {full.comm_time_s:.3f} s; hybrid {hyb.hybrid} "
                f"{gb(hyb.comm_bytes_per_step)} ({gb(hyb.cross_node_bytes_per_step)} across "
                f"nodes) in {hyb.comm_time_s:.3f} s")
    return out


def _zeropp_notes(rows: list[PlanRow], counts: list[int]) -> list[str]:
    """Where stage 3's inter-node link dominates its step (its cross-node time above its
    compute), what the secondary shard and ZeRO++'s quantised collectives would save."""
    out = []
    for n in counts:
        for p in dict.fromkeys(x.activation_checkpointing for x in rows if x.gpus == n):
            mine = [x for x in rows if (x.gpus, x.stage, x.activation_checkpointing,
                                        x.hybrid) == (n, 3, p, None)]
            plain = next((x for x in mine if x.secondary is None), None)
            hpz = next((x for x in mine if x.secondary and not x.zeropp), None)
            zpp = next((x for x in mine if x.zeropp), None)
            if None in (plain, hpz, zpp) or plain.cross_node_time_s <= plain.compute_time_s:
                continue
            hyb = next((x for x in rows if (x.gpus, x.stage, x.activation_checkpointing)
                        == (n, 3, p) and x.hybrid), None)
            exact = (f"; hybrid sharding {hyb.hybrid}, exact, crosses "
                     f"{gb(hyb.cross_node_bytes_per_step)} (~{hyb.tokens_per_s:,.0f} tokens/s"
                     f"{'' if hyb.fits else ', does not fit'})" if hyb is not None else "")
            out.append(
                f"stage 3 on {n} devices ({'no' if p == 'none' else p} checkpointing): the "
                f"inter-node link dominates "
                f"({plain.cross_node_time_s:.3f} s across nodes against {plain.compute_time_s:.3f}"
                f" s of compute); reshard_after_forward={hpz.secondary} (hpZ) crosses "
                f"{gb(hpz.cross_node_bytes_per_step)} instead of "
                f"{gb(plain.cross_node_bytes_per_step)} (~{hpz.tokens_per_s:,.0f} tokens/s "
                f"against ~{plain.tokens_per_s:,.0f}, +{gb(hpz.total_bytes - plain.total_bytes)}"
                f" per device); with quantize_weights='int8', quantize_grads='int4' (lossy, "
                f"error feedback off; docs/links.md) {gb(zpp.cross_node_bytes_per_step)}, "
                f"~{zpp.tokens_per_s:,.0f} tokens/s{exact}")
            break  # one policy per N is enough to say it
    return out


def _host_notes(su: Setup, rows: list[PlanRow], recs: list[Recommendation]) -> list[str]:
    """Host memory per node for each N's pick (or its leanest offloaded row)."""
    out = []
    for rec in recs:
        mine = [x for x in rows if x.gpus == rec.gpus and x.offload]
        pick = next((x for x in mine if (x.stage, x.activation_checkpointing, x.hybrid,
                                         x.secondary, x.zeropp) ==
                     (rec.stage, rec.activation_checkpointing, rec.hybrid, rec.secondary,
                      rec.zeropp)), None)
        x = pick or min(mine, key=lambda x: x.host_bytes, default=None)
        if x is None:
            continue
        rpn = ranks_per_node(su, rec.gpus)
        limit = f" of {gb(su.host_mem)}" if su.host_mem is not None else ""
        out.append(f"host memory on {rec.gpus} device{'s' if rec.gpus > 1 else ''}, {describe(x)}: {gb(x.host_bytes)} per "
                   f"device x {rpn} device{'s' if rpn > 1 else ''} per node = "
                   f"{gb(x.host_bytes * rpn)} per node{limit}")
    return out
