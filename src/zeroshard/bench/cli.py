"""``zeroshard bench``: the arguments and the handler, wired into zeroshard.cli.

:func:`add_arguments` fills a parser; :func:`run` validates the values (a bad one prints
one line naming it and the fix, and returns 2), starts the ranks, prints the table and
writes the JSON and the plot. ``python -m zeroshard.bench`` runs it on its own.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from typing import Any

from zeroshard.bench.configs import (
    DEFAULT_CONFIGS,
    HF_FACTORY,
    MUON_CONFIGS,
    BenchSettings,
    describe_configs,
    parse_bytes,
    parse_configs,
)

__all__ = ["add_arguments", "run", "settings_from_args"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Train the same model under plain data parallelism, ZeRO stages 1-3 and activation "
        "checkpointing, side by side with torch DDP, ZeroRedundancyOptimizer, FSDP2 and "
        "DeepSpeed; record peak memory by category, throughput, communication and loss "
        "(docs/bench.md). Without torchrun it starts --world-size local ranks itself.")
    a = parser.add_argument
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", default=None, help="model preset (default gpt2-small)")
    which.add_argument("--model-factory", default=None, metavar="MODULE:FUNCTION",
                       help="a function returning an nn.Module mapping LongTensor[B, T] to logits")
    which.add_argument("--hf-config", default=None, metavar="PATH",
                       help="a Hugging Face config.json: each rank builds "
                       "AutoModelForCausalLM.from_config (needs zeroshard[hf])")
    a("--vocab", type=int, default=None, help="vocabulary of a --model-factory model")
    a("--world-size", type=int, default=None,
      help="local ranks to start (default: one per GPU, else 2)")
    a("--micro-batch", type=int, default=2, help="sequences per rank per step (default 2)")
    a("--seq", type=int, default=128, help="sequence length (default 128)")
    a("--steps", type=int, default=5, help="timed steps per configuration (default 5)")
    a("--warmup", type=int, default=2, help="warm-up steps per configuration (default 2)")
    a("--configs", default=",".join(DEFAULT_CONFIGS),
      help="comma-separated configuration names (see --list-configs)")
    a("--list-configs", action="store_true", help="list configuration names and exit")
    a("--compress", action="store_true",
      help="ZeRO++'s rows on logical nodes (needs --node-size G, at least 2 nodes): ddp, "
           "zs-s3, zs-s3-hpzG, zs-s3-w8, zs-s3-g4 and all three, zs-s3-hpzG-w8-g4, with "
           "the bytes each sends across nodes (docs/links.md)")
    a("--baseline", default="ddp", help="configuration the ratios refer to (default ddp)")
    a("--budget", default=None, metavar="SIZE",
      help="memory per rank with a unit, e.g. 1.5GiB: pick the fastest configuration that fits")
    a("--mixed-precision", choices=["bf16", "fp16"], default=None,
      help="16-bit compute (default fp32)")
    a("--node-size", type=int, default=None, metavar="N",
      help="ranks per node (default torchrun's LOCAL_WORLD_SIZE, else one node): zeroshard's "
           "rows split their bytes on the wire into inside a node and between nodes; any "
           "divisor of the world declares logical nodes (docs/links.md)")
    a("--compile", choices=["block", "whole"], default=None,
      help="torch.compile every configuration: each block in place, or the whole model")
    a("--compile-backend", default="inductor",
      help="torch.compile backend with --compile (default inductor; aot_eager compiles fast)")
    a("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    a("--optimizer", choices=["adamw", "muon"], default="adamw",
      help="adamw (default), or muon: torch's Muon (lr 0.02) for the hidden matrices and "
           "AdamW for the rest, as two optimizers; runs ddp, naive-muon and zs-s* "
           f"(default --configs {','.join(MUON_CONFIGS)}; docs/optimizers.md)")
    a("--seed", type=int, default=0, help="model and data seed (default 0)")
    a("--timeout", type=float, default=120.0, metavar="SECONDS",
      help="how long a rank waits in one collective before failing its configuration")
    a("--profile", default=None, metavar="PATH",
      help="predict each zeroshard row's step time from this calibration profile "
           "(`zeroshard calibrate`); if it is missing or was measured elsewhere, the ranks "
           "calibrate first and write it there (docs/planning.md, 'Predicted step times')")
    a("--json", default=None, metavar="PATH", help="write the results as JSON")
    a("--plot", default=None, metavar="PATH", help="write a PNG (needs matplotlib)")
    a("--quiet", action="store_true", help="no progress bar")


def _compress_configs(args: argparse.Namespace, configs: str, world: int) -> str:
    """--compress: stage 3 beside ZeRO++'s options one by one and together."""
    g = getattr(args, "node_size", None)
    if g is None or g < 2 or world % g or world // g < 2:
        raise ValueError(f"--compress needs --node-size G with at least two nodes of 2 or "
                         f"more ranks in --world-size {world} (e.g. --world-size 4 "
                         "--node-size 2): the secondary shard lives inside a node")
    if configs != ",".join(DEFAULT_CONFIGS):
        raise ValueError("--compress picks its own configurations; drop --configs")
    return f"ddp,zs-s3,zs-s3-hpz{g},zs-s3-w8,zs-s3-g4,zs-s3-hpz{g}-w8-g4"


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """Validate the parsed arguments; ValueError names the value and the fix."""
    from zeroshard.launch import under_torchrun

    factory, vocab, configs = args.model_factory, args.vocab, args.configs
    optimizer = getattr(args, "optimizer", "adamw")
    if optimizer == "muon" and configs == ",".join(DEFAULT_CONFIGS):
        configs = ",".join(MUON_CONFIGS)  # the default list, for Muon
    label = None
    if getattr(args, "hf_config", None) is not None:
        factory, vocab, label = _hf_model(args.hf_config, vocab)
        if configs == ",".join(DEFAULT_CONFIGS):  # zeroshard.hf's selective is op-level already
            configs = configs.replace("zs-s3-selective-op", "zs-s3-selective")
    model = args.model if factory is None else None
    if factory is None:
        from zeroshard.models import get_preset

        model = model or "gpt2-small"
        try:
            cfg = get_preset(model)
        except ValueError as exc:
            raise ValueError(f"--model: {exc}") from None
        if isinstance(args.seq, int) and args.seq > cfg.seq_len:
            raise ValueError(f"--seq {args.seq} exceeds {model}'s maximum sequence length "
                             f"{cfg.seq_len}; use --seq {cfg.seq_len} or less")
    world = args.world_size
    if under_torchrun():
        import os

        env_world = int(os.environ["WORLD_SIZE"])
        if world is not None and world != env_world:
            raise ValueError(f"--world-size {world} differs from torchrun's WORLD_SIZE="
                             f"{env_world}; drop --world-size under torchrun")
        world = env_world
    if world is None:  # NCCL refuses two ranks on one GPU: one rank per visible device
        world = _cuda_devices() or 2
    elif not under_torchrun() and 0 < _cuda_devices() < world:
        raise ValueError(f"--world-size {world} exceeds the {_cuda_devices()} visible GPU(s); "
                         "NCCL needs one GPU per rank: use --world-size "
                         f"{_cuda_devices()} or less")
    if getattr(args, "compress", False):
        configs = _compress_configs(args, configs, world)
    settings = BenchSettings(
        model=model, model_factory=factory, model_label=label, vocab=vocab,
        world_size=world, micro_batch=args.micro_batch, seq=args.seq,
        steps=args.steps, warmup=args.warmup, configs=tuple(parse_configs(configs)),
        baseline=args.baseline, mixed_precision=args.mixed_precision,
        budget_bytes=None if args.budget is None else parse_bytes(args.budget),
        lr=args.lr, seed=args.seed, timeout_s=args.timeout, compile=args.compile,
        compile_backend=args.compile_backend, optimizer=optimizer,
        node_size=getattr(args, "node_size", None), profile=getattr(args, "profile", None))
    if settings.model_factory is not None:
        _check_factory(settings.model_factory)
    return settings


def _hf_model(path: str, vocab: int | None) -> tuple[str, int, str]:
    """--hf-config: every rank builds the model with zeroshard.hf.bench_model, which reads
    the config's path from the environment the ranks inherit. Returns (factory, vocab,
    the model's name for tables and plots)."""
    import os

    from zeroshard import hf

    config = hf.load_config(path)  # fails here, once, naming the problem
    os.environ[hf.BENCH_CONFIG_ENV] = os.path.abspath(path)
    arch = (getattr(config, "architectures", None) or [config.model_type])[0]
    return HF_FACTORY, vocab or config.vocab_size, f"{arch} ({os.path.basename(path)})"


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_factory(spec: str) -> None:
    import importlib

    module, _, fn = spec.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in fn.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--model-factory {spec!r}: {exc}; give an importable "
                         "module:function") from None
    if not callable(obj):
        raise ValueError(f"--model-factory {spec!r} is not callable")


def _command(s: BenchSettings) -> str:
    parts = ["zeroshard", "bench"]
    if s.model_factory == HF_FACTORY:
        import os

        from zeroshard.hf import BENCH_CONFIG_ENV

        parts += ["--hf-config", os.environ.get(BENCH_CONFIG_ENV, "?")]
    else:
        parts += (["--model-factory", s.model_factory] if s.model_factory
                  else ["--model", s.model or ""])
    parts += ["--world-size", str(s.world_size), "--micro-batch", str(s.micro_batch),
              "--seq", str(s.seq), "--warmup", str(s.warmup), "--steps", str(s.steps),
              "--configs", ",".join(c.name for c in s.configs)]
    if s.baseline != "ddp":
        parts += ["--baseline", s.baseline]
    if s.mixed_precision:
        parts += ["--mixed-precision", s.mixed_precision]
    if s.optimizer != "adamw":
        parts += ["--optimizer", s.optimizer]
    if s.budget_bytes is not None:
        parts += ["--budget", f"{s.budget_bytes}B" if s.budget_bytes % 2**20 else
                  f"{s.budget_bytes // 2**20}MiB"]
    if s.profile is not None:
        parts += ["--profile", s.profile]
    return shlex.join(parts)


def _prepare_prediction(settings: BenchSettings) -> tuple[dict, Any, BenchSettings]:
    """Trace the predictable rows; load the profile, or ask the ranks to calibrate."""
    import dataclasses
    import os

    from zeroshard.bench.predict import load_or_none, shapes, trace_rows

    backend = "nccl" if _cuda_devices() else "gloo"
    traces = trace_rows(settings, backend)
    threads = max(1, (os.cpu_count() or 1) // settings.world_size) if backend == "gloo" else (
        int(os.environ.get("OMP_NUM_THREADS", "0")) or None)
    prof = load_or_none(settings.profile, settings, backend, threads)
    if prof is None:
        settings = dataclasses.replace(settings, calibrate_shapes=shapes(traces))
    return traces, prof, settings


def _error(msg: str) -> int:
    print(f"zeroshard bench: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Handler of ``zeroshard bench``: 0 on success, 2 on a bad argument, 1 if nothing ran."""
    if args.list_configs:
        print(describe_configs())
        return 0
    try:
        settings = settings_from_args(args)
        if args.plot is not None:
            from zeroshard.bench.render import require_matplotlib

            require_matplotlib()
    except (ValueError, ImportError) as exc:
        return _error(str(exc))
    from zeroshard.bench.launch import launch
    from zeroshard.bench.render import format_table, plot
    from zeroshard.bench.report import build_result, write_json

    start, started = time.perf_counter(), time.time()
    traces, prof = {}, None
    if settings.profile is not None:
        traces, prof, settings = _prepare_prediction(settings)
    try:
        meta = launch(settings, progress=not args.quiet)
    except Exception as exc:  # a rank died outside any configuration (crash, signal)
        print(f"zeroshard bench: the ranks failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if meta is None:  # a torchrun rank other than 0
        return 0
    result = build_result(settings, meta, _command(settings), time.perf_counter() - start,
                          started)
    if settings.profile is not None:
        from zeroshard.bench.predict import annotate
        from zeroshard.timing.profile import Profile

        if prof is None:
            prof = Profile(**meta["profile"])
            prof.save(settings.profile)
        annotate(result, traces, prof, settings.profile)
    if args.plot is not None:
        plot(result, args.plot)
        result["plot"] = str(args.plot)
    if args.json is not None:
        write_json(result, args.json)
    print(format_table(result))
    return 0 if any(r["status"] == "ok" for r in result["rows"]) else 1
