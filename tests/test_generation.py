"""Generation and whole weights kept gathered at stage 3 (issue #44, piece a): ``generate()``
gathers each unit once per call, ``zeroshard.gathered(model, budget=)``,
``model.unshard()``/``reshard()`` and ``set_reshard_after_forward(False)`` under
``no_grad`` — tokens, losses and weights as without them, and the gathers counted in the
ledger. A tiny HF Llama (2 layers: 3 units with the root), world 2, one group of ranks.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import transformers

os.environ["HF_HUB_OFFLINE"] = "1"
transformers.logging.set_verbosity_error()

import zeroshard  # noqa: E402
from zeroshard.testing import run_ranks  # noqa: E402

VOCAB, NEW = 128, 6


def tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def _prompt(rank: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank + 1))


def _generate(model: torch.nn.Module, prompt: torch.Tensor, sample: bool) -> torch.Tensor:
    torch.manual_seed(7)  # sampling draws from torch's global generator
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW,
                          do_sample=sample, top_k=0, pad_token_id=0)


def _gathers(ledger: Any, start: int) -> list:
    return [r for r in ledger.records[start:] if r.op == "all_gather"]


def _generation(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ref = tiny().eval()
    prompt = _prompt(rank)
    want = {s: _generate(ref, prompt, s) for s in (False, True)}
    for stage, budget in ((0, None), (1, None), (2, None), (3, None), (3, 0), (3, "root")):
        opts = {} if budget in (None, "root") or stage != 3 else {"generate_budget": budget}
        model, _ = zeroshard.shard(tiny(), torch.optim.AdamW, stage=stage, lr=1e-3, **opts)
        model.eval()
        engine = zeroshard.engine_of(model)
        ledger = engine.comm.ledger
        key = f"s{stage}-{budget}"
        if budget == "root":  # the root resident, the two layers gathered per token
            root = engine.units[-1].unsharded_bytes
            zeroshard.register_forward_method(model, "generate", budget=root)
            with zeroshard.gathered(model, budget=root) as held:
                out[f"{key}-held"] = held
            out[f"{key}-root"] = root
            out[f"{key}-others"] = sum(u.unsharded_bytes for u in engine.units[:-1])
        for sample in (False, True):
            start = len(ledger.records)
            ledger.windows.pop("generate", None)
            engine.peak_unsharded_bytes = engine.unsharded_bytes
            got = _generate(model, prompt, sample)
            out[f"{key}-{sample}-peak"] = engine.peak_unsharded_bytes
            out[f"{key}-{sample}-equal"] = torch.equal(got, want[sample])
            # generate()'s collectives are in their own window, not the open step's.
            out[f"{key}-{sample}-in-step"] = len(ledger.records) - start
            gathers = [r for r in ledger.windows.get("generate", ()) if r.op == "all_gather"]
            out[f"{key}-{sample}-gathers"] = len(gathers)
            out[f"{key}-{sample}-bytes"] = sum(r.logical_bytes for r in gathers)
        # Ranks that stop at different lengths (EOS on one rank first, or another limit):
        # generate() goes on forwarding with the others (HF's synced_gpus), tokens as
        # unsharded on each rank.
        uneven = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=2 + 4 * rank,
                      do_sample=False, pad_token_id=0)
        out[f"{key}-uneven"] = torch.equal(model.generate(prompt, **uneven),
                                           ref.generate(prompt, **uneven))
        # The tracker files generate()'s key/value cache as kv_cache: the cache of the
        # last forward holds the prompt and every new token but the last.
        tracker = zeroshard.memory_tracker(model)
        kv: list[int] = []
        hook = model.register_forward_hook(
            lambda *_, kv=kv, tracker=tracker: kv.append(tracker.current()["kv_cache"]))
        with tracker:
            _generate(model, prompt, False)
        hook.remove()
        out[f"{key}-kv"] = kv
        out[f"{key}-kv-after"] = tracker.current()["kv_cache"]
        out[f"{key}-kv-max"] = tracker.max_per_category()["kv_cache"]  # read after, as usual
        with zeroshard.memory_tracker(model) as plain, torch.no_grad():
            held = model(prompt, use_cache=True)  # a forward that makes its own cache
            out[f"{key}-kv-plain"] = plain.current()["kv_cache"]
        del held
        out[f"{key}-units"] = len(engine.units)
        out[f"{key}-prefetch"] = engine.config.prefetch
        out[f"{key}-layer"] = max((u.unsharded_bytes for u in engine.units[:-1]), default=0)
        out[f"{key}-bytes-after"] = engine.unsharded_bytes
    return out


def _unshard(rank: int, world: int) -> dict[str, Any]:
    """Three training steps with the model unsharded the whole time (plus an eval, a
    load and an in-place edit in between) against the same steps without unshard()."""
    out: dict[str, Any] = {}
    x = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank + 3))
    runs = {}
    for held in (False, True):
        model, optim = zeroshard.shard(tiny(), torch.optim.AdamW, stage=3, lr=1e-2)
        engine = zeroshard.engine_of(model)
        ledger = engine.comm.ledger
        if held:
            handle = model.unshard(async_op=True)
            handle.wait()
            out["dtensors while held"] = all(hasattr(p, "full_tensor")
                                             for p in model.parameters())
            out["bytes held"] = engine.unsharded_bytes
            out["bytes whole"] = sum(u.unsharded_bytes for u in engine.units)
        losses, gathers = [], []
        for _ in range(3):
            start = len(ledger.records)
            loss = model(x, labels=x).loss
            loss.backward()
            gathers.append(len(_gathers(ledger, start)))
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        with torch.no_grad():
            start = len(ledger.records)
            model.eval()
            logits = [model(x).logits for _ in range(2)]
            model.train()
            out[f"eval gathers {held}"] = len(_gathers(ledger, start))
            # An in-place edit of the masters, then a load: the next forward sees each.
            p = next(model.parameters())
            p.mul_(0.5)
            edited = model(x).logits
            model.load_state_dict(tiny(seed=1).state_dict())
            loaded = model(x).logits
        runs[held] = (losses, logits, edited, loaded)
        out[f"gathers per step {held}"] = gathers
        model.reshard()
        out[f"bytes after reshard {held}"] = engine.unsharded_bytes
    base, kept = runs[False], runs[True]
    out["losses equal"] = base[0] == kept[0]
    out["eval equal"] = all(torch.equal(a, b) for a, b in zip(base[1], kept[1]))
    out["edit seen"] = torch.equal(base[2], kept[2])
    out["load seen"] = torch.equal(base[3], kept[3])
    return out


def _no_reshard_eval(rank: int, world: int) -> dict[str, Any]:
    """set_reshard_after_forward(False) holds in forwards without gradients too (FSDP2's
    semantics): the second eval forward gathers nothing; True frees them again."""
    model, optim = zeroshard.shard(tiny(), torch.optim.AdamW, stage=3, lr=1e-2)
    engine = zeroshard.engine_of(model)
    ledger = engine.comm.ledger
    x = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    model.set_reshard_after_forward(False)
    out: dict[str, Any] = {}
    with torch.no_grad():
        first = model(x).logits
        start = len(ledger.records)
        second = model(x).logits
        out["second gathers"] = len(_gathers(ledger, start))
    out["same"] = torch.equal(first, second)
    out["kept bytes"] = engine.unsharded_bytes
    # A training step after: the idle units are freed after their backward, the step's
    # new weights gathered by the next forward.
    model(x, labels=x).loss.backward()
    optim.step()
    optim.zero_grad()
    out["bytes after step"] = engine.unsharded_bytes
    with torch.no_grad():
        start = len(ledger.records)
        model(x)
        out["gathers after step"] = len(_gathers(ledger, start))
    model.set_reshard_after_forward(True)
    out["bytes after True"] = engine.unsharded_bytes
    return out


def _unit_unshard(rank: int, world: int) -> dict[str, Any]:
    """FSDP2's ``layer.unshard()`` / ``layer.reshard()`` on one unit's module: three
    training steps with layer 0 held against the same steps without."""
    from zeroshard.gather import ShardedUnit

    out: dict[str, Any] = {}
    x = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank + 3))
    losses = {}
    for held in (False, True):
        model, optim = zeroshard.shard(tiny(), torch.optim.AdamW, stage=3, lr=1e-2)
        engine = zeroshard.engine_of(model)
        ledger = engine.comm.ledger
        layer = model.model.layers[0]
        out["classes"] = [type(m).__name__ for m in model.model.layers]
        out["mixed in"] = [isinstance(m, ShardedUnit) for m in model.model.layers]
        if held:
            layer.unshard(async_op=True).wait()
            out["bytes held"] = engine.unsharded_bytes
            out["layer bytes"] = next(u for u in engine.units
                                      if u.module is layer).unsharded_bytes
            layer.unshard()  # held already: nothing more
            out["bytes held twice"] = engine.unsharded_bytes
        gathers, losses[held] = [], []
        for _ in range(3):
            start = len(ledger.records)
            loss = model(x, labels=x).loss
            loss.backward()
            gathers.append([r.unit for r in _gathers(ledger, start)])
            optim.step()
            optim.zero_grad()
            losses[held].append(loss.item())
        out[f"gathers {held}"] = gathers
        layer.reshard()
        out[f"bytes after reshard {held}"] = engine.unsharded_bytes
    out["losses equal"] = losses[False] == losses[True]
    return out


def _reshard_mid_step(rank: int, world: int) -> dict[str, Any]:
    """``model.reshard()`` between a forward and its backward (with units held by
    ``unshard()``, and with reshard_after_forward=False): three steps against the same
    without the call."""
    x = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank + 7))
    out: dict[str, Any] = {}
    for opts in ({}, {"reshard_after_forward": False}):
        losses = {}
        for call in (False, True):
            model, optim = zeroshard.shard(tiny(), torch.optim.AdamW, stage=3, lr=1e-2, **opts)
            engine = zeroshard.engine_of(model)
            losses[call] = []
            for step in range(3):
                if call and step == 0:
                    model.unshard()
                loss = model(x, labels=x).loss
                if call:
                    model.reshard()  # frees the held units, not what the backward needs
                    out[f"bytes kept {opts}"] = engine.unsharded_bytes
                loss.backward()
                optim.step()
                optim.zero_grad()
                losses[call].append(loss.item())
            out[f"bytes after {opts}"] = engine.unsharded_bytes
        out[f"equal {opts}"] = losses[False] == losses[True]
    return out


def _peft(rank: int, world: int) -> dict[str, Any]:
    """A PEFT LoRA model's generate at stage 3: PEFT's generate never calls the sharded
    root's forward (it calls the base model's), so the root's weights are put in place
    for the call ([Note: methods that skip the root's forward] in gather.py)."""
    import peft

    def lora(base: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(3)
        return peft.get_peft_model(base, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))

    ref, prompt = lora(tiny()).eval(), _prompt(rank)
    model, _ = zeroshard.shard(lora(tiny()), torch.optim.AdamW, stage=3, lr=1e-3)
    model.eval()
    out = {"lora": (_generate(model, prompt, False), _generate(ref, prompt, False))}
    with model.disable_adapter(), ref.disable_adapter():
        out["base"] = (_generate(model, prompt, True), _generate(ref, prompt, True))
    # Entry points below the sharded model: a clear error, not DTensor's "got mixed
    # torch.Tensor and DTensor" ([Note: forwards outside the sharded model's])
    for key, call in (("inner generate", lambda: _generate(model.get_base_model(), prompt,
                                                           False)),
                      ("backbone", lambda: model.get_base_model().model(prompt))):
        try:
            call()
            out[key] = "ran"
        except RuntimeError as e:
            out[key] = str(e)
    out["after"] = torch.equal(_generate(model, prompt, False), out["lora"][1])
    return out


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    out = {}
    for name, fn in (("generation", _generation), ("unshard", _unshard),
                     ("eval", _no_reshard_eval), ("unit", _unit_unshard),
                     ("mid", _reshard_mid_step), ("peft", _peft)):
        out[name] = run_ranks(fn, 2, timeout=240)[0]
    return out


def test_generate_gives_the_unsharded_tokens_and_gathers_once_per_call(results) -> None:
    """Greedy and sampled (fixed seed) tokens equal the unsharded model's at stages 0-3;
    at stage 3 generate() issues one all-gather per unit per call (not per token), and
    with generate_budget=0 one per unit per forward."""
    r = results["generation"]
    for key in ("s0-None", "s1-None", "s2-None", "s3-None", "s3-0", "s3-root"):
        for sample in (False, True):
            assert r[f"{key}-{sample}-equal"], (key, sample)
        assert r[f"{key}-uneven"], key
    for key in ("s0-None", "s1-None", "s2-None"):
        assert r[f"{key}-False-gathers"] == 0, key
    for key in ("s3-None", "s3-0", "s3-root"):
        for sample in (False, True):
            assert r[f"{key}-{sample}-in-step"] == 0, (key, r)  # the ledger's own window
    units = r["s3-None-units"]
    assert units == 3
    for sample in (False, True):
        assert r[f"s3-None-{sample}-gathers"] == units, r
        assert r[f"s3-0-{sample}-gathers"] == units * NEW, r  # one forward per new token
    assert r["s3-None-bytes-after"] == 0  # released when generate() returns


def test_a_peft_model_generates_the_unsharded_tokens_at_stage_3(results) -> None:
    """GRPO with a LoRA peft_config generates through PEFT's generate: it raised (a
    DTensor met a plain tensor in the embedding) before the root's weights were put in
    place for calls that skip the root's forward."""
    for key in ("lora", "base"):
        got, want = results["peft"][key]
        assert torch.equal(got, want), key
    for key in ("inner generate", "backbone"):
        msg = results["peft"][key]
        assert "embed_tokens (Embedding) ran outside the sharded model's forward" in msg, msg
        assert "register_forward_method" in msg
    assert results["peft"]["after"]  # nothing left gathered or half-done by the error


def test_the_tracker_files_the_kv_cache_as_its_own_category(results) -> None:
    """After each forward of generate() the tracker's kv_cache is exactly the cache's
    bytes: 2 layers x keys and values x batch 2 x 2 kv heads x head dim 16 x 4 bytes per
    position, 8 prompt positions after the first forward, one more after each; nothing
    once generate() returns, and its maximum read afterwards; a plain forward's returned
    cache too. At every stage and budget."""
    r = results["generation"]
    per_position = 2 * 2 * 2 * 2 * 16 * 4
    want = [per_position * (8 + i) for i in range(NEW)]
    for key in ("s0-None", "s1-None", "s2-None", "s3-None", "s3-0", "s3-root"):
        assert r[f"{key}-kv"] == want, (key, r[f"{key}-kv"], want)
        assert r[f"{key}-kv-after"] == 0, (key, r[f"{key}-kv-after"])
        # read after the call: the largest cache (old and new beside each other while a
        # forward grows it: below twice that)
        assert want[-1] <= r[f"{key}-kv-max"] < 2 * want[-1], (key, r[f"{key}-kv-max"])
        # a plain no_grad forward with use_cache=True: the cache it returns
        assert r[f"{key}-kv-plain"] == want[0], (key, r[f"{key}-kv-plain"])


def test_a_budget_keeps_what_fits_and_gathers_exactly_the_rest_per_token(results) -> None:
    """A budget the size of the root unit: the root is gathered once per call, the two
    layers once per token — the bytes gathered per token are exactly theirs."""
    r = results["generation"]
    assert r["s3-root-held"] == ["root"]
    for sample in (False, True):
        assert r[f"s3-root-{sample}-gathers"] == 1 + 2 * NEW, r
        per_token = (r[f"s3-root-{sample}-bytes"] - r["s3-root-root"]) / NEW
        assert per_token == r["s3-root-others"], r
        # Gathered weights never above the budget plus the units a forward gathers at
        # once (the one computing and `prefetch` ahead).
        transient = (r["s3-root-prefetch"] + 1) * r["s3-root-layer"]
        assert r[f"s3-root-{sample}-peak"] <= r["s3-root-root"] + transient, r
    assert r["s3-root-bytes-after"] == 0


def test_unshard_holds_every_unit_until_reshard_and_trains_as_without(results) -> None:
    r = results["unshard"]
    assert r["dtensors while held"]  # outside forward the modules hold the user's DTensors
    assert r["bytes held"] == r["bytes whole"] > 0
    assert r["gathers per step True"] == [0, 3, 3], r  # a step frees: one gather per unit
    # Without: each layer in forward and again in backward, the root once (it stays
    # gathered from its forward to the end of backward).
    assert r["gathers per step False"] == [5, 5, 5], r
    assert r["eval gathers True"] == 3 and r["eval gathers False"] == 6, r
    assert r["losses equal"] and r["eval equal"], r
    assert r["edit seen"] and r["load seen"], r
    assert r["bytes after reshard True"] == 0 and r["bytes after reshard False"] == 0


def test_a_units_own_unshard_holds_it_until_its_reshard(results) -> None:
    """FSDP2's per-module calls: ``model.model.layers[0].unshard()`` gathers that unit
    alone (async handle included); forwards and backwards then gather the others only,
    until a step frees it and the next forward gathers the new values once; losses as
    without; ``layer.reshard()`` frees it. The layer keeps its class's name."""
    r = results["unit"]
    assert r["classes"] == ["LlamaDecoderLayer"] * 2 and r["mixed in"] == [True, True], r
    assert r["bytes held"] == r["layer bytes"] == r["bytes held twice"] > 0, r
    layer0, layer1 = "model.layers.0", "model.layers.1"
    # Without: each layer in forward and again in backward, the root once.
    assert all(sorted(g) == sorted(["root", layer0, layer1, layer1, layer0])
               for g in r["gathers False"]), r
    # Held: layer 0 not at all in the first step; after each step once (new values).
    assert sorted(r["gathers True"][0]) == sorted(["root", layer1, layer1]), r
    for g in r["gathers True"][1:]:
        assert sorted(g) == sorted(["root", layer0, layer1, layer1]), r
    assert r["losses equal"], r
    assert r["bytes after reshard True"] == 0 and r["bytes after reshard False"] == 0, r


def test_reshard_between_forward_and_backward_keeps_what_the_backward_needs(results) -> None:
    """FSDP2 allows ``reshard()`` between a forward and its backward; it crashed here
    (the root's saved weights freed: "setStorage ... storage of size 0"). Now it frees
    the held units and keeps what the pending backward reads: losses as without, with
    and without reshard_after_forward, and nothing gathered after the steps."""
    r = results["mid"]
    for opts in ({}, {"reshard_after_forward": False}):
        assert r[f"equal {opts}"], r
        assert r[f"bytes kept {opts}"] > 0, r  # the root, at least, until its backward
        assert r[f"bytes after {opts}"] == 0, r


def test_reshard_after_forward_false_keeps_units_in_no_grad_forwards(results) -> None:
    r = results["eval"]
    assert r["second gathers"] == 0 and r["same"], r
    assert r["kept bytes"] > 0
    assert r["gathers after step"] == 3, r
    assert r["bytes after True"] == 0, r


def test_generate_budget_is_checked_at_shard() -> None:
    with pytest.raises(ValueError, match="generate_budget '2 apples' has an unknown unit"):
        zeroshard.ShardConfig(stage=3, generate_budget="2 apples")
    with pytest.raises(ValueError, match="generate_budget=-1"):
        zeroshard.ShardConfig(stage=3, generate_budget=-1)


@pytest.mark.slow  # its path is test_generate_gives_the_unsharded_tokens_... in make test
def test_the_example_runs_under_torchrun() -> None:
    """examples/generate_stage3.py, as its docstring runs it, with and without a budget."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "generate_stage3.py"
    for extra in ([], ["--budget", "1MiB"]):
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             str(example), *extra], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "after stream_weights): True" in done.stdout, done.stdout


def _alone(rank: int, world: int) -> str:
    """Rank 0 generates alone (the DDP habit of sampling on rank 0), rank 1 trains on."""
    from zeroshard.comm import CollectiveMismatch, CollectiveTimeout

    model, optim = zeroshard.shard(tiny(), torch.optim.AdamW, stage=3, lr=1e-2, timeout=60)
    x = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    try:
        for _ in range(2):
            if rank == 0:
                model.eval()
                _generate(model, x, False)
                model.train()
            model(x, labels=x).loss.backward()
            optim.step()
        return "no error"
    except (CollectiveMismatch, CollectiveTimeout) as e:
        return f"{type(e).__name__}: {e}"


def test_generate_on_one_rank_alone_is_an_error_on_every_rank() -> None:
    """generate() at stage 3 is a collective (its gathers, and the check before them):
    on one rank alone both ranks raise, naming the fix — no hang, no mixed-up weights."""
    for rank, got in enumerate(run_ranks(_alone, 2, timeout=120, fresh=True)):
        assert got.startswith("CollectiveMismatch"), (rank, got)
        assert "barrier(unshard" in got and "Call them on every rank" in got, (rank, got)
        assert "layer drop" not in got, (rank, got)


def _reference(rank: int, world: int) -> dict[str, Any]:
    """A forward-only sharded model (an RL loop's reference): the unsharded model's
    logits and tokens, 1/N of its bytes per rank, no optimizer state or gradients; a
    soft update from a trained stage-3 policy (TRL's sync_ref_model) as on whole models."""
    ref = tiny().eval()
    whole = sum(p.numel() * p.element_size() for p in ref.parameters())
    model = zeroshard.shard_for_inference(tiny())
    model.eval()
    x = _prompt(rank)
    out: dict[str, Any] = {}
    with torch.no_grad():
        out["logits"] = torch.equal(model(x).logits, ref(x).logits)
    out["tokens"] = torch.equal(_generate(model, x, False), _generate(ref, x, False))
    tracker = zeroshard.memory_tracker(model)
    current = tracker.current()
    out["params"] = current[next(c for c in current if c.value == "params")]
    out["whole"] = whole
    out["frozen"] = not any(p.requires_grad for p in model.parameters())
    # TRL's SyncRefModelCallback: target.data.mul_(1 - alpha).add_(policy.data, alpha)
    policy, _ = zeroshard.shard(tiny(seed=1), torch.optim.AdamW, stage=3, lr=1e-2)
    with torch.no_grad():
        for t, p in zip(model.parameters(), policy.parameters()):
            t.data.mul_(0.5).add_(p.data, alpha=0.5)
        want = {k: 0.5 * v + 0.5 * w for (k, v), w in
                zip(tiny().state_dict().items(), tiny(seed=1).state_dict().values())}
    got = zeroshard.full_state_dict(model)
    out["synced"] = all(torch.allclose(got[k], want[k], rtol=0, atol=1e-7) for k in want)
    with torch.no_grad():  # the next forward reads the synced weights
        merged = tiny()
        merged.load_state_dict(want)
        out["synced forward"] = torch.allclose(model(x).logits, merged.eval()(x).logits,
                                               rtol=0, atol=1e-6)
    try:
        zeroshard.shard_for_inference(tiny(), stage=3, lr=1e-3)
        out["bad option"] = "no error"
    except TypeError as e:
        out["bad option"] = str(e)
    return out


def test_a_forward_only_sharded_reference_model() -> None:
    for r in run_ranks(_reference, 2, timeout=120):
        assert r["logits"] and r["tokens"] and r["frozen"], r
        assert r["params"] == r["whole"] // 2, r  # this rank's half, nothing else
        assert r["synced"] and r["synced forward"], r
        assert "unknown option 'lr' for shard_for_inference" in r["bad option"], r
