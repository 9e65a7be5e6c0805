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

import pytest

ROOT = Path(__file__).resolve().parent.parent


ALL_PARTS = ["parity", "shared", "offload", "memory", "speed"]


# Two runs of the driver over disjoint parts (each run stays under the suite's per-test
# budget; every part still runs once, through the same driver and report).
@pytest.mark.parametrize("parts", [ALL_PARTS[:3], ALL_PARTS[3:]], ids=["first", "last"])
def test_gpu_check_dry_run_passes_every_part(tmp_path: Path, parts: list[str]) -> None:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                           "--dry-run", "--parts", ",".join(parts), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["part"] for r in results] == parts
    assert all(r["ok"] for r in results), results
    text = (tmp_path / "results.txt").read_text()
    for part in parts:
        assert f"== {part}: PASS" in text, text
    by = {r["part"]: r for r in results}
    if "parity" in by:
        assert len(by["parity"]["rows"]) == 13  # + Muon + AdamW at stages 0 and 3
    if "offload" in by:
        checked = [r for r in by["offload"]["rows"] if not r["offload"].startswith("diag")]
        assert len(checked) == 3 and all(r["bitwise_equal"] for r in checked)
    if "speed" in by:
        assert {r["config"] for r in by["speed"]["rows"]} == {
            "zeroshard s3 selective", "fsdp2 selective", "zeroshard s3 selective compiled",
            "fsdp2 selective compiled"}
    print(f"gpu_check --dry-run --parts {','.join(parts)}: {wall:.0f} s")


def test_every_part_is_checked() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert list(gpu_check.PARTS) == ALL_PARTS


def test_gpu_profile_dry_run_profiles_both_systems(tmp_path: Path) -> None:
    """benchmarks/gpu_profile.py (the speed part under torch.profiler) keeps working."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_profile.py"),
                           "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = (tmp_path / "profile.txt").read_text()
    assert "## zeroshard:" in text and "## fsdp2:" in text, text[:2000]
    assert (tmp_path / "trace-zeroshard.json.gz").stat().st_size > 0
    assert (tmp_path / "trace-fsdp2.json.gz").stat().st_size > 0
