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


def test_plan_muon_owner_balance(capsys: pytest.CaptureFixture[str]) -> None:
    """--muon: per sharding-group size, work and byte balance of Muon's owners (the work
    decides; both shown), the busiest rank's share of the orthogonalisation."""
    assert main(["plan", "--model", "llama-1b", "--gpus", "2,4", "--muon"]) == 0
    out = capsys.readouterr().out
    assert "balanced by Newton-Schulz work" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("      ")]
    assert [r[0] for r in rows] == ["2", "4"]
    for r in rows:
        ranks, work, share = int(r[0]), float(r[2].rstrip("x")), float(r[4].rstrip("%"))
        assert 1.0 <= work <= 1.05 and abs(share - 100 * work / ranks) < 0.1, r
    assert main(["plan", "--model", "llama-1b", "--gpus", "4", "--muon", "--json"]) == 0
    owners = json.loads(capsys.readouterr().out)["muon_owners"]
    # the recipe's matrices: 16 blocks x 7 (the embedding and the head go to AdamW)
    assert owners[0]["ranks"] == 4 and owners[0]["matrices"] == 16 * 7


def test_plan_muon_traced_rows(capsys: pytest.CaptureFixture[str]) -> None:
    """--muon --traced: every row without checkpointing traced again with Muon + AdamW
    (the owners' step in the peak: tests/test_traced.py checks such traces against measured
    peaks), beside the AdamW trace of the same row; Muon keeps one moment where AdamW
    keeps two, so at stage 0 (every rank steps every matrix) its peak is the lower."""
    argv = ["plan", "--model", "gpt2-tiny", "--gpus", "2", "--policies", "none", "--muon",
            "--traced"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    traced, state = out["muon_traced"], out["muon_state"]
    assert [(t["gpus"], t["stage"]) for t in traced] == [(2, s) for s in range(4)]
    # The priced state ([Note: Muon's model state, priced]) is the traced one: masters
    # and AdamW's moments sharded, Muon's momentum whole on its owner (a few step counters
    # apart), and below AdamW's.
    assert [(m["gpus"], m["stage"]) for m in state] == [(2, s) for s in range(4)]
    for t, m in zip(traced, state):
        assert abs(m["optim_bytes"] - t["optim_bytes"]) <= 256, (m, t)
        assert m["optim_bytes"] < m["adamw_optim_bytes"], m
    for t in traced:
        assert t["peak_bytes"] > t["optim_bytes"] > 0 and t["adamw_peak_bytes"] > 0, t
    assert traced[0]["peak_bytes"] < traced[0]["adamw_peak_bytes"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Traced with Muon over the hidden matrices + AdamW" in out
    assert "Model state with Muon over the hidden matrices + AdamW" in out
    assert sum(1 for line in out.splitlines() if line.startswith("     2     ")) == 8


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


def test_plan_hybrid_on_4_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "llama-7b", "--gpus", "32", "--gpus-per-node", "8", "--seq",
            "4096", "--intra", "nvlink", "--inter", "50"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for needle in ("hybrid", "xnode GB", "xnode s", "50 GB/s between nodes",
                   "Recommendation (32 devices): hybrid sharding 4 x 8", "stage 3 on 32 devices"):
        assert needle in out
    # 4 stages x 3 policies, + hybrid stages 1-3, + stage 3 hpz8 and z++8 (3 policies each)
    assert out.count("\n  32 ") == 12 + 9 + 6
    assert "hpz8" in out and "z++8" in out
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    hyb = [r for r in data["rows"] if r["hybrid"]]
    assert len(hyb) == 9 and {r["hybrid"] for r in hyb} == {"4 x 8"}
    assert all(r["cross_node_bytes_per_step"] == hyb[0]["cross_node_bytes_per_step"] for r in hyb)
    assert data["recommendation"]["hybrid"] == "4 x 8"
    # --inter defaults to InfiniBand (45 GB/s) on several nodes.
    assert main([*args[:-2], "--json"]) == 0
    ib = json.loads(capsys.readouterr().out)["rows"][0]
    assert ib["cross_node_time_s"] == pytest.approx(ib["comm_bytes_per_step"] * 31 / 32 / 45e9)


def test_plan_offload(capsys: pytest.CaptureFixture[str]) -> None:
    args = [*BASE, "--offload", "--host-mem", "512GB", "--pcie", "32"]
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    psi = 6_738_415_616
    for r in rows:
        assert r["offload"] == (r["stage"] > 0)
        assert r["host_bytes"] == (20 * psi // 8 if r["stage"] else 0)
        if r["stage"]:
            assert r["offload_time_s"] == pytest.approx(4 * psi / 8 / 32e9 + 12 * psi / 8 / 20e9)
    assert main(args) == 0
    out = capsys.readouterr().out
    for needle in ("host GB", "offl s", "PCIe 32 GB/s", "134.8 GB per node of 512.0 GB",
                   "optimizer offloaded to the host"):
        assert needle in out
    assert main([*BASE, "--offload", "optimizer+params"]) == 0
    assert "weight slices too (stage 3)" in capsys.readouterr().out
    assert main([*BASE, "--offload", "optimizer+params", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert all(r["offload_params"] == (r["stage"] == 3) for r in rows)
    assert all(r["params_bytes"] == 0 for r in rows if r["stage"] == 3)


def test_params_and_gpu_ranges(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--params", "13B", "--gpus", "8,16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert sorted({r["gpus"] for r in data["rows"]}) == [8, 16]
    assert parse_gpus("8-64") == [8, 16, 32, 64]
    assert parse_gpus("8-48") == [8, 16, 32, 48]
    assert parse_gpus("16,8") == [8, 16]
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000
    assert parse_params("350M") == 350_000_000 and parse_params("7e9") == 7 * 10**9


def test_plan_that_no_device_count_fits_says_tensor_parallel(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue: 1T on 8-1024 x 80 GB printed "Recommendation: more devices" beside "more
    devices will not help", and "Lower the micro-batch" at micro-batch 1."""
    big = ["plan", "--params", "1T", "--gpu-mem", "80GB"]
    assert main([*big, "--gpus", "8-1024", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)["recommendation"]
    assert rec["action"] == "tensor-parallel"
    assert {r["action"] for r in rec["by_gpus"]} == {"tensor-parallel"}
    assert main([*big, "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "Recommendation (8 devices): tensor parallel" in out
    assert "micro-batch" not in out.split("Recommendation (8 devices)")[1]


def test_plan_more_devices_figures_are_the_table_row_there(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue: "fits on 20+ ... gathered units 9.7 GB ... leave 55.0 GB" for 70B on 8 x 80 GB:
    those give 21, and the table's buf at N=20 is 14.2 GB. Every figure of the reason is
    now a column of the row a plan at 20 prints (or their sum), and 19 does not fit."""
    assert main(["plan", "--params", "70B", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    why = " ".join(out.split("Recommendation (8 devices): more devices")[1].split())
    assert "fits on 20+ devices" in why
    assert main(["plan", "--params", "70B", "--gpus", "19,20"]) == 0
    table = capsys.readouterr().out.splitlines()
    row = {n: next(ln.split() for ln in table if ln.split()[:3] == [str(n), "3", "full"])
           for n in (19, 20)}
    state, act, buf, total, fits = (row[20][i] for i in (3, 4, 5, 6, 8))
    assert fits == "yes" and row[19][8] == "no"
    assert (f"model state {state} GB (16Ψ/N) + the gradient slices' fp32 copies (4Ψ/N) "
            f"{buf} GB = {total} GB (the state, buf and total columns") in why
    assert f"on 19 devices, {row[19][6]} GB." in why
    assert f"{act} GB" not in why  # freed by the optimizer step, the moment of the peak


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
        (["plan", "--model", "llama-7b", "--gpus", "12", "--gpus-per-node", "8"],
         ["--gpus 12", "--gpus-per-node 8", "--gpus 8 or 16"]),
        (["plan", "--model", "llama-7b", "--gpus", "32", "--inter", "ib"],
         ["--inter 45", "--gpus-per-node"]),
        (["plan", "--model", "llama-7b", "--host-mem", "512GB"], ["--host-mem", "--offload"]),
        (["plan", "--model", "llama-7b", "--offload", "--pcie", "fast"], ["'fast'", "GB/s"]),
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


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        # argparse reads "-5B" as an option ("expected one argument"); the value reaches
        # its own check, written either way.
        (["--params", "-5B"], ["'-5B' is negative", "at least 1, e.g. 5B"]),
        (["--params=-5B"], ["'-5B' is negative", "e.g. 5B"]),
        (["--params", "-1e9"], ["'-1e9' is negative"]),
        (["--params", "abc"], ["'abc' is not a parameter count", "13B"]),
        (["--params", "0"], ["'0' is not a parameter count of at least 1", "13B"]),
        (["--params", "0.1"], ["'0.1'", "at least 1"]),  # was a traceback (0 parameters)
        (["--params", "1e400"], ["'1e400'", "at least 1"]),  # was an OverflowError
        (["--model", "llama-7b", "--gpu-mem", "-3GB"], ["'-3GB' is negative", "80GB"]),
        (["--model", "llama-7b", "--gpu-mem=-3GB"], ["'-3GB' is negative", "80GB"]),
        (["--model", "llama-7b", "--gpu-mem", "0GB"], ["'0GB' is 0 bytes", "80GB"]),
        (["--model", "llama-7b", "--offload", "--host-mem", "-1TB"], ["--host-mem", "'-1TB'"]),
        (["--model", "llama-7b", "--seq", "-5k"], ["--seq", "'-5k'", "positive integer"]),
        (["--model", "llama-7b", "--micro-batch", "-1"], ["'-1'", "positive integer"]),
        (["--model", "llama-7b", "--gpus", "-8"], ["'-8'", "--gpus 8"]),
        (["--model", "llama-7b", "--peak-tflops", "-5"], ["'-5'", "989"]),
        (["--model", "llama-7b", "--peak-tflops", "0"], ["'0'", "989"]),  # was ZeroDivisionError
    ],
)
def test_negative_and_malformed_sizes_exit_2_naming_the_value(
    args: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "expected one argument" not in err
    for needle in needles:
        assert needle in err


def test_negative_values_reach_train_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--lr", "-1e-3"]) == 2  # "-1e-3" too looks like an option
    err = capsys.readouterr().err
    assert "lr=-0.001" in err and "expected one argument" not in err
    # A value that is an option name is left alone: argparse's own error.
    assert main(["plan", "--params", "--json"]) == 2
    assert "expected one argument" in capsys.readouterr().err


def test_console_error_and_lazy_imports() -> None:
    """A real process: exit code 2, one message, no traceback; --version stays light."""
    bad = subprocess.run([sys.executable, "-m", "zeroshard.cli", "plan", "--model", "llama-7b",
                          "--gpu-mem", "80"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "'80'" in bad.stderr
    code = ("import sys; from zeroshard.cli import main; rc = main(['--version']); "
            "print(rc, 'zeroshard.memory.planner' in sys.modules)")
    ver = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert ver.stdout.split()[-2:] == ["0", "False"]
    # `import zeroshard` loads neither torch.compile's machinery (~3 s a process) nor
    # DTensor and checkpointing (loaded on first use) nor any optional integration.
    heavy = ["torch._dynamo", "torch.distributed.tensor", "torch.distributed.checkpoint",
             "transformers", "peft", "trl", "lightning", "datasets", "matplotlib"]
    code = (f"import sys, zeroshard; print([m for m in {heavy!r} if m in sys.modules]); "
            "from zeroshard import save_checkpoint, CheckpointError; print(save_checkpoint.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == ["[]", "zeroshard.state.save"], out.stdout + out.stderr


def test_plan_traced_hybrid_and_offload_rows(capsys: pytest.CaptureFixture[str]) -> None:
    """--traced traces a hybrid row as plain sharding over G (the same memory per rank)
    and an offloaded row with device and host memory apart."""
    base = ["plan", "--model", "gpt2-tiny", "--gpus", "4", "--gpus-per-node", "2", "--seq", "64",
            "--policies", "none", "--traced", "--json"]
    assert main(base) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    hyb = [r for r in rows if r["hybrid"]]
    assert len(hyb) == 3
    for r in rows:
        if r["secondary"]:  # hpz / z++ rows are priced, not traced (the plan's notes say)
            assert r["traced_model_state_bytes"] is None
            continue
        assert abs(r["traced_model_state_bytes"] / r["model_state_bytes"] - 1) < 1e-3, r
    assert main([*base, "--offload", "optimizer+params"]) == 0
    data = json.loads(capsys.readouterr().out)
    for r in data["rows"]:  # offloaded rows are traced with the copy path forced
        if r["secondary"]:
            continue
        if r["offload_params"]:  # stage 3: nothing on the device between steps
            assert r["model_state_bytes"] == r["traced_model_state_bytes"] == 0, r
        else:
            assert abs(r["traced_model_state_bytes"] / r["model_state_bytes"] - 1) < 1e-3, r
        if r["offload"]:  # the host's share: state, gradient slice + fp32 cast, weights
            assert abs(r["traced_host_bytes"] / r["host_bytes"] - 1) < 1e-3, r
        else:
            assert r["traced_host_bytes"] is None


def test_plan_tp_columns_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BASE, "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "tp GB" in out and "tp = 2: each device holds" in out
    assert out.count("\n   8 ") == 9  # stages 1-3 x 3 policies: no stage 0 under tp
    assert main([*BASE, "--tp", "2", "--traced"]) == 2
    assert "--traced with --tp" in capsys.readouterr().err
    assert main([*BASE, "--tp", "3"]) == 2
    assert "does not divide" in capsys.readouterr().err
