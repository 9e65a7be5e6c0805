"""The Hugging Face Trainer on zeroshard (zeroshard.integrations.hf_trainer, issue #28).

examples/integrations/hf_trainer.py runs on 2 ranks as ``ZeroShardTrainer`` at stages 0-3
and as the plain ``Trainer`` (DDP), in the same processes: the logged losses and gradient
norms agree within 1e-5 (fp32); resuming from the step-3 checkpoint — at the same stage
and at another — continues as the uninterrupted run; the exported model loads with plain
``from_pretrained``; LoRA saves the adapter DDP saves; bad settings fail before training.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from zeroshard.testing import run_ranks  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "integrations"
EXAMPLE = EXAMPLES / "hf_trainer.py"
TRL = EXAMPLES / "trl_sft_lora.py"
DPO = EXAMPLES / "trl_dpo_lora.py"
GRPO = EXAMPLES / "trl_grpo.py"
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "ACCELERATE_USE_CPU": "1"}


def _example(path: Path = EXAMPLE) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem + "_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run(rank: int, world: int, runs: list[list[str]]) -> list[list[dict]]:
    transformers.logging.set_verbosity_error()
    scripts = {"hf": _example(), "trl": _example(TRL), "dpo": _example(DPO),
               "grpo": _example(GRPO)}
    return [scripts[argv[0]].main(argv[1:]) if argv[0] in scripts
            else scripts["hf"].main(argv) for argv in runs]


def _runs(base: str) -> dict[str, list[str]]:
    runs: dict[str, list[str]] = {"ddp": ["--ddp", "--out", f"{base}/ddp"]}
    for s in range(4):
        runs[f"s{s}"] = ["--stage", str(s), "--out", f"{base}/s{s}"]
    # resume at step 3: the same stage, and another
    runs["s2-resume"] = ["--stage", "2", "--out", f"{base}/s2r",
                         "--resume", f"{base}/s2/checkpoint-3"]
    runs["s2-as-s3"] = ["--stage", "3", "--out", f"{base}/s2s3",
                        "--resume", f"{base}/s2/checkpoint-3"]
    runs["ddp-accum"] = ["--ddp", "--accum", "2", "--out", f"{base}/ddpa"]
    runs["s3-accum"] = ["--stage", "3", "--accum", "2", "--out", f"{base}/s3a"]
    runs["ddp-lora"] = ["--ddp", "--lora", "--out", f"{base}/ddpl"]
    runs["s3-lora"] = ["--stage", "3", "--lora", "--out", f"{base}/s3l"]
    runs["ddp-eval"] = ["--ddp", "--eval", "--checkpointing", "--out", f"{base}/ddpe"]
    for s in range(4):  # evaluate() mid-training: Accelerate's prepare_model (issue #65)
        runs[f"s{s}-eval"] = ["--stage", str(s), "--eval", "--checkpointing", "--out",
                              f"{base}/s{s}e"]
    runs["s1-eval-resume"] = ["--stage", "1", "--eval", "--checkpointing", "--out",
                              f"{base}/s1er", "--resume", f"{base}/s1e/checkpoint-3"]
    runs["s0-eval-as-s2"] = ["--stage", "2", "--eval", "--checkpointing", "--out",
                             f"{base}/s0es2", "--resume", f"{base}/s0e/checkpoint-3"]
    runs["s3-selective"] = ["--stage", "3", "--selective", "--out", f"{base}/s3s"]
    runs["ddp-bf16"] = ["--ddp", "--bf16", "--out", f"{base}/ddpb"]
    runs["s2-bf16"] = ["--stage", "2", "--bf16", "--out", f"{base}/s2b"]
    runs["s2-fp16"] = ["--stage", "2", "--fp16", "--out", f"{base}/s2h"]
    # TRL's SFTTrainer with LoRA (peft_config=), through zeroshard_trainer(SFTTrainer)
    runs["trl-ddp"] = ["trl", "--ddp", "--out", f"{base}/trl-ddp"]
    for s in range(4):
        runs[f"trl-s{s}"] = ["trl", "--stage", str(s), "--out", f"{base}/trl-s{s}"]
    runs["trl-ddp-bf16"] = ["trl", "--ddp", "--bf16", "--out", f"{base}/trl-ddpb"]
    runs["trl-s3-bf16"] = ["trl", "--stage", "3", "--bf16", "--out", f"{base}/trl-s3b"]
    # TRL's DPOTrainer with LoRA: the reference pass disables the adapters (under no_grad)
    # between the policy's forward and its backward; stages 0-2 in make slow
    runs["dpo-ddp"] = ["dpo", "--ddp", "--out", f"{base}/dpo-ddp"]
    runs["dpo-s3"] = ["dpo", "--stage", "3", "--out", f"{base}/dpo-s3"]
    runs["dpo-ddp-bf16"] = ["dpo", "--ddp", "--bf16", "--out", f"{base}/dpo-ddpb"]
    runs["dpo-s3-bf16"] = ["dpo", "--stage", "3", "--bf16", "--out", f"{base}/dpo-s3b"]
    # Full fine-tuning against a separate reference model, sharded too at stage 3
    runs["dpo-full-ddp"] = ["dpo", "--ddp", "--full", "--out", f"{base}/dpo-full-ddp"]
    runs["dpo-full-s3"] = ["dpo", "--stage", "3", "--full", "--out", f"{base}/dpo-full-s3"]
    runs["dpo-sync-ddp"] = ["dpo", "--ddp", "--full", "--sync-ref", "--out", f"{base}/dpo-sd"]
    runs["dpo-sync-s3"] = ["dpo", "--stage", "3", "--full", "--sync-ref", "--out",
                           f"{base}/dpo-ss3"]
    # TRL's GRPOTrainer: generation, a reference model synced every step
    runs["grpo-ddp"] = ["grpo", "--ddp", "--out", f"{base}/grpo-ddp"]
    runs["grpo-s3"] = ["grpo", "--stage", "3", "--out", f"{base}/grpo-s3"]
    # TRL's RLOOTrainer: the same, with leave-one-out baselines
    runs["rloo-ddp"] = ["grpo", "--trainer", "rloo", "--ddp", "--out", f"{base}/rloo-ddp"]
    runs["rloo-s3"] = ["grpo", "--trainer", "rloo", "--stage", "3", "--out",
                       f"{base}/rloo-s3"]
    return runs


@functools.cache
def _all() -> dict[str, Any]:
    base = tempfile.mkdtemp(prefix="zeroshard-hf-trainer-")
    runs = _runs(base)
    logs = run_ranks(_run, 2, list(runs.values()), timeout=900, env=ENV)[0]
    return {"base": base, "logs": dict(zip(runs, logs))}


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def _assert_same_logs(got: list[dict], want: list[dict], rel: float = 1e-5,
                      keys: tuple[str, ...] = ("loss", "grad_norm")) -> None:
    assert [h["step"] for h in got] == [h["step"] for h in want]
    for g, w in zip(got, want):
        for k in keys:
            assert _close(g[k], w[k], rel), (g["step"], k, g[k], w[k])


@pytest.mark.parametrize("stage", range(4))
def test_losses_and_grad_norms_equal_ddp(stage: int) -> None:
    logs = _all()["logs"]
    _assert_same_logs(logs[f"s{stage}"], logs["ddp"])


def test_hf_selective_checkpointing_on_the_trainers_default_call_equals_ddp() -> None:
    """The Trainer calls the model with HF's default use_cache=True; selective
    checkpointing turns the cache off in training (as HF's own checkpointing does) and
    trains as DDP without checkpointing."""
    logs = _all()["logs"]
    _assert_same_logs(logs["s3-selective"], logs["ddp"])


def test_gradient_accumulation_equals_ddp() -> None:
    logs = _all()["logs"]
    _assert_same_logs(logs["s3-accum"], logs["ddp-accum"])


@pytest.mark.parametrize("name", ["s0-eval", "s1-eval", "s2-eval", "s3-eval",
                                  "s1-eval-resume", "s0-eval-as-s2"])
def test_evaluation_generation_and_checkpointing(name: str) -> None:
    """eval_strategy="steps" (the Trainer's evaluate() between training steps: Accelerate's
    prepare_model moves the model to cpu:0, a copy of every parameter — issue #65),
    gradient_checkpointing=True (HF's flag) and greedy generate() after training, at
    stages 0-3, and resumed from checkpoint-3 (written after the step-3 evaluation) at the
    same stage and at another: the logged losses, norms and eval losses are DDP's, and the
    generated tokens the same, on a Llama with untied embeddings."""
    logs = _all()["logs"]
    got, want = logs[name], logs["ddp-eval"]
    assert got[-1]["generated"] == want[-1]["generated"] and len(got[-1]["generated"]) == 9
    _assert_same_logs([h for h in got if "loss" in h], [h for h in want if "loss" in h])
    _assert_same_logs([h for h in got if "eval_loss" in h],
                      [h for h in want if "eval_loss" in h], keys=("eval_loss",))
    assert len([h for h in got if "eval_loss" in h]) == 2  # steps 3 and 6


def test_fp16_is_zeroshards_loss_scaled_fp16() -> None:
    """fp16=True: zeroshard's fp16 recipe with its own loss scaling (Accelerate's GradScaler
    is off): the fp32 run's losses and norms within fp16's rounding."""
    logs = _all()["logs"]
    _assert_same_logs(logs["s2-fp16"], logs["ddp"], rel=3e-2)


def test_bf16_trains_within_the_bf16_tolerance() -> None:
    """bf16=True is zeroshard's bf16 recipe (16-bit compute weights, fp32 masters); the
    plain Trainer's is autocast over fp32 weights: the same within bf16's rounding."""
    logs = _all()["logs"]
    _assert_same_logs(logs["s2-bf16"], logs["ddp-bf16"], rel=3e-2, keys=("loss",))


@pytest.mark.parametrize("name", ["s2-resume", "s2-as-s3"])
def test_resume_from_step_3_continues_as_the_uninterrupted_run(name: str) -> None:
    """Checkpoint-3 of the stage-2 run, resumed at stage 2 and at stage 3: steps 4-6 log
    what the uninterrupted run logged, and the final weights are the same."""
    run = _all()
    logs = run["logs"]
    # the log history comes back with the checkpoint's trainer state: steps 1-3 as saved
    _assert_same_logs(logs[name], logs["s2"])
    from safetensors.torch import load_file

    out = {"s2-resume": "s2r", "s2-as-s3": "s2s3"}[name]
    got = load_file(f"{run['base']}/{out}/final/model.safetensors")
    want = load_file(f"{run['base']}/s2/final/model.safetensors")
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 3])
def test_the_saved_model_loads_with_plain_from_pretrained(stage: int) -> None:
    base = _all()["base"]
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    ours = transformers.AutoModelForCausalLM.from_pretrained(f"{base}/s{stage}/final").eval()
    ddp = transformers.AutoModelForCausalLM.from_pretrained(f"{base}/ddp/final").eval()
    assert type(ours) is type(ddp)
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=x).logits, ddp(input_ids=x).logits,
                                   rtol=1e-4, atol=1e-5)
    assert (Path(base) / f"s{stage}" / "checkpoint-3" / "zeroshard" / "zeroshard.json").exists()


def test_lora_saves_the_adapter_ddp_saves() -> None:
    from safetensors.torch import load_file

    run = _all()
    _assert_same_logs(run["logs"]["s3-lora"], run["logs"]["ddp-lora"])
    got = load_file(f"{run['base']}/s3l/final/adapter_model.safetensors")
    want = load_file(f"{run['base']}/ddpl/final/adapter_model.safetensors")
    assert got.keys() == want.keys() and got  # non-empty, same names
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    with open(f"{run['base']}/s3l/final/adapter_config.json") as f:
        assert json.load(f)["peft_type"] == "LORA"


def _adapters_equal(base: str, got: str, want: str) -> None:
    """The LoRA adapters two runs saved (q_proj and v_proj of 2 layers: 8 tensors)."""
    from safetensors.torch import load_file

    a = load_file(f"{base}/{got}/final/adapter_model.safetensors")
    b = load_file(f"{base}/{want}/final/adapter_model.safetensors")
    assert a.keys() == b.keys() and len(a) == 8
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", range(4))
def test_trl_sft_with_lora_equals_ddp(stage: int) -> None:
    """TRL's SFTTrainer wraps the model with LoRA itself (peft_config=): the same losses
    and gradient norms as its DDP run, and an adapter equal to the one DDP saves."""
    run = _all()
    _assert_same_logs(run["logs"][f"trl-s{stage}"], run["logs"]["trl-ddp"])
    _adapters_equal(run["base"], f"trl-s{stage}", "trl-ddp")


def test_trl_bf16_default_trains_within_the_bf16_tolerance() -> None:
    logs = _all()["logs"]
    _assert_same_logs(logs["trl-s3-bf16"], logs["trl-ddp-bf16"], rel=3e-2, keys=("loss",))


DPO_KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins")


def test_trl_dpo_with_lora_equals_ddp_at_stage_3() -> None:
    """TRL's DPOTrainer + LoRA (trl/scripts/dpo.py --use_peft): losses, gradient norms and
    rewards as its DDP run, and the same adapter."""
    run = _all()
    _assert_same_logs(run["logs"]["dpo-s3"], run["logs"]["dpo-ddp"], keys=DPO_KEYS)
    _adapters_equal(run["base"], "dpo-s3", "dpo-ddp")


def _same_dpo_logs(got: list[dict], want: list[dict]) -> None:
    """Losses and norms within 1e-5 relative; the rewards (beta x a log-ratio of two
    nearly equal log-probabilities, ~1e-2 here) within 1e-6 absolute: relative to their
    own size float32's rounding of the log-probabilities shows at ~1e-5."""
    _assert_same_logs(got, want, keys=("loss", "grad_norm"))
    for g, w in zip(got, want):
        for k in DPO_KEYS[2:]:
            assert abs(g[k] - w[k]) < 1e-6, (g["step"], k, g[k], w[k])


def test_trl_dpo_with_a_reference_model_shards_it_and_equals_ddp_at_stage_3() -> None:
    """DPOTrainer without LoRA keeps a separate reference model: at stage 3 zeroshard
    shards it too (half its bytes on each of the 2 ranks, not the whole model), and the
    losses, gradient norms and rewards are DDP's."""
    logs = _all()["logs"]
    got, want = logs["dpo-full-s3"], logs["dpo-full-ddp"]
    _same_dpo_logs(got, want)
    assert got[-1]["reference bytes"] <= want[-1]["reference bytes"] // 2 + 4096, (
        got[-1]["reference bytes"], want[-1]["reference bytes"])
    # sync_ref_model=True: TRL's soft update (ref = 0.5 ref + 0.5 policy) after every step
    # runs on the shards; the rewards after 3 syncs read DDP's reference weights.
    _same_dpo_logs(logs["dpo-sync-s3"], logs["dpo-sync-ddp"])
    assert logs["dpo-sync-ddp"][-1]["rewards/margins"] != want[-1]["rewards/margins"]


def test_trl_grpo_at_stage_3_equals_ddp_with_a_sharded_reference() -> None:
    """TRL's GRPOTrainer (generation through zeroshard's gathered generate(), beta > 0, the
    reference synced every step): losses, rewards and gradient norms are DDP's, and the
    reference model holds half its bytes on each of the 2 ranks."""
    logs = _all()["logs"]
    got, want = logs["grpo-s3"], logs["grpo-ddp"]
    _assert_same_logs(got, want, keys=("loss", "reward", "grad_norm"))
    assert got[-1]["reference bytes"] <= want[-1]["reference bytes"] // 2 + 4096, (
        got[-1]["reference bytes"], want[-1]["reference bytes"])


def test_trl_rloo_at_stage_3_equals_ddp_with_a_sharded_reference() -> None:
    """TRL's RLOOTrainer through zeroshard_trainer, as GRPO above: DDP's rewards and
    gradient norms, the reference at half its bytes per rank. Its loss is zero up to float
    rounding (leave-one-out advantages sum to zero; ~1e-7 either side on both): equal
    within 1e-6 absolute."""
    logs = _all()["logs"]
    got, want = logs["rloo-s3"], logs["rloo-ddp"]
    _assert_same_logs(got, want, keys=("reward", "grad_norm"))
    assert all(abs(g["loss"] - w["loss"]) <= 1e-6 for g, w in zip(got, want)), (got, want)
    assert any(abs(w["grad_norm"]) > 1 for w in want)  # it trains: the gradient is not zero
    assert got[-1]["reference bytes"] <= want[-1]["reference bytes"] // 2 + 4096, (
        got[-1]["reference bytes"], want[-1]["reference bytes"])


def test_trl_dpo_bf16_trains_within_the_bf16_tolerance() -> None:
    logs = _all()["logs"]
    _assert_same_logs(logs["dpo-s3-bf16"], logs["dpo-ddp-bf16"], rel=3e-2, keys=("loss",))


def _dpo_stages(rank: int, world: int, base: str) -> list[list[dict]]:
    transformers.logging.set_verbosity_error()
    dpo = _example(DPO)
    runs = [["--stage", str(s), "--out", f"{base}/dpo-s{s}"] for s in (0, 1, 2)]
    runs.append(["--stage", "2", "--bf16", "--out", f"{base}/dpo-s2b"])
    return [dpo.main(argv) for argv in runs]


@pytest.mark.slow
def test_trl_dpo_with_lora_equals_ddp_at_stages_0_to_2() -> None:
    run = _all()
    logs = run_ranks(_dpo_stages, 2, run["base"], timeout=900, env=ENV)[0]
    for stage in (0, 1, 2):
        _assert_same_logs(logs[stage], run["logs"]["dpo-ddp"], keys=DPO_KEYS)
        _adapters_equal(run["base"], f"dpo-s{stage}", "dpo-ddp")
    _assert_same_logs(logs[3], run["logs"]["dpo-ddp-bf16"], rel=3e-2, keys=("loss",))


# -- bad settings: refused before training, nothing written ---------------------------------
def _refused(rank: int, world: int, out: str, case: str) -> str:
    example = _example()
    from zeroshard.integrations.hf_trainer import ZeroShardTrainer

    kwargs: dict[str, Any] = {"output_dir": out, "max_steps": 1, "report_to": [],
                              "use_cpu": True}
    zs: dict[str, Any] = {"stage": 2}
    if case == "fsdp":
        kwargs["fsdp"] = "full_shard"
    elif case == "unknown":
        zs["stagee"] = 3
    elif case == "precision":
        kwargs["bf16"] = True
        zs["mixed_precision"] = "fp16"
    elif case == "stage":
        zs["stage"] = 5
    try:
        args = transformers.TrainingArguments(**kwargs)
        trainer = ZeroShardTrainer(model=example.tiny_llama(), args=args,
                                   train_dataset=example.Tokens(128, 16, 8), zeroshard=zs)
        trainer.train()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(("case", "says"), [
    ("fsdp", "drop fsdp="), ("unknown", "unknown option(s) ['stagee']"),
    ("precision", "set the precision in one place"), ("stage", "stage"),
])
def test_bad_settings_are_refused_before_training(case: str, says: str,
                                                  tmp_path: Path) -> None:
    out = tmp_path / "out"
    msgs = run_ranks(_refused, 2, str(out), case, timeout=120, env=ENV)
    for msg in msgs:
        assert says in msg, msg
    assert not out.exists() or not any(out.iterdir())


def test_import_does_not_import_transformers() -> None:
    import subprocess

    code = ("import sys, zeroshard.integrations, zeroshard.integrations.hf_trainer; "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"}, check=True)
    assert out.stdout.strip() == "False"
