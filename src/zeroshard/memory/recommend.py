"""The planner's recommendation ladder (mission.md §3): which fitting row to run.

[Note: recommendation]
Among fitting rows of one N: the best estimated tokens/s; on a tie (stages 1 and 2 move
the same bytes) the one using less memory, then the lower stage, then plain over hybrid
sharding. Hybrid rows (several nodes, see [Note: hybrid sharding, priced] in analytic.py)
compete like any other row, and the reason then compares their communication with full
sharding's. Stage 3 (hybrid or not) must beat the best fitting stage <= 2 by more than
10%: its per-unit gathers cost launch latency, copies and compute-stream contention this
model does not price (anchors.md: "Stage 3 by default is a common mistake"). Nothing
fits: if one block's 16-bit weights, gradients and activations (micro-batch 1) exceed a
device, no sharding helps -> tensor parallelism; if a row fits the device but not the
host memory (offload), say so; else the device count at which stage 3 would fit, or, when
the terms that do not shrink with N (activations and stage 3's buffers) already exceed a
device, those terms by name. Over
several N, the best tokens/s per device wins (more devices always add throughput; this
asks what each one buys).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zeroshard.memory.plan_rows import PlanRow, Setup

__all__ = ["STAGE3_MARGIN", "Recommendation", "recommend"]

STAGE3_MARGIN = 0.10


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    gpus: int
    stage: int | None
    activation_checkpointing: str | None
    action: str
    """single-device | data-parallel | zero-1 | zero-2 | zero-3 | more-devices | tensor-parallel"""
    reason: str
    tokens_per_s: float | None = None
    hybrid: str | None = None
    """"R x G" when the pick is hybrid sharding (shard over G, replicate over R); else None."""
    offload: bool = False
    """Whether the pick keeps the optimizer state and step on the host."""
    offload_params: bool = False
    """Whether it keeps the (stage 3) weight slices on the host too."""


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def describe(x: PlanRow) -> str:
    """"stage 2 with no activation checkpointing", "hybrid stage 3 (4 x 8) with full ..."."""
    p = x.activation_checkpointing
    where = f"hybrid stage {x.stage} ({x.hybrid})" if x.hybrid else f"stage {x.stage}"
    off = (", optimizer and weights offloaded," if x.offload_params
           else ", optimizer offloaded," if x.offload else "")
    return f"{where}{off} with {'no' if p == 'none' else p} activation checkpointing"


def devices(n: int) -> str:
    return f"{n} device{'s' if n != 1 else ''}"


def ranks_per_node(su: Setup, n: int) -> int:
    """Ranks sharing one host: gpus_per_node, or all N on a single node."""
    return min(n, su.gpus_per_node) if su.gpus_per_node else n


def _nothing_fits(su: Setup, rows: list[PlanRow], n: int) -> Recommendation:
    if su.layer_bytes > su.usable:
        why = (f"One transformer block needs {gb(su.layer_bytes)} (16-bit weights and "
               f"gradients plus its activations at micro-batch 1) but a device has "
               f"{gb(su.usable)} usable, so no amount of sharding fits it: tensor "
               "parallelism is needed.")
        return Recommendation(gpus=n, stage=None, activation_checkpointing=None,
                              action="tensor-parallel", reason=why)
    on_device = [x for x in rows if x.total_bytes <= x.usable_bytes]
    if on_device and su.host_mem is not None:  # only the host memory is short
        x = min(on_device, key=lambda x: x.host_bytes)
        rpn = ranks_per_node(su, n)
        why = (f"Nothing fits on {devices(n)}: {describe(x)} fits the device "
               f"({gb(x.total_bytes)} of {gb(su.usable)} usable) but its offloaded optimizer "
               f"state needs {gb(x.host_bytes)} of host memory per device, "
               f"{gb(x.host_bytes * rpn)} for the {devices(rpn)} of a node, more than the "
               f"{gb(su.host_mem)} given; add host memory or devices.")
        return Recommendation(gpus=n, stage=None, activation_checkpointing=None,
                              action="more-devices", reason=why)

    def floor(x: PlanRow) -> int:  # the part of a stage-3 peak that no N shrinks
        return x.activation_bytes + su.stage3.beside(x.activation_bytes)

    lean = min((x for x in rows if x.stage == 3 and x.hybrid is None),
               key=lambda x: (floor(x), x.total_bytes))
    fixed = su.stage3.beside(lean.activation_bytes)
    rest = floor(lean)
    act, buf = _fixed_terms(lean, fixed)
    terms = f"{act} + {buf} = {gb(rest)}" if buf else act
    if su.usable > rest:
        r = su.recipe
        per_param = (r.bytes_per_param - (r.optim_bytes if su.offload else 0)
                     - (r.param_bytes if su.offload_params else 0))
        need = _stage3_devices(su, lean, n, rest)
        why = (f"Nothing fits on {devices(n)} with {gb(su.usable)} usable; {describe(lean)} "
               f"fits on {need}+ devices: {terms} leave {gb(su.usable - rest)} for its "
               f"model state ({per_param}Ψ/N bytes).")
    else:
        if lean.activation_bytes > su.usable:  # even without stage 3's buffers
            held = f"{act} by themselves"
            more = f" (before {buf} and any model state)" if buf else " before any model state"
        else:
            held, more = terms, " before any model state"
        why = (f"Nothing fits on {devices(n)}, and more devices will not help: even "
               f"{describe(lean)} holds {held}, more than the {gb(su.usable)} usable{more}, "
               "and none of it shrinks with more devices. Lower the micro-batch or sequence "
               "length, or use tensor/sequence parallelism.")
    return Recommendation(gpus=n, stage=None, activation_checkpointing=None,
                          action="more-devices", reason=why)


def _fixed_terms(x: PlanRow, buffers: int) -> tuple[str, str]:
    """("activations (full checkpointing) 35.6 GB", "stage-3 gathered units and unit
    gradients 50.8 GB"): what a stage-3 row holds whatever N ("" for no buffers)."""
    p = x.activation_checkpointing
    act = f"activations ({'no' if p == 'none' else p} checkpointing) {gb(x.activation_bytes)}"
    buf = f"stage-3 gathered units and unit gradients {gb(buffers)}"
    return act, buf if buffers else ""


def _stage3_devices(su: Setup, x: PlanRow, n: int, rest: int) -> int:
    """The fewest devices on which row ``x``'s configuration fits, more than ``n``. Its
    peak falls with N towards ``rest`` (< usable): every moment's shards and gradient
    slices shrink, its activations and buffers do not ([Note: stage-3 peak] in
    analytic.py). So bisect between ``n`` and a count that surely fits: where the whole
    model state and the step's fp32 gradient copies fit beside ``rest``."""

    def fits(m: int) -> bool:
        total, _ = su.stage3_peak(n=m, policy=x.activation_checkpointing, offload=x.offload,
                                  offload_params=x.offload_params)
        return total <= su.usable

    r = su.recipe
    hi = max(n, math.ceil(su.psi * (r.bytes_per_param + 4) / (su.usable - rest))) + 1
    lo = n  # does not fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def _hybrid_note(su: Setup, rows: list[PlanRow], best: PlanRow) -> str:
    """Hybrid vs full sharding of the picked configuration, on several nodes."""
    same = [x for x in rows if (x.stage, x.activation_checkpointing) ==
            (best.stage, best.activation_checkpointing)]
    full = next((x for x in same if x.hybrid is None), None)
    hyb = next((x for x in same if x.hybrid is not None), None)
    if full is None or hyb is None:
        return ""
    vol = "3Ψ" if best.stage == 3 else "2Ψ"
    g = su.gpus_per_node
    cmp = (f"cross-node traffic 2Ψ/G = {gb(hyb.cross_node_bytes_per_step)} instead of "
           f"{vol} = {gb(full.cross_node_bytes_per_step)}; {hyb.comm_time_s:.3f} s vs "
           f"{full.comm_time_s:.3f} s of communication per step")
    if best.hybrid:
        return (f" Hybrid sharding ({best.hybrid}, sharded over the {g} devices of a node): "
                f"{cmp}.")
    if not hyb.fits:
        return (f" Hybrid sharding ({hyb.hybrid}) would keep most traffic inside a node "
                f"but does not fit ({gb(hyb.total_bytes)}: its state is sharded over {g}, "
                f"not {best.gpus}).")
    return (f" Hybrid sharding ({hyb.hybrid}) is not faster here: {cmp}, "
            f"~{hyb.tokens_per_s:,.0f} tokens/s.")


def _offload_note(su: Setup, best: PlanRow, n: int) -> str:
    if not best.offload:
        return ""
    rpn = ranks_per_node(su, n)
    what = "weight slices" if best.offload_params else "a staging copy of the weights"
    return (f" The optimizer state, the gradient slices and {what} live in host memory: "
            f"{gb(best.host_bytes)} per device, "
            f"{gb(best.host_bytes * rpn)} for the {devices(rpn)} of a node; PCIe copies and "
            f"the host step add {best.offload_time_s:.3f} s per step.")


def recommend(su: Setup, rows: list[PlanRow], n: int) -> Recommendation:
    """[Note: recommendation]"""
    fitting = [x for x in rows if x.fits]
    if not fitting:
        return _nothing_fits(su, rows, n)

    def key(x: PlanRow) -> tuple[float, float, int, int, bool]:
        # equal speed (communication-bound): no needless recompute, then less memory, ...
        return (x.tokens_per_s, -x.compute_time_s, -x.total_bytes, -x.stage, x.hybrid is None)

    best = max(fitting, key=key)
    low = [x for x in fitting if x.stage <= 2]
    alt = max(low, key=key) if low else None
    if best.stage == 3 and alt and best.tokens_per_s <= (1 + STAGE3_MARGIN) * alt.tokens_per_s:
        best = alt
    how = (f"{describe(best)}: {gb(best.total_bytes)} of {gb(su.usable)} usable, "
           f"~{best.tokens_per_s:,.0f} tokens/s")
    s0 = gb(min(x.total_bytes for x in rows if x.stage == 0))
    if n == 1:
        action, why = "single-device", f"It fits on one device ({how}): use one device."
    elif best.stage == 0:
        action = "data-parallel"
        why = f"A full replica fits on each device: plain data parallelism is fastest ({how})."
    elif best.stage in (1, 2):
        action = f"zero-{best.stage}"
        what = f"optimizer state{' and gradients' if best.stage == 2 else ''}"
        replica = [x for x in fitting if x.stage == 0]
        if replica:  # as fast as a full replica here: the sharded state is free headroom
            why = (f"A full replica fits too, but sharding {what} is estimated as fast and "
                   f"needs less memory ({how}; stage 0 needs at least {s0}).")
        else:
            why = (f"A full replica does not fit (stage 0 needs at least {s0}); sharding "
                   f"{what} gives the best estimated throughput that fits ({how}).")
    elif alt is None:
        action = "zero-3"
        s2 = gb(min(x.total_bytes for x in rows if x.stage == 2))
        why = (f"Stages 0-2 do not fit (stage 2 needs at least {s2}), so parameters must be "
               f"sharded too ({how}); measure its throughput cost, don't assume it.")
    else:
        action = "zero-3"
        if best.activation_checkpointing != alt.activation_checkpointing:
            gain = (f"sharding the weights leaves room to recompute less than "
                    f"{alt.activation_checkpointing} checkpointing does")
        elif best.hybrid != alt.hybrid:
            gain = "its communication overlaps better on these links"
        else:
            gain = f"stage {alt.stage}'s post-step all-gather cannot overlap"
        why = (f"Stage 3 is estimated {best.tokens_per_s / alt.tokens_per_s - 1:.1%} faster than "
               f"the best stage 0-2 option ({describe(alt)}, ~{alt.tokens_per_s:,.0f} tokens/s): "
               f"{gain} ({how}); confirm by measuring.")
    why += _hybrid_note(su, rows, best) + _offload_note(su, best, n)
    return Recommendation(gpus=n, stage=best.stage, action=action, reason=why,
                          activation_checkpointing=best.activation_checkpointing,
                          tokens_per_s=best.tokens_per_s, hybrid=best.hybrid,
                          offload=best.offload, offload_params=best.offload_params)
