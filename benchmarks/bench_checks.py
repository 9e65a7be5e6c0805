"""Two checks of ``zeroshard bench`` itself (not asserted in tests: they take minutes).

``order``: run the same configurations in two orders and compare each row's ``rss``
(it must be the configuration's own, not depend on what ran before) and its exact
columns (tracked peak, collective bytes).

    python benchmarks/bench_checks.py order [--model gpt2-124m] [--configs a,b,c] [--steps 1]

``spread``: the spread, over several JSON results of the same command, of each row's
median step time, its ratio to the baseline, and whether the exact columns agree.
With ``--first K`` it also recomputes each median from the first K timed steps only
(what ``--steps K`` would have given, interleaved the same way).

    python benchmarks/bench_checks.py spread run1.json run2.json run3.json [--first 4] [--paired]

``--paired`` takes each ratio as the median over timed rounds of the baseline's step time
over the row's in the same round (drift between rounds cancels), instead of the ratio of
the two medians that ``zeroshard bench`` reports; on a quiet machine the two agree (the
noise is within a round, not between rounds).

Recorded output: benchmarks/bench-checks.txt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 2**20


def _rows(path: str | Path) -> dict[str, dict]:
    return {r["name"]: r for r in json.loads(Path(path).read_text())["rows"] if r["status"] == "ok"}


def order(args: argparse.Namespace) -> None:
    names = args.configs.split(",")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for tag, seq in (("forward", names), ("reversed", names[::-1])):
            out = Path(tmp) / f"{tag}.json"
            cmd = ["zeroshard", "bench", "--quiet", "--model", args.model, "--warmup", "1",
                   "--steps", str(args.steps), "--configs", ",".join(seq), "--json", str(out)]
            print("$", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            runs.append(_rows(out))
    a, b = runs
    print(f"{'config':<20} {'rss fwd':>8} {'rss rev':>8} {'diff':>6}  {'peak fwd':>8} {'peak rev':>8}"
          f"  comm equal")
    for n in names:
        if n in a and n in b:
            x, y = a[n]["rss_bytes"] / MIB, b[n]["rss_bytes"] / MIB
            print(f"{n:<20} {x:>8,.0f} {y:>8,.0f} {y - x:>+6,.0f}  "
                  f"{a[n]['peak_bytes']['total'] / MIB:>8,.1f} {b[n]['peak_bytes']['total'] / MIB:>8,.1f}"
                  f"  {a[n]['comm_bytes_per_step'] == b[n]['comm_bytes_per_step']}")


def _median(row: dict, first: int | None) -> float:
    times = row["step_s_all"][:first] if first else row["step_s_all"]
    return statistics.median(times)


def _ratio(run: dict, name: str, base: str, first: int | None, paired: bool) -> float:
    """The row's ratio to the baseline: of medians, or (paired) the median over timed
    rounds of the baseline's step over the row's step in the same round."""
    if not paired:
        return _median(run[base], first) / _median(run[name], first)
    b, x = run[base]["step_s_all"][:first], run[name]["step_s_all"][:first]
    return statistics.median(bi / xi for bi, xi in zip(b, x, strict=True))


def spread(args: argparse.Namespace) -> None:
    runs = [_rows(p) for p in args.json]
    base = json.loads(Path(args.json[0]).read_text())["settings"]["baseline"]
    names = [n for n in runs[0] if all(n in r for r in runs)]
    for first in [None] + ([args.first] if args.first else []):
        label = "all timed steps" if first is None else f"first {first} timed steps"
        if args.paired:
            label += "; ratios paired by round"
        print(f"-- {len(runs)} runs, medians over {label}")
        print(f"{'config':<20} {'step s: mean':>12} {'cv':>6}   {'x' + base + ': mean':>12} "
              f"{'range':>13} {'cv':>6}   exact columns equal")
        cvs = []
        for n in names:
            med = [_median(r[n], first) for r in runs]
            ratio = [_ratio(r, n, base, first, args.paired) for r in runs]
            exact = all(r[n]["peak_bytes"] == runs[0][n]["peak_bytes"]
                        and r[n]["comm_bytes_per_step"] == runs[0][n]["comm_bytes_per_step"]
                        for r in runs)
            cv_s = statistics.pstdev(med) / statistics.mean(med)
            cv_r = statistics.pstdev(ratio) / statistics.mean(ratio)
            if n != base:
                cvs.append(cv_r)
            print(f"{n:<20} {statistics.mean(med):>12.2f} {cv_s:>6.1%}   "
                  f"{statistics.mean(ratio):>12.2f} {min(ratio):>6.2f}-{max(ratio):<6.2f} "
                  f"{cv_r:>6.1%}   {exact}")
        print(f"mean cv of the ratios: {statistics.mean(cvs):.1%}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("order")
    o.add_argument("--model", default="gpt2-small")
    o.add_argument("--configs", default="ddp,zero-redundancy,fsdp2,fsdp2-noreshard,zs-s0,"
                   "zs-s1,zs-s2,zs-s2-full,zs-s3,zs-s3-full,zs-s3-selective-op")
    o.add_argument("--steps", type=int, default=1)
    s = sub.add_parser("spread")
    s.add_argument("json", nargs="+")
    s.add_argument("--first", type=int, default=None)
    s.add_argument("--paired", action="store_true",
                   help="ratio = median over rounds of the per-round ratio (not of medians)")
    args = p.parse_args(argv)
    (order if args.cmd == "order" else spread)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
