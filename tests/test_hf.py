"""Hugging Face transformers causal LMs under zeroshard (zeroshard.hf; extra zeroshard[hf]).

Tiny GPT2LMHeadModel (tied embeddings, loss through ``labels=``) and LlamaForCausalLM
(grouped-query attention, untied head, loss from the logits) built from configs with random
init, no download. One group of ranks per world size runs every configuration (sweep).
Parity bound per parameter, as in test_parity.py: ||delta|| / ||reference|| <= max(1e-5,
3 x what torch DDP reaches on the same batches, 3 x the re-association yardstick: single
process summing the batch in two halves). HF's attention kernels round differently at
different batch sizes, which is what the yardsticks measure.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may reach a model hub
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

import zeroshard  # noqa: E402
import zeroshard.hf as zhf  # noqa: E402
from zeroshard.data import SyntheticLanguage, TokenLoader  # noqa: E402
from zeroshard.testing import run_ranks, sweep  # noqa: E402

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 128, 16, 12, 3
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
KINDS = ("gpt2", "llama")
LOSS = {"gpt2": "labels", "llama": "logits"}


def tiny(kind: str, seed: int = 0, attn: str | None = None) -> torch.nn.Module:
    """2 layers, hidden 64, 4 heads, vocab 128, no dropout; random init from ``seed``;
    HF's default attention (SDPA where the model supports it) unless ``attn``."""
    torch.manual_seed(seed)
    extra = {} if attn is None else {"attn_implementation": attn}
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            **extra)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0, **extra)
    return transformers.LlamaForCausalLM(cfg)


def hf_checkpointing(model: torch.nn.Module, *, on: bool = True, reentrant: bool = False) -> None:
    """HF's own checkpointing flag (renamed activation_checkpointing_* in transformers 5)."""
    new = hasattr(model, "activation_checkpointing_enable")
    if not on:
        (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()
    elif new:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant})


def loss_of(kind: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if LOSS[kind] == "labels":  # HF shifts the labels itself: predict x[1:] from x[:-1]
        return model(input_ids=x, labels=x, use_cache=False).loss
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def loader(rank: int, world: int) -> TokenLoader:
    src = SyntheticLanguage(VOCAB, SEQ, seed=1)
    return TokenLoader(src, global_batch=GLOBAL_BATCH, rank=rank, world_size=world)


def train_sharded(rank: int, world: int, *, kind: str, stage: int, hf_gc: str | None = None,
                  policy: str | None = None, export: str | None = None) -> dict:
    model = tiny(kind)
    if hf_gc is not None:  # HF's own flag, composed with sharding
        hf_checkpointing(model, reentrant=hf_gc == "reentrant")
    if policy is not None:
        zhf.apply_checkpointing(model, policy)
    model.train()
    model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=stage, lr=1e-2,
                                   weight_decay=0.1)
    data = loader(rank, world)
    for _ in range(STEPS):
        x, y = next(data)
        loss_of(kind, model, x, y).backward()
        optim.step()
        optim.zero_grad()
    full = zeroshard.full_state_dict(model)
    if export is not None:
        zhf.save_pretrained(model, export)
    return full


def train_reference(kind: str, split: int = 1) -> dict:
    """One process, whole global batch; ``split=2`` sums it in two halves instead."""
    model = tiny(kind)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = loader(0, 1)
    for _ in range(STEPS):
        for x, y in data.micro_batches(split):
            (loss_of(kind, model, x, y) / split).backward()
        optim.step()
        optim.zero_grad()
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def train_ddp(rank: int, world: int, *, kind: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = tiny(kind)
    model.train()
    ddp = DDP(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = loader(rank, world)
    for _ in range(STEPS):
        x, y = next(data)
        loss_of(kind, ddp, x, y).backward()
        optim.step()
        optim.zero_grad()
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def fp16_update(rank: int, world: int) -> tuple[float, float]:
    """One SGD step in fp16 with the loss inside a ModelOutput, against fp32: the engine
    must scale the loss alone (not the logits too) and unscale before the step. Steps
    that overflow are skipped and retried at half the scale (transformers 4 computes the
    loss in fp16, whose gradient overflows at 2^16)."""
    ref = tiny("gpt2")
    x, _ = next(loader(0, 1))
    w0 = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref(input_ids=x, labels=x, use_cache=False).loss.backward()
    want = {n: -0.1 * p.grad for n, p in ref.named_parameters()}
    model, optim = zeroshard.shard(tiny("gpt2"), torch.optim.SGD, stage=1, lr=0.1,
                                   mixed_precision="fp16")
    xr, _ = next(loader(rank, world))
    for _ in range(16):
        scale = optim.loss_scale
        model(input_ids=xr, labels=xr, use_cache=False).loss.backward()
        optim.step()
        optim.zero_grad()
        if optim.loss_scale == scale:  # not skipped
            break
    got = zeroshard.full_state_dict(model)
    num = sum(((got[n] - w0[n]) - want[n]).norm() ** 2 for n in want) ** 0.5
    return float(num / sum(d.norm() ** 2 for d in want.values()) ** 0.5), scale


def no_layer_list(rank: int, world: int) -> str:
    # one module with parameters: no layer list, and nothing to choose units by size from
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    try:
        zeroshard.shard(model, torch.optim.AdamW, stage=3)
    except ValueError as e:
        return str(e)
    return "no error"


def bench_in_group(rank: int, world: int, config_path: str) -> dict[str, str]:
    """zeroshard bench's per-rank entry on an HF config, inside this group of ranks."""
    from zeroshard.bench.configs import BenchSettings, parse_configs
    from zeroshard.bench.worker import rank_main

    os.environ[zhf.BENCH_CONFIG_ENV] = config_path
    s = BenchSettings(model=None, model_factory="zeroshard.hf:bench_model", vocab=VOCAB,
                      world_size=world, micro_batch=1, seq=SEQ, warmup=0, steps=1,
                      configs=tuple(parse_configs("zs-s3,zs-s3-full,zs-s3-selective")),
                      baseline="zs-s3")
    meta = rank_main(s, progress=False)
    return {} if meta is None else {r["spec"].name: r["status"] + r["error"] for r in meta["rows"]}


GRID: list[dict[str, Any]] = [{"kind": k, "stage": s} for k in KINDS for s in (1, 2, 3)]
# World 2 only: HF's own checkpointing flag (both checkpoint engines) and zeroshard.hf's
# policies, composed with sharding; checkpointing changes no arithmetic.
EXTRA: list[dict[str, Any]] = [
    {"kind": "gpt2", "stage": 3, "hf_gc": "non-reentrant"},
    {"kind": "llama", "stage": 3, "hf_gc": "reentrant"},
    {"kind": "llama", "stage": 2, "hf_gc": "non-reentrant"},
    {"kind": "gpt2", "stage": 3, "policy": "selective"},
    {"kind": "llama", "stage": 3, "policy": "selective"},
    {"kind": "llama", "stage": 3, "policy": "every-2"},
]


def _all(rank: int, world: int, grid: list[dict], checks: dict[str, Any]) -> dict:
    transformers.logging.set_verbosity_error()
    out: dict[str, Any] = {
        # Single-process references (split=2: the re-association yardstick), computed
        # here so that the ranks share the work.
        "refs": {(k, split): train_reference(k, split)
                 for k in KINDS[rank::world] for split in (1, 2)},
    }
    results = sweep(functools.partial(train_sharded, rank, world), grid)
    ddp = {k: train_ddp(rank, world, kind=k) for k in KINDS}
    if checks:
        out["exported"] = {k: train_sharded(rank, world, kind=k, stage=3, export=d)
                           for k, d in checks["export_dirs"].items()}
        out["fp16"] = fp16_update(rank, world)
        out["no_layers"] = no_layer_list(rank, world)
        out["bench"] = bench_in_group(rank, world, checks["bench_config"])
    if rank == 0:
        out.update(results=results, ddp=ddp)
    return out


@functools.cache
def _world_run(world: int) -> dict:
    """One group of ranks per world size; world 2 also runs the extra configurations,
    the export, fp16 scaling, the missing-layer-list error and the bench."""
    grid = GRID + (EXTRA if world == 2 else [])
    checks: dict[str, Any] = {}
    if world == 2:
        base = Path(tempfile.mkdtemp(prefix="zeroshard-hf-"))
        (base / "config.json").write_text(tiny("llama").config.to_json_string())
        checks = {"export_dirs": {k: str(base / k) for k in KINDS},
                  "bench_config": str(base / "config.json")}
    outs = run_ranks(_all, world, grid, checks, timeout=300, env=ENV)
    run = {**outs[0], "world": world, "grid": grid, **checks}
    run["refs"] = {key: ref for o in outs for key, ref in o["refs"].items()}
    return run


@pytest.fixture
def world_run() -> dict:
    """The world-2 run (extra checks run there only)."""
    return _world_run(2)


@pytest.mark.parametrize("world", [2, 3])
def test_hf_parity_stages_1_to_3(world: int) -> None:
    from _training import rel_diffs

    world_run = _world_run(world)
    world, grid, results = world_run["world"], world_run["grid"], world_run["results"]
    ref = world_run["refs"]
    ddp = {k: rel_diffs(world_run["ddp"][k], ref[k, 1]) for k in KINDS}
    yard = {k: rel_diffs(ref[k, 2], ref[k, 1]) for k in KINDS}
    failures = []
    worst = {k: {"dev": (0.0, ""), "ratio": 0.0, "median": 0.0} for k in KINDS}
    for point, got in zip(grid, results):
        kind, w = point["kind"], worst[point["kind"]]
        devs = rel_diffs(got, ref[kind, 1])
        for name, dev in devs.items():
            bound = max(1e-5, 3 * yard[kind][name], 3 * ddp[kind][name])
            w["dev"] = max(w["dev"], (dev, name))
            w["ratio"] = max(w["ratio"], dev / bound)
            if dev > bound:
                failures.append(f"{point} {name}: {dev:.2e} > bound {bound:.1e}")
        w["median"] = max(w["median"], sorted(devs.values())[len(devs) // 2])
    for k, w in worst.items():
        d = max((v, n) for n, v in ddp[k].items())
        med = sorted(ddp[k].values())[len(ddp[k]) // 2]
        print(f"world {world} {k} ({LOSS[k]} loss): DDP worst {d[0]:.2e} ({d[1]}, median "
              f"{med:.1e}), re-association worst {max(yard[k].values()):.2e}; zeroshard "
              f"worst {w['dev'][0]:.2e} ({w['dev'][1]}, median {w['median']:.1e}), "
              f"worst deviation/bound {w['ratio']:.2f}")
    assert not failures, "\n".join(failures)


def test_export_loads_with_from_pretrained(world_run) -> None:
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    for kind, full in world_run["exported"].items():
        out = Path(world_run["export_dirs"][kind])
        assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
        assert type(loaded) is type(tiny(kind))
        fresh = tiny(kind, seed=1).eval()
        fresh.load_state_dict(full)
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=x).logits, fresh(input_ids=x).logits), kind
        if kind == "gpt2":  # tied: stored once, tied again on load
            from safetensors import safe_open

            with safe_open(str(out / "model.safetensors"), "pt") as f:
                assert "lm_head.weight" not in f.keys()
            assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_fp16_scales_the_loss_inside_model_output(world_run) -> None:
    error, scale = world_run["fp16"]
    assert error < 5e-2 and scale >= 2.0**8, (error, scale)  # a wrong scale is off by >> 1


def test_no_layer_list_error_says_how_to_pass_units(world_run) -> None:
    message = world_run["no_layers"]
    assert "units=" in message and "Sequential" in message, message
    with pytest.raises(ValueError, match="units=list"):
        zhf.decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_bench_runs_an_hf_config_on_every_rank(world_run) -> None:
    assert world_run["bench"] == {"zs-s3": "ok", "zs-s3-full": "ok", "zs-s3-selective": "ok"}



# -- single process ---------------------------------------------------------------------
def test_import_zeroshard_does_not_import_transformers() -> None:
    code = ("import sys, zeroshard, zeroshard.hf, zeroshard.cli, zeroshard.checkpointing; "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, **ENV})
    assert out.stdout.strip() == "False", out.stderr


def test_default_units_are_the_decoder_layers() -> None:
    from zeroshard.engine.units import _unit_modules

    for kind, path in (("gpt2", "transformer.h"), ("llama", "model.layers")):
        model = tiny(kind)
        layers = model.get_submodule(path)
        assert zhf.decoder_layers(model) is layers
        assert _unit_modules(model, None) == list(layers)


def _tiny_family(kind: str) -> torch.nn.Module:
    if kind != "mistral":
        return tiny(kind)
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0))


def test_checkpointing_on_hfs_default_call_turns_the_cache_off_in_training(caplog) -> None:
    """``model(input_ids=x, labels=x)`` (use_cache=True by default, as the HF Trainer
    calls it) in train mode: gradients bitwise those without checkpointing, for every
    family the planner supports; the cache is off in training (said once in the log) and
    on in evaluation; a cache passed in to a training forward is refused. See [Note: the
    KV cache under checkpointing] in zeroshard/hf.py."""
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    zhf._LOG_ONCE.clear()
    for kind in (*KINDS, "mistral"):
        ref = _tiny_family(kind)
        ref.train()
        ref(input_ids=x, labels=x, use_cache=False).loss.backward()
        for policy in ("selective", "selective-op", "full"):
            model = _tiny_family(kind)
            model.train()
            zhf.apply_checkpointing(model, policy)
            out = model(input_ids=x, labels=x)
            out.loss.backward()
            assert out.past_key_values is None, (kind, policy)  # full: it held keys twice
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(p.grad, q.grad), (kind, policy, n)
            model.eval()
            with torch.no_grad():
                assert model(input_ids=x).past_key_values.get_seq_length() == SEQ
            model.train()
            cache = model(input_ids=x, use_cache=True).past_key_values  # still off
            assert cache is None, (kind, policy)
            with torch.no_grad():
                cache = model(input_ids=x[:, :4]).past_key_values  # no gradients: kept
            with pytest.raises(ValueError, match="= was passed to a training forward"):
                model(input_ids=x[:, :4], past_key_values=cache)
            zhf.remove_checkpointing(model)
            assert model(input_ids=x).past_key_values is not None  # the hook went too
    said = [r.getMessage() for r in caplog.records
            if "use_cache=True is incompatible with activation checkpointing" in r.getMessage()]
    # once per decoder class and process
    assert [m.split(": ")[1].split()[0] for m in said] == ["GPT2Model", "LlamaModel",
                                                            "MistralModel"], said


def test_selective_recomputes_the_attention_core_only() -> None:
    """Gradients are bitwise those without checkpointing; with eager attention the
    scores are no longer alive after forward."""
    from zeroshard.memory.tracker import Category, MemoryTracker

    x = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
    for kind in KINDS:
        live, grads = {}, {}
        for policy in ("none", "selective", "full"):
            model = tiny(kind, attn="eager")
            model.train()
            zhf.apply_checkpointing(model, policy)
            if policy == "selective":  # e.g. LlamaAttention (LlamaSdpaAttention before 4.48)
                names = [type(m).__name__ for m in zhf.selective_modules(model)]
                want = "GPT2" if kind == "gpt2" else "Llama"
                assert len(names) == 2 and all(
                    n.startswith(f"Selective{want}") and n.endswith("Attention") for n in names
                ), names
            with MemoryTracker().track_module(model) as t:
                loss = model(input_ids=x, labels=x, use_cache=False).loss
                now = t.current()
            live[policy] = now[Category.ACTIVATIONS] + now[Category.OTHER]
            loss.backward()
            grads[policy] = {n: p.grad for n, p in model.named_parameters()}
        for policy in ("selective", "full"):
            for n, g in grads["none"].items():
                assert torch.equal(grads[policy][n], g), (kind, policy, n)
        # per layer, the b x heads x s x s fp32 scores and softmax output are not kept
        scores = 4 * 4 * SEQ * SEQ * 4
        assert live["none"] - live["selective"] >= 2 * scores, (kind, live)
        assert live["full"] < live["selective"] < live["none"], (kind, live)


def test_checkpointing_refuses_double_with_hf_flag() -> None:
    from zeroshard.checkpointing import checkpointed_modules

    model = tiny("llama")
    hf_checkpointing(model)
    with pytest.raises(ValueError, match="checkpointing_disable"):
        zhf.apply_checkpointing(model, "full")
    hf_checkpointing(model, on=False)
    zhf.apply_checkpointing(model, "full")
    assert [n for n, _ in checkpointed_modules(model)] == ["model.layers.0", "model.layers.1"]
    zhf.apply_checkpointing(model, "selective")  # replaces the previous policy
    assert not list(checkpointed_modules(model))
    assert len(zhf.selective_modules(model)) == 2
    zhf.remove_checkpointing(model)
    names = {type(m).__name__ for m in zhf.selective_modules(model)}
    assert len(names) == 1 and not names.pop().startswith("Selective")


LLAMA2_7B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
}


def test_plan_from_hf_config_matches_llama_7b_preset(tmp_path: Path, capsys) -> None:
    from zeroshard.cli import main
    from zeroshard.memory import analytic
    from zeroshard.memory.planner import plan
    from zeroshard.models import get_preset

    cfg = zhf.model_config_from_hf(LLAMA2_7B)
    preset = get_preset("llama-7b")
    assert cfg.param_count() == preset.param_count() == 6_738_415_616
    for n in (1, 8):
        for stage in range(4):
            got = analytic.model_state_bytes(cfg.param_count(), stage=stage, n=n)
            assert got == analytic.model_state_bytes(preset.param_count(), stage=stage, n=n)
    kw = dict(gpus=[8, 16], gpu_mem_bytes=80 * 10**9, seq_len=4096, micro_batch=1,
              interconnect_GBps=400.0)
    assert plan(cfg, **kw).to_dict() == plan("llama-7b", **kw).to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA2_7B))
    rows = {}
    for which in (["--hf-config", str(path)], ["--model", "llama-7b"]):
        assert main(["plan", *which, "--gpus", "8", "--json"]) == 0
        rows[which[0]] = json.loads(capsys.readouterr().out)["rows"]
    assert rows["--hf-config"] == rows["--model"] and len(rows["--model"]) == 12
    assert main(["plan", "--hf-config", str(tmp_path), "--gpus", "8", "--json"]) == 0  # a dir
    assert json.loads(capsys.readouterr().out)["rows"] == rows["--model"]
    assert main(["plan", "--hf-config", str(path), "--gpus", "8"]) == 0
    assert "Hugging Face config" in capsys.readouterr().out


def test_plan_hf_config_errors(tmp_path: Path, capsys) -> None:
    from zeroshard.cli import main
    from zeroshard.models import get_preset

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**LLAMA2_7B, "attention_bias": True}))
    assert main(["plan", "--hf-config", str(bad)]) == 2
    assert "attention_bias=True" in capsys.readouterr().err
    assert main(["plan", "--hf-config", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    other = tmp_path / "bert.json"
    other.write_text(json.dumps({"model_type": "bert"}))
    assert main(["plan", "--hf-config", str(other)]) == 2
    assert "--params" in capsys.readouterr().err
    gpt2 = zhf.model_config_from_hf({"model_type": "gpt2"})  # HF's defaults: GPT-2 124M
    assert gpt2.param_count() == get_preset("gpt2-124m").param_count()


def test_bench_cli_hf_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from zeroshard.bench.cli import _command, settings_from_args
    from zeroshard.cli import build_parser

    monkeypatch.setenv(zhf.BENCH_CONFIG_ENV, "unset")  # restored after the test
    path = tmp_path / "config.json"
    path.write_text(tiny("llama").config.to_json_string())
    s = settings_from_args(build_parser().parse_args(["bench", "--hf-config", str(path)]))
    assert (s.model_factory, s.vocab) == ("zeroshard.hf:bench_model", VOCAB)
    assert os.environ[zhf.BENCH_CONFIG_ENV] == str(path)
    # HF models checkpoint with zeroshard.hf's policies: -selective stays in the list
    assert [c.name for c in s.configs if c.activation_checkpointing == "selective"] == [
        "zs-s3-selective"]
    assert s.model_label == "llama (config.json)"  # tables and plots: its architecture or type
    assert f"--hf-config {path}" in _command(s)
    logits = zhf.bench_model()(torch.zeros(2, 5, dtype=torch.long))
    assert logits.shape == (2, 5, VOCAB)
    selective = ["bench", "--hf-config", str(path), "--configs", "ddp,zs-s3-selective"]
    s = settings_from_args(build_parser().parse_args(selective))
    assert [c.name for c in s.configs] == ["ddp", "zs-s3-selective"]
    missing = ["bench", "--hf-config", str(tmp_path / "nope.json")]
    with pytest.raises(ValueError, match="does not exist"):
        settings_from_args(build_parser().parse_args(missing))
