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
host memory (offload), say so. Else stage 3's peak falls with N towards what no N
shrinks, the largest moment's activations and buffers (backward's start or the root's
reduction, [Note: stage-3 peak] in stage3_buffers.py). If that is under a device, the fewest
devices on which a stage-3 row fits (-> more devices), found by evaluating the real
stage-3 peak at each N (not by dividing a remainder by 16Ψ: the moment that peaks
changes with N and holds no activation at the optimizer step), and that row's figures at
that N, the table's; if not, no device count helps -> tensor parallelism, with those
terms by name and only remedies that shrink them (no "lower the micro-batch" at 1, no
"checkpoint" when full checkpointing was planned, no optimizer offload). Over
several N, the best tokens/s per device wins (more devices always add throughput; this
asks what each one buys).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zeroshard.memory import analytic
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
    secondary: int | None = None
    """k when the pick is stage 3 with a secondary shard (hpZ); else None."""
    zeropp: bool = False
    """The pick also quantises its collectives (int8 weights, int4 gradients)."""
    offload: bool = False
    """Whether the pick keeps the optimizer state and step on the host."""
    offload_params: bool = False
    """Whether it keeps the (stage 3) weight slices on the host too."""


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def describe(x: PlanRow) -> str:
    """"stage 2 with no activation checkpointing", "hybrid stage 3 (4 x 8) with full ..."."""
    p = x.activation_checkpointing
    where = (f"hybrid stage {x.stage} ({x.hybrid})" if x.hybrid else
             f"stage 3 with ZeRO++'s three (reshard_after_forward={x.secondary}, "
             "quantize_weights='int8', quantize_grads='int4')" if x.zeropp else
             f"stage 3 with a secondary shard per node (reshard_after_forward={x.secondary}, "
             "ZeRO++'s hpZ)" if x.secondary else f"stage {x.stage}")
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
               f"{gb(su.usable)} usable, so no amount of sharding fits it: "
               + (f"tensor parallelism is needed{_tp_hint(su)}." if su.tp == 1 else
                  f"a tensor-parallel degree above {su.tp} is needed."))
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

    plain = [x for x in rows if x.stage == 3 and x.hybrid is None and x.secondary is None]
    helps = [x for x in plain if _floor(su, x) < su.usable]
    if helps:  # the fewest devices on which some policy fits; on a tie, the leanest
        x, need = min(((x, _stage3_devices(su, x, n)) for x in helps),
                      key=lambda t: (t[1], _floor(su, t[0])))
        return Recommendation(gpus=n, stage=None, activation_checkpointing=None,
                              action="more-devices", reason=_fits_from(su, x, n, need))
    lean = min(plain, key=lambda x: (_floor(su, x), x.total_bytes))
    return Recommendation(gpus=n, stage=None, activation_checkpointing=None,
                          action="tensor-parallel", reason=_never_fits(su, lean, n))


def _tp_hint(su: Setup, lead: str = " (") -> str:
    """Where ``plan --tp`` can price it (Llama shapes, torchtitan's plan): say so."""
    from zeroshard.models.config import LlamaConfig

    if not isinstance(su.cfg, LlamaConfig):
        return ""
    return f"{lead}plan --tp prices it)"


def _floor(su: Setup, x: PlanRow) -> int:
    """What stage-3 row ``x``'s peak falls towards as N grows, and never reaches
    (``Setup.stage3_floor``)."""
    return su.stage3_floor(policy=x.activation_checkpointing)[0]


def _stage3_devices(su: Setup, x: PlanRow, n: int) -> int:
    """The fewest devices on which row ``x``'s configuration fits, more than ``n``: the
    first N at which the real stage-3 peak (``Setup.stage3_peak``, the largest of the
    step's moments, the one a row's ``total`` is) is within the usable memory. The peak
    only falls as N grows (every term is constant or ceil(·/N)), towards
    :func:`_floor` (< usable), so bisect between ``n`` and a count that surely fits."""

    def fits(m: int) -> bool:
        total, _ = su.stage3_peak(n=m, policy=x.activation_checkpointing, offload=x.offload,
                                  offload_params=x.offload_params)
        return total <= su.usable

    # By then every moment's N-dependent part (at most the whole state plus the fp32
    # copies, 20 bytes a parameter) fits beside the floor.
    hi = max(n, math.ceil(su.psi * (su.recipe.bytes_per_param + 4)
                          / (su.usable - _floor(su, x)))) + 1
    while not fits(hi):  # padding's rounding: never by more than a few bytes
        hi *= 2
    lo = n  # does not fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


_AT = {"loss's backward": "at the loss's backward, only the root gathered",
       "backward begins": "when backward begins",
       "end of the blocks' backward": "at the end of the blocks' backward",
       "root's reduction": "at the root's reduction, the activations freed",
       "optimizer step": "at the optimizer step, the activations freed"}


def _digits(limit: int, *totals: int) -> int:
    """Decimals of GB (1-9) at which each of ``totals`` reads as on its side of ``limit``."""
    for d in range(1, 9):
        if all(t == limit or f"{t / 1e9:.{d}f}" != f"{limit / 1e9:.{d}f}" for t in totals):
            return d
    return 9


def _fits_from(su: Setup, x: PlanRow, n: int, need: int) -> str:
    """"... fits on 842+ devices": the figures of the row at N = need (the table's row
    there, column by column) and that N's peak moment, summed; and the peak at need-1."""
    pol, off, offp = x.activation_checkpointing, x.offload, x.offload_params
    state = su.device_state(n=need, stage=3, offload=off, offload_params=offp)
    total, m = su.stage3_peak(n=need, policy=pol, offload=off, offload_params=offp)
    before, _ = su.stage3_peak(n=need - 1, policy=pol, offload=off, offload_params=offp)
    d = _digits(su.usable, total, before)

    def g(b: int) -> str:
        return f"{b / 1e9:.{d}f} GB"

    r = su.recipe
    coef = (0 if offp else r.param_bytes) + (0 if off else r.grad_bytes + r.optim_bytes)
    parts = [f"model state {g(state.total)} ({coef}Ψ/N)"]
    unreduced = state.grads - m.grad_slices
    if unreduced:
        which = {"backward begins": f"({r.grad_bytes}Ψ/N, none reduced yet)",
                 "loss's backward": f"({r.grad_bytes}Ψ/N, none reduced yet)",
                 "root's reduction": "not reduced yet (the root's)"}.get(
                     m.name, f"not reduced yet (the {su.prefetch + 1} lowest blocks' and the "
                     "root's)")
        parts.append(f"− {g(unreduced)} of gradient slices {which}")
    if m.activations:
        act = f"activations ({'no' if pol == 'none' else pol} checkpointing)"
        peak = f"(of {g(x.activation_bytes)} at their peak)"
        parts.append({
            "loss's backward": f"+ the {act} forward saved {g(m.activations)} {peak}",
            "backward begins": f"+ the blocks' {act} and recompute working set, the head's "
                               f"freed by its backward, {g(m.activations)} {peak}",
        }.get(m.name, f"+ the {su.prefetch + 1} lowest blocks' {act} and recompute working "
                      f"set {g(m.activations)} {peak}"))
    if m.buffers:
        buf = {"root's reduction": "the root's gradients, twice, and a block's reduction in "
                                   "flight",
               "loss's backward": "the root's gathered weights and the loss's two fp32 "
                                  "gradients",
               "optimizer step": "the gradient slices' fp32 copies (4Ψ/N)"}.get(
                   m.name, "stage-3 gathered units and unit gradients")
        parts.append(f"+ {buf} {g(m.buffers)}")
    what = describe(x)
    shown = ["state"] + (["act"] if m.activations == x.activation_bytes else []) + (
        ["buf"] if m.buffers else [])
    cols = ", ".join(shown) + " and total columns"
    exact = f" ({g(su.usable)})" if d > 1 else ""
    return (f"Nothing fits on {devices(n)} with {gb(su.usable)} usable. "
            f"{what[0].upper()}{what[1:]} fits on {need}+ devices, the fewest on which its "
            f"peak (the largest of stage 3's moments in a step, evaluated at each N: the "
            f"shards, gradient slices and their fp32 copies shrink as N grows, the "
            f"activations and the gathered units and unit gradients do not) is within "
            f"that{exact}. On {devices(need)} it peaks {_AT[m.name]}: "
            f"{' '.join(parts)} = {g(total)} (the {cols} of its row in a "
            f"plan for {need}); on {devices(need - 1)}, {g(before)}.")


def _never_fits(su: Setup, x: PlanRow, n: int) -> str:
    """No device count helps: name what no N shrinks at stage 3's leanest row, and only
    remedies that shrink it (tensor parallelism; shorter sequences, a smaller
    micro-batch if above 1, full checkpointing if not planned, activations kept on the
    host, prefetch 0), and say that optimizer offload does not."""
    pol = x.activation_checkpointing
    act_b = x.activation_bytes
    floor, m = su.stage3_floor(policy=pol)
    b3 = m.buffers  # what sits beside the activations at the floor's moment
    act = f"activations ({'no' if pol == 'none' else pol} checkpointing) {gb(act_b)}"
    buf = {"loss's backward": "the root's gathered weights and the loss's two fp32 "
                              "gradients"}.get(
        m.name, "stage-3 gathered units and unit gradients") + f" {gb(b3)}"
    at_root = m.name == "root's reduction"
    if at_root:
        held = (f"{gb(floor)} at the root's reduction (the root's gradients, twice, and a "
                "block's reduction in flight; no activation is left by then)")
    elif act_b > su.usable:
        held = f"{act} by themselves (before {buf} and any model state)"
    else:
        held = (f"activations at that moment {gb(m.activations)} + {buf} = {gb(floor)} "
                f"{_AT[m.name]}, before any model state")
    why = (f"Nothing fits on {devices(n)}, and no device count will: even {describe(x)} "
           f"holds {held}, more than the {gb(su.usable)} usable, and more devices shrink "
           "only the model state. " + (
               "Use tensor parallelism (with sequence parallelism for the activations): it "
               "splits each block's weights, gradients and activations over devices"
               f"{_tp_hint(su, ', which zeroshard composes with (docs/tensor-parallel.md, ')}."
               if su.tp == 1 else
               f"Use a tensor-parallel degree above {su.tp}: it splits each block's weights, "
               "gradients and activations over more devices."))
    if at_root:
        return why + (" The root (embeddings, LM head) is split by a vocabulary-parallel "
                      "embedding and head.")
    room = su.usable - b3
    if su.stage3.root_reduce >= su.usable:
        why += (f" The root's reduction alone (its gradients, twice, and a block's reduction "
                f"in flight) holds {gb(su.stage3.root_reduce)}, so fewer activations would "
                "not do.")
    elif room > 0:
        ways = ["a shorter sequence (--seq)"]
        if su.micro_batch > 1:
            ways.append(f"a smaller micro-batch than {su.micro_batch} (--micro-batch)")
        if "full" not in su.act:
            ways.append("full checkpointing (--policies full: each block keeps only its "
                        "input)")
        ways.append("the blocks' saved inputs kept on the host (apply_checkpointing(model, "
                    "'full', offload_activations=True), not priced here)")
        listed = (" or ".join(ways) if len(ways) == 2 else
                  "; ".join(ways[:-1]) + "; or " + ways[-1])
        why += (f" Without it, bring the activations under {gb(room)} ({gb(su.usable)} "
                f"less {gb(b3)}), with room left for the model state: {listed}.")
    else:
        why += f" The buffers alone ({gb(b3)}) exceed the {gb(su.usable)} usable."
    if su.prefetch > 0:
        cfg = su.cfg
        b0 = analytic.stage3_buffer_bytes(
            block=analytic.block_params(cfg), root=analytic.root_params(cfg),
            head=analytic.head_params(cfg), prefetch=0, recipe=su.recipe)
        floor0 = su.stage3_floor(policy=pol, prefetch=0)[0]
        verdict = "under" if floor0 < su.usable else "still over"
        why += (f" Gathering no block ahead (ShardConfig(prefetch=0)) cuts the buffers to "
                f"{gb(b0.backward)}: {gb(floor0)}, {verdict} the usable memory.")
    return why + (" --offload does not help: it moves model state, which more devices "
                  "already shrink.")


def _hybrid_note(su: Setup, rows: list[PlanRow], best: PlanRow) -> str:
    """Hybrid vs full sharding of the picked configuration, on several nodes."""
    same = [x for x in rows if (x.stage, x.activation_checkpointing) ==
            (best.stage, best.activation_checkpointing)]
    full = next((x for x in same if x.hybrid is None and x.secondary is None), None)
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
    margin = ""
    if best.stage == 3 and alt and best.tokens_per_s <= (1 + STAGE3_MARGIN) * alt.tokens_per_s:
        margin = "" if best.tokens_per_s <= alt.tokens_per_s else (f" Stage 3 is estimated {best.tokens_per_s / alt.tokens_per_s - 1:.1%} faster "
                  f"({describe(best)}, ~{best.tokens_per_s:,.0f} tokens/s), under the "
                  f"{STAGE3_MARGIN:.0%} it must win by: its per-unit gathers cost what this "
                  "estimate does not price.")
        best = alt
    how = (f"{describe(best)}: {gb(best.total_bytes)} of {gb(su.usable)} usable, "
           f"~{best.tokens_per_s:,.0f} tokens/s")
    low_stages = "1-2" if su.tp > 1 else "0-2"  # no stage 0 under tp
    top = (f"the best estimated throughput of stages {low_stages}" if margin else
           "the best estimated throughput that fits")
    zero = [x.total_bytes for x in rows if x.stage == 0]  # none under tp (stages 1-3)
    s0 = gb(min(zero)) if zero else None
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
        elif s0 is None:
            why = (f"With tensor parallelism zeroshard shards stages 1-3; sharding {what} "
                   f"gives {top} ({how}).")
        else:
            why = (f"A full replica does not fit (stage 0 needs at least {s0}); sharding "
                   f"{what} gives {top} ({how}).")
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
    if su.tp > 1 and su.dp(n) == 1:
        why += (f" With tp={su.tp} on {devices(n)} there is one data-parallel replica: the "
                "ZeRO stage shards nothing (each rank keeps its whole piece's state).")
    why += margin + _hybrid_note(su, rows, best) + _offload_note(su, best, n)
    return Recommendation(gpus=n, stage=best.stage, action=action, reason=why,
                          activation_checkpointing=best.activation_checkpointing,
                          tokens_per_s=best.tokens_per_s, hybrid=best.hybrid,
                          secondary=best.secondary, zeropp=best.zeropp,
                          offload=best.offload, offload_params=best.offload_params)
