"""What every rank runs: build each configuration, then step them in interleaved rounds.

[Note: interleaving]
On a noisy machine (two cores shared by two ranks, a laptop, a shared node) the speed of
the machine drifts over a run. Timing configuration A for a minute and then B for a
minute folds that drift into the A/B ratio. So every configuration is built once and they
take turns: warm-up rounds (one step each, in order A B C ...), then ``steps`` timed
rounds A B C, A B C, ... Drift then hits all of them alike. Last, one configuration after
the other runs its measured step (see [Note: timed steps and measured steps are
different steps] in measure.py) and is dropped (see [Note: the rss of one
configuration]). If all models would not fit in memory at once (estimate: model state of
every configuration within half of the host's available memory per rank, or of the free
device memory), each configuration runs alone, one after the other, and the report says
so.

[Note: the rss of one configuration]
The process's resident set is shared: the torch runtime, every configuration still alive
(all of them while interleaving), and heap pages glibc kept after earlier configurations
freed them. Read in the measured step, the RSS grew row after row (gpt2-124m, world 2,
one configuration at a time: ddp 2,784 MiB ... zs-s3 6,060, DeepSpeed's rows up to
10,311), because freed memory stayed in malloc's arenas. A row's ``rss`` is therefore
computed as what a process running only that configuration would hold at the peak of its
step: ``base + (peak - after)``, where ``base`` is the rank's RSS before any
configuration is built, ``peak`` the high-water mark of the measured step, and ``after``
the RSS once the configuration is dropped (every reference gone, ``malloc_trim``:
:func:`~zeroshard.bench.measure.release_memory`). Whatever else is resident at the peak
(other configurations, kept pages) is resident after it too and cancels; pages the step
reused from earlier garbage are handed back by the trim and count for the configuration,
as they would in a process of its own. Not counted: runtime state created lazily by
whichever configuration ran first (thread pools, kernel caches), a few MiB.

[Note: failing configurations]
A configuration may raise on one rank only (out of memory, a bug, data-dependent control
flow) while its peers wait inside a collective for that rank. Two things keep the run
alive: each configuration has its *own* process group, created with ``timeout_s``, so a
peer blocked in it gives up with an error instead of hanging; and after every build and
every step all ranks meet on a separate gloo *control* group (never used by any
configuration) and exchange a failure flag, their step time and loss in one all-gather.
If any rank failed, every rank drops the configuration, so the collectives of the rest
stay matched. DeepSpeed uses the world group and does not get this protection.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.bench.configs import HF_FACTORY, BenchSettings, ConfigSpec
from zeroshard.bench.isolation import TorchPatches
from zeroshard.bench.measure import (
    StepMemory,
    measured_step,
    optimizer_matmul_seconds,
    release_memory,
    rss,
    timed_step,
)
from zeroshard.bench.runners import Runner, SkipConfig, build_runner, deepspeed_missing
from zeroshard.data import SyntheticLanguage, TokenLoader

__all__ = ["rank_main", "make_model"]


def make_model(s: BenchSettings, device: torch.device | str) -> nn.Module:
    """The benchmark model, initialised identically on every rank and for every config."""
    if s.model_factory is None:
        from zeroshard.models import build_model

        return build_model(s.model or "", device=device, seed=s.seed)
    module, _, fn = s.model_factory.partition(":")
    factory = importlib.import_module(module)
    for part in fn.split("."):
        factory = getattr(factory, part)
    torch.manual_seed(s.seed)
    model = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"--model-factory {s.model_factory} returned {type(model).__name__}, "
                        "not an nn.Module")
    return model.to(device)


@dataclass
class _Config:
    spec: ConfigSpec
    status: str = "ok"
    error: str = ""
    note: str = ""
    runner: Runner | None = None
    patches: TorchPatches | None = None
    """What its build replaced in torch, in place for its steps only (isolation.py)."""
    step_s: list[float] = field(default_factory=list)
    time_optimizer: bool = False  # --optimizer muon: time the optimizer step too
    optimizer_s: list[float] = field(default_factory=list)
    newton_schulz_s: float | None = None  # --optimizer muon: one profiled step's
    comm: list[int] = field(default_factory=list)
    #: (intra, inter) wire bytes per timed step ([Note: bytes by link] in comm_links.py)
    comm_links: list[tuple[int, int]] = field(default_factory=list)
    loss: float = float("nan")
    memory: dict[str, Any] = field(default_factory=dict)
    time_s: dict[str, float] = field(default_factory=dict)
    """Wall seconds this configuration spent building, warming up, measured, timed."""

    def clock(self, phase: str, secs: float) -> None:
        self.time_s[phase] = self.time_s.get(phase, 0.0) + secs


class _Progress:
    """The bench's progress bar: tqdm's, on stderr, rank 0 only. Without a terminal (a
    log, CI) tqdm redraws at most every 30 s instead of ten times a second."""

    def __init__(self, total: int, enabled: bool) -> None:
        from tqdm import tqdm

        tty = sys.stderr.isatty()
        self.bar = tqdm(total=max(total, 1), disable=not enabled, file=sys.stderr,
                        leave=True, dynamic_ncols=tty, mininterval=0.1 if tty else 30.0,
                        bar_format="{l_bar}{bar:30}| {n_fmt}/{total_fmt} [{elapsed}]")

    def update(self, what: str, n: int = 1) -> None:
        self.bar.set_description_str(what, refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def _exchange(ctrl: dist.ProcessGroup, failed: bool, err: str, secs: float = 0.0,
              loss: float = float("nan")) -> tuple[bool, str, float, float]:
    """All ranks: any failed?, errors by rank, max step time, mean loss."""
    t = torch.tensor([float(failed), secs, loss], dtype=torch.float64)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(ctrl))]
    dist.all_gather(out, t, group=ctrl)
    rows = torch.stack(out)
    if not bool(rows[:, 0].any()):
        return False, "", float(rows[:, 1].max()), float(rows[:, 2].mean())
    errs: list[Any] = [None] * len(out)
    dist.all_gather_object(errs, err if failed else "", group=ctrl)
    # The cause first: a peer that gave up waiting for the failed rank reports a timeout.
    found = sorted((("timed out" in e.lower() or "timeout" in e.lower(), r, e)
                    for r, e in enumerate(errs) if e))
    msg = "; ".join(f"rank {r}: {e}" for _, r, e in found)
    return True, msg, 0.0, float("nan")


def _fail(c: _Config, status: str, error: str) -> None:
    c.status, c.error, c.runner = status, error, None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 400 else text[:397] + "..."


def _build(c: _Config, s: BenchSettings, device: torch.device, ctrl: dist.ProcessGroup) -> None:
    from zeroshard.checkpointing import apply_checkpointing

    if c.spec.system == "deepspeed" and (why := deepspeed_missing()) is not None:
        _fail(c, "skipped", why)  # the same on every rank: no model, no group, no exchange
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    group = dist.new_group(backend=backend, timeout=timedelta(seconds=s.timeout_s))
    skip, err = False, ""
    found: list[TorchPatches] = []
    try:
        with TorchPatches.during(found):  # see [Note: the rows must not touch each other]
            model = make_model(s, device)
            if c.spec.activation_checkpointing != "none":
                if s.model_factory == HF_FACTORY:  # HF layers: zeroshard.hf's policies
                    from zeroshard.hf import apply_checkpointing as apply_hf

                    apply_hf(model, c.spec.activation_checkpointing)
                else:
                    apply_checkpointing(model, c.spec.activation_checkpointing)
            c.runner = build_runner(c.spec, model, group, s, device)
        c.patches = found[0]
        c.note = c.runner.note
        if c.patches:
            c.note += (("; " if c.note else "") + "replaces "
                       + ", ".join(c.patches.names) + " (in its own steps only)")
    except SkipConfig as exc:
        skip, err = True, str(exc)
    except Exception as exc:
        err = _describe(exc)
    failed, msg, _, _ = _exchange(ctrl, bool(err), err)
    if skip:  # decided identically on every rank
        _fail(c, "skipped", err)
    elif failed:
        _fail(c, "failed", msg)


def _step(c: _Config, kind: str, k: int, batches: list, device: torch.device,
          ctrl: dist.ProcessGroup, base_rss: int = 0) -> None:
    """One step of ``kind`` (warmup, timed, measured) on every rank. A measured step is a
    configuration's last: it is dropped afterwards (see [Note: the rss of one
    configuration])."""
    assert c.runner is not None
    x, y = batches[k]
    err, secs, loss, mem, opt_secs = "", 0.0, float("nan"), None, 0.0
    try:
        # its own replacements of torch's functions, and no other row's (isolation.py)
        with c.patches or contextlib.nullcontext():
            if kind == "profiled":
                c.newton_schulz_s, loss = optimizer_matmul_seconds(c.runner.step, x, y, device)
            elif kind == "measured":
                ledger = c.runner.ledger
                release_memory(collect=False)  # trim only: nothing of this configuration is garbage
                mem = measured_step(c.runner.step, c.runner.tracker(), x, y, device,
                                    count_comm=ledger is None)
                loss = mem.loss
            else:
                secs, loss, opt_secs = timed_step(c.runner.step, x, y, device,
                                                  c.time_optimizer)
        if not math.isfinite(loss):
            err = f"loss is {loss} at step {k}"
    except Exception as exc:
        err = _describe(exc)
    failed, msg, secs, loss = _exchange(ctrl, bool(err), err, secs, loss)
    if failed:
        _fail(c, "failed", f"{kind} step {k}: {msg}")
        return
    c.loss = loss
    ledger = c.runner.ledger
    if kind == "timed":
        c.step_s.append(secs)
        if c.time_optimizer:  # this rank's (rank 0's reaches the report)
            c.optimizer_s.append(opt_secs)
        if ledger is not None:
            totals = ledger.totals(ledger.last_step())
            c.comm.append(totals["logical_bytes"])
            # each rank sends different amounts to each link: the mean over ranks
            links = torch.tensor([totals["intra_wire_bytes"], totals["inter_wire_bytes"]])
            dist.all_reduce(links, group=ctrl)
            n = dist.get_world_size(ctrl)
            c.comm_links.append((int(links[0]) // n, int(links[1]) // n))
    elif kind == "measured":
        assert mem is not None
        c.runner = None
        release_memory()
        mem.rss_bytes = base_rss + max(0, mem.rss_bytes - rss())
        _merge_memory(c, mem, ctrl)


def _merge_memory(c: _Config, mem: StepMemory | None, ctrl: dist.ProcessGroup) -> None:
    """Every rank's measured step -> the row: breakdown of the rank with the highest peak."""
    got: list[Any] = [None] * dist.get_world_size(ctrl)
    dist.all_gather_object(got, asdict(mem) if mem is not None else None, group=ctrl)
    top = max(got, key=lambda m: m["peak"]["total"])
    cuda = [m["cuda_peak_bytes"] for m in got if m["cuda_peak_bytes"] is not None]
    c.memory = {
        "peak_bytes": top["peak"],
        "peak_rank": got.index(top),
        "peak_total_by_rank": [m["peak"]["total"] for m in got],
        "rss_bytes": max(m["rss_bytes"] for m in got),
        "cuda_peak_bytes": max(cuda) if cuda else None,
        "comm_bytes": got[0]["comm_bytes"],
        "comm_calls": got[0]["comm_calls"],
        "timeline": top["timeline"],
    }


def _fits_together(s: BenchSettings, psi: int, device: torch.device, world: int) -> bool:
    """[Note: interleaving]: can every configuration's model state stay resident?"""
    from zeroshard.bench.report import predicted_state

    need = sum(predicted_state(psi, c.stage, world, s.mixed_precision)["total"]
               for c in s.configs)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return need <= 0.5 * free
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith("MemAvailable"))
    except (OSError, StopIteration, ValueError):
        return True
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return need <= 0.5 * avail / max(local, 1)


def rank_main(s: BenchSettings, progress: bool = True) -> dict[str, Any] | None:
    """The per-rank entry point (elastic_launch or torchrun). Rank 0 returns the results."""
    entered = time.time()  # wall clock: the launcher compares it with its own start
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))
    ctrl = dist.new_group(backend="gloo")
    profile = None
    if s.calibrate_shapes is not None:  # --profile without a profile measured here
        from zeroshard.timing.calibrate import calibrate

        gemm, attention, collectives = s.calibrate_shapes
        profile = calibrate(gemm=gemm, attention=attention, collectives=collectives,
                            device=device).to_dict()

    probe = make_model(s, "meta") if s.model_factory is None else make_model(s, "cpu")
    psi = sum(p.numel() for p in probe.parameters())
    vocab = _vocab(s, probe)
    del probe
    loader = TokenLoader(SyntheticLanguage(vocab, s.seq, seed=s.seed),
                         global_batch=s.global_batch, rank=rank, world_size=world)
    total = s.warmup + 1 + s.steps
    batches = [tuple(t.to(device) for t in next(loader)) for _ in range(total)]

    release_memory()
    base_rss = rss()
    setup_s = time.time() - entered
    together = _fits_together(s, psi, device, world)
    configs = [_Config(spec, time_optimizer=s.optimizer == "muon") for spec in s.configs]
    waves = [configs] if together else [[c] for c in configs]
    bar = _Progress(len(configs) * (1 + total), progress and rank == 0)
    for wave in waves:
        for c in wave:
            bar.update(f"build {c.spec.name}")
            t = time.perf_counter()
            _build(c, s, device, ctrl)
            c.clock("build", time.perf_counter() - t)
        plan = [("warmup", w) for w in range(s.warmup)]
        plan += [("timed", s.warmup + r) for r in range(s.steps)]
        rounds = [(kind, k, wave) for kind, k in plan]
        if s.optimizer == "muon":  # an extra step under the profiler, after the timed ones
            rounds.append(("profiled", total - 1, wave))
        rounds += [("measured", total - 1, [c]) for c in wave]  # one at a time, then dropped
        for kind, k, turn in rounds:
            for c in turn:
                bar.update(f"{kind} {c.spec.name} (step {k + 1}/{total})")
                if c.runner is not None:
                    t = time.perf_counter()
                    _step(c, kind, k, batches, device, ctrl, base_rss)
                    c.clock(kind, time.perf_counter() - t)
        for c in wave:
            c.runner = None
        release_memory()
    bar.close()
    dist.barrier(group=ctrl)
    if own:
        dist.destroy_process_group()
    if rank != 0:
        return None
    return {
        "psi": psi, "vocab": vocab, "world_size": world, "interleaved": together,
        "backend": "nccl" if device.type == "cuda" else "gloo", "device": _device_name(device),
        "threads_per_rank": torch.get_num_threads(), "profile": profile,
        "entered": entered, "setup_s": setup_s, "ranks_s": time.time() - entered,
        "rows": [{"spec": c.spec, "status": c.status, "error": c.error, "note": c.note,
                  "step_s": c.step_s, "optimizer_s": c.optimizer_s,
                  "newton_schulz_s": c.newton_schulz_s, "comm": c.comm,
                  "comm_links": c.comm_links, "loss": c.loss,
                  "memory": c.memory,
                  "time_s": c.time_s}
                 for c in configs],
    }


def _vocab(s: BenchSettings, model: nn.Module) -> int:
    if s.vocab is not None:
        return s.vocab
    cfg = getattr(model, "config", None)
    if isinstance(getattr(cfg, "vocab", None), int):
        return cfg.vocab  # type: ignore[union-attr]
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise ValueError("cannot tell the factory model's vocabulary; pass --vocab N")
    return emb.num_embeddings


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"
