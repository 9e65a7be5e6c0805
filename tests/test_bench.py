"""``zeroshard bench``: one fast two-rank run checked from several sides, plus argument checks.

The run (gpt2-tiny, 2 timed steps, world 2) covers torch DDP (the baseline), zeroshard
stage 3 with full checkpointing, a DeepSpeed configuration (not installed here: skipped)
and the test-only ``fail`` configuration, which raises on rank 1 while rank 0 waits in a
collective: rank 0 must give up after ``--timeout`` and the others must still complete.
Timing is never asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any

import pytest

from zeroshard.bench import add_arguments, run
from zeroshard.bench.configs import parse_bytes, parse_config
from zeroshard.bench.report import CATEGORIES, ROW_KEYS, choose
from zeroshard.models import build_model, param_count

CONFIGS = "ddp,zs-s3-full,ds-z1,fail"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    code = run(_args("--model", "gpt2-tiny", "--seq", "32", "--micro-batch", "2",
                     "--world-size", "2", "--warmup", "1", "--steps", "2", "--configs", CONFIGS,
                     "--timeout", "8", "--budget", "64MiB", "--quiet",
                     "--json", str(out / "r.json"), "--plot", str(out / "r.png")))
    assert code == 0
    return {"json": json.loads((out / "r.json").read_text()), "png": out / "r.png", "dir": out}


def _rows(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in result["rows"]}


def test_json_has_every_key_with_its_type(fast_run: dict[str, Any]) -> None:
    result = fast_run["json"]
    assert result["schema"] == "zeroshard.bench/1"
    assert result["settings"]["world_size"] == 2 and result["settings"]["interleaved"] is True
    assert [r["name"] for r in result["rows"]] == CONFIGS.split(",")
    for r in result["rows"]:
        assert set(ROW_KEYS) <= set(r), set(ROW_KEYS) - set(r)
        assert r["system"] in ("zeroshard", "ddp", "ddp_zero_redundancy", "fsdp2", "deepspeed")
        assert r["status"] in ("ok", "failed", "skipped")
        assert isinstance(r["stage"], int) and r["world_size"] == 2
        assert r["activation_checkpointing"] in ("none", "full", "selective", "sqrt")
        assert r["reshard_after_forward"] in (True, False, None)
        assert set(r["predicted_model_state_bytes"]) == {"params", "grads", "optim", "total"}
        if r["status"] != "ok":
            assert isinstance(r["error"], str) and r["error"]
            assert r["tokens_per_s"] is None and r["peak_bytes"] is None
            continue
        assert r["error"] is None
        for key in ("tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "step_s_median",
                    "step_s_min", "step_s_max", "loss", "loss_rel_dev", "tokens_per_s_ratio"):
            assert isinstance(r[key], float) and r[key] >= 0, key
        assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
        assert r["step_s_min"] <= r["step_s_median"] <= r["step_s_max"]
        assert r["steps_measured"] == 2 and len(r["step_s_all"]) == 2
        assert set(r["peak_bytes"]) == set(CATEGORIES)
        assert all(isinstance(v, int) and v >= 0 for v in r["peak_bytes"].values())
        assert r["peak_bytes"]["total"] == sum(r["peak_bytes"][c] for c in CATEGORIES[:-1])
        assert isinstance(r["rss_bytes"], int) and r["rss_bytes"] > r["peak_bytes"]["total"]
        assert isinstance(r["comm_bytes_per_step"], int) and isinstance(r["comm_source"], str)
        assert r["mfu"] is None  # CPU: no MFU
        assert isinstance(r["fits_budget"], bool)


def test_rows_measure_what_the_formulas_say(fast_run: dict[str, Any]) -> None:
    rows = _rows(fast_run["json"])
    psi = param_count(build_model("gpt2-tiny", device="meta"))
    ddp, zs3 = rows["ddp"], rows["zs-s3-full"]
    assert (ddp["system"], ddp["stage"]) == ("ddp", 0)
    assert (zs3["system"], zs3["stage"], zs3["reshard_after_forward"]) == ("zeroshard", 3, True)
    # fp32 all-reduce of the gradients: logical 2 x 4 bytes x Psi (+ DDP's small syncs)
    assert ddp["comm_bytes_per_step"] == pytest.approx(8 * psi, rel=0.01)
    # stage 3: gather in forward and backward + reduce-scatter: 3 x 4 bytes x Psi, less one
    # gather of the root unit (embeddings, final norm), which stays gathered until backward
    assert 10 * psi < zs3["comm_bytes_per_step"] <= 12 * psi * 1.01
    # one node (no --node-size, no torchrun): every byte on the wire stays inside it
    assert zs3["inter_wire_bytes_per_step"] == 0 < zs3["intra_wire_bytes_per_step"]
    assert ddp["inter_wire_bytes_per_step"] is None  # no ledger
    assert ddp["predicted_model_state_bytes"]["total"] == 16 * psi
    # Adam's moments are sharded: half of DDP's per rank (2 blocks + prefetch mean every
    # weight is gathered at some moment in this tiny model, so params are not compared)
    assert zs3["peak_bytes"]["optim"] == pytest.approx(ddp["peak_bytes"]["optim"] / 2, rel=0.02)
    # same data, same init: the losses agree
    assert ddp["loss_rel_dev"] == 0.0 and ddp["tokens_per_s_ratio"] == 1.0
    assert zs3["loss_ok"] is True and zs3["loss_rel_dev"] < 0.02


def test_failing_configuration_is_reported_and_the_rest_complete(
        fast_run: dict[str, Any]) -> None:
    rows = _rows(fast_run["json"])
    fail = rows["fail"]
    assert fail["status"] == "failed"
    assert fail["error"].startswith("warmup step 0: rank 1: RuntimeError: deliberate failure")
    assert rows["ddp"]["status"] == "ok" and rows["zs-s3-full"]["status"] == "ok"


def test_a_rows_loss_does_not_depend_on_the_other_rows(fast_run: dict[str, Any],
                                                        tmp_path) -> None:  # noqa: ANN001
    """The test-only ``patch-linear`` row replaces ``torch.nn.functional.linear`` in its
    build, as DeepSpeed's ZeRO-3 does (its linear is also 2^-8 off torch's). Built first
    here, it used to reach every row stepping after it; now each row steps with the torch
    its build saw: DDP's and zeroshard's losses are those of ``fast_run`` (the same
    settings, no such row), bit for bit, and the row says what it replaces."""
    code = run(_args("--model", "gpt2-tiny", "--seq", "32", "--micro-batch", "2",
                     "--world-size", "2", "--warmup", "1", "--steps", "2", "--configs",
                     "patch-linear,ddp,zs-s3-full", "--quiet",
                     "--json", str(tmp_path / "r.json")))
    assert code == 0
    rows, alone = _rows(json.loads((tmp_path / "r.json").read_text())), _rows(fast_run["json"])
    for name in ("ddp", "zs-s3-full"):
        assert rows[name]["loss"] == alone[name]["loss"], name
    assert rows["patch-linear"]["loss"] != alone["ddp"]["loss"]
    assert "replaces torch.nn.functional.linear" in rows["patch-linear"]["note"]


def test_deepspeed_absent_is_skipped_with_a_note(fast_run: dict[str, Any]) -> None:
    try:
        import deepspeed  # noqa: F401
        pytest.skip("deepspeed is installed here")
    except ImportError:
        pass
    ds = _rows(fast_run["json"])["ds-z1"]
    assert ds["status"] == "skipped" and ds["system"] == "deepspeed" and ds["stage"] == 1
    assert "zeroshard[compare]" in ds["error"]


def test_budget_picks_the_fastest_that_fits(fast_run: dict[str, Any]) -> None:
    budget = fast_run["json"]["budget"]
    ok = [r for r in fast_run["json"]["rows"] if r["status"] == "ok"]
    assert budget["budget_bytes"] == 64 * 2**20
    assert budget["choice"] == max(ok, key=lambda r: r["tokens_per_s"])["name"]
    assert "fastest" in budget["reason"]
    rows = [{"name": n, "status": "ok", "tokens_per_s": t, "peak_bytes": {"total": p}}
            for n, t, p in (("a", 100.0, 900), ("b", 80.0, 500), ("c", 60.0, 300))]
    got = choose(rows, 600)
    assert got is not None and got["choice"] == "b" and "a (" in got["reason"]
    assert [r["fits_budget"] for r in rows] == [False, True, True]
    none = choose(rows, 100)
    assert none is not None and none["choice"] is None and "c at" in none["reason"]


def test_plot_has_both_panels(fast_run: dict[str, Any]) -> None:
    from zeroshard.bench.render import plot

    assert fast_run["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    titles = plot(fast_run["json"], fast_run["dir"] / "again.png")
    assert titles == ["Peak memory by category", "Throughput against peak memory"]


def test_memory_timeline_shows_each_phase_and_the_peak(fast_run: dict[str, Any]) -> None:
    """--plot also draws bytes by category over the measured step (r-timeline.png); the
    JSON carries the series: phases marked in order, and its highest point is the peak."""
    from zeroshard.bench.render import plot_timeline, timeline_path

    assert timeline_path(fast_run["png"]) == fast_run["dir"] / "r-timeline.png"
    ok = [r for r in fast_run["json"]["rows"] if r["status"] == "ok"]
    for r in ok:
        tl = r["memory_timeline"]
        assert [label for _, label in tl["marks"]] == ["forward", "backward", "step"], r["name"]
        ops = [op for op, _ in tl["marks"]]
        assert ops == sorted(ops) and len(tl["op"]) <= 600
        totals = [sum(tl[c][i] for c in CATEGORIES if c != "total")
                  for i in range(len(tl["op"]))]
        assert max(totals) == r["peak_bytes"]["total"], r["name"]
    if importlib.util.find_spec("matplotlib") is None:
        return
    assert timeline_path(fast_run["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    titles = plot_timeline(fast_run["json"], fast_run["dir"] / "t.png")
    assert titles == [f"{r['name']}: peak {r['peak_bytes']['total'] / 2**20:,.0f} MiB"
                      for r in ok]


def test_table_is_printed(fast_run: dict[str, Any]) -> None:
    from zeroshard.bench.render import format_table

    text = format_table(fast_run["json"])
    assert "zs-s3-full" in text and "FAILED" in text and "SKIPPED" in text and "xddp" in text


@pytest.mark.parametrize(("argv", "words"), [
    (["--budget", "1.5"], ["'1.5'", "no unit", "1.5GiB"]),
    (["--budget", "1.5 parsecs"], ["'1.5 parsecs'", "unknown unit"]),
    (["--configs", "ddp,zs-s9"], ["'zs-s9'", "--list-configs"]),
    (["--configs", "zs-s1-noreshard"], ["-noreshard", "stage 3"]),
    (["--configs", "zs-s3-partial"], ["'partial'", "full"]),
    (["--world-size", "0"], ["--world-size 0", ">= 1"]),
    (["--world-size", "4", "--node-size", "3"], ["--node-size 3", "--world-size 4"]),
    (["--world-size", "4", "--configs", "ddp,zs-s3-hpz3"], ["-hpz3 needs k dividing"]),
    (["--world-size", "4", "--compress"], ["--compress needs --node-size G"]),
    (["--world-size", "4", "--node-size", "2", "--compress", "--configs", "ddp"],
     ["drop --configs"]),
    (["--model", "gpt-17"], ["'gpt-17'", "gpt2-small"]),
    (["--model", "gpt2-tiny", "--seq", "500"], ["--seq 500", "64"]),
    (["--baseline", "fsdp2", "--configs", "ddp"], ["--baseline 'fsdp2'", "--configs"]),
    (["--model-factory", "no_such_module_x:make"], ["no_such_module_x", "module:function"]),
    (["--optimizer", "muon", "--configs", "ddp,fsdp2"], ["--optimizer muon runs", "drop fsdp2"]),
    (["--configs", "ddp,naive-muon"], ["naive-muon", "add --optimizer muon"]),
])
def test_bad_arguments_exit_2_naming_value_and_fix(
        argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_args(*argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("zeroshard bench: error: ")
    for w in words:
        assert w in err, (w, err)


def test_plot_without_matplotlib_is_a_clear_error(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert run(_args("--plot", "x.png")) == 2
    assert "matplotlib" in capsys.readouterr().err


def test_module_entry_point_rejects_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    from zeroshard.bench.__main__ import main

    assert main(["--world-size", "two"]) == 2  # argparse's own check
    assert "'two'" in capsys.readouterr().err
    assert main(["--list-configs"]) == 0
    assert "zs-s3-full" in capsys.readouterr().out


def test_config_names_and_sizes() -> None:
    spec = parse_config("fsdp2-noreshard-selective")
    assert (spec.system, spec.stage, spec.reshard_after_forward) == ("fsdp2", 2, False)
    assert spec.activation_checkpointing == "selective"
    assert parse_config("zero-redundancy").system == "ddp_zero_redundancy"
    assert parse_config("zs-s2-every-2").activation_checkpointing == "every-2"
    assert parse_config("ds-z3").stage == 3
    assert parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes("2GB") == 2 * 10**9
    tp = parse_config("zs-s3-noreshard-tp2-full")
    assert (tp.tp, tp.reshard_after_forward, tp.activation_checkpointing) == (2, False, "full")
    assert parse_config("fsdp2-tp4").tp == 4 and parse_config("zs-s1").tp == 1
    for bad in ("ddp-tp2", "zs-s0-tp2", "zs-s3-tp1"):
        with pytest.raises(ValueError, match="-tp<k>"):
            parse_config(bad)
    hpz = parse_config("zs-s3-hpz2-w8-full")  # ZeRO++'s hpZ and qwZ (docs/links.md)
    assert (hpz.reshard_after_forward, hpz.quantize_weights,
            hpz.activation_checkpointing) == (2, "int8", "full")
    assert parse_config("fsdp2-hpz4").reshard_after_forward == 4
    assert parse_config("zs-s3-wf8").quantize_weights == "fp8"
    all3 = parse_config("zs-s3-hpz2-w8-g4")
    assert (all3.reshard_after_forward, all3.quantize_weights, all3.quantize_grads) == (
        2, "int8", "int4")
    assert parse_config("zs-s2-g8").quantize_grads == "int8"
    for bad, why in (("zs-s2-hpz2", "-hpz<k>"), ("zs-s3-noreshard-hpz2", "-hpz<k>"),
                     ("zs-s3-hpz1", "-hpz<k>"), ("fsdp2-w8", "zs-s3 only"),
                     ("zs-s1-g8", "zs-s2 and zs-s3"), ("zs-s3-w8-hpz2", "suffixes come in"),
                     ("zs-s3-w4", "'w4' is not a suffix here")):
        with pytest.raises(ValueError, match=why):
            parse_config(bad)


def _check_tp_rows(tmp_path, configs: list[str]) -> None:  # noqa: ANN001
    """Run ``configs`` (tp 2 rows) beside the ddp baseline on (dp 2, tp 2) and check each row:
    the same sequences as ddp's step, the prediction the tp piece's over dp."""
    code = run(_args("--model", "llama-tiny", "--seq", "32", "--micro-batch", "1",
                     "--world-size", "4", "--warmup", "0", "--steps", "1", "--configs",
                     ",".join([*configs, "ddp"]), "--baseline", "ddp", "--quiet",
                     "--json", str(tmp_path / "r.json")))
    assert code == 0
    rows = _rows(json.loads((tmp_path / "r.json").read_text()))
    from zeroshard.memory.analytic import model_state_bytes
    from zeroshard.memory.tensor_parallel import tp_param_count
    from zeroshard.models import get_preset

    local = tp_param_count(get_preset("llama-tiny"), 2)
    for name in configs:
        r = rows[name]
        assert r["status"] == "ok" and r["tp"] == 2, r["error"]
        assert r["loss_rel_dev"] < 1e-5  # the same sequences as ddp's step
        want = model_state_bytes(local, stage=r["stage"], n=2, recipe="fp32-adamw").total
        assert r["predicted_model_state_bytes"]["total"] == want
        assert r["comm_source"].startswith("c10d dispatch counter")  # dp and tp alike
    assert rows["ddp"]["tp"] == 1


def test_tensor_parallel_rows(tmp_path) -> None:  # noqa: ANN001
    """FSDP2 + TP and zeroshard stage 3 + TP on (dp 2, tp 2) train the same sequences
    (the same loss); the state prediction is the tp piece's over dp. Stage 1 + TP (the
    same runner, another stage) is test_tensor_parallel_rows_at_stage_1 (slow)."""
    _check_tp_rows(tmp_path, ["fsdp2-tp2", "zs-s3-tp2"])


@pytest.mark.slow
def test_tensor_parallel_rows_at_stage_1(tmp_path) -> None:  # noqa: ANN001
    """test_tensor_parallel_rows's checks (its twin) on zeroshard stage 1 + TP."""
    _check_tp_rows(tmp_path, ["zs-s1-tp2"])


def test_muon_rows(tmp_path) -> None:  # noqa: ANN001
    """--optimizer muon: DDP, the naive sharded Muon and zeroshard stages 1 and 3 train
    Muon + AdamW to the same loss; the naive one moves more bytes per step than the owner
    scheme (each full gradient all-gathered on every rank). Speed: docs/optimizers.md."""
    out = tmp_path / "m.json"
    code = run(_args("--optimizer", "muon", "--model", "llama-tiny", "--seq", "32",
                     "--micro-batch", "2", "--world-size", "2", "--warmup", "1", "--steps", "2",
                     "--quiet", "--json", str(out)))
    assert code == 0
    result = json.loads(out.read_text())
    rows = _rows(result)
    assert list(rows) == ["ddp", "naive-muon", "zs-s1", "zs-s3"]
    assert all(r["status"] == "ok" for r in rows.values()), rows
    assert rows["naive-muon"]["system"] == "naive_muon"
    for r in rows.values():
        assert r["loss"] == pytest.approx(rows["ddp"]["loss"], rel=1e-3) and r["loss_ok"]
    assert rows["naive-muon"]["comm_bytes_per_step"] > rows["zs-s1"]["comm_bytes_per_step"]
    assert "--optimizer muon" in result["command"]
    assert result["settings"]["optimizer"] == "muon"
    for r in rows.values():  # the optimizer step's time, within the step's
        assert 0 < r["optimizer_step_s_median"] <= r["step_s_median"], r
        # Newton-Schulz's matrix products, from one profiled step: some on every row
        assert 0 < r["newton_schulz_s"] < r["step_s_median"] * 2, r
