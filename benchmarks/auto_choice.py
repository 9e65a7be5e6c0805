"""Does stage="auto" pick what measuring would pick? (docs/planning.md, 'Choosing by itself')

One ``zeroshard bench --profile`` run of every configuration stage="auto" weighs
(zeroshard, stages 0-3 x checkpointing none / selective-op / full, stage 3 also without
resharding) beside DDP, interleaved as the bench runs them. Then, at budgets spread
between the smallest and the largest measured peak, the pick stage="auto" makes from the
traced peaks and predicted times (``zeroshard.timing.auto._decide``, the function shard()
calls) is compared with the measured fastest configuration whose measured peak fits.

    python benchmarks/auto_choice.py --profile /tmp/profile.json --out benchmarks/auto-choice.txt
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CONFIGS = ["ddp"] + [f"zs-s{s}{r}{p}" for s in range(4) for r in (
    ("", "-noreshard") if s == 3 else ("",)) for p in ("", "-selective-op", "-every-2", "-full")]


def _candidate_of(name: str) -> tuple[int, str, bool]:
    parts = name.split("-")
    stage = int(parts[1][1])
    raf = "noreshard" not in parts
    rest = [p for p in parts[2:] if p != "noreshard"]
    return stage, "-".join(rest) or "none", raf


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default="/tmp/auto-choice-bench.json")
    ap.add_argument("--budgets", type=int, default=10)
    ap.add_argument("--reuse", action="store_true", help="read --json, do not run the bench")
    args = ap.parse_args()
    if not args.reuse:
        subprocess.run([sys.executable, "-m", "zeroshard.cli", "bench", "--configs",
                        ",".join(CONFIGS), "--profile", args.profile, "--json", args.json,
                        "--quiet"], check=True)
    result = json.loads(Path(args.json).read_text())
    from zeroshard.timing.auto import Candidate, Skipped, _chains, _decide, walk
    from zeroshard.timing.profile import Profile

    rows = [r for r in result["rows"] if r["status"] == "ok" and r["system"] == "zeroshard"]
    prof = Profile.load(args.profile)
    lines = [f"command: {result['command']}", "",
             f"{'configuration':<26} {'meas s':>7} {'pred s':>7} {'x pred':>6} "
             f"{'meas MiB':>9} {'traced MiB':>10}"]
    traced = {}
    from zeroshard.bench.configs import BenchSettings, parse_config
    from zeroshard.bench.predict import trace_rows

    s = BenchSettings(model=result["settings"]["model"], world_size=result["settings"]["world_size"],
                      micro_batch=result["settings"]["micro_batch"], seq=result["settings"]["seq"],
                      configs=tuple(parse_config(r["name"]) for r in rows), baseline=rows[0]["name"])
    traced = trace_rows(s)
    for r in rows:
        lines.append(f"{r['name']:<26} {r['step_s_median']:>7.3f} {r['predicted_step_s']:>7.3f} "
                     f"{r['step_s_over_predicted']:>6.2f} {r['peak_bytes']['total'] / 2**20:>9.1f} "
                     f"{traced[r['name']].device_peak_bytes / 2**20:>10.1f}")
    cands = [Candidate(*_candidate_of(r["name"])) for r in rows]
    lo = min(r["peak_bytes"]["total"] for r in rows)
    hi = max(r["peak_bytes"]["total"] for r in rows)
    lines += ["", f"{'budget MiB':>10}  {'auto pick':<26} {'measured best that fits':<26} "
              f"{'pick/best tok/s':>15}  {'fits':>4}  {'spread':>6}"]
    ok = discriminating = 0
    chains = _chains(None, None, None)
    by_cand = {c: traced[r["name"]] for r, c in zip(rows, cands)}
    traced_counts = []
    for i in range(args.budgets):
        budget = int(lo + (hi - lo) * (i + 0.5) / args.budgets)
        # what shard() traces: walk() over the measured rows' traces
        seen = walk(chains, lambda todo: [by_cand[c] for c in todo], budget)
        traced_counts.append(sum(not isinstance(v, Skipped) for v in seen.values()))
        order = [c for ch in chains for level in ch for c in level]
        pick = _decide(order, [seen[c] for c in order], prof, budget, []).chosen
        name = next(r["name"] for r, c in zip(rows, cands)
                    if (c.stage, c.checkpointing, c.reshard_after_forward)
                    == (pick.stage, pick.checkpointing, pick.reshard_after_forward))
        picked = next(r for r in rows if r["name"] == name)
        fit = [r for r in rows if r["peak_bytes"]["total"] <= budget]
        best = max(fit, key=lambda r: r["tokens_per_s"]) if fit else None
        ratio = picked["tokens_per_s"] / best["tokens_per_s"] if best else float("nan")
        fits = picked["peak_bytes"]["total"] <= budget
        spread = (max(r["tokens_per_s"] for r in fit) / min(r["tokens_per_s"] for r in fit)
                  - 1 if fit else 0.0)
        ok += fits and ratio >= 0.95
        discriminating += spread >= 0.10
        lines.append(f"{budget / 2**20:>10.1f}  {name:<26} {best['name'] if best else '-':<26} "
                     f"{ratio:>15.3f}  {'yes' if fits else 'NO':>4}  {100 * spread:>5.0f}%")
    lines += ["", f"{ok} of {args.budgets} budgets: the pick fits its measured peak and is "
              f"within 5% of the measured best; {discriminating} budgets where the fitting "
              "configurations' tokens/s differ by >= 10%; traces shard() would run per "
              f"budget: {', '.join(map(str, traced_counts))} (of {len(rows)})"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
