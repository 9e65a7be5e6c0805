"""Turn what the ranks measured into result rows: statistics, ratios, the planner's
prediction, the loss check and the budget choice; and write them as JSON.

The JSON schema is documented in docs/bench.md; :data:`ROW_KEYS` lists every row key.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from zeroshard.bench.configs import BenchSettings, ConfigSpec

__all__ = ["CATEGORIES", "ROW_KEYS", "build_result", "choose", "predicted_state", "write_json"]

CATEGORIES = ("params", "grads", "optim", "activations", "comm", "other", "total")
ROW_KEYS = (
    "name", "system", "stage", "reshard_after_forward", "activation_checkpointing",
    "world_size", "status", "error", "note", "tokens_per_s", "tokens_per_s_min",
    "tokens_per_s_max", "step_s_median", "step_s_min", "step_s_max", "step_s_all",
    "steps_measured",
    "peak_bytes", "peak_rank", "rss_bytes", "cuda_peak_bytes", "comm_bytes_per_step",
    "comm_source", "intra_wire_bytes_per_step", "inter_wire_bytes_per_step", "quantize_weights",
    "quantize_grads", "loss", "loss_rel_dev", "loss_ok", "mfu", "predicted_model_state_bytes",
    "measured_model_state_bytes", "tokens_per_s_ratio", "peak_bytes_ratio", "fits_budget",
    "memory_timeline", "time_s", "tp", "optimizer_step_s_median", "newton_schulz_s",
    "predicted_step_s", "step_s_over_predicted", "predicted",
)
PHASES = ("build", "warmup", "measured", "timed")
"""Where a configuration's wall time goes (row ``time_s``)."""

#: Dense 16-bit peak FLOP/s per device, for MFU (vendor datasheets, no sparsity).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12,
              "L4": 121e12, "V100": 125e12}


def predicted_state(psi: int, stage: int, n: int, mixed_precision: str | None,
                    system: str = "zeroshard") -> dict[str, int]:
    """The planner's model-state bytes per rank (zeroshard.memory.analytic, ZeRO sec. 3.1).

    zeroshard keeps 16-bit weights and gradients under mixed precision (the bf16/fp16
    recipes); the other systems autocast from fp32 weights and keep fp32 gradients, so
    for them the fp32 recipe (4 + 4 + 8 bytes per parameter) is the right prediction.
    """
    from zeroshard.memory.analytic import model_state_bytes

    recipe = "fp32-adamw"
    if mixed_precision is not None and system == "zeroshard":
        recipe = f"{mixed_precision}-adamw"
    st = model_state_bytes(psi, stage=stage, n=n, recipe=recipe, padded=True)
    return {"params": st.params, "grads": st.grads, "optim": st.optim, "total": st.total}


def _state_of(s: BenchSettings, spec: ConfigSpec, psi: int, world: int) -> tuple[int, int]:
    """(parameters one rank's state covers, ranks it is sharded over): under ``-tp<k>``
    the rank's tp piece over world / k (memory/tensor_parallel.py)."""
    if spec.tp == 1 or s.model_factory is not None or s.model is None:
        return psi, world
    from zeroshard.memory.tensor_parallel import tp_param_count
    from zeroshard.models import get_preset

    return tp_param_count(get_preset(s.model), spec.tp), world // spec.tp


def _flops_per_token(s: BenchSettings, psi: int) -> float:
    if s.model_factory is None and s.model is not None:
        from zeroshard.models import get_preset

        return float(get_preset(s.model).flops_per_token(s.seq))
    return 6.0 * psi  # a factory model: the 6N rule without the attention term


def _peak_flops(device: str) -> float | None:
    return next((v for k, v in PEAK_FLOPS.items() if k in device), None)


def _row(raw: dict[str, Any], s: BenchSettings, meta: dict[str, Any]) -> dict[str, Any]:
    spec: ConfigSpec = raw["spec"]
    world, psi = meta["world_size"], meta["psi"]
    local, ranks = _state_of(s, spec, psi, world)
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    row.update(name=spec.name, system=spec.system, stage=spec.stage,
               reshard_after_forward=spec.reshard_after_forward,
               quantize_weights=spec.quantize_weights, quantize_grads=spec.quantize_grads,
               activation_checkpointing=spec.activation_checkpointing, world_size=world,
               status=raw["status"], error=raw["error"] or None, note=raw["note"] or None,
               time_s={k: round(raw.get("time_s", {}).get(k, 0.0), 3) for k in PHASES},
               # the planner knows AdamW's recipe: no prediction for Muon's rows
               predicted_model_state_bytes=None if s.optimizer != "adamw" else predicted_state(
                   local, spec.stage, ranks, s.mixed_precision, spec.system),
               tp=spec.tp)
    if raw["status"] != "ok":
        return row
    tokens = s.global_batch * s.seq
    times = sorted(raw["step_s"])
    med = statistics.median(times)
    mem = raw["memory"]
    peak = {k: int(mem["peak_bytes"].get(k, 0)) for k in CATEGORIES}
    row.update(
        tokens_per_s=tokens / med, tokens_per_s_min=tokens / times[-1],
        tokens_per_s_max=tokens / times[0], step_s_median=med, step_s_min=times[0],
        step_s_max=times[-1], step_s_all=raw["step_s"], steps_measured=len(times),
        # from the optimizer step's start to the step's end, rank 0's (muon: its share)
        optimizer_step_s_median=(statistics.median(raw["optimizer_s"])
                                 if raw.get("optimizer_s") else None),
        # muon: one profiled step's matrix products inside optimizer steps, rank 0's
        newton_schulz_s=raw.get("newton_schulz_s"),
        peak_bytes=peak, peak_rank=mem["peak_rank"], rss_bytes=mem["rss_bytes"],
        cuda_peak_bytes=mem["cuda_peak_bytes"], loss=raw["loss"],
        measured_model_state_bytes=peak["params"] + peak["grads"] + peak["optim"],
        memory_timeline=mem.get("timeline"))
    if raw["comm"]:
        row["comm_bytes_per_step"] = int(statistics.median(raw["comm"]))
        row["comm_source"] = "zeroshard ledger (median over timed steps)"
        links = raw.get("comm_links") or []
        row["intra_wire_bytes_per_step"] = int(statistics.median(i for i, _ in links))
        row["inter_wire_bytes_per_step"] = int(statistics.median(x for _, x in links))
    elif mem.get("comm_bytes") is not None and (mem["comm_bytes"] or world == 1):
        row["comm_bytes_per_step"] = int(mem["comm_bytes"])
        row["comm_source"] = "c10d dispatch counter (measured step)"
    else:
        row["comm_source"] = "n/a: no collectives were visible to the dispatch counter"
    if (peak_flops := _peak_flops(meta["device"])) is not None and meta["backend"] == "nccl":
        row["mfu"] = _flops_per_token(s, psi) * row["tokens_per_s"] / (world * peak_flops)
    return row


def choose(rows: list[dict[str, Any]], budget: int | None) -> dict[str, Any] | None:
    """The fastest configuration whose measured peak per rank fits ``budget`` (mission, 3)."""
    if budget is None:
        return None
    ok = [r for r in rows if r["status"] == "ok"]
    fit = [r for r in ok if r["peak_bytes"]["total"] <= budget]
    for r in ok:
        r["fits_budget"] = r in fit
    mib = 2**20
    if not fit:
        small = min(ok, key=lambda r: r["peak_bytes"]["total"], default=None)
        why = "no configuration ran" if small is None else (
            f"none fits: the smallest peak is {small['name']} at "
            f"{small['peak_bytes']['total'] / mib:,.0f} MiB > {budget / mib:,.0f} MiB; add "
            "ranks (a cheaper stage may then fit), use a smaller micro-batch or a more "
            "aggressive checkpointing policy")
        return {"budget_bytes": budget, "choice": None, "reason": why}
    best = max(fit, key=lambda r: r["tokens_per_s"])
    faster = [r for r in ok if r not in fit and r["tokens_per_s"] > best["tokens_per_s"]]
    why = (f"{best['name']} fits (peak {best['peak_bytes']['total'] / mib:,.0f} MiB <= "
           f"{budget / mib:,.0f} MiB per rank) and is the fastest of the {len(fit)} "
           f"configurations that fit ({best['tokens_per_s']:,.0f} tokens/s); keep the best "
           "throughput that fits, not the most headroom")
    if faster:
        why += "; faster but over budget: " + ", ".join(
            f"{r['name']} ({r['peak_bytes']['total'] / mib:,.0f} MiB)" for r in faster)
    return {"budget_bytes": budget, "choice": best["name"], "reason": why}


def _time_split(meta: dict[str, Any], rows: list[dict[str, Any]], wall_s: float,
                started: float | None) -> dict[str, float]:
    """Where the run's wall time went: starting the ranks (processes, imports, rendezvous),
    their set-up (data, probe model), each phase summed over configurations, the rest."""
    out = {"start_ranks": (meta["entered"] - started) if started and "entered" in meta else 0.0,
           "setup": meta.get("setup_s", 0.0)}
    for k in PHASES:
        out[k] = sum(r["time_s"][k] for r in rows)
    out["other"] = wall_s - sum(out.values())
    return {k: round(v, 2) for k, v in out.items()}


def build_result(s: BenchSettings, meta: dict[str, Any], command: str,
                 wall_s: float, started: float | None = None) -> dict[str, Any]:
    """Rows with statistics, ratios vs the baseline, loss check and the budget choice.
    ``started``: the launcher's ``time.time()`` before starting the ranks."""
    rows = [_row(r, s, meta) for r in meta["rows"]]
    base = next(r for r in rows if r["name"] == s.baseline)
    notes = []
    if base["status"] != "ok":
        notes.append(f"baseline {s.baseline} {base['status']}: no ratios or loss check")
    for r in rows:
        if r["status"] != "ok" or base["status"] != "ok":
            continue
        r["tokens_per_s_ratio"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["peak_bytes_ratio"] = r["peak_bytes"]["total"] / max(base["peak_bytes"]["total"], 1)
        r["loss_rel_dev"] = abs(r["loss"] - base["loss"]) / max(abs(base["loss"]), 1e-12)
        r["loss_ok"] = r["loss_rel_dev"] <= s.tolerance
    if not meta["interleaved"]:
        notes.append("configurations ran one after another (their model states would not all "
                     "fit in memory at once), not interleaved: ratios include machine drift")
    budget = choose(rows, s.budget_bytes)
    settings = {
        "model": s.model_label or s.model_factory or s.model, "params": meta["psi"], "vocab": meta["vocab"],
        "world_size": meta["world_size"], "micro_batch": s.micro_batch, "seq": s.seq,
        "global_batch": s.global_batch, "tokens_per_step": s.global_batch * s.seq,
        "warmup": s.warmup, "steps": s.steps, "mixed_precision": s.mixed_precision,
        "lr": s.lr, "seed": s.seed, "baseline": s.baseline, "loss_tolerance": s.tolerance,
        "optimizer": s.optimizer,
        "timeout_s": s.timeout_s, "backend": meta["backend"], "device": meta["device"],
        "threads_per_rank": meta["threads_per_rank"], "interleaved": meta["interleaved"],
    }
    return {"schema": "zeroshard.bench/1", "command": command, "wall_s": wall_s,
            "time_s": _time_split(meta, rows, wall_s, started), "settings": settings, "rows": rows, "budget": budget, "notes": notes}


def write_json(result: dict[str, Any], path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=2) + "\n")
