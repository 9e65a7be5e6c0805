"""``shard(model, optimizer, stage="auto", memory_budget=...)``: the plan chooses itself.

[Note: stage="auto"]
mission.md's ladder, decided by measurement-backed prediction instead of by hand:

1. The candidates: stage 0-3 × activation checkpointing (none, selective-op, every-2,
   full) ×, at stage 3, ``reshard_after_forward`` True/False. What the caller fixed stays
   fixed and is said so in the log: ``reshard_after_forward=``, ``offload=`` (then stages
   1-3, or 3 for "optimizer+params"), checkpointing already applied to the model (every
   candidate keeps it). Buckets and prefetch keep their defaults; offload is not a
   candidate of its own on a CPU (host and device are one memory there).
2. Each candidate is traced on fake tensors (memory/traced.py): its peak is the traced
   peak (traced = measured within ~1%, docs/planning.md), its ops and collectives are
   priced by the calibration profile (timing/model.py). The candidates of one (stage,
   reshard_after_forward) form a chain of levels of ever more recompute — none, then
   selective-op and every-2, then full; each level's policies recompute everything some
   policy of the level before does, and more — so a chain ends at the first level where
   a candidate fits (the rest only add recompute to it: slower by construction), or
   where even the traced model state exceeds the budget (checkpointing does not shrink
   it). :func:`walk` does this; the untraced say why in the table. Rounds trace the next
   level of every open chain, split among the ranks (each in one child process, kept
   for the whole choice: trace_child.py), and gather the results. A roomy budget costs one round: five
   traces.
3. Candidates whose peak exceeds the budget drop out; the fastest predicted of the rest
   wins. Rank 0's decision is broadcast, so every rank shards alike.
4. The chosen checkpointing is applied (``apply_checkpointing``), then the model is
   sharded at the chosen stage. ``engine_of(model).auto_choice`` keeps the chosen row and
   the whole table; rank 0 logs the table once.

[Note: the trace cache]
A trace of gpt2-small costs ~2.5 s (fake-tensor dispatch of ~23K ops); fifteen of them,
split over two ranks, ~20-40 s at start-up. A job started again (an elastic restart, the
next run of a script) would pay that again for the same answers, so each trace is kept
on disk (``ZEROSHARD_TRACE_CACHE``, default ``~/.cache/zeroshard/traces``), under a hash
of everything its answer depends on: the model's structure (its repr, and every
parameter's and buffer's name, shape, dtype and ``requires_grad``), the candidate, the
world size, the batch, the precision, the loss function's name, torch's version and
zeroshard's own source (every .py file of the package, so an edited engine traces anew).
A file that cannot be read is traced again, never trusted.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import pickle
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.sizes import parse_bytes

from .model import predict
from .profile import Profile
from .trace_child import TORCHRUN_ENV, read, write

__all__ = ["AutoChoice", "Candidate", "LEVELS", "Skipped", "resolve_auto", "walk"]

log = logging.getLogger("zeroshard")

AUTO_OPTIONS = ("memory_budget", "example_batch", "profile", "auto_loss", "auto_recalibrate")


@dataclass(frozen=True)
class Candidate:
    stage: int
    checkpointing: str
    reshard_after_forward: bool = True
    peak_bytes: int = 0
    predicted_step_s: float = 0.0
    verdict: str = ""

    @property
    def name(self) -> str:
        raf = "" if self.stage != 3 or self.reshard_after_forward else " noreshard"
        return f"stage {self.stage}{raf}, checkpointing {self.checkpointing}"


@dataclass(frozen=True)
class AutoChoice:
    """What ``stage="auto"`` chose, and every candidate it weighed."""

    chosen: Candidate
    table: tuple[Candidate, ...]
    budget_bytes: int
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        lines = [f"stage='auto' within {self.budget_bytes / 2**20:,.1f} MiB per rank "
                 "(traced peak, predicted step):",
                 f"  {'configuration':<48} {'peak MiB':>9} {'step s':>7}  verdict"]
        for c in self.table:
            peak, step = ((f"{c.peak_bytes / 2**20:,.1f}", f"{c.predicted_step_s:.3f}")
                          if c.peak_bytes else ("-", "-"))
            lines.append(f"  {c.name:<48} {peak:>9} {step:>7}  {c.verdict}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _budget(value: Any) -> int:
    if value is None:
        raise ValueError(
            "stage='auto' needs memory_budget=: the bytes one rank may hold, e.g. "
            "memory_budget='20GiB' or 20 * 2**30 (on a GPU also a fraction of the device, "
            "memory_budget='80%'); on a CPU a number is required")
    if isinstance(value, str) and value.strip().endswith("%"):
        if not torch.cuda.is_available():
            raise ValueError(f"memory_budget={value!r}: a fraction needs a GPU to take it "
                             "of; on a CPU pass bytes, e.g. memory_budget='2GiB'")
        try:
            frac = float(value.strip()[:-1]) / 100
        except ValueError:
            frac = -1.0
        if not 0 < frac <= 1:
            raise ValueError(f"memory_budget={value!r}: a fraction of the device is a "
                             "percentage in (0, 100], e.g. '80%'")
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return int(frac * total)
    if isinstance(value, str):
        return parse_bytes(value, what="memory_budget")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"memory_budget={value!r} must be bytes (an int > 0 or a string "
                         "with a unit such as '2GiB')")
    return value


def _meta_twin(model: nn.Module) -> nn.Module:
    """The model's structure with meta tensors in place of its weights (nothing copied),
    without checkpointing (its classes are made at run time: no pickling them to the
    tracing process; the traces apply the policy again)."""
    from zeroshard.checkpointing import remove_checkpointing

    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                   requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return remove_checkpointing(copy.deepcopy(model, memo))


def _checkpointed(model: nn.Module) -> bool:
    from zeroshard.checkpointing import _CheckpointedMixin

    return any(isinstance(m, _CheckpointedMixin) for m in model.modules())


def _applied_policy(model: nn.Module) -> Any:
    """The checkpointing policy the caller applied, for the traces to apply to the twin."""
    from zeroshard.checkpointing import applied_policy

    found = applied_policy(model)
    if found is None or not found[2] or found[1]:
        raise ValueError(
            "stage='auto' traces a copy of the model and must apply its checkpointing again: "
            "apply it to the whole model with zeroshard.checkpointing.apply_checkpointing("
            "model, policy) (default blocks, no offload_activations), or leave "
            "checkpointing to stage='auto'")
    return found[0]


def _policy_name(policy: Any) -> str:
    name = getattr(policy, "name", None)
    return name if isinstance(name, str) else type(policy).__name__


def cache_dir() -> Path:
    return Path(os.environ.get("ZEROSHARD_TRACE_CACHE")
                or Path.home() / ".cache" / "zeroshard" / "traces")


def _source_hash() -> str:
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent  # the zeroshard package
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _model_signature(model: nn.Module) -> str:
    rows = [type(model).__qualname__, repr(model)]
    rows += [f"{n} {tuple(t.shape)} {t.dtype} {t.requires_grad}"
             for n, t in model.named_parameters()]
    rows += [f"{n} {tuple(t.shape)} {t.dtype}" for n, t in model.named_buffers()]
    return "\n".join(rows)


def _cache_key(signature: str, source: str, job: dict[str, Any]) -> str:
    loss = job["loss_fn"]
    plain = {k: v for k, v in job.items() if k != "loss_fn"}
    text = repr((signature, source, torch.__version__, sorted(plain.items()),
                 f"{loss.__module__}.{loss.__qualname__}"))
    return hashlib.sha256(text.encode()).hexdigest()


def _cached(key: str) -> Any:
    try:
        with open(cache_dir() / f"{key}.pkl", "rb") as f:
            return pickle.load(f)
    except Exception:  # missing, partial or from another version: trace again
        return None


def _store(key: str, result: Any) -> None:
    if isinstance(result, str):
        return  # a failure is not kept: it may be this machine's
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{key}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(result, f)
        os.replace(tmp, d / f"{key}.pkl")  # whole or absent
    except OSError as exc:
        log.info("zeroshard: trace cache not written (%s)", exc)


class _Tracer:
    """This rank's traces: from the cache where it has them, else in one child process
    kept for the whole choice (its start costs seconds: torch's import); see [Note: a
    child that imports nothing of the script] in trace_child.py."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.signature, self.source = _model_signature(model), _source_hash()
        self.child: subprocess.Popen | None = None
        self.twin: nn.Module | None = None

    def __call__(self, jobs: list[dict[str, Any]]) -> list[Any]:
        keys = [_cache_key(self.signature, self.source, j) for j in jobs]
        got = [_cached(k) for k in keys]
        todo = [i for i, g in enumerate(got) if g is None]
        if todo:
            fresh = self._trace([jobs[i] for i in todo])
            for i, r in zip(todo, fresh):
                got[i] = r
                _store(keys[i], r)
        return got

    def _trace(self, jobs: list[dict[str, Any]]) -> list[Any]:
        if self.child is None:
            self.twin = _meta_twin(self.model)
            env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
            self.child = subprocess.Popen(
                [sys.executable, "-m", "zeroshard.timing.trace_child"], env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.child.stdin is not None and self.child.stdout is not None
        try:
            write(self.child.stdin, (self.twin, jobs))
            status, answer = read(self.child.stdout)
        except (EOFError, BrokenPipeError) as exc:
            raise RuntimeError(f"stage='auto': the tracing process ended (exit code "
                               f"{self.child.poll()}); its error is above") from exc
        if status == "unpickle":
            raise ValueError(
                f"stage='auto' traces a copy of the model in a fresh process, which could "
                f"not import it ({answer}): define the model's classes (and auto_loss) in "
                "an importable module, not in the script run as __main__")
        return answer

    def close(self) -> None:
        if self.child is not None:
            if self.child.stdin is not None:
                self.child.stdin.close()  # EOF: the child ends
            try:
                self.child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.child.kill()


#: A chain's levels: each level's policies recompute more than some policy of the level
#: before (selective-op and every-2 each more than none, full more than both).
LEVELS = (("none",), ("selective-op", "every-2"), ("full",))


@dataclass(frozen=True)
class Skipped:
    """A candidate left untraced, and why."""

    reason: str


def _chains(fixed_raf: bool | int | None, applied: str | None, offload: str | None,
            meta: bool = False) -> list[list[list[Candidate]]]:
    """The candidates: per (stage, reshard_after_forward), levels of ever more recompute
    ([Note: stage="auto"]). ``meta``: the model is on the meta device (only stage 3
    materialises it)."""
    levels = ((applied,),) if applied else LEVELS
    stages: tuple[int, ...] = (0, 1, 2, 3)
    if offload is not None:
        stages = (3,) if offload == "optimizer+params" else (1, 2, 3)
    if meta:
        stages = (3,)
    chains = []
    for stage in stages:
        rafs = [True] if stage != 3 else ([fixed_raf] if fixed_raf is not None
                                          else [False, True])
        chains += [[[Candidate(stage, p, raf) for p in level] for level in levels]
                   for raf in rafs]
    return chains


def walk(chains: list[list[list[Candidate]]], trace: Callable[[list[Candidate]], list[Any]],
         budget: int) -> dict[Candidate, Any]:
    """Every candidate's trace, or why it was left untraced: rounds trace the next level
    of every open chain; a chain ends at a level where a candidate fits (what is left
    only adds recompute), or where even the model state exceeds the budget (checkpointing
    does not shrink it)."""
    out: dict[Candidate, Any] = {}
    pos = [0] * len(chains)
    while True:
        todo = [c for i, ch in enumerate(chains) if pos[i] < len(ch) for c in ch[pos[i]]]
        if not todo:
            return out
        out.update(zip(todo, trace(todo)))
        for i, ch in enumerate(chains):
            if pos[i] >= len(ch):
                continue
            got = [out[c] for c in ch[pos[i]] if not isinstance(out[c], str)]
            if any(_peak(r) <= budget for r in got):
                why = Skipped("less recompute fits at this stage")
            elif got and min(r.device_model_state_bytes for r in got) > budget:
                state = min(r.device_model_state_bytes for r in got)
                why = Skipped(f"the model state alone ({state / 2**20:,.1f} MiB) exceeds "
                              "the budget")
            else:
                pos[i] += 1
                continue
            for level in ch[pos[i] + 1:]:
                out.update(dict.fromkeys(level, why))
            pos[i] = len(ch)


def _profile(path: Any, backend: str, world: int, group: Any, traces: list[Any],
             strict: bool = False) -> tuple[Profile, list[str]]:
    """The profile to price with: ``path``'s if it was measured here, else a brief
    calibration — written to ``path`` (rank 0) when one was named, as ``bench --profile``
    does; with ``strict`` (``auto_recalibrate=False``) a missing or foreign profile is an
    error instead."""
    from .calibrate import calibrate, probes

    notes = []
    prof: Profile | None = None
    if isinstance(path, Profile):
        prof = path
    elif path is not None and Path(path).exists():
        prof = Profile.load(path)
    elif path is not None:
        if strict:
            raise ValueError(f"stage='auto': profile={str(path)!r} does not exist and "
                             "auto_recalibrate=False; write it with `zeroshard calibrate "
                             f"--out {path}`, or let auto calibrate (and write it there)")
        warnings.warn(f"stage='auto': profile={str(path)!r} does not exist: calibrating "
                      "briefly and writing it there", stacklevel=4)
        notes.append(f"profile {str(path)!r} missing: calibrated briefly, written there")
    else:
        notes.append("no profile given (profile=PATH from `zeroshard calibrate`): "
                     "calibrated briefly")
    if prof is not None:
        why = prof.mismatch(backend=backend, world_size=world)
        if why and strict:
            raise ValueError(f"stage='auto': the profile was measured elsewhere "
                             f"({'; '.join(why)}) and auto_recalibrate=False; run `zeroshard "
                             "calibrate` here, or let auto recalibrate")
        if why:
            warnings.warn(f"stage='auto': the profile was measured elsewhere ({'; '.join(why)}); "
                          "recalibrating", stacklevel=4)
            notes.append("profile measured elsewhere: recalibrated")
            prof = None
    if prof is None:
        prof = calibrate(**probes(traces), group=group, quick=True)
        if isinstance(path, (str, os.PathLike)) and dist.get_rank(group) == 0:
            prof.save(path)
    return prof, notes


def resolve_auto(model: nn.Module, options: dict[str, Any], *,
                 process_group: dist.ProcessGroup | None, mixed_precision: str | None,
                 hybrid: Any = None, mesh: Any = None
                 ) -> tuple[int, dict[str, Any], AutoChoice]:
    """Choose; apply the chosen checkpointing to ``model``. Returns (stage, the options
    to shard with, the choice). ``options`` loses the auto-only keys."""
    from zeroshard.checkpointing import apply_checkpointing
    from zeroshard.memory.traced import lm_loss

    budget = _budget(options.pop("memory_budget", None))
    batch = options.pop("example_batch", None)
    path = options.pop("profile", None)
    loss_fn: Callable | None = options.pop("auto_loss", None)
    recalibrate = options.pop("auto_recalibrate", True)
    if isinstance(batch, list):
        batch = tuple(batch)
    if (not isinstance(batch, tuple) or len(batch) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                       for v in batch)):
        raise ValueError(
            f"stage='auto' needs example_batch=(micro_batch, seq_len), the per-rank batch "
            f"the model will train on (got {batch!r}), e.g. example_batch=(2, 128): each "
            "candidate is traced on such a batch")
    if loss_fn is None and not hasattr(getattr(model, "config", None), "vocab"):
        raise ValueError(
            "stage='auto' traces a step of the model: pass auto_loss=fn(model, micro_batch, "
            "seq_len) -> loss (a picklable module-level function), or use a model with "
            "config.vocab (token ids in, logits out)")
    for k, v in (("hybrid", hybrid), ("mesh", mesh)):
        if v is not None:
            raise ValueError(f"stage='auto' chooses over one shard group; with {k}= pass a "
                             "stage (docs/hybrid.md)")
    offload = options.get("offload")
    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    backend = str(dist.get_backend(process_group))
    fixed_raf = options.get("reshard_after_forward")
    applied = _checkpointed(model)
    policy = _applied_policy(model) if applied else None
    notes = []
    if fixed_raf is not None:
        notes.append(f"reshard_after_forward={fixed_raf!r} given: kept")
    if applied:
        notes.append("checkpointing already applied to the model: kept on every candidate")
    if offload is not None:
        notes.append(f"offload={offload!r} given: kept (stages "
                     f"{'3' if offload == 'optimizer+params' else '1-3'} only)")
    elif not torch.cuda.is_available():
        notes.append("offload not weighed: on a CPU host and device memory are one")
    meta = any(p.is_meta for p in model.parameters())
    if meta:
        notes.append("the model is on the meta device: stage 3 only (it materialises unit "
                     "by unit; stages 0-2 need real weights)")
    chains = _chains(fixed_raf, f"applied: {_policy_name(policy)}" if applied else None,
                     offload, meta)

    def job(c: Candidate) -> dict[str, Any]:
        extra: dict[str, Any] = {"offload": offload} if offload is not None else {}
        if c.stage == 3:
            extra["reshard_after_forward"] = c.reshard_after_forward
        return dict(world_size=world, rank=0, stage=c.stage, mixed_precision=mixed_precision,
                    micro_batch=batch[0], seq_len=batch[1],
                    checkpointing=policy if applied else c.checkpointing, record_ops=True,
                    loss_fn=loss_fn or lm_loss, stage3_buffers=False,
                    collectives="gloo" if backend == "gloo" else "native", **extra)

    tracer = _Tracer(model)

    def trace(todo: list[Candidate]) -> list[Any]:  # split among the ranks, gathered
        mine = list(range(rank, len(todo), world))
        got = tracer([job(todo[i]) for i in mine])
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, list(zip(mine, got)), group=process_group)
        out: list[Any] = [None] * len(todo)
        for part in gathered:
            for i, r in part:
                out[i] = r
        return out

    try:
        traced = walk(chains, trace, budget)
    finally:
        tracer.close()
    cands = [c for ch in chains for level in ch for c in level]
    traces = [traced.get(c) for c in cands]
    prof, more = _profile(path, backend, world, process_group,
                          [t for t in traces if not isinstance(t, (str, Skipped))],
                          strict=not recalibrate)
    notes += more
    choice = _decide(cands, traces, prof, budget, notes)
    box = [choice]
    dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0)
                               if process_group is not None else 0, group=process_group)
    choice = box[0]
    if rank == 0:
        log.warning("%s", choice.format())
    c = choice.chosen
    if not applied and c.checkpointing != "none":
        apply_checkpointing(model, c.checkpointing)
    if c.stage == 3:
        options["reshard_after_forward"] = c.reshard_after_forward
    return c.stage, options, choice


def _peak(r: Any) -> int:
    """A trace's peak on the device (what the budget bounds)."""
    return int(r.device_peak_bytes)


def _decide(cands: list[Candidate], traces: list[Any], prof: Profile, budget: int,
            notes: list[str]) -> AutoChoice:
    rows = []
    for c, r in zip(cands, traces):
        if isinstance(r, Skipped):
            rows.append(Candidate(c.stage, c.checkpointing, c.reshard_after_forward,
                                  verdict=f"not traced: {r.reason}"))
            continue
        if isinstance(r, str):
            rows.append(Candidate(c.stage, c.checkpointing, c.reshard_after_forward,
                                  verdict=f"not traceable: {r[:80]}"))
            continue
        step = predict(r.ops, r.collectives, prof).total_s
        rows.append(Candidate(c.stage, c.checkpointing, c.reshard_after_forward,
                              _peak(r), step))
    fits = [x for x in rows if x.peak_bytes and x.peak_bytes <= budget]
    if not fits:
        traced = [x for x in rows if x.peak_bytes]
        low = min(traced, key=lambda x: x.peak_bytes) if traced else None
        raise ValueError(
            f"stage='auto': no configuration fits memory_budget={budget / 2**20:,.1f} MiB per "
            "rank" + (f"; the smallest peak found is {low.peak_bytes / 2**20:,.1f} MiB "
                      f"({low.name})" if low else "") + ". Next rungs: more ranks (stage 3 "
            "shards the model state over them), tensor parallelism (docs/tensor-parallel.md), "
            + ("offload of the optimizer state (docs/offload.md), " if torch.cuda.is_available()
               else "") + "or a larger budget; the table above the error: "
            + "; ".join(f"{x.name} {x.peak_bytes / 2**20:,.1f} MiB" for x in traced))
    best = min(fits, key=lambda x: (x.predicted_step_s, x.peak_bytes))
    table = []
    for x in rows:
        if x is best:
            verdict = "chosen: the fastest predicted that fits"
        elif not x.peak_bytes:
            verdict = x.verdict
        elif x.peak_bytes > budget:
            verdict = f"over the budget by {(x.peak_bytes - budget) / 2**20:,.1f} MiB"
        else:
            verdict = f"fits; {100 * (x.predicted_step_s / best.predicted_step_s - 1):.1f}% slower"
        table.append(Candidate(x.stage, x.checkpointing, x.reshard_after_forward,
                               x.peak_bytes, x.predicted_step_s, verdict))
    chosen = next(t for t in table if t.verdict.startswith("chosen"))
    return AutoChoice(chosen=chosen, table=tuple(table), budget_bytes=budget,
                      notes=tuple(notes))
