"""peft (LoRA) models under zeroshard: training, exporting, resuming (issue #31).

A tiny Llama (and a tied-embedding GPT-2) saved as a base with HF's ``save_pretrained``,
loaded by every rank with ``from_pretrained``, wrapped with ``peft.get_peft_model`` (LoRA
r=4), sharded at stages 0-3, fp32 and bf16 mixed precision, trained, then exported with
``zeroshard.hf.save_pretrained``: the adapter (peft's format) and the merged model. This
process reloads them as a user would — ``PeftModel.from_pretrained(base, dir)`` and plain
``AutoModelForCausalLM.from_pretrained(dir)`` — and compares logits with the trained
model's. Exports that would load wrongly are refused ([Note: exports check themselves]).
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
import transformers

import zeroshard
import zeroshard.hf as zhf
from zeroshard.hf_export import ExportError
from zeroshard.testing import run_ranks, sweep

os.environ["HF_HUB_OFFLINE"] = "1"
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
       "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
VOCAB, SEQ, STEPS = 128, 16, 3
LORA = {"llama": dict(target_modules=["q_proj", "v_proj"]),
        "gpt2": dict(target_modules=["c_attn"], fan_in_fan_out=True)}


def base_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":  # tied input/output embeddings
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0))


def lora(kind: str, base: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **LORA[kind])
    return peft.get_peft_model(base, config)


def probe() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(9))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(
        100 * step + rank))


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=probe(), use_cache=False).logits.float()


def sharded(kind: str, bases: str, stage: int, mp: str | None,
            dtype: str | None = None) -> tuple[Any, Any]:
    base = transformers.AutoModelForCausalLM.from_pretrained(
        f"{bases}/{kind}", dtype=getattr(torch, dtype) if dtype else None)
    return zeroshard.shard(lora(kind, base), torch.optim.AdamW, stage=stage, lr=1e-2,
                           mixed_precision=mp)


def train(model: Any, optim: Any, rank: int, steps: range) -> None:
    for step in steps:
        x = batch(rank, step)
        model(input_ids=x, labels=x, use_cache=False).loss.backward()
        optim.step()
        optim.zero_grad()


def train_and_export(rank: int, world: int, *, kind: str, stage: int, mp: str | None,
                     bases: str, out: str, dtype: str | None = None) -> dict:
    model, optim = sharded(kind, bases, stage, mp, dtype)
    train(model, optim, rank, range(STEPS))
    tag = f"{out}/{kind}-s{stage}-{mp}-{dtype}"
    zhf.save_pretrained(model, f"{tag}-adapter")
    zhf.save_pretrained(model, f"{tag}-merged", merge_adapters=True)
    return {"logits": logits_of(model), "full": zeroshard.full_state_dict(model), "tag": tag}


def resume(rank: int, world: int, bases: str, out: str) -> dict:
    """Train 2 steps, save a sharded checkpoint, train 1 more; a fresh peft model loads the
    checkpoint and trains the same step: the weights agree exactly."""
    model, optim = sharded("llama", bases, 3, "bf16")
    train(model, optim, rank, range(2))
    zeroshard.save_checkpoint(f"{out}/ckpt", model, optim, extra={"step": 2})
    train(model, optim, rank, range(2, 3))
    again, optim2 = sharded("llama", bases, 3, "bf16")
    extra = zeroshard.load_checkpoint(f"{out}/ckpt", again, optim2)
    train(again, optim2, rank, range(extra["step"], 3))
    a, b = zeroshard.full_state_dict(model), zeroshard.full_state_dict(again)
    return {"equal": all(torch.equal(a[k], b[k]) for k in a), "keys": len(a)}


def refused_on_every_rank(rank: int, world: int, out: str) -> str:
    """An export rank 0 refuses raises on every rank (none reports success)."""
    model, _ = zeroshard.shard(base_model("llama"), torch.optim.AdamW, stage=3, lr=1e-2)
    model.config.intermediate_size = 256  # the config no longer describes the weights
    try:
        zhf.save_pretrained(model, f"{out}/refused")
    except ExportError as exc:
        return str(exc)
    return "no error"


def _dpo_loss(model: Any, x: torch.Tensor, reference: bool = True) -> torch.Tensor:
    """TRL DPO's shape: a reference pass through the same peft model with its adapters
    disabled (``disable_adapter()`` flips the adapters' requires_grad, under no_grad),
    then the policy's loss against it."""
    out = model(input_ids=x, labels=x, use_cache=False)
    ref = torch.zeros(())
    if reference:  # after the policy's forward, before its backward, as TRL orders them
        with torch.no_grad(), model.disable_adapter():
            ref = model(input_ids=x, use_cache=False).logits.float()
    return out.loss + (out.logits.float() - ref).pow(2).mean()


def dpo_reference_pass(rank: int, world: int, *, stage: int, mp: str | None,
                       bases: str) -> dict:
    """Three steps of _dpo_loss at ``stage`` / ``mp``; then the error for an adapter left
    disabled (flags still flipped) at the next forward with gradients."""
    model, optim = sharded("llama", bases, stage, mp)
    losses = []
    for step in range(STEPS):
        loss = _dpo_loss(model, batch(rank, step))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    model.base_model.disable_adapter_layers()  # flips the flags and leaves them flipped
    try:
        _dpo_loss(model, batch(rank, 0), reference=False)
        left = "no error"
    except RuntimeError as exc:
        left = str(exc)
    model.base_model.enable_adapter_layers()
    return {"losses": losses, "full": zeroshard.full_state_dict(model), "left": left}


DPO_GRID = [{"stage": s, "mp": None} for s in range(4)] + [
    {"stage": s, "mp": "bf16"} for s in (2, 3)]

GRID = [{"kind": "llama", "stage": s, "mp": mp} for s in range(4) for mp in (None, "bf16")]
GRID += [{"kind": "gpt2", "stage": 3, "mp": None}, {"kind": "gpt2", "stage": 1, "mp": "bf16"}]
# a base loaded in bf16 (its LoRA weights fp32, as peft makes them): exported in bf16
GRID += [{"kind": "llama", "stage": 3, "mp": None, "dtype": "bfloat16"}]


def _all(rank: int, world: int, bases: str, out: str) -> dict:
    transformers.logging.set_verbosity_error()
    results = sweep(functools.partial(train_and_export, rank, world, bases=bases, out=out),
                    GRID)
    dpo = sweep(functools.partial(dpo_reference_pass, rank, world, bases=bases), DPO_GRID)
    return {"results": results, "resume": resume(rank, world, bases, out),
            "refused": refused_on_every_rank(rank, world, out), "dpo": dpo}


@functools.cache
def _run() -> dict:
    bases = Path(tempfile.mkdtemp(prefix="zeroshard-peft-bases-"))
    for kind in ("llama", "gpt2"):
        base_model(kind).save_pretrained(str(bases / kind))
    out = tempfile.mkdtemp(prefix="zeroshard-peft-")
    ranks = run_ranks(_all, 2, str(bases), out, timeout=400, env=ENV)
    return {"bases": str(bases), "out": out, "ranks": ranks}


@pytest.fixture
def run() -> dict:
    return _run()


def _reference(run: dict, kind: str, full: dict, *, adapters_only: bool = False,
               dtype: str | None = None) -> torch.nn.Module:
    """The trained model, unsharded: a fresh peft model over the base files with the
    trained weights (``adapters_only``: the adapters' weights, the base's own; under mixed
    precision zeroshard holds frozen weights in bf16, docs/porting.md)."""
    model = lora(kind, transformers.AutoModelForCausalLM.from_pretrained(
        f"{run['bases']}/{kind}", dtype=getattr(torch, dtype) if dtype else None))
    if adapters_only:
        model.load_state_dict({k: v for k, v in full.items() if ".lora_" in k}, strict=False)
    else:
        model.load_state_dict(full, strict=True)
    return model.eval()


def _close(got: torch.Tensor, want: torch.Tensor, mp: str | None) -> None:
    if mp is None:  # fp32 training: the trained model's own forward, bit for bit
        assert torch.equal(got, want), (got - want).abs().max()
    else:  # the trained model computes in bf16; the export holds its fp32 masters
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)


def _base(run: dict, kind: str, dtype: str | None) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        f"{run['bases']}/{kind}", dtype=getattr(torch, dtype) if dtype else None).eval()


def test_adapter_export_loads_with_peft_from_pretrained(run: dict) -> None:
    for point, res in zip(GRID, run["ranks"][0]["results"]):
        kind, mp, dtype = point["kind"], point["mp"], point.get("dtype")
        d = Path(f"{res['tag']}-adapter")
        names = {p.name for p in d.iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= names, (point, names)
        assert "model.safetensors" not in names, point
        base = _base(run, kind, dtype)
        loaded = peft.PeftModel.from_pretrained(base, str(d)).eval()
        got = logits_of(loaded)
        # the export holds exactly the trained adapter weights
        want = logits_of(_reference(run, kind, res["full"], adapters_only=True, dtype=dtype))
        assert torch.equal(got, want), point
        if mp is None:  # the base is untouched by training: the trained model, bitwise
            assert torch.equal(got, logits_of(_reference(run, kind, res["full"], dtype=dtype))), \
                point
        _close(got, res["logits"], mp)
        # and training moved the adapter: the export is not the base
        assert (got - logits_of(_base(run, kind, dtype))).abs().max() > 1e-3, point


def test_merged_export_loads_with_plain_from_pretrained(run: dict) -> None:
    for point, res in zip(GRID, run["ranks"][0]["results"]):
        kind, mp, dtype = point["kind"], point["mp"], point.get("dtype")
        d = f"{res['tag']}-merged"
        loaded = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
        assert type(loaded) is type(base_model(kind)), (point, type(loaded))
        # exported in the dtypes the model was built in, as HF's save_pretrained does
        assert loaded.dtype == (getattr(torch, dtype) if dtype else torch.float32), point
        ref = _reference(run, kind, res["full"], dtype=dtype)
        unmerged = logits_of(ref)
        merged = logits_of(ref.merge_and_unload())
        got = logits_of(loaded)
        assert torch.equal(got, merged), point  # peft's merge of the trained weights
        # merging re-associates W x + s B (A x) as (W + s B A) x: float rounding only
        tol = 1e-5 if dtype is None else 2e-2  # (in bf16, bf16's)
        torch.testing.assert_close(got, unmerged, atol=tol, rtol=tol)
        if mp is None:
            torch.testing.assert_close(got, res["logits"], atol=tol, rtol=tol)
        else:
            _close(got, res["logits"], mp)
        if kind == "gpt2":  # tied: stored once and tied again on load
            assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_resume_from_a_sharded_checkpoint_continues_exactly(run: dict) -> None:
    for r in run["ranks"]:
        assert r["resume"]["equal"], r["resume"]


def test_a_refused_export_raises_on_every_rank_and_writes_nothing(run: dict) -> None:
    for rank, r in enumerate(run["ranks"]):
        msg = r["refused"]
        assert "of another shape" in msg, (rank, msg)
        assert "mlp.gate_proj.weight (128, 64) (expected (256, 64))" in msg, (rank, msg)
        assert "Nothing was written" in msg, (rank, msg)
    assert not Path(run["out"], "refused").exists()


# -- single process: planted mismatches -----------------------------------------------------
class Wrapper(torch.nn.Module):
    """A user's wrapper around an HF model, carrying its config: its keys gain a prefix."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm, self.config = lm, lm.config


def test_planted_key_mismatches_fail_loudly(tmp_path: Path) -> None:
    model = base_model("llama")
    model.register_buffer("planted", torch.zeros(3))  # a key LlamaForCausalLM lacks
    with pytest.raises(ExportError, match=r"1 unexpected \(planted\).*Nothing was written"):
        zhf.save_pretrained(model, tmp_path / "extra")
    assert not (tmp_path / "extra").exists()

    model = base_model("llama")
    model.config.vocab_size = 256  # the config no longer matches the embedding
    with pytest.raises(ExportError, match=r"model.embed_tokens.weight \(128, 64\) "
                                          r"\(expected \(256, 64\)\)"):
        zhf.save_pretrained(model, tmp_path / "shape")
    assert not (tmp_path / "shape").exists()

    with pytest.raises(TypeError, match="Wrapper is not a Hugging Face transformers model"):
        zhf.save_pretrained(Wrapper(base_model("llama")), tmp_path / "wrapper")
    assert not (tmp_path / "wrapper").exists()

    with pytest.raises(TypeError, match="merge_adapters=True, but LlamaForCausalLM is not a "
                                        "peft model"):
        zhf.save_pretrained(base_model("llama"), tmp_path / "m", merge_adapters=True)


def test_hf_integrated_adapters_are_refused_with_the_fix(tmp_path: Path) -> None:
    # what transformers' model.add_adapter does (it needs peft >= 0.22, not yet released)
    model = peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["q_proj"]),
                                         base_model("llama"))
    model._hf_peft_config_loaded = True
    with pytest.raises(TypeError, match="peft.get_peft_model"):
        zhf.save_pretrained(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_unsharded_peft_export_matches_peft_own_save(tmp_path: Path) -> None:
    """On an unsharded model the adapter export is peft's own save_pretrained's."""
    from safetensors.torch import load_file

    model = lora("llama", base_model("llama"))
    zhf.save_pretrained(model, tmp_path / "ours")
    model.save_pretrained(str(tmp_path / "peft"))
    ours = load_file(str(tmp_path / "ours" / "adapter_model.safetensors"))
    theirs = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_reference_pass_with_adapters_disabled_trains_as_unsharded(run: dict) -> None:
    """TRL DPO + LoRA's reference pass (peft's disable_adapter() under no_grad flips the
    adapters' requires_grad) at stages 0-3, fp32 and bf16: the losses and weights of one
    process over the global batch; a flip left in place at the next forward with
    gradients keeps the error that names it where the flag cannot reach the backward."""
    model = lora("llama", _base(run, "llama", None))
    model.train()
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    want = []
    for step in range(STEPS):
        per_rank = [_dpo_loss(model, batch(r, step)) for r in range(2)]
        loss = sum(per_rank) / 2  # DDP's mean of the ranks' means
        loss.backward()
        optim.step()
        optim.zero_grad()
        want.append([t.item() for t in per_rank])
    ref = dict(model.state_dict())
    for rank, res in enumerate(run["ranks"]):
        for point, got in zip(DPO_GRID, res["dpo"]):
            tol = 1e-5 if point["mp"] is None else 5e-2
            for g, w in zip(got["losses"], want):
                assert abs(g - w[rank]) <= tol * abs(w[rank]), (point, got["losses"], want)
            for k, v in got["full"].items():
                if ".lora_" in k:
                    torch.testing.assert_close(v, ref[k].float(), atol=tol, rtol=tol)
            if point["stage"] == 3 or point["mp"]:  # the model computes with other tensors
                assert "had requires_grad=True when the model was sharded" in got["left"], got
            else:  # fp32 stages 0-2 honour freezing, as DDP does (docs/porting.md)
                assert got["left"] == "no error", got
