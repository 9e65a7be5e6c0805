"""``zeroshard train``: a fault-tolerant training entry point for ``torchrun``.

Every rank runs the same loop: build a reference model, apply an activation-checkpointing
policy, ``zeroshard.shard`` it at the chosen stage, and train AdamW on a deterministic,
rank-sharded token stream (zeroshard.data) with warmup + cosine learning rate and
global-norm clipping. Every ``--ckpt-every`` steps (and at the end) it saves a sharded
checkpoint ``<ckpt-dir>/step-<n>`` (zeroshard.state), keeping the newest ``--keep``.

Fault tolerance is torchrun's restart plus this loop's determinism: with
``torchrun --max-restarts K ... zeroshard train --resume``, a killed rank makes torchrun
stop the others and start all ranks again; they load the latest *complete* checkpoint
(weights, optimizer state, loss scale, data position, RNG states) and replay the steps
after it. Since the data of step k is a function of (seed, k) and every operation is
deterministic on a fixed world size, the finished run's parameters are bitwise those of
an uninterrupted run. Each rank writes its pid to ``<ckpt-dir>/rank<r>.pid``.

Without torchrun's environment the command trains in one process (world size 1), or
starts ``--nproc`` local ranks itself. Rank 0 prints a progress line and appends
JSON records (``start``, ``resume``, ``step``, ``checkpoint``, ``done``) to the metrics
file (``--metrics``, default ``<ckpt-dir>/metrics.jsonl``). Resumed at or past
``--steps``, it trains nothing: see [Note: nothing left to do].
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["TrainConfig", "train", "add_arguments", "run"]


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What ``zeroshard train`` runs; every field is also a flag (``--global-batch``)."""

    model: str = _opt("gpt2-tiny", "a preset of zeroshard.models, gpt2-tiny ... llama-13b")
    text: str | None = _opt(None, "train on this local file's bytes (vocab 256); "
                            "default: the synthetic language")
    seq_len: int | None = _opt(None, "tokens per sample; default: the model's, at most 256")
    global_batch: int = _opt(8, "samples per step over all ranks (multiple of world x accum)")
    accum: int = _opt(1, "micro-batches per step on each rank (accumulated under no_sync)")
    steps: int = _opt(100, "steps of the whole run; a resumed run continues up to it")
    lr: float = _opt(3e-3, "peak learning rate, after warmup; then cosine to min_lr")
    min_lr: float = _opt(3e-4, "final learning rate of the cosine schedule")
    warmup: int = _opt(10, "steps of linear warmup")
    weight_decay: float = _opt(0.1, "AdamW weight decay")
    clip: float = _opt(1.0, "global gradient-norm clip; 0 disables it")
    stage: int | str = _opt(2, "ZeRO stage 0-3, or auto: the fastest predicted that fits "
                            "--memory-budget (docs/planning.md)")
    memory_budget: str | None = _opt(None, "with --stage auto: bytes per rank, e.g. 2GiB")
    profile: str | None = _opt(None, "with --stage auto: a `zeroshard calibrate` profile "
                               "(default: a brief calibration at start)")
    mixed_precision: str = _opt("none", "none, bf16 or fp16 (dynamic loss scaling)")
    activation_checkpointing: str = _opt("none", "none, full, every-<k>, selective or sqrt")
    offload: str = _opt("none", "none, optimizer (stages 1-3) or optimizer+params (stage 3): "
                        "ZeRO-Offload, docs/offload.md")
    seed: int = _opt(0, "seed of model init, data and RNGs")
    ckpt_dir: str | None = _opt(None, "directory of step-<n> checkpoints, pid files, metrics")
    ckpt_every: int = _opt(0, "save every this many steps (0: only at the end)")
    keep: int = _opt(2, "complete checkpoints to keep, the newest")
    resume: bool = _opt(False, "start from the latest complete checkpoint in ckpt_dir, if any")
    log_every: int = _opt(10, "log (loss averaged over ranks) every this many steps")
    metrics: str | None = _opt(None, "JSONL metrics file; default <ckpt_dir>/metrics.jsonl")
    step_sleep: float = _opt(0.0, "seconds to sleep after each step (fault-injection tests)")
    nproc: int = _opt(1, "without torchrun: local ranks to start")

    def __post_init__(self) -> None:
        for name in ("global_batch", "accum", "steps", "warmup", "keep", "log_every", "nproc"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "warmup" else 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise ValueError(f"seq_len={self.seq_len!r} must be a positive integer or None")
        if self.stage not in (0, 1, 2, 3, "auto"):
            raise ValueError(f"stage={self.stage!r}; use 0, 1, 2, 3 or auto")
        if (self.stage == "auto") != (self.memory_budget is not None):
            raise ValueError("--stage auto goes with --memory-budget (bytes per rank, e.g. "
                             "--memory-budget 2GiB); pass both, or a stage 0-3 without it")
        if self.memory_budget is not None:
            from zeroshard.sizes import parse_bytes

            parse_bytes(self.memory_budget, what="--memory-budget")  # names the fix
        if self.profile is not None and self.stage != "auto":
            raise ValueError("--profile goes with --stage auto")
        if self.stage == "auto" and self.offload != "none":
            raise ValueError("--offload with --stage auto: offload is not among the "
                             "configurations auto weighs; pass a stage (1-3) with --offload")
        if self.mixed_precision not in ("none", "bf16", "fp16"):
            raise ValueError(f"mixed_precision={self.mixed_precision!r}; use none, bf16 or fp16")
        if self.offload not in ("none", "optimizer", "optimizer+params"):
            raise ValueError(f"offload={self.offload!r}; use none, optimizer or "
                             "optimizer+params")
        if self.offload == "optimizer+params" and self.stage not in (3, "auto"):
            raise ValueError(f"offload='optimizer+params' needs stage 3, not "
                             f"stage={self.stage}; pass --stage 3, or --offload optimizer "
                             "(stages 1-3) or none")
        if self.offload == "optimizer" and self.stage == 0:
            raise ValueError("offload='optimizer' needs stage 1, 2 or 3, not stage=0; pass "
                             "--stage 1 or higher, or --offload none")
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr):
            raise ValueError(f"lr={self.lr!r}, min_lr={self.min_lr!r}: need 0 <= min_lr <= lr, lr > 0")
        if self.clip < 0 or self.step_sleep < 0 or self.ckpt_every < 0:
            raise ValueError("clip, step_sleep and ckpt_every must be >= 0")
        if (self.ckpt_every or self.resume) and not self.ckpt_dir:
            raise ValueError("ckpt_every and resume need a ckpt_dir; pass --ckpt-dir DIR")
        if self.text is not None and not Path(self.text).is_file():
            raise ValueError(f"text={self.text!r} is not a file; pass a local text file")

    def lr_at(self, step: int) -> float:
        """Linear warmup to ``lr``, then cosine to ``min_lr`` at ``steps``."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        frac = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * min(frac, 1.0)))


def _init_group() -> bool:
    """Join torchrun's group, or make a world of one; True if we created it.

    [Note: restarts and torchrun's shared store]
    torchrun (c10d rendezvous) lets the workers use its own TCP store, which outlives a
    restart, so the keys a killed generation of workers left behind (their gloo/NCCL
    addresses) are still there when the next generation connects, and a new rank can
    dial a dead one (pytorch/pytorch#135712). On one node every worker shares one
    agent and hence one restart count, so we namespace our process group's keys by it.
    Across nodes restart counts can differ, so there we ask for the upstream workaround:
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives every generation a fresh store.
    """
    import torch
    import torch.distributed as dist

    from zeroshard.launch import under_torchrun

    if dist.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not under_torchrun():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return True
    env = os.environ
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared and env.get("GROUP_WORLD_SIZE", "1") == "1":
        store, rank, world = next(dist.rendezvous("env://"))
        attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"zeroshard/attempt-{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        return True
    if shared and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and env.get("RANK") == "0":
        print("zeroshard train: warning: multi-node torchrun with --max-restarts shares its "
              "rendezvous store with the workers; restarted ranks can then connect to dead "
              "ones (pytorch#135712). Launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
              flush=True)
    dist.init_process_group(backend)
    return True


class _Log:
    """Rank 0's progress lines and JSONL records."""

    def __init__(self, rank: int, path: str | None) -> None:
        self.rank, self.path = rank, Path(path) if path else None
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if self.path and rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, event: str, **values: Any) -> None:
        if self.rank != 0 or self.path is None:
            return
        rec = {"event": event, "time": round(time.time(), 3), "restart": self.restart, **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)


def _peak_memory(device: Any) -> tuple[str, int]:
    """("device", CUDA max allocated) on a GPU, else ("RSS", the process's peak RSS)."""
    import torch

    if device is not None and device.type == "cuda":
        return "device", int(torch.cuda.max_memory_allocated(device))
    return "RSS", _host_rss()


def _host_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def train(config: TrainConfig) -> dict[str, Any] | None:
    """Run the loop on this rank (see the module docstring); rank 0 returns a summary."""
    import torch.distributed as dist

    owned = _init_group()
    try:
        return _train(config)
    finally:
        if owned:
            dist.destroy_process_group()


def _build(c: TrainConfig, rank: int, world: int, device: Any) -> tuple[Any, Any, Any, int]:
    """Model (checkpointing policy applied, sharded), optimizer, loader, sequence length."""
    import random

    import torch

    import zeroshard
    from zeroshard.checkpointing import apply_checkpointing
    from zeroshard.data import TokenLoader, make_source
    from zeroshard.models import build_model, get_preset

    torch.manual_seed(c.seed)
    random.seed(c.seed)
    cfg = get_preset(c.model)
    seq = c.seq_len or min(cfg.seq_len, 256)
    cfg.check_seq_len(seq)
    model = build_model(cfg, device=device, seed=c.seed)
    if c.activation_checkpointing != "none":
        apply_checkpointing(model, c.activation_checkpointing)
    mp = None if c.mixed_precision == "none" else c.mixed_precision
    offload = None if c.offload == "none" else c.offload
    auto = {} if c.stage != "auto" else {  # [Note: stage="auto"] in timing/auto.py
        "memory_budget": c.memory_budget, "profile": c.profile,
        "example_batch": (c.global_batch // (world * c.accum), seq)}
    model, optim = zeroshard.shard(model, torch.optim.AdamW, stage=c.stage, mixed_precision=mp,
                                   offload=offload,
                                   device=device, lr=c.lr, betas=(0.9, 0.95),
                                   weight_decay=c.weight_decay, **auto)
    source = make_source("bytes" if c.text else "synthetic", vocab=cfg.vocab, seq_len=seq,
                         seed=c.seed, path=c.text)
    loader = TokenLoader(source, global_batch=c.global_batch, rank=rank, world_size=world)
    return model, optim, loader, seq


def _step(c: TrainConfig, model: Any, optim: Any, loader: Any, device: Any) -> tuple[Any, float]:
    """One optimizer step over ``c.accum`` micro-batches; (summed loss tensor, grad norm)."""
    from contextlib import nullcontext

    import torch
    import torch.nn.functional as F

    total = torch.zeros((), device=device or "cpu")
    micro = loader.micro_batches(c.accum)
    for i, (x, y) in enumerate(micro):
        x, y = (x.to(device), y.to(device)) if device is not None else (x, y)
        with model.no_sync() if i < len(micro) - 1 else nullcontext():
            out = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) / c.accum
            out.backward()
        total += out.detach()
    norm = optim.clip_grad_norm_(c.clip).item() if c.clip else float("nan")
    optim.step()
    optim.zero_grad()
    return total, norm


def _train(c: TrainConfig) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    import zeroshard
    from zeroshard.state import latest_checkpoint, load_checkpoint, save_checkpoint, step_dir
    from zeroshard.state.manifest import prune

    rank, world = dist.get_rank(), dist.get_world_size()
    _check_same_config(c, world)
    if c.global_batch % (world * c.accum):
        raise ValueError(f"global_batch={c.global_batch} is not a multiple of world size "
                         f"{world} x accum {c.accum}; use e.g. {world * c.accum * 4}")
    device = None
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    model, optim, loader, seq = _build(c, rank, world, device)
    log = _Log(rank, c.metrics or (str(Path(c.ckpt_dir) / "metrics.jsonl") if c.ckpt_dir else None))
    if c.ckpt_dir:
        Path(c.ckpt_dir).mkdir(parents=True, exist_ok=True)
        (Path(c.ckpt_dir) / f"rank{rank}.pid").write_text(f"{os.getpid()}\n")
    step = 0
    found = latest_checkpoint(c.ckpt_dir) if c.resume else None
    # The last loss logged (averaged over ranks) and its step: carried in each checkpoint,
    # so a resumed run that has nothing left to do can still report one.
    loss, loss_step = float("nan"), None
    if found is not None:
        t0 = time.perf_counter()
        extra = load_checkpoint(found, model, optim)
        loader.load_state_dict(extra["data"])
        step = int(extra["step"])
        loss, loss_step = _last_loss(extra, log, step)
        log.record("resume", step=step, path=str(found), seconds=time.perf_counter() - t0)
        log.say(f"resumed from {found} at step {step} ({time.perf_counter() - t0:.2f} s)")
        changed = _schedule_change(extra.get("config"), c, step)
        if changed is not None and step < c.steps:
            log.record("schedule_changed", step=step, message=changed)
            log.say(changed)
    if step >= c.steps:  # see [Note: nothing left to do]
        return _nothing_left(c, log, step, world, found, loss, loss_step)
    chosen = zeroshard.engine_of(model).auto_choice
    log.record("start", step=step, world_size=world, config=dataclasses.asdict(c),
               **({} if chosen is None else {"auto": dataclasses.asdict(chosen.chosen)}))
    how = (f"stage {c.stage}, checkpointing {c.activation_checkpointing}" if chosen is None else
           f"stage auto -> {chosen.chosen.name} (predicted {chosen.chosen.predicted_step_s:.3f} "
           f"s/step, traced peak {chosen.chosen.peak_bytes / 2**20:,.1f} MiB)")
    log.say(f"zeroshard train: {c.model} on {world} rank(s), {how}, "
            f"mixed precision {c.mixed_precision or 'off'}, "
            + (f"offload {c.offload}, " if c.offload != "none" else "")
            + f"global batch {c.global_batch} x {seq} tokens, steps {step}->{c.steps}")
    group = zeroshard.engine_of(model).comm.group
    tokens, busy = 0, 0.0
    while step < c.steps:
        t0 = time.perf_counter()
        lr = c.lr_at(step)
        for g in optim.param_groups:
            g["lr"] = lr
        total, norm = _step(c, model, optim, loader, device)
        step += 1
        busy += time.perf_counter() - t0
        tokens += c.global_batch * seq
        if step % c.log_every == 0 or step == c.steps:
            dist.all_reduce(total, group=group)
            loss, tok_s, loss_step = total.item() / world, tokens / busy, step
            where, mem = _peak_memory(device)
            host = _host_rss() if where == "device" and c.offload != "none" else None
            log.record("step", step=step, loss=loss, lr=lr, grad_norm=norm, tokens_per_s=tok_s,
                       peak_mem_bytes=mem, peak_mem_kind=where, peak_host_rss_bytes=host,
                       loss_scale=optim.loss_scale)
            log.say(f"step {step:>6}/{c.steps}  loss {loss:.4f}  lr {lr:.2e}  "
                    f"{tok_s:>9,.0f} tok/s  peak {where} {mem / 2**20:,.0f} MiB"
                    + (f"  host RSS {host / 2**20:,.0f} MiB" if host is not None else ""))
            tokens, busy = 0, 0.0
        if c.ckpt_dir and ((c.ckpt_every and step % c.ckpt_every == 0) or step == c.steps):
            t1 = time.perf_counter()
            path = save_checkpoint(step_dir(c.ckpt_dir, step), model, optim,
                                   extra={"step": step, "data": loader.state_dict(),
                                          "config": _shared_config(c),
                                          "loss": None if loss_step is None else loss,
                                          "loss_step": loss_step})
            if rank == 0:
                prune(c.ckpt_dir, c.keep)
            log.record("checkpoint", step=step, path=str(path), seconds=time.perf_counter() - t1)
        if c.step_sleep:
            time.sleep(c.step_sleep)
    log.record("done", step=step, loss=loss)
    return {"step": step, "loss": loss, "world_size": world} if rank == 0 else None


_SCHEDULE = ("steps", "warmup", "lr", "min_lr")


#: Options that may differ from node to node: paths on the node's own disk (each node's
#: metrics file; its copy of the text). The rest must agree on every rank.
_NODE_LOCAL = ("metrics", "text")


def _shared_config(c: TrainConfig) -> dict[str, Any]:
    """The options every rank must agree on: what a checkpoint records."""
    return {k: v for k, v in dataclasses.asdict(c).items() if k not in _NODE_LOCAL}


def _check_same_config(c: TrainConfig, world: int) -> None:
    """Refuse, before anything is built, options that differ across ranks (a node
    started with another --lr): naming the option, its value on rank 0 and the ranks that
    differ. Node-local paths (:data:`_NODE_LOCAL`) may differ."""
    import torch.distributed as dist

    if world == 1:
        return
    configs: list[Any] = [None] * world
    dist.all_gather_object(configs, _shared_config(c))
    for k, v in configs[0].items():
        odd = [r for r, cfg in enumerate(configs) if cfg[k] != v]
        if odd:
            raise ValueError(
                f"--{k.replace('_', '-')} is {v!r} on rank 0 and "
                f"{configs[odd[0]][k]!r} on rank(s) {odd}; start every node with the same "
                f"options (only {', '.join('--' + n for n in _NODE_LOCAL)} may differ)")


def _schedule_change(saved: dict[str, Any] | None, c: TrainConfig, step: int) -> str | None:
    """What a resume with other schedule settings does to the learning rate, or None.

    The rate is a function of the step and of --steps/--warmup/--lr/--min-lr (lr_at):
    raising --steps to train further stretches the cosine, so the resumed run does not
    continue the saved run's decay — it restarts from the new curve's value at this step
    (higher: the decay had almost ended). That may be what the user wants; it must not be
    a surprise."""
    if not saved or all(saved.get(k) == getattr(c, k) for k in _SCHEDULE):
        return None
    try:
        before = TrainConfig(**{k: saved[k] for k in _SCHEDULE}).lr_at(step)
    except (KeyError, TypeError, ValueError):
        return None
    diff = ", ".join(f"--{k.replace('_', '-')} {saved[k]} -> {getattr(c, k)}"
                     for k in _SCHEDULE if saved.get(k) != getattr(c, k))
    return (f"note: the learning-rate schedule differs from the checkpoint's ({diff}): the "
            f"rate at step {step} is {c.lr_at(step):.2e} on the new schedule, {before:.2e} "
            "on the saved run's (warmup + cosine over --steps); pass the saved values to "
            "continue its decay")


def _last_loss(extra: dict[str, Any], log: _Log, step: int) -> tuple[float, int | None]:
    """(loss, its step) last logged before the checkpoint at ``step``: from the checkpoint
    (written since the loss is carried in it), else the newest ``step`` record at or
    before ``step`` in the metrics file (rank 0's; others need none); (nan, None) if
    neither has one."""
    if extra.get("loss_step") is not None and extra.get("loss") is not None:
        return float(extra["loss"]), int(extra["loss_step"])
    found: tuple[float, int | None] = (float("nan"), None)
    if log.rank != 0 or log.path is None or not log.path.is_file():
        return found
    for line in log.path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut short by a killed rank 0
            continue
        if (isinstance(rec, dict) and rec.get("event") == "step" and isinstance(
                rec.get("loss"), (int, float)) and rec.get("step", step + 1) <= step
                and math.isfinite(rec["loss"])):
            found = (float(rec["loss"]), int(rec["step"]))
    return found


def _nothing_left(c: TrainConfig, log: _Log, step: int, world: int, found: Any,
                  loss: float, loss_step: int | None) -> dict[str, Any] | None:
    """[Note: nothing left to do]
    ``--resume`` from a checkpoint at or past ``--steps`` (a finished run started again,
    e.g. by a scheduler's retry) trains nothing and saves nothing: it says so, with the
    loss last logged before that checkpoint (nan would read as a diverged run), and
    records a ``done`` event with ``nothing_to_do: true``. Raise ``--steps`` to train on."""
    past = "" if step == c.steps else f", past --steps {c.steps}"
    known = loss_step is not None
    log.say(f"zeroshard train: nothing left to do: the checkpoint {found} is at step "
            f"{step}{past}, and the run ends at --steps {c.steps}. Raise --steps to train "
            "further.")
    log.record("done", step=step, loss=loss if known else None, loss_step=loss_step,
               nothing_to_do=True)
    if log.rank != 0:
        return None
    return {"step": step, "loss": loss if known else None, "loss_step": loss_step,
            "world_size": world, "nothing_to_do": True}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=argparse.SUPPRESS,
                        help="a JSON or TOML file of these options (flags override it)")
    for f in fields(TrainConfig):
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0])
        if f.name == "stage":
            kind = _stage
        if f.type == "bool":
            parser.add_argument(_flag(f.name), action="store_true", default=argparse.SUPPRESS,
                                help=f.metadata["help"])
            continue
        parser.add_argument(_flag(f.name), type=kind or str, default=argparse.SUPPRESS,
                            metavar=f.name.upper(),
                            help=f"{f.metadata['help']} (default {f.default!r})")


def _stage(text: str) -> int | str:
    return text if text == "auto" else int(text)


def load_config(args: argparse.Namespace) -> TrainConfig:
    """The file given by ``--config`` (if any), overridden by the flags given."""
    values: dict[str, Any] = {}
    path = getattr(args, "config", None)
    if path:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--config {path!r} is not a file")
        if p.suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                raise ValueError(f"--config {path!r}: TOML needs Python >= 3.11; use JSON") from None
            values = tomllib.loads(p.read_text())
        else:
            values = json.loads(p.read_text())
        values = {k.replace("-", "_"): v for k, v in values.items()}
    names = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"--config {path!r}: unknown option(s) {unknown}; known: {sorted(names)}")
    values.update({k: v for k, v in vars(args).items() if k in names})
    return TrainConfig(**values)


def run(args: argparse.Namespace) -> int:
    from zeroshard.errors import UsageError
    from zeroshard.launch import run_ranks_local, under_torchrun

    try:
        config = load_config(args)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    try:
        if config.nproc > 1 and not under_torchrun():
            summary = run_ranks_local(train, config.nproc, config, name="zeroshard-train")
        else:
            summary = train(config)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if summary and summary.get("nothing_to_do"):
        loss = ("no loss was recorded" if summary["loss"] is None else
                f"last logged loss {summary['loss']:.4f} (step {summary['loss_step']})")
        print(f"done: nothing left to do (resumed at step {summary['step']}, --steps "
              f"{config.steps}); {loss}")
    elif summary:
        print(f"done: {summary['step']} steps on {summary['world_size']} rank(s), "
              f"final loss {summary['loss']:.4f}")
    return 0
