"""``zeroshard plan``'s tables: the plan (zeroshard.memory.planner) as text.

The command line (cli.py) parses and validates; this renders: the 16Ψ breakdown, one
table per device count with the traced and predicted columns when present, the
recommendation and its reasons (docs/planning.md shows the output).
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zeroshard.memory.plan_rows import PlanRow
    from zeroshard.memory.planner import Plan

__all__ = ["format_plan"]


def _layout(x: PlanRow) -> str:
    """The table's layout column: "2x8" (hybrid), "hpz8" (a secondary shard), "-"."""
    if x.hybrid:
        return x.hybrid.replace(" ", "")
    return (f"z++{x.secondary}" if x.zeropp else f"hpz{x.secondary}" if x.secondary
            else "-")


def format_plan(p: Plan, name: str) -> str:
    """The human-readable plan: assumptions, the 16Ψ breakdown, tables, recommendation."""
    from zeroshard.memory.planner import reserve_bytes

    r, psi, cfg = p.recipe, p.params, p.config
    mem, reserve = p.gpu_mem_bytes, reserve_bytes(p.gpu_mem_bytes)
    optim = "fp32 master + Adam m + v" if r.optim_bytes == 12 else "Adam m + v (fp32)"
    kinds = [(r.param_bytes, "weights the model computes with"), (r.grad_bytes, "gradients"),
             (r.optim_bytes, f"optimizer: {optim}"), (r.bytes_per_param, "per full replica")]
    lines = [
        f"model   {name}: {psi / 1e9:.2f}B parameters (L={cfg.n_layers}, h={cfg.hidden}, "
        f"heads={cfg.n_heads}), recipe {r.name}",
        f"batch   seq {p.seq_len} x micro-batch {p.micro_batch} per device, one optimizer "
        "step per micro-batch",
        f"device  {mem / 1e9:.1f} GB ({mem / 2**30:.1f} GiB); usable {(mem - reserve) / 1e9:.1f} "
        f"GB after a {reserve / 1e9:.1f} GB reserve (max(10%, 1.5 GB): CUDA context, NCCL, "
        "fragmentation)",
        _links(p),
        *(["offload optimizer state and step on the host (stages 1-3)"
           + (", weight slices too (stage 3)" if p.offload_mode == "optimizer+params" else "")
           + f": PCIe {p.pcie_GBps:g} "
           f"GB/s per device, host step at {p.host_GBps:g} GB/s per rank; host memory "
           + (f"{p.host_mem_bytes / 1e9:.1f} GB per node" if p.host_mem_bytes else
              "not checked (--host-mem)")] if p.offload else []),
        "",
        f"Model state (ZeRO, Rajbhandari et al. 2020, sec. 3.1): {r.bytes_per_param} bytes "
        "per parameter",
        *(f"  {b:>2} B  {what:<36} {psi * b / 1e9:8.1f} GB" for b, what in kinds),
        "  stage 0 keeps all of it on every device; stage 1 shards the optimizer part over N,",
        "  stage 2 also the gradients, stage 3 everything. Activations are a separate bill that",
        "  no sharding touches; checkpointing trades them for recompute (+~33% FLOPs for full).",
        "",
        "GB = 10^9 bytes, GiB = 2^30 bytes; per device. comm = ZeRO volume per step (2Ψ / 3Ψ);",
        "act = saved activations (fused attention) + backward's recompute working set;",
        "buf = stage 2 gradient buckets, stage 3 gathered units and unit gradients at the step's",
        "  peak (the root whole; stage 1 reduces in its gradients); where the optimizer step is",
        "  the peak, its fp32 gradient copies (+ stages 1-2's refresh bucket) and no act;",
        "total = the step's fullest moment (JSON peak_moment): where backward begins, no",
        "  gradient yet and the loss's fp32 gradients beside act (docs/planning.md);",
        "hides@tok = tokens per device per step at which overlappable communication hides.",
    ]
    if p.tp > 1:
        lines += [f"tp = {p.tp}: each device holds {p.tp_params / 1e9:.2f}B of the "
                  f"{psi / 1e9:.2f}B parameters (torchtitan's plan: blocks and vocabulary split, "
                  "norms whole) and computes", f"  1/{p.tp} of every matmul; ZeRO shards over "
                  f"N/{p.tp}; act = one tp rank's (sequence parallelism); tp GB / tp s = the tp "
                  "collectives per", "  device and step, on the critical path (in step s); "
                  "comm = the data-parallel ones; tokens/s counts N/tp replicas."]
    multi = p.gpus_per_node is not None
    if multi:
        lines += ["hybrid R x G = shard over the G devices of a node, replicate over R nodes;",
                  "  hpzG = stage 3 with a secondary shard over each node's G devices "
                  "(reshard_after_forward=G: backward's all-gather stays in the node);",
                  "  z++G = hpzG with int8 weight all-gathers and int4 two-hop gradients "
                  "(ZeRO++'s three, error feedback off; docs/links.md);",
                  "xnode = traffic crossing nodes: all of it with plain sharding, the 2Ψ/G "
                  "slice all-reduce with hybrid, the forward all-gather and the reduce-scatter "
                  "with hpzG, their quantised bytes with z++G (quantised collectives count "
                  "the bytes they move in comm and xnode)."]
    if p.offload:
        lines += ["host = offloaded optimizer state, gradient and weight slices per device "
                  "(x devices per node per host);",
                  "offl s = PCIe copies + host optimizer step, not overlapped, included in "
                  "step s; fits 'host' = fits the device, not the host."]
    traced = any(x.traced_peak_bytes is not None for x in p.rows)
    predicted = any(x.predicted_step_s is not None for x in p.rows)
    if traced:
        lines += ["trace st/pk = one real step of the engine on fake tensors at this N "
                  "(zeroshard.memory.traced): model state between steps / peak total"
                  + (" on the device; trace host = peak host memory." if p.offload else ".")]
    if predicted:
        lines += ["pred s = the row's traced step (its ops and collectives) priced by the "
                  "calibration profile (--profile; zeroshard.timing): the machine it was "
                  "measured on, not --mfu/--peak-tflops; step s and the recommendation stay "
                  "the analytic estimate's."]
    head = (f"{'N':>4} {'stage':>5} {'ckpt':<9} " + (f"{'hybrid':<6} " if multi else "")
            + f"{'state GB':>8} {'act GB':>7} {'buf GB':>6} {'total GB':>8} {'total GiB':>9} "
            + (f"{'host GB':>7} " if p.offload else "")
            + f"{'fits':<4} {'comm GB':>7} {'comm s':>6} "
            + (f"{'tp GB':>6} {'tp s':>6} " if p.tp > 1 else "")
            + (f"{'xnode GB':>8} {'xnode s':>7} " if multi else "")
            + (f"{'offl s':>6} " if p.offload else "")
            + f"{'step s':>6} {'tokens/s':>9} {'hides@tok':>9}"
            + (f" {'trace st GB':>11} {'trace pk GB':>11}" if traced else "")
            + (f" {'trace host GB':>13}" if traced and p.offload else "")
            + (f" {'pred s':>7} {'pred tok/s':>10}" if predicted else ""))
    for n in sorted({x.gpus for x in p.rows}):
        lines += ["", head, "-" * len(head)]
        for x in (x for x in p.rows if x.gpus == n):
            fits = "yes" if x.fits else "host" if x.total_bytes <= x.usable_bytes else "no"
            lines.append(
                f"{x.gpus:>4} {x.stage:>5} {x.activation_checkpointing:<9} "
                + (f"{_layout(x):<6} " if multi else "")
                + f"{x.model_state_bytes / 1e9:>8.1f} {x.activation_bytes / 1e9:>7.1f} "
                f"{x.buffer_bytes / 1e9:>6.1f} {x.total_bytes / 1e9:>8.1f} "
                f"{x.total_bytes / 2**30:>9.1f} "
                + (f"{x.host_bytes / 1e9:>7.1f} " if p.offload else "")
                + f"{fits:<4} {x.comm_bytes_per_step / 1e9:>7.1f} "
                f"{x.comm_time_s - x.tp_comm_time_s:>6.3f} "
                + (f"{x.tp_comm_bytes_per_step / 1e9:>6.1f} {x.tp_comm_time_s:>6.3f} "
                   if p.tp > 1 else "")
                + (f"{x.cross_node_bytes_per_step / 1e9:>8.1f} {x.cross_node_time_s:>7.3f} "
                   if multi else "")
                + (f"{x.offload_time_s:>6.3f} " if p.offload else "")
                + f"{x.step_time_s:>6.3f} {x.tokens_per_s:>9,.0f} {x.break_even_tokens:>9,.0f}"
                + _traced_cols(x, traced, p.offload) + (_predicted_cols(x) if predicted else ""))
    lines.append("")
    if len(p.by_gpus) > 1:
        lines += [f"on {c.gpus:>4} devices: {_rec_title(c)}" for c in p.by_gpus]
        lines += [f"  {note}" for note in p.notes] + [""]
    elif p.notes:  # rows left untraced and why; hybrid vs full; host memory
        lines += [f"  {note}" for note in p.notes] + [""]
    rec = p.recommendation
    plural = "s" if rec.gpus > 1 else ""
    lines.append(f"Recommendation ({rec.gpus} device{plural}): {_rec_title(rec)}")
    lines += textwrap.wrap(rec.reason, width=96, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(lines)


def _links(p: Plan) -> str:
    if p.gpus_per_node is None:
        return f"links   {p.interconnect_GBps:g} GB/s bus bandwidth per device"
    if p.inter_GBps is None:
        return (f"links   {p.interconnect_GBps:g} GB/s bus bandwidth per device inside a node "
                f"of {p.gpus_per_node} (every count fits in one node)")
    return (f"links   {p.interconnect_GBps:g} GB/s bus bandwidth per device inside a node of "
            f"{p.gpus_per_node}, {p.inter_GBps:g} GB/s between nodes; a ring across nodes "
            f"runs at {min(p.interconnect_GBps, p.inter_GBps):g}")


def _predicted_cols(x: Any) -> str:
    if x.predicted_step_s is None:
        return f" {'-':>7} {'-':>10}"
    tokens = x.tokens_per_s * x.step_time_s  # tokens per step over the replicas
    return f" {x.predicted_step_s:>7.3f} {tokens / x.predicted_step_s:>10,.0f}"


def _traced_cols(x: Any, traced: bool, offload: bool) -> str:
    if not traced:
        return ""
    host = ""
    if offload:
        host = f" {x.traced_host_bytes / 1e9:>13.1f}" if x.traced_host_bytes is not None else (
            f" {'-':>13}")
    if x.traced_peak_bytes is None:
        return f" {'-':>11} {'-':>11}{host}"
    return (f" {x.traced_model_state_bytes / 1e9:>11.1f} {x.traced_peak_bytes / 1e9:>11.1f}"
            + host)


def _rec_title(rec: Any) -> str:
    if rec.stage is None:
        return rec.action.replace("-", " ")
    what = {"single-device": "one device", "data-parallel": "plain data parallelism (stage 0)"}
    title = what.get(rec.action, f"ZeRO stage {rec.stage}")
    if rec.hybrid:
        title = f"hybrid sharding {rec.hybrid} (shard in a node, replicate across), {title}"
    ckpt = rec.activation_checkpointing
    off = (", optimizer and weight slices offloaded to the host" if rec.offload_params
           else ", optimizer offloaded to the host" if rec.offload else "")
    return f"{title}, {'no' if ckpt == 'none' else ckpt} activation checkpointing{off}"
