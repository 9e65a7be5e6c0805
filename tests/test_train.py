"""``zeroshard train``: configuration, resume, and surviving a killed rank under torchrun.

The fault test is the real thing: torchrun with ``--max-restarts 1`` runs two ranks, the
test SIGKILLs rank 1 (its pid from ``<ckpt-dir>/rank1.pid``) once step 6 is logged,
torchrun restarts both ranks, they resume from the latest complete checkpoint (step 4)
and finish; the final checkpoint must equal an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zeroshard.cli import build_parser, main
from zeroshard.launch import free_port
from zeroshard.state import CheckpointReader, step_dir
from zeroshard.testing import run_ranks
from zeroshard.train import TrainConfig, load_config

TINY = ["--model", "gpt2-tiny", "--seq-len", "16", "--global-batch", "4", "--lr", "1e-2",
        "--warmup", "2", "--log-every", "1"]


def _same_checkpoint(a: Path, b: Path) -> None:
    """Every weight and per-element optimizer state of two checkpoints, bitwise."""
    ra, rb = CheckpointReader(a), CheckpointReader(b)
    assert ra.keys() == rb.keys()
    for key in ra.keys():
        assert torch.equal(ra.tensor(key), rb.tensor(key)), key
    oa, ob = ra.manifest["optimizer"]["params"], rb.manifest["optimizer"]["params"]
    assert oa == ob  # per-parameter state keys and scalar state (AdamW's step)
    for name, info in oa.items():
        for k in info["per_element"]:
            assert torch.equal(ra.optimizer_state(name, k), rb.optimizer_state(name, k)), (name, k)


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_config_file_then_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text('model = "llama-tiny"\nstage = 3\nglobal-batch = 16\n')
    args = build_parser().parse_args(["train", "--config", str(cfg), "--stage", "1"])
    c = load_config(args)
    assert (c.model, c.stage, c.global_batch, c.steps) == ("llama-tiny", 1, 16, 100)
    assert c.lr_at(0) == c.lr / c.warmup and c.lr_at(c.steps) == pytest.approx(c.min_lr)
    bad = tmp_path / "bad.json"
    bad.write_text('{"stgae": 3}')
    assert main(["train", "--config", str(bad)]) == 2  # names the unknown key
    assert main(["train", "--stage", "5"]) == 2
    assert main(["train", "--ckpt-every", "5"]) == 2  # needs --ckpt-dir
    with pytest.raises(ValueError, match="mixed_precision='fp8'"):
        TrainConfig(mixed_precision="fp8")
    with pytest.raises(ValueError, match="optimizer\\+params' needs stage 3.*--offload optimizer"):
        TrainConfig(stage=2, offload="optimizer+params")
    with pytest.raises(ValueError, match="offload='optimizer' needs stage 1, 2 or 3"):
        TrainConfig(stage=0, offload="optimizer")
    assert TrainConfig(stage=3, offload="optimizer+params").offload == "optimizer+params"


def test_standalone_resume_equals_straight_run(tmp_path: Path, capsys) -> None:
    """World size 1 without torchrun: 3 steps, then resume to 6 == 6 straight."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train", *TINY, "--steps", "6", "--ckpt-dir", str(straight)]) == 0
    assert main(["train", *TINY, "--steps", "3", "--ckpt-dir", str(split)]) == 0
    assert main(["train", *TINY, "--steps", "6", "--ckpt-dir", str(split), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step      6/6" in out
    events = [r["event"] for r in _records(split / "metrics.jsonl")]
    assert events.count("resume") == 1 and events[-1] == "done"
    _same_checkpoint(step_dir(straight, 6), step_dir(split, 6))


def test_resume_at_the_last_step_has_nothing_left_to_do(tmp_path: Path, capsys) -> None:
    """A finished run started again with --resume (a scheduler's retry) trains nothing and
    reports the loss last logged before its checkpoint, never nan (was: "done: 4 steps on
    1 rank(s), final loss nan")."""
    ckpt = tmp_path / "run"
    # Checkpoints at 4 and 6; the loss is logged at steps 3 and 6 only.
    args = ["train", *TINY[:-2], "--log-every", "3", "--ckpt-every", "4", "--ckpt-dir", str(ckpt)]
    assert main([*args, "--steps", "6"]) == 0
    logged = {r["step"]: r["loss"] for r in _records(ckpt / "metrics.jsonl")
              if r["event"] == "step"}
    assert sorted(logged) == [3, 6]
    capsys.readouterr()
    assert main([*args, "--steps", "6", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "nothing left to do" in out and "Raise --steps" in out and "nan" not in out
    assert f"done: nothing left to do (resumed at step 6, --steps 6); last logged loss " \
           f"{logged[6]:.4f} (step 6)" in out
    assert "step      " not in out  # no step was trained
    done = _records(ckpt / "metrics.jsonl")[-1]
    assert done["event"] == "done" and done["nothing_to_do"] and done["loss"] == logged[6]
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000004", "step-00000006"]
    # Past --steps: the newest checkpoint (6) is beyond --steps 5.
    assert main([*args, "--steps", "5", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "at step 6, past --steps 5" in out and "(resumed at step 6, --steps 5)" in out
    # A checkpoint between logged steps carries the loss logged before it (step 3's).
    (ckpt / "step-00000006").rename(tmp_path / "moved")
    assert main([*args, "--steps", "4", "--resume"]) == 0
    assert f"last logged loss {logged[3]:.4f} (step 3)" in capsys.readouterr().out


def test_resume_with_more_steps_says_the_schedule_moved(tmp_path: Path, capsys) -> None:
    """--steps raised on resume stretches the cosine: the run says so, with both rates at
    the resumed step (a new user saw the rate jump from 3e-4 back to 6e-4 unannounced);
    the same settings say nothing."""
    ckpt = tmp_path / "run"
    args = ["train", *TINY, "--ckpt-dir", str(ckpt), "--ckpt-every", "3"]
    assert main([*args, "--steps", "5"]) == 0
    shutil.rmtree(step_dir(ckpt, 5))
    assert main([*args, "--steps", "5", "--resume"]) == 0  # from step 3, as saved
    first = capsys.readouterr().out
    assert "resumed from" in first and "schedule differs" not in first
    assert main([*args, "--steps", "8", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "learning-rate schedule differs from the checkpoint's (--steps 5 -> 8)" in out, out
    new = TrainConfig(steps=8, warmup=2, lr=1e-2).lr_at(5)
    old = TrainConfig(steps=5, warmup=2, lr=1e-2).lr_at(5)
    assert f"the rate at step 5 is {new:.2e} on the new schedule, {old:.2e} on the saved " \
           "run's" in out
    line = next(x for x in out.splitlines() if x.startswith("step      6/8"))
    assert f"lr {new:.2e}" in line, line  # the step trained at the new schedule's rate
    changed = [r for r in _records(ckpt / "metrics.jsonl") if r["event"] == "schedule_changed"]
    assert [r["step"] for r in changed] == [5]


def test_last_loss_of_a_checkpoint_without_one(tmp_path: Path) -> None:
    """Checkpoints written before the loss was carried in them: the metrics file's newest
    finite step record at or before the checkpoint's step, else none (never nan)."""
    from zeroshard.train import _last_loss, _Log

    metrics = tmp_path / "metrics.jsonl"
    log = _Log(0, str(metrics))
    assert _last_loss({"step": 8}, log, 8) == (pytest.approx(float("nan"), nan_ok=True), None)
    lines = [{"event": "step", "step": 4, "loss": 2.5}, {"event": "step", "step": 8, "loss": 2.0},
             {"event": "step", "step": 9, "loss": 1.0}]  # 9: after the checkpoint (replayed)
    metrics.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"event": "st')
    assert _last_loss({"step": 8}, log, 8) == (2.0, 8)
    assert _last_loss({"step": 8, "loss": 1.5, "loss_step": 7}, log, 8) == (1.5, 7)
    assert _last_loss({"step": 8}, _Log(1, str(metrics)), 8)[1] is None  # rank 1 reads none


def _torchrun(ckpt: Path, port: int, *extra: str) -> tuple[subprocess.Popen, Path]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "zeroshard.cli", "train", *TINY,
           "--stage", "2", "--steps", "12", "--ckpt-every", "4", "--ckpt-dir", str(ckpt),
           "--resume", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = ckpt.with_suffix(".log")  # a file, not a pipe: nobody reads while it runs
    with open(log, "w") as f:
        # Own session: on a failure the test kills torchrun *and* its workers at once.
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True), log


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tail(log: Path) -> str:
    return "\n".join(log.read_text().splitlines()[-60:])


# No wall-clock budget: under two busy processes torchrun and its ranks took 4 minutes
# just to start (three interpreters importing torch), and a correct run timed out. A run
# fails when its log and metrics stop growing for this long instead.
STALL_S = 300.0


def _progress(ckpt: Path, log: Path) -> tuple[int, ...]:
    return tuple(p.stat().st_size if p.exists() else -1
                 for p in (log, ckpt / "metrics.jsonl"))


def _wait(proc: subprocess.Popen, ckpt: Path, log: Path, until=lambda: False) -> None:
    """Wait until ``proc`` exits (or ``until()``), failing if it stops making progress."""
    seen, since = _progress(ckpt, log), time.monotonic()
    while proc.poll() is None and not until():
        now = _progress(ckpt, log)
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since > STALL_S:
            raise AssertionError(f"no progress for {STALL_S:.0f} s:\n{_tail(log)}")
        time.sleep(0.05)


def _uninterrupted(rank: int, world: int, ckpt: str) -> int:
    # The same command as _torchrun's, on kept ranks whose group `train` takes as it finds it.
    return main(["train", *TINY, "--stage", "2", "--steps", "12", "--ckpt-every", "4",
                 "--ckpt-dir", ckpt])


def test_torchrun_restart_after_sigkill_matches_uninterrupted_run(tmp_path: Path) -> None:
    # The uninterrupted reference runs on the suite's kept ranks (no torchrun tree of
    # three fresh interpreters): the same command, the same 2 gloo ranks and code path.
    assert run_ranks(_uninterrupted, 2, str(tmp_path / "ref"), timeout=300) == [0, 0]
    ckpt = tmp_path / "faulty"

    def at_step_6() -> bool:
        steps = [r["step"] for r in _records(ckpt / "metrics.jsonl") if r["event"] == "step"]
        return bool(steps) and steps[-1] >= 6

    killed = None
    run, log = _torchrun(ckpt, free_port(), "--step-sleep", "0.3")
    try:
        _wait(run, ckpt, log, until=at_step_6)
        if run.poll() is None:
            killed = int((ckpt / "rank1.pid").read_text())
            os.kill(killed, signal.SIGKILL)
            _wait(run, ckpt, log)
    finally:
        _stop(run)
    assert killed is not None, f"never saw step 6 logged:\n{_tail(log)}"
    assert run.returncode == 0, _tail(log)
    records = _records(ckpt / "metrics.jsonl")
    resumed = [r for r in records if r["event"] == "resume"]
    assert [(r["restart"], r["step"]) for r in resumed] == [(1, 4)], records
    assert int((ckpt / "rank1.pid").read_text()) != killed  # a new process finished the run
    _same_checkpoint(step_dir(tmp_path / "ref", 12), step_dir(ckpt, 12))


def _per_node(rank: int, world: int, root: str, lr: str) -> str:
    """Each rank its own --metrics file (as each node of a multi-node job has), and --lr
    as given: the run checkpoints; options that must agree are checked at the start."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["train", *TINY, "--stage", "2", "--steps", "4", "--ckpt-every", "2",
                     "--ckpt-dir", f"{root}/ckpt", "--metrics", f"{root}/metrics-{rank}.jsonl",
                     "--lr", lr if rank == 0 else "1e-3"])
    return f"exit {code}: {err.getvalue().strip()}" if code else "exit 0"


def test_node_local_metrics_paths_checkpoint_and_differing_options_are_named(
        tmp_path: Path) -> None:
    """#64 item 7: a per-node --metrics path stopped the first checkpoint ("extra differs
    across ranks"). Node-local paths stay out of what must agree; an option that differs
    (--lr) is refused before training, naming it."""
    assert run_ranks(_per_node, 2, str(tmp_path / "a"), "1e-3", timeout=300) == ["exit 0"] * 2
    assert (step_dir(tmp_path / "a" / "ckpt", 4)).exists()
    assert (tmp_path / "a" / "metrics-0.jsonl").exists()  # rank 0 logs
    said = run_ranks(_per_node, 2, str(tmp_path / "b"), "2e-3", timeout=300)
    assert said[0] == said[1]
    assert said[0].startswith("exit 2: zeroshard train: error: --lr is 0.002 "
                              "on rank 0 and 0.001 on rank(s) [1]; start every node with the "
                              "same options"), said[0]
