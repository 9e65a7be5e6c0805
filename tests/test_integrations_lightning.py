"""Lightning Fabric and the Lightning Trainer on zeroshard (issue #28).

examples/integrations/fabric.py and lightning_trainer.py on 2 ranks, with the zeroshard
strategy at stages 0-3 and with Lightning's DDP strategy, in the same processes: per-step
losses and (global) gradient norms agree within 1e-5 (fp32, gradient accumulation and
clipping on); a step-3 checkpoint of the stage-2 run resumed at stage 3 continues as the
uninterrupted run; bf16-mixed trains as under DDP; a "full" checkpoint loads into plain
torch; bad settings are refused before training.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

# lightning is imported by the ranks and the tests that use it, not at collection (2 s
# per worker); a missing lightning fails them (it is a dev dependency), never skips.
from zeroshard.testing import run_ranks

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "integrations"


def _example(name: str) -> Any:
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run(rank: int, world: int, runs: list[tuple[str, list[str]]]) -> list[list[dict]]:
    import warnings

    warnings.filterwarnings("ignore")
    examples = {n: _example(n) for n in ("fabric", "lightning_trainer")}
    return [_convert(rank, *argv) if name == "convert" else examples[name].main(argv)
            for name, argv in runs]


def _convert(rank: int, src: str, dst: str) -> list:
    """Rank 0 writes the one-file .ckpt (one process, no group); the other waits for it."""
    import time

    from zeroshard.integrations.lightning_checkpoint import to_lightning_checkpoint

    if rank == 0:
        to_lightning_checkpoint(src, dst)
    while not Path(dst).exists():  # os.replace: whole once it exists
        time.sleep(0.05)
    return []


def _runs(base: str) -> dict[str, tuple[str, list[str]]]:
    runs: dict[str, tuple[str, list[str]]] = {}
    for ex in ("fabric", "lightning_trainer"):
        runs[f"{ex}-ddp"] = (ex, ["--strategy", "ddp", "--out", f"{base}/{ex}-ddp"])
        for s in range(4):
            runs[f"{ex}-s{s}"] = (ex, ["--strategy", f"zeroshard_stage_{s}",
                                       "--out", f"{base}/{ex}-s{s}"])
        runs[f"{ex}-resume"] = (ex, ["--strategy", "zeroshard_stage_3", "--resume",
                                     "--out", f"{base}/{ex}-s2"])
        runs[f"{ex}-ddp-bf16"] = (ex, ["--strategy", "ddp", "--precision", "bf16-mixed",
                                       "--out", f"{base}/{ex}-ddpb"])
        runs[f"{ex}-s3-bf16"] = (ex, ["--strategy", "zeroshard_stage_3", "--precision",
                                      "bf16-mixed", "--out", f"{base}/{ex}-s3b"])
    runs["fabric-full"] = ("fabric", ["--strategy", "zeroshard_stage_3", "--state-dict-type",
                                      "full", "--out", f"{base}/fabric-full"])
    runs["fabric-meta"] = ("fabric", ["--strategy", "zeroshard_stage_3", "--empty-init",
                                      "--out", f"{base}/fabric-meta"])
    runs["lightning-meta"] = ("lightning_trainer", ["--strategy", "zeroshard_stage_3",
                                                    "--empty-init",
                                                    "--out", f"{base}/lightning-meta"])
    # another strategy's checkpoint: DDP's one-file .ckpt resumed (and tested) under
    # zeroshard; zeroshard's directory, converted to one file, resumed under DDP
    lt, ddp_ckpt = "lightning_trainer", f"{base}/lightning_trainer-ddp/ckpt/step-step=3.ckpt"
    for s in (0, 3):
        runs[f"lt-from-ddp-s{s}"] = (lt, ["--strategy", f"zeroshard_stage_{s}", "--resume-from",
                                          ddp_ckpt, "--out", f"{base}/lt-from-ddp-s{s}"])
    runs["lt-test-ddp"] = (lt, ["--strategy", "ddp", "--test-from", ddp_ckpt,
                                "--out", f"{base}/lt-test-ddp"])
    runs["lt-test-s3"] = (lt, ["--strategy", "zeroshard_stage_3", "--test-from", ddp_ckpt,
                               "--out", f"{base}/lt-test-s3"])
    own = f"{base}/lightning_trainer-s3/ckpt/step-step=3.ckpt"
    runs["lt-test-s3-own"] = (lt, ["--strategy", "zeroshard_stage_3", "--test-from", own,
                                   "--out", f"{base}/lt-test-s3o"])
    runs["lt-convert"] = ("convert", [own, f"{base}/converted.ckpt"])
    runs["lt-s3-to-ddp"] = (lt, ["--strategy", "ddp", "--resume-from",
                                 f"{base}/converted.ckpt", "--out", f"{base}/lt-s3-to-ddp"])
    runs["lightning-full"] = ("lightning_trainer", [
        "--strategy", "zeroshard_stage_3", "--state-dict-type", "full",
        "--out", f"{base}/lightning-full"])
    return runs


@functools.cache
def _all() -> dict[str, Any]:
    base = tempfile.mkdtemp(prefix="zeroshard-lightning-")
    runs = _runs(base)
    logs = run_ranks(_run, 2, list(runs.values()), timeout=900)[0]
    return {"base": base, "logs": dict(zip(runs, logs))}


def _same(got: list[dict], want: list[dict], rel: float = 1e-5,
          keys: tuple[str, ...] = ("loss", "grad_norm")) -> None:
    assert [h["step"] for h in got] == [h["step"] for h in want]
    for g, w in zip(got, want):
        for k in keys:
            assert abs(g[k] - w[k]) <= rel * max(abs(g[k]), abs(w[k])), (g["step"], k, g, w)


@pytest.mark.parametrize("example", ["fabric", "lightning_trainer"])
@pytest.mark.parametrize("stage", range(4))
def test_losses_and_grad_norms_equal_ddp(example: str, stage: int) -> None:
    logs = _all()["logs"]
    _same(logs[f"{example}-s{stage}"], logs[f"{example}-ddp"])


@pytest.mark.parametrize("example", ["fabric", "lightning_trainer"])
def test_stage2_checkpoint_resumed_at_stage3_continues_the_run(example: str) -> None:
    logs = _all()["logs"]
    _same(logs[f"{example}-resume"], [h for h in logs[f"{example}-s2"] if h["step"] > 3])


@pytest.mark.parametrize("example", ["fabric", "lightning_trainer"])
def test_bf16_mixed_is_lightnings_amp_as_under_ddp(example: str) -> None:
    """bf16-mixed stays Lightning's autocast over fp32 weights, as under the DDP strategy:
    the same arithmetic, up to the order of the gradient reduction, which bf16's rounding
    and AdamW magnify over steps (measured: losses within 3e-6, norms within 1.4e-3)."""
    logs = _all()["logs"]
    _same(logs[f"{example}-s3-bf16"], logs[f"{example}-ddp-bf16"], rel=1e-2)


def test_fabric_full_checkpoint_loads_into_plain_torch() -> None:
    from zeroshard.models import build_model

    run = _all()
    _same(run["logs"]["fabric-full"], run["logs"]["fabric-ddp"])
    ckpt = torch.load(f"{run['base']}/fabric-full/step-3", weights_only=False)
    ddp = torch.load(f"{run['base']}/fabric-ddp/step-3", weights_only=False)
    assert set(ckpt) == set(ddp) >= {"model", "optimizer", "scheduler", "step"}
    plain = build_model("gpt2-tiny", seed=0)
    plain.load_state_dict(ckpt["model"])  # strict: the DDP strategy's format
    for k, v in ddp["model"].items():  # per tensor, as tests/test_parity.py measures; the
        # loosest is the fused q/k/v bias, whose key part softmax ignores (a zero gradient:
        # AdamW turns rounding noise into lr-sized steps; 1.3e-4 here)
        assert (ckpt["model"][k] - v).norm() <= 1e-3 * v.norm() + 1e-8, k
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(ckpt["optimizer"])  # torch's format


def test_lightning_full_checkpoint_loads_into_plain_torch() -> None:
    """state_dict_type="full": Lightning's one-file checkpoint, whole weights and torch-format
    optimizer state, as the DDP strategy writes it."""
    run = _all()
    _same(run["logs"]["lightning-full"], run["logs"]["lightning_trainer-ddp"])
    path = f"{run['base']}/lightning-full/ckpt/step-step=3.ckpt"
    ckpt = torch.load(path, weights_only=False)
    ddp = torch.load(f"{run['base']}/lightning_trainer-ddp/ckpt/step-step=3.ckpt",
                     weights_only=False)
    assert ckpt["state_dict"].keys() == ddp["state_dict"].keys()
    lit = _example("lightning_trainer").LitGPT()
    lit.load_state_dict(ckpt["state_dict"])  # strict
    for k, v in ddp["state_dict"].items():
        assert (ckpt["state_dict"][k] - v).norm() <= 1e-3 * v.norm() + 1e-8, k
    opt = torch.optim.AdamW(lit.parameters(), lr=1e-2)
    opt.load_state_dict(ckpt["optimizer_states"][0])


@pytest.mark.parametrize("stage", [0, 3])
def test_ddp_checkpoint_resumed_under_zeroshard_continues_ddps_run(stage: int) -> None:
    """fit(ckpt_path=<the DDP strategy's one-file .ckpt>) under zeroshard: weights,
    optimizer, scheduler and loop state restored (it once trained fresh weights)."""
    logs = _all()["logs"]
    _same(logs[f"lt-from-ddp-s{stage}"],
          [h for h in logs["lightning_trainer-ddp"] if h["step"] > 3])


def test_test_from_a_ddp_checkpoint_gives_ddps_metric() -> None:
    logs = _all()["logs"]
    want = logs["lt-test-ddp"][0]["test_loss"]
    for run in ("lt-test-s3", "lt-test-s3-own"):  # DDP's file; zeroshard's own directory
        got = logs[run][0]["test_loss"]
        assert abs(got - want) <= 1e-5 * abs(want), (run, got, want)


def test_zeroshard_checkpoint_converted_resumes_under_ddp_and_loads_for_inference() -> None:
    """to_lightning_checkpoint (zeroshard consolidate --lightning): the stage-3 run's
    step-3 directory as one .ckpt, which the DDP strategy resumes (continuing the stage-3
    run) and LitGPT.load_from_checkpoint loads (the weights the run had at step 3: those
    of the "full" stage-3 run's one-file checkpoint, bit for bit)."""
    run = _all()
    logs, base = run["logs"], run["base"]
    _same(logs["lt-s3-to-ddp"], [h for h in logs["lightning_trainer-s3"] if h["step"] > 3])
    lit = _example("lightning_trainer").LitGPT.load_from_checkpoint(f"{base}/converted.ckpt")
    full = torch.load(f"{base}/lightning-full/ckpt/step-step=3.ckpt", weights_only=False)
    got = lit.state_dict()
    assert got.keys() == full["state_dict"].keys()
    for k, v in full["state_dict"].items():
        assert torch.equal(got[k], v), k
    converted = torch.load(f"{base}/converted.ckpt", weights_only=False)
    for i, entry in full["optimizer_states"][0]["state"].items():
        for key, v in entry.items():
            assert torch.equal(converted["optimizer_states"][0]["state"][i][key], v), (i, key)
    assert converted["optimizer_states"][0]["param_groups"][0]["params"] == \
        full["optimizer_states"][0]["param_groups"][0]["params"]
    # the same from the command line
    from zeroshard.cli import main

    out = f"{base}/cli.ckpt"
    assert main(["consolidate", f"{base}/lightning_trainer-s3/ckpt/step-step=3.ckpt", out,
                 "--lightning"]) == 0
    cli = torch.load(out, weights_only=False)
    assert all(torch.equal(cli["state_dict"][k], v) for k, v in converted["state_dict"].items())
    assert cli["global_step"] == converted["global_step"] == 3


def _fabric_extras(rank: int, world: int, strategy: str) -> dict:
    """clip_gradients by value, and Fabric's collectives, under a strategy."""
    import lightning as L

    import zeroshard.integrations.lightning_fabric  # noqa: F401
    from zeroshard.models import build_model

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = build_model("gpt2-tiny", seed=0)
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    fabric.backward(model(x).float().logsumexp(-1).mean())
    fabric.clip_gradients(model, opt, clip_val=1e-3)
    opt.step()
    out = {"sum": fabric.all_reduce(torch.tensor([rank + 1.0]), reduce_op="sum").item(),
           "gathered": fabric.all_gather(torch.tensor([rank + 1.0])).flatten().tolist(),
           "broadcast": fabric.broadcast(f"from {rank}", src=1)}
    fabric.barrier()
    weights = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    return {**out, "weights": weights}


def test_fabric_clip_by_value_and_collectives_as_under_ddp() -> None:
    got = run_ranks(_fabric_extras, 2, "zeroshard_stage_3", timeout=120)
    want = run_ranks(_fabric_extras, 2, "ddp", timeout=120)
    for g, w in zip(got, want):
        assert (g["sum"], g["gathered"], g["broadcast"]) == (3.0, [1.0, 2.0], "from 1")
        for k, v in w["weights"].items():
            torch.testing.assert_close(g["weights"][k], v, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("example", ["fabric", "lightning"])
def test_init_module_empty_init_at_stage3(example: str) -> None:
    """fabric.init_module / trainer.init_module(empty_init=True) build the model on the meta
    device; stage 3 materialises it unit by unit (zeroshard's reference init): the same run."""
    logs = _all()["logs"]
    eager = "fabric-s3" if example == "fabric" else "lightning_trainer-s3"
    _same(logs[f"{example}-meta"], logs[eager], rel=0.0)


# -- bad settings, refused before training --------------------------------------------------
def _refused(rank: int, world: int, case: str) -> str:
    import lightning as L

    from zeroshard.integrations.lightning_fabric import ZeroShardStrategy

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        if case == "precision":
            fabric = L.Fabric(accelerator="cpu", devices=2, precision="64-true",
                              strategy=ZeroShardStrategy(stage=2))
        elif case == "twice":
            fabric = L.Fabric(accelerator="cpu", devices=2, precision="bf16-mixed",
                              strategy=ZeroShardStrategy(stage=2, mixed_precision="bf16"))
        elif case == "option":
            fabric = L.Fabric(accelerator="cpu", devices=2,
                              strategy=ZeroShardStrategy(stage=2, bucket_byte=1))
        else:
            fabric = L.Fabric(accelerator="cpu", devices=2, strategy="zeroshard_stage_2")
        fabric.launch()  # the ranks exist already (run_ranks): this only sets up
        if case == "alone":
            fabric.setup_module(model)
        else:
            fabric.setup(model, opt)
    except (TypeError, ValueError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(("case", "says"), [
    ("precision", "precision='64-true' is not supported"),
    ("twice", "would be cast twice"),
    ("option", "unknown option(s) ['bucket_byte']"),
    ("alone", "setup_module_and_optimizers"),
])
def test_bad_settings_are_refused(case: str, says: str) -> None:
    import zeroshard.integrations.lightning_fabric  # noqa: F401  (registers the names)

    for msg in run_ranks(_refused, 2, case, timeout=120):
        assert says in msg, msg


def _torchrun_fabric(out: Path, strategy: str) -> list[dict]:
    """examples/integrations/fabric.py under torchrun (Fabric finds the ranks there)."""
    import json
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           str(EXAMPLES / "fabric.py"), "--strategy", strategy, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_fabric_strategy_name_under_torchrun_equals_ddp(tmp_path) -> None:
    """Fabric(strategy="zeroshard_stage_2") in a script launched by torchrun (after the
    import that registers the name): DDP's losses and norms (docs/trainers-lightning.md)."""
    got = _torchrun_fabric(tmp_path / "zs", "zeroshard_stage_2")
    want = _torchrun_fabric(tmp_path / "ddp", "ddp")
    assert len(got) == 6
    _same(got, want)


# -- load_from_checkpoint on the path Lightning reports (#64 item 5) -------------------------
def _autoencoder(rank: int, world: int, root: str) -> dict:
    """Lightning's README example, LitAutoEncoder (an MNIST-shaped encoder/decoder, Adam),
    on random 28x28 images, trained at stage 3 with a ModelCheckpoint keeping the best and
    the last; then loaded for inference from the paths Lightning reports."""
    import warnings

    import lightning as L
    from torch import nn
    from torch.nn import functional as F

    import zeroshard
    import zeroshard.integrations.lightning_trainer as zl

    warnings.filterwarnings("ignore")

    class LitAutoEncoder(L.LightningModule):
        def __init__(self, hidden: int = 64) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.encoder = nn.Sequential(nn.Linear(28 * 28, hidden), nn.ReLU(), nn.Linear(hidden, 3))
            self.decoder = nn.Sequential(nn.Linear(3, hidden), nn.ReLU(), nn.Linear(hidden, 28 * 28))

        def training_step(self, batch, batch_idx):
            x = batch[0].view(batch[0].size(0), -1)
            loss = F.mse_loss(self.decoder(self.encoder(x)), x)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.rand(64, 1, 28, 28))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=f"{root}/ckpt", monitor="train_loss",
                                               save_last=True)
    model = LitAutoEncoder(hidden=32)
    trainer = L.Trainer(strategy="zeroshard_stage_3", accelerator="cpu", devices=world,
                        max_epochs=1, callbacks=[ckpt], logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    trained = zeroshard.full_state_dict(model)  # collective: every rank
    out: dict = {}
    try:
        LitAutoEncoder.load_from_checkpoint(ckpt.last_model_path)
    except IsADirectoryError as e:
        out["plain"] = f"IsADirectoryError: {e}"
    last = zl.load_from_checkpoint(LitAutoEncoder, ckpt.last_model_path)
    best = zl.load_from_checkpoint(LitAutoEncoder, ckpt.best_model_path, map_location="cpu")
    out["last_equal"] = all(torch.equal(v, trained[k]) for k, v in last.state_dict().items())
    out["hidden"] = last.hparams.hidden
    out["best_is_dir"] = Path(ckpt.best_model_path).is_dir()
    out["best_loads"] = isinstance(best, LitAutoEncoder) and best.state_dict().keys() == trained.keys()
    return out


def test_load_from_checkpoint_reads_the_directory_lightning_reports(tmp_path) -> None:  # noqa: ANN001
    """LitAutoEncoder.load_from_checkpoint(<best or last path>) raised IsADirectoryError on a
    zeroshard strategy's checkpoint (a directory); zeroshard.integrations.lightning_trainer.
    load_from_checkpoint(LitAutoEncoder, path, ...) takes the same path and arguments and
    gives the trained weights, bit for bit, and the saved hyperparameters."""
    for got in run_ranks(_autoencoder, 2, str(tmp_path), timeout=300):
        assert got["plain"].startswith("IsADirectoryError"), got
        assert got["last_equal"] and got["hidden"] == 32 and got["best_is_dir"], got
        assert got["best_loads"], got
