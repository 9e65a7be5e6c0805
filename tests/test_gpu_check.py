"""benchmarks/gpu_check.py --dry-run: every part of the GPU check runs on CPU (issue #19).

The real run needs a GPU (docs/gpu-check.md); this keeps the script working between the
rare sessions that have one: each part runs in its own subprocess, on CPU with gloo and
tiny models, and must pass, and the report must name every part.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run_passes_every_part(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                           "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["part"] for r in results] == ["parity", "shared", "offload", "memory", "speed"]
    assert all(r["ok"] for r in results), results
    text = (tmp_path / "results.txt").read_text()
    for part in ("parity", "shared", "offload", "memory", "speed"):
        assert f"== {part}: PASS" in text, text
    by = {r["part"]: r for r in results}
    assert len(by["parity"]["rows"]) == 11
    assert all(r["bitwise_equal"] for r in by["offload"]["rows"])
    assert {r["config"] for r in by["speed"]["rows"]} == {
        "zeroshard s3 selective", "fsdp2 selective", "zeroshard s3 selective compiled",
        "fsdp2 selective compiled"}
    print(f"gpu_check --dry-run: {wall:.0f} s")
