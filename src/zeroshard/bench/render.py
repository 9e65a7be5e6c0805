"""The terminal table and the PNG plots of a benchmark result (see docs/bench.md)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

__all__ = ["format_table", "plot", "plot_timeline", "require_matplotlib", "timeline_path"]

MIB = 2**20
_CATS = ("params", "grads", "optim", "activations", "comm", "other")


def _mib(v: int | None) -> str:
    if v is None:
        return "-"
    return f"{v / MIB:.1f}" if 0 < v < 10 * MIB else f"{v / MIB:,.0f}"


def _ckpt(r: dict[str, Any]) -> str:
    return r["activation_checkpointing"]


def _plan(r: dict[str, Any]) -> str:
    p = r["predicted_model_state_bytes"]
    return "-" if p is None else f"{_mib(p['total'])}"


def _optimizer(s: dict[str, Any]) -> str:
    return "Muon + AdamW (two optimizers), " if s.get("optimizer") == "muon" else ""


def format_table(result: dict[str, Any]) -> str:
    s, rows = result["settings"], result["rows"]
    base = s["baseline"]
    head = (f"{'config':<18} {'st':>2} {'ckpt':<12} {'tokens/s':>8} {'[min-max]':>13} "
            f"{'x' + base:>6} {'step s':>6} {'params':>6} {'grads':>6} {'optim':>6} "
            f"{'act':>5} {'other':>5} {'peak':>6} {'x' + base:>6} {'state':>6} {'plan':>6} "
            f"{'rss':>6} {'comm/st':>7} {'inter':>6} {'loss':>7} {'dloss':>6}")
    predicted = "profile" in result
    if predicted:
        head += f" {'pred s':>6} {'x pred':>6}"
    lines = [
        f"model {s['model']} ({s['params'] / 1e6:.1f}M params), world {s['world_size']} x "
        f"micro-batch {s['micro_batch']} x seq {s['seq']} = {s['tokens_per_step']:,} tokens/step, "
        f"{s['mixed_precision'] or 'fp32'}, {_optimizer(s)}{s['backend']} on {s['device']}, "
        f"{s['warmup']} warm-up + {s['steps']} timed + 1 measured step per configuration, "
        f"{'interleaved' if s['interleaved'] else 'sequential'}",
        "", head, "-" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            why = textwrap.shorten(r["error"] or "", width=len(head) - 40, placeholder="...")
            lines.append(f"{r['name']:<18} {r['stage']:>2} {_ckpt(r):<12} "
                         f"{r['status'].upper()}: {why}")
            continue
        pk = r["peak_bytes"]
        flag = "" if r["loss_ok"] in (True, None) else " !"
        ratio = "-" if r["tokens_per_s_ratio"] is None else f"{r['tokens_per_s_ratio']:.2f}"
        pratio = "-" if r["peak_bytes_ratio"] is None else f"{r['peak_bytes_ratio']:.2f}"
        dloss = "-" if r["loss_rel_dev"] is None else f"{100 * r['loss_rel_dev']:.2f}%"
        span = f"[{r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f}]"
        lines.append(
            f"{r['name']:<18} {r['stage']:>2} {_ckpt(r):<12} {r['tokens_per_s']:>8,.0f} "
            f"{span:>13} {ratio:>6} {r['step_s_median']:>6.2f} "
            f"{_mib(pk['params']):>6} {_mib(pk['grads']):>6} {_mib(pk['optim']):>6} "
            f"{_mib(pk['activations']):>5} {_mib(pk['comm'] + pk['other']):>5} "
            f"{_mib(pk['total']):>6} {pratio:>6} {_mib(r['measured_model_state_bytes']):>6} "
            f"{_plan(r):>6} {_mib(r['rss_bytes']):>6} "
            f"{_mib(r['comm_bytes_per_step']):>7} {_mib(r['inter_wire_bytes_per_step']):>6} "
            f"{r['loss']:>7.4f} {dloss:>6}{flag}" + (_predicted(r) if predicted else ""))
    lines += [
        "",
        f"tokens/s: whole job, median over timed steps [slowest-fastest]; x{base}: ratio to the "
        f"baseline. Memory in MiB per rank, measured by the category tracker in a separate "
        "step (the rank with the highest peak): params/grads/optim/act/other(+comm) at the "
        "moment of peak; state = params+grads+optim measured, plan = the planner's ZeRO "
        "model-state prediction; rss = peak resident set of a process running only that "
        "configuration (the rank's RSS before any configuration + the step's peak RSS - the "
        "RSS once the configuration is dropped). "
        "comm/st = logical collective MiB per step "
        "(2 Psi all-reduce, 3 Psi stage 3); inter = MiB a rank sends to other nodes per "
        "step (zeroshard's ledger, --node-size; the mean over ranks). "
        f"dloss: relative deviation of the final loss "
        f"from {base}'s; '!' marks more than {100 * s['loss_tolerance']:g}%."
        + (" --optimizer muon: torch's Muon over the hidden matrices and AdamW over the "
           "rest on every row; naive-muon is sharded Muon as Megatron and Moonlight run it "
           "(stage 1's layout, each full gradient all-gathered, Newton-Schulz on every "
           "rank); zeroshard's comm/st includes its owner all-to-alls; plan: - (the planner "
           "knows AdamW's recipe only)." if s.get("optimizer") == "muon" else ""),
    ]
    lines = lines[:-1] + textwrap.wrap(lines[-1], width=100)
    if s.get("optimizer") == "muon":
        lines.append("optimizer step s (share of the step), rank 0: " + ", ".join(
            f"{r['name']} {r['optimizer_step_s_median']:.3f} "
            f"({100 * r['optimizer_step_s_median'] / r['step_s_median']:.0f}%)"
            for r in rows if r["status"] == "ok" and r.get("optimizer_step_s_median")))
        lines.append("Newton-Schulz s per step (share of the step), rank 0, one profiled step: "
                     + ", ".join(
                         f"{r['name']} {r['newton_schulz_s']:.3f} "
                         f"({100 * r['newton_schulz_s'] / r['step_s_median']:.0f}%)"
                         for r in rows if r["status"] == "ok"
                         and r.get("newton_schulz_s") is not None))
    if predicted:
        lines += textwrap.wrap(
            "pred s: the step time predicted from a trace of the row priced by the "
            f"calibration profile ({result['profile']['path']}; docs/planning.md); x pred = "
            "measured median / predicted. Only zeroshard's rows are predicted: the others "
            "run engines whose schedule a zeroshard trace does not follow.", width=100)
    if any(r.get("mfu") is not None for r in rows):
        lines.append("MFU: " + ", ".join(f"{r['name']} {100 * r['mfu']:.1f}%"
                                         for r in rows if r.get("mfu") is not None))
    for note in result["notes"]:
        lines.append(f"note: {note}")
    if result.get("budget"):
        b = result["budget"]
        lines += textwrap.wrap(f"budget {b['budget_bytes'] / MIB:,.0f} MiB per rank -> "
                               f"{b['choice'] or 'nothing fits'}: {b['reason']}", width=100)
    lines.append(f"wall time {result['wall_s']:.0f} s")
    return "\n".join(lines)


def _predicted(r: dict[str, Any]) -> str:
    if r.get("predicted_step_s") is None:
        return f" {'-':>6} {'-':>6}"
    return f" {r['predicted_step_s']:>6.3f} {r['step_s_over_predicted']:>6.2f}"


def require_matplotlib() -> None:
    """Raise ImportError with the fix when --plot is given and matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError("--plot needs matplotlib, which is not installed; "
                          "pip install 'zeroshard[plot]' (or matplotlib), or drop --plot") from None


def timeline_path(path: str | Path) -> Path:
    """Where ``--plot PATH`` puts the memory timeline: ``PATH`` with ``-timeline`` added."""
    p = Path(path)
    return p.with_name(f"{p.stem}-timeline{p.suffix or '.png'}")


def plot(result: dict[str, Any], path: str | Path) -> list[str]:
    """Two PNGs. ``path``: memory by category per configuration (stacked bars), and
    throughput against peak memory with the budget line. :func:`timeline_path`: each
    configuration's bytes by category over one training step (:func:`plot_timeline`).
    Returns the panel titles of the first."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["status"] == "ok"]
    names = [r["name"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5))
    bottom = [0.0] * len(rows)
    for cat in _CATS:
        vals = [r["peak_bytes"][cat] / MIB for r in rows]
        ax1.bar(names, vals, bottom=bottom, label=cat)
        bottom = [b + v for b, v in zip(bottom, vals)]
    planned = [(n, r["predicted_model_state_bytes"]["total"] / MIB)
               for n, r in zip(names, rows) if r["predicted_model_state_bytes"] is not None]
    if planned:
        ax1.scatter([n for n, _ in planned], [v for _, v in planned], marker="_", s=400,
                    color="black", label="planned model state", zorder=3)
    ax1.set_ylabel("peak MiB per rank")
    ax1.set_title("Peak memory by category")
    ax1.tick_params(axis="x", rotation=60)
    ax1.set_ylim(0, 1.35 * max(bottom + [1.0]))  # room for the legend above the bars
    ax1.legend(fontsize=7, loc="upper center", ncol=4)
    xs = [r["peak_bytes"]["total"] / MIB for r in rows]
    ys = [r["tokens_per_s"] for r in rows]
    ax2.errorbar(xs, ys, yerr=[[r["tokens_per_s"] - r["tokens_per_s_min"] for r in rows],
                               [r["tokens_per_s_max"] - r["tokens_per_s"] for r in rows]],
                 fmt="o", capsize=3)
    for x, y, n in zip(xs, ys, names):
        ax2.annotate(n, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    budget = result.get("budget")
    if budget:
        ax2.axvline(budget["budget_bytes"] / MIB, color="red", linestyle="--",
                    label=f"budget {budget['budget_bytes'] / MIB:,.0f} MiB")
        ax2.legend(fontsize=8)
    ax2.set_xlabel("peak MiB per rank")
    ax2.set_ylabel("tokens/s (median, min-max)")
    ax2.set_title("Throughput against peak memory")
    s = result["settings"]
    fig.suptitle(f"zeroshard bench: {_title(s)}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    plot_timeline(result, timeline_path(path))
    return [ax1.get_title(), ax2.get_title()]


def _title(s: dict[str, Any]) -> str:
    return f"{s['model']}, world {s['world_size']}, {s['device']}"


def plot_timeline(result: dict[str, Any], path: str | Path) -> list[str]:
    """One panel per configuration: bytes per rank by category (stacked) over the ops of
    its measured step, on the rank with the highest peak; forward, backward and the
    optimizer step marked, the peak dotted. Same scales everywhere, so panels compare.
    Returns the panel titles."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["status"] == "ok" and r.get("memory_timeline")]
    if not rows:
        return []
    cols = min(4, len(rows))
    nrows = -(-len(rows) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.1 * nrows), sharey=True,
                             squeeze=False)
    top = max(r["peak_bytes"]["total"] for r in rows) / MIB
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    titles = []
    for ax, r in zip(axes.flat, rows):
        tl = r["memory_timeline"]
        n = max(tl["op"][-1], 1) if tl["op"] else 1
        x = [i / n for i in tl["op"]]
        ys = [[v / MIB for v in tl[c]] for c in _CATS]
        ax.stackplot(x, ys, labels=_CATS, colors=colors[: len(_CATS)], linewidth=0)
        totals = [sum(v) for v in zip(*ys)]
        if totals:
            k = max(range(len(totals)), key=totals.__getitem__)
            ax.plot([x[k]], [totals[k]], "k.", markersize=6)
            ax.annotate(f"{totals[k]:,.0f}", (x[k], totals[k]), textcoords="offset points",
                        xytext=(3, 3), fontsize=7)
        for op, label in tl["marks"]:
            ax.axvline(op / n, color="black", linewidth=0.6, linestyle=":")
            ax.annotate(label, (op / n, top * 1.02), fontsize=7, rotation=90, va="bottom")
        title = f"{r['name']}: peak {r['peak_bytes']['total'] / MIB:,.0f} MiB"
        ax.set_title(title, fontsize=9)
        titles.append(title)
        ax.set_ylim(0, top * 1.25)
        ax.set_xlim(0, 1)
        ax.tick_params(labelsize=7)
    for ax in axes.flat[len(rows):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("MiB per rank", fontsize=8)
    for ax in axes[-1, :]:
        ax.set_xlabel("ops of one training step (fraction)", fontsize=8)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=len(_CATS), fontsize=8, frameon=False)
    fig.suptitle(f"Memory over one training step: {_title(result['settings'])}", x=0.3)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return titles
