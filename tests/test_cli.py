"""The ``zeroshard`` command line: plan output, JSON schema, and user errors (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zeroshard import __version__
from zeroshard.cli import main, parse_bytes, parse_gpus, parse_params

BASE = ["plan", "--model", "llama-7b", "--gpus", "8", "--gpu-mem", "80GB", "--seq", "4096",
        "--micro-batch", "1"]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert __version__ in capsys.readouterr().out


def test_plan_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(BASE) == 0
    out = capsys.readouterr().out
    for needle in ("total GB", "total GiB", "fits", "comm GB", "tokens/s", "16 B",
                   "12 B", "Recommendation (8 devices)"):
        assert needle in out
    assert out.count("\n   8 ") == 12  # 4 stages x 3 policies


def test_plan_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BASE, "--json", "--interconnect", "ib", "--policies", "none,full"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"rows", "recommendation"}
    assert len(data["rows"]) == 8
    keys = {"stage", "activation_checkpointing", "model_state_bytes", "activation_bytes",
            "buffer_bytes", "total_bytes", "fits", "comm_bytes_per_step", "comm_time_s",
            "step_time_s", "tokens_per_s"}
    assert all(keys <= set(row) for row in data["rows"])
    assert {"stage", "activation_checkpointing", "reason"} <= set(data["recommendation"])


def test_params_and_gpu_ranges(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--params", "13B", "--gpus", "8,16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert sorted({r["gpus"] for r in data["rows"]}) == [8, 16]
    assert parse_gpus("8-64") == [8, 16, 32, 64]
    assert parse_gpus("8-48") == [8, 16, 32, 48]
    assert parse_gpus("16,8") == [8, 16]
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000
    assert parse_params("350M") == 350_000_000 and parse_params("7e9") == 7 * 10**9


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["plan", "--model", "llama-7b", "--gpus", "0"], ["'0'", "--gpus 8"]),
        (["plan", "--params", "7X"], ["'7X'", "13B"]),
        (["plan", "--model", "llama-7b", "--gpu-mem", "80"], ["'80'", "no unit", "80GB"]),
        (["plan", "--model", "gpt5"], ["'gpt5'", "llama-7b", "gpt2-124m"]),
        (["plan", "--model", "llama-7b", "--seq", "8192"], ["8192", "4096"]),
        (["plan", "--model", "llama-7b", "--interconnect", "carrier-pigeon"],
         ["'carrier-pigeon'", "nvlink"]),
    ],
)
def test_bad_inputs_exit_2_naming_the_value(
    args: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err


def test_console_error_and_lazy_imports() -> None:
    """A real process: exit code 2, one message, no traceback; --version stays light."""
    bad = subprocess.run([sys.executable, "-m", "zeroshard.cli", "plan", "--model", "llama-7b",
                          "--gpu-mem", "80"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "'80'" in bad.stderr
    code = ("import sys; from zeroshard.cli import main; rc = main(['--version']); "
            "print(rc, 'zeroshard.memory.planner' in sys.modules)")
    ver = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert ver.stdout.split()[-2:] == ["0", "False"]
