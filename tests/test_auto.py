"""shard(stage="auto", memory_budget=...): traced peaks, predicted times, the choice."""

from __future__ import annotations

import json
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _profiles import synthetic_profile

from zeroshard.memory.traced import trace_step
from zeroshard.testing import run_ranks

BATCH = (2, 32)
#: Traces cached where this test session alone reads them ([Note: the trace cache]).
ENV = {"ZEROSHARD_TRACE_CACHE": tempfile.mkdtemp(prefix="zeroshard-traces-")}


def _profile(path: str, world: int = 2) -> None:
    synthetic_profile(path, batch=BATCH, world=world)


def _loss(model, x, y) -> torch.Tensor:
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def _train(model, opt, steps: int = 2) -> list[float]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randint(0, 256, (BATCH[0] * dist.get_world_size(), BATCH[1]), generator=g)
        y = torch.randint(0, 256, x.shape, generator=g)
        r = dist.get_rank()
        loss = _loss(model, x[r * BATCH[0]:(r + 1) * BATCH[0]], y[r * BATCH[0]:(r + 1) * BATCH[0]])
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _auto(rank: int, world_size: int, path: str, budget: int | None) -> dict:
    import zeroshard
    from zeroshard.checkpointing import _CheckpointedMixin, apply_checkpointing
    from zeroshard.models import build_model

    model = build_model("gpt2-tiny")
    model, opt = zeroshard.shard(model, torch.optim.AdamW, stage="auto", lr=1e-3,
                                 memory_budget=budget, example_batch=BATCH, profile=path)
    engine = zeroshard.engine_of(model)
    choice = engine.auto_choice
    checkpointed = any(isinstance(m, _CheckpointedMixin) for m in model.modules())
    losses = _train(model, opt)
    # the same configuration by hand trains identically
    ref = build_model("gpt2-tiny")
    c = choice.chosen
    if c.checkpointing != "none":
        apply_checkpointing(ref, c.checkpointing)
    extra = {"reshard_after_forward": c.reshard_after_forward} if c.stage == 3 else {}
    ref, ref_opt = zeroshard.shard(ref, torch.optim.AdamW, stage=c.stage, lr=1e-3, **extra)
    return {"stage": engine.config.stage, "raf": engine.config.reshard_after_forward,
            "choice": choice, "checkpointed": checkpointed, "losses": losses,
            "ref": _train(ref, ref_opt)}


def test_auto_takes_the_fastest_predicted_that_fits_and_applies_it(tmp_path) -> None:
    path = str(tmp_path / "profile.json")
    _profile(path)
    roomy, = {repr(r["choice"]): r for r in run_ranks(_auto, 2, path, 2**31, env=ENV)}.values()
    table = roomy["choice"].table
    assert len(table) == 4 * 4 + 4  # stages x policies, + stage 3 without resharding
    traced = [c for c in table if c.peak_bytes]
    # a roomy budget: each chain's first (no recompute) fits, the rest stay untraced
    assert {(c.stage, c.reshard_after_forward) for c in traced} == {
        (0, True), (1, True), (2, True), (3, True), (3, False)}
    assert all(c.checkpointing == "none" for c in traced)
    assert all("not traced: less recompute fits" in c.verdict for c in table
               if not c.peak_bytes)
    chosen = roomy["choice"].chosen
    assert chosen == min(traced, key=lambda c: (c.predicted_step_s, c.peak_bytes))
    # a budget that the fastest misses: the next fastest that fits
    fits = sorted(traced, key=lambda c: c.peak_bytes)
    budget = (fits[0].peak_bytes + fits[-1].peak_bytes) // 2
    tight = run_ranks(_auto, 2, path, budget, env=ENV)
    assert repr(tight[0]["choice"]) == repr(tight[1]["choice"])  # decided once, broadcast
    for r in (roomy, tight[0]):
        c = r["choice"].chosen
        assert r["stage"] == c.stage and r["checkpointed"] == (c.checkpointing != "none")
        if c.stage == 3:
            assert r["raf"] == c.reshard_after_forward
        assert r["losses"] == r["ref"]  # what auto applied is what the row says
    c, b = tight[0]["choice"].chosen, budget
    table = tight[0]["choice"].table
    rows = [x for x in table if x.peak_bytes]
    # a stage whose model state alone exceeds the budget stops after its first level
    stopped = [x for x in table if "model state alone" in x.verdict]
    assert all(x.checkpointing != "none" for x in stopped)
    assert c.peak_bytes <= b
    assert all(x.peak_bytes > b for x in rows if x.predicted_step_s < c.predicted_step_s)
    assert any(x.peak_bytes > b and "over the budget" in x.verdict for x in rows)
    # the traced peak is the trace's: one row checked against trace_step itself
    x = next(x for x in rows if x.stage == 2 and x.checkpointing == "none")
    r = trace_step("gpt2-tiny", world_size=2, stage=2, mixed_precision=None,
                   micro_batch=BATCH[0], seq_len=BATCH[1], collectives="gloo")
    assert x.peak_bytes == r.device_peak_bytes


def _refused(rank: int, world_size: int, path: str, kw: dict) -> str:
    import zeroshard
    from zeroshard.models import build_model

    try:
        zeroshard.shard(build_model("gpt2-tiny"), torch.optim.AdamW, lr=1e-3, **kw)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_auto_bad_input(tmp_path) -> None:
    path = str(tmp_path / "profile.json")
    _profile(path)
    auto = {"stage": "auto", "example_batch": BATCH, "profile": path}
    cases = [
        ({**auto}, "needs memory_budget="),
        ({**auto, "memory_budget": "80%"}, "a fraction needs a GPU"),
        ({**auto, "memory_budget": 1024}, "smallest peak found is"),
        ({**auto, "memory_budget": "1GiB", "example_batch": None}, "example_batch=(micro_batch"),
        ({"stage": 2, "memory_budget": "1GiB"}, "go with stage='auto'"),
        ({**auto, "memory_budget": "1GiB", "hybrid": (1, 2)}, "chooses over one shard group"),
    ]
    cases += [
        ({**auto, "memory_budget": "1GiB", "stage": "Auto"}, "lower case"),
        ({"memory_budget": "1GiB"}, "pass stage='auto' (here stage=0)"),
        ({**auto, "memory_budget": "1GiB", "profile": str(tmp_path / "nope.json"),
          "auto_recalibrate": False}, "does not exist and auto_recalibrate=False"),
    ]
    foreign = str(tmp_path / "foreign.json")
    _profile(foreign, world=4)
    cases.append(({**auto, "memory_budget": "1GiB", "profile": foreign,
                   "auto_recalibrate": False}, "world size 4 (the run's is 2)"))
    for kw, want in cases:
        got = run_ranks(_refused, 2, path, kw, env=ENV)
        assert all(want in g for g in got), (kw, got)
    small = run_ranks(_refused, 2, path, {**auto, "memory_budget": 1024}, env=ENV)[0]
    assert "more ranks" in small and "tensor parallelism" in small
    assert ("offload" in small) == torch.cuda.is_available()  # on a CPU host = device


def _fixed(rank: int, world_size: int, path: str) -> dict:
    import zeroshard
    from zeroshard.checkpointing import apply_checkpointing
    from zeroshard.models import build_model

    model = build_model("gpt2-tiny")
    apply_checkpointing(model, "full")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model, _ = zeroshard.shard(model, torch.optim.AdamW, stage="auto", lr=1e-3,
                                   memory_budget=2**31, example_batch=BATCH, profile=path,
                                   reshard_after_forward=False)
    choice = zeroshard.engine_of(model).auto_choice
    return {"choice": choice, "warned": [str(w.message) for w in seen]}


def test_auto_keeps_what_the_caller_fixed_and_recalibrates_a_foreign_profile(tmp_path) -> None:
    path = str(tmp_path / "profile.json")
    _profile(path, world=4)  # measured at another world size: recalibrated, with a warning
    r = run_ranks(_fixed, 2, path, env=ENV)[0]
    rows = r["choice"].table
    assert {x.checkpointing for x in rows} == {"applied: full"}
    assert all(not x.reshard_after_forward for x in rows if x.stage == 3)
    assert len(rows) == 4 and all(x.peak_bytes for x in rows)
    notes = " ".join(r["choice"].notes)
    assert "reshard_after_forward=False given" in notes and "already applied" in notes
    assert "recalibrated" in notes
    assert any("measured elsewhere" in w and "world size 4" in w for w in r["warned"])


def test_train_stage_auto(tmp_path, capfd, monkeypatch) -> None:
    from zeroshard.cli import main

    monkeypatch.setenv("ZEROSHARD_TRACE_CACHE", ENV["ZEROSHARD_TRACE_CACHE"])
    path = str(tmp_path / "profile.json")
    _profile(path)
    tiny = ["train", "--model", "gpt2-tiny", "--nproc", "2", "--steps", "2",
            "--global-batch", "4", "--seq-len", str(BATCH[1]), "--log-every", "1"]
    metrics = tmp_path / "metrics.jsonl"
    assert main([*tiny, "--stage", "auto", "--memory-budget", "1GiB", "--profile", path,
                 "--metrics", str(metrics)]) == 0
    start = next(json.loads(line) for line in metrics.read_text().splitlines()
                 if json.loads(line)["event"] == "start")
    assert start["auto"]["verdict"].startswith("chosen") and start["auto"]["peak_bytes"] > 0
    capfd.readouterr()
    assert main([*tiny, "--stage", "auto"]) == 2  # no budget
    assert "--memory-budget" in capfd.readouterr().err
    assert main([*tiny, "--stage", "2", "--memory-budget", "1GiB"]) == 2


def test_trace_cache_keeps_answers_and_retraces_what_it_cannot_read(tmp_path, monkeypatch) -> None:
    from zeroshard.memory.traced import lm_loss
    from zeroshard.models import build_model
    from zeroshard.timing import auto

    monkeypatch.setenv("ZEROSHARD_TRACE_CACHE", str(tmp_path))
    job = dict(world_size=2, rank=0, stage=0, mixed_precision=None, micro_batch=BATCH[0],
               seq_len=BATCH[1], checkpointing="none", record_ops=True, loss_fn=lm_loss,
               stage3_buffers=False, collectives="gloo")
    model = build_model("gpt2-tiny")
    tracer = auto._Tracer(model)
    first = tracer([job])[0]
    tracer.close()
    files = list(tmp_path.glob("*.pkl"))
    assert len(files) == 1 and first.device_peak_bytes > 0

    def no_tracing(*a, **k):  # a cache hit starts no tracing process
        raise AssertionError("traced again")

    monkeypatch.setattr(auto._Tracer, "_trace", no_tracing)
    again = auto._Tracer(model)([job])[0]
    assert again.device_peak_bytes == first.device_peak_bytes and again.ops == first.ops
    with pytest.raises(AssertionError, match="traced again"):  # another batch: a miss
        auto._Tracer(model)([{**job, "micro_batch": 1}])
    with pytest.raises(AssertionError, match="traced again"):  # another model: a miss
        auto._Tracer(build_model("llama-tiny"))([job])
    files[0].write_bytes(b"not a pickle")  # unreadable: traced again, never trusted
    with pytest.raises(AssertionError, match="traced again"):
        auto._Tracer(model)([job])


def test_walk_traces_levels_until_one_fits_or_the_state_cannot() -> None:
    """The chains' walk: a roomy budget traces each chain's first level only; a chain
    goes on while nothing fits; a stage whose model state alone exceeds the budget
    stops; a failed trace is not a fit."""
    from types import SimpleNamespace

    from zeroshard.timing.auto import Candidate, Skipped, _chains, walk

    chains = _chains(None, None, None)
    peaks = {"none": 300, "selective-op": 250, "every-2": 240, "full": 200}
    state = {0: 280, 1: 150, 2: 100, 3: 50}
    asked: list[list[Candidate]] = []

    def trace(todo):
        asked.append(list(todo))
        return ["boom" if (c.stage, c.checkpointing) == (2, "every-2") else SimpleNamespace(
            device_peak_bytes=peaks[c.checkpointing] - 10 * c.stage
            + (0 if c.reshard_after_forward else 30),
            device_model_state_bytes=state[c.stage]) for c in todo]

    roomy = walk(chains, trace, 10**9)
    assert len(asked) == 1 and {c.checkpointing for c in asked[0]} == {"none"}
    assert len(asked[0]) == 5
    assert all(v == Skipped("less recompute fits at this stage") for v in roomy.values()
               if isinstance(v, Skipped))
    asked.clear()
    tight = walk(chains, trace, 245)
    got = {(c.stage, c.checkpointing, c.reshard_after_forward): v for c, v in tight.items()}
    assert "model state alone" in got[(0, "full", True)].reason  # 280 > 245 after level 1
    assert not isinstance(got[(1, "every-2", True)], Skipped)  # level 2 traced ...
    assert got[(1, "full", True)] == Skipped("less recompute fits at this stage")  # ... fit
    assert got[(2, "every-2", True)] == "boom"
    assert len(asked) == 2 and all(c.checkpointing in ("selective-op", "every-2")
                                   for c in asked[1])


def _offloaded(rank: int, world_size: int, path: str) -> dict:
    import zeroshard
    from zeroshard.models import build_model

    model, _ = zeroshard.shard(build_model("gpt2-tiny"), torch.optim.AdamW, stage="auto",
                               lr=1e-3, memory_budget="1GiB", example_batch=BATCH,
                               profile=path, offload="optimizer")
    engine = zeroshard.engine_of(model)
    return {"choice": engine.auto_choice, "offload": engine.config.offload,
            "stage": engine.config.stage}


def test_auto_keeps_a_given_offload(tmp_path) -> None:
    path = str(tmp_path / "profile.json")
    _profile(path)
    r = run_ranks(_offloaded, 2, path, env=ENV)[0]
    assert {x.stage for x in r["choice"].table} == {1, 2, 3}
    assert r["stage"] in (1, 2, 3) and r["offload"]
    assert any("offload='optimizer' given: kept" in n for n in r["choice"].notes)


def _on_meta(rank: int, world_size: int, path: str) -> dict:
    import zeroshard
    from zeroshard.models import build_model

    model, opt = zeroshard.shard(build_model("gpt2-tiny", device="meta"), torch.optim.AdamW,
                                 stage="auto", lr=1e-3, memory_budget="1GiB",
                                 example_batch=BATCH, profile=path)
    choice = zeroshard.engine_of(model).auto_choice
    return {"stages": {x.stage for x in choice.table}, "notes": choice.notes,
            "losses": _train(model, opt)}


def test_auto_on_a_meta_model_weighs_stage_3_only(tmp_path) -> None:
    path = str(tmp_path / "profile.json")
    _profile(path)
    r = run_ranks(_on_meta, 2, path, env=ENV)[0]
    assert r["stages"] == {3} and any("meta device" in n for n in r["notes"])
    assert len(r["losses"]) == 2


def test_auto_writes_the_profile_it_calibrated_to_a_missing_path(tmp_path) -> None:
    """profile=PATH that does not exist: calibrated briefly (with a warning) and written
    there, as bench --profile does; example_batch as a list is taken too."""
    from zeroshard.timing.profile import Profile

    path = tmp_path / "new.json"
    r = run_ranks(_missing, 2, str(path), env=ENV)
    assert all(any("does not exist" in w for w in x["warned"]) for x in r)
    assert any("missing: calibrated briefly, written there" in n for n in r[0]["notes"])
    prof = Profile.load(path)
    assert prof.world_size == 2 and prof.backend == "gloo"


def _missing(rank: int, world_size: int, path: str) -> dict:
    import zeroshard
    from zeroshard.models import build_model

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model, _ = zeroshard.shard(build_model("gpt2-tiny"), torch.optim.AdamW, lr=1e-3,
                                   stage="auto", memory_budget="1GiB",
                                   example_batch=list(BATCH), profile=path)
    return {"warned": [str(w.message) for w in seen],
            "notes": zeroshard.engine_of(model).auto_choice.notes}
