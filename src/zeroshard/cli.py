"""The ``zeroshard`` command line: a thin layer over the library.

Each subcommand is registered by one ``_add_<name>(subparsers)`` function listed in
``_SUBCOMMANDS`` and runs a handler that imports its module lazily, so ``--version`` and
``--help`` import no planner, engine or benchmark code. A handler returns the exit code;
a :class:`UsageError` (or argparse's own checks) prints one line naming the value and the
fix and exits 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from zeroshard._version import __version__
from zeroshard.errors import UsageError

if TYPE_CHECKING:
    from zeroshard.memory.planner import Plan

__all__ = ["UsageError", "main", "parse_bytes", "parse_gpus", "parse_params"]

#: Rough all-reduce bus bandwidths (nccl-tests busbw, 10^9 B/s): H100 NVLink 4 (900 GB/s
#: bidirectional) reaches ~400; one 400 Gb/s InfiniBand NDR port per GPU ~45; PCIe Gen4 x16
#: rings through host bridges ~20. Pass a number for your own measurement.
INTERCONNECTS = {"nvlink": 400.0, "ib": 45.0, "pcie": 20.0}
_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_bytes(text: str) -> int:
    """"80GB" -> 80e9, "80GiB" -> 80 * 2**30; a unit is required."""
    m = re.fullmatch(r"\s*(-?)(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    units = "MB, MiB, GB, GiB, TB or TiB"
    if m is None or not m.group(3):
        why = "has no unit" if m else "is not a memory size"
        raise argparse.ArgumentTypeError(
            f"{text!r} {why}; write e.g. 80GB (10^9 bytes) or 80GiB (2^30 bytes), using {units}")
    if m.group(3).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: unknown unit {m.group(3)!r}; use {units}")
    value = int(float(m.group(2)) * _UNITS[m.group(3).lower()])
    if m.group(1) or value <= 0:
        why = "is negative" if m.group(1) and value else "is 0 bytes"
        raise argparse.ArgumentTypeError(
            f"{text!r} {why}; a memory size must be more than 0 bytes, e.g. 80GB")
    return value


def parse_params(text: str) -> int:
    """"13B", "1.5B", "350M", "7e9" -> a parameter count."""
    m = re.fullmatch(r"\s*(-?)(\d+(?:\.\d+)?(?:e\d+)?)\s*([kKmMbBgGtT]?)\s*", text)
    fix = "write e.g. 13B, 1.5B, 350M or 7e9"
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count; {fix}")
    value = float(m.group(2)) * _SUFFIX[m.group(3).lower()]
    if m.group(1) and value:
        raise argparse.ArgumentTypeError(
            f"{text!r} is negative; a parameter count must be at least 1, e.g. "
            f"{text.strip()[1:]}")
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a parameter count of at least 1; {fix}")
    return int(value)


def parse_gpus(text: str) -> list[int]:
    """"8" -> [8]; "8-64" -> [8, 16, 32, 64] (doubling, B included); "8,16" -> [8, 16]."""
    fix = "use a device count >= 1: --gpus 8, a doubling range --gpus 8-64 or a list --gpus 8,16,32"
    try:
        if re.fullmatch(r"\s*\d+\s*-\s*\d+\s*", text):
            lo, hi = (int(x) for x in text.split("-"))
            counts = [lo * 2**k for k in range(64) if lo * 2**k <= hi] if 0 < lo <= hi else []
            counts += [hi] if counts and counts[-1] != hi else []
        else:
            counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device count; {fix}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"invalid device count {text!r}; {fix}")
    return sorted(set(counts))


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer, e.g. 1")
    return int(text)


def _tflops(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a peak; give dense 16-bit TFLOP/s per device > 0, e.g. 989 (H100)")
    return value


def _interconnect(text: str) -> float:
    if text.lower() in INTERCONNECTS:
        return INTERCONNECTS[text.lower()]
    try:
        value = float(re.sub(r"(?i)\s*GB/?s$", "", text))
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an interconnect; use {', '.join(INTERCONNECTS)} or a bus bandwidth "
            "in GB/s, e.g. 100")
    return value


_PCIE_GBPS, _HOST_GBPS = 25.0, 20.0  # = analytic.PCIE_GBPS / HOST_MEM_GBPS (lazy import)


def _gbps(text: str) -> float:
    try:
        value = float(re.sub(r"(?i)\s*GB/?s$", "", text))
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a bandwidth; write GB/s, e.g. 25")
    return value


def _mfu(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a model FLOPs utilisation; use a number in (0, 1], e.g. 0.4")
    return value


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in ("none", "selective", "full", "sqrt")
           and not re.fullmatch(r"every-[1-9]\d*", p)]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown checkpointing policy {', '.join(bad) or text!r}; use a comma list of none, "
            "selective, full, sqrt, every-<k> (e.g. every-2)")
    return names


def _add_plan(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="estimate memory and throughput per ZeRO stage and checkpointing policy",
        description="Estimate per-device memory, communication and throughput for ZeRO stages "
        "0-3 x activation checkpointing policies, and recommend one (docs/planning.md).")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="preset name, e.g. llama-7b")
    which.add_argument("--params", type=parse_params,
                       help="parameter count (13B, 350M, 7e9): nearest Llama-2-like shape")
    which.add_argument("--hf-config", metavar="PATH",
                       help="a Hugging Face config.json or model directory (gpt2, llama, mistral; "
                       "needs zeroshard[hf])")
    p.add_argument("--gpus", type=parse_gpus, default=[8], help="8, 8-64 (doubling) or 8,16,32")
    p.add_argument("--gpu-mem", type=parse_bytes, default=parse_bytes("80GB"),
                   help="device memory with a unit: 80GB, 80GiB, 24GB (default 80GB)")
    p.add_argument("--seq", type=_positive_int, help="sequence length (default: the model's)")
    p.add_argument("--micro-batch", type=_positive_int, default=1, help="sequences per device")
    p.add_argument("--intra", "--interconnect", dest="intra", type=_interconnect,
                   default=INTERCONNECTS["nvlink"], metavar="LINK",
                   help="bus bandwidth inside a node: nvlink (400, default), ib (45), pcie (20) "
                   "or GB/s; --interconnect is an alias")
    p.add_argument("--gpus-per-node", type=_positive_int, metavar="G",
                   help="devices per node; counts above it span several nodes and get hybrid "
                   "sharding rows (R x G)")
    p.add_argument("--inter", type=_interconnect, metavar="LINK",
                   help="bus bandwidth between nodes: ib (45, default with --gpus-per-node), "
                   "nvlink, pcie or GB/s")
    p.add_argument("--offload", nargs="?", const="optimizer",
                   choices=["optimizer", "optimizer+params"],
                   help="stages 1-3 keep the optimizer state and step on the host "
                   "(ZeRO-Offload); 'optimizer+params': stage 3's weight slices too")
    p.add_argument("--host-mem", type=parse_bytes, metavar="SIZE",
                   help="host memory per node with --offload, e.g. 512GB (default: unchecked)")
    p.add_argument("--pcie", type=_gbps, metavar="GB/s",
                   help=f"host<->device bandwidth per device with --offload (default "
                   f"{_PCIE_GBPS:g})")
    p.add_argument("--host-bw", type=_gbps, metavar="GB/s",
                   help=f"host memory bandwidth per rank for the host optimizer step with "
                   f"--offload (default {_HOST_GBPS:g}, a rough figure; docs/offload.md)")
    p.add_argument("--mfu", type=_mfu, default=0.4, help="model FLOPs utilisation (default 0.4)")
    p.add_argument("--peak-tflops", type=_tflops, default=989.0,
                   help="dense 16-bit peak per device, TFLOP/s (default 989)")
    p.add_argument("--recipe", default="bf16-adamw",
                   choices=["bf16-adamw", "fp16-adamw", "fp32-adamw"])
    p.add_argument("--policies", type=_policies, default=["none", "selective", "full"],
                   help="checkpointing policies, comma separated")
    p.add_argument("--activations", type=parse_bytes, metavar="SIZE",
                   help="activations and buffers per device as given (e.g. 25GB), in place of "
                   "the ones computed from the shape: total = model state + SIZE")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree (Llama shapes, torchtitan's plan): each of N "
                   "devices holds 1/tp of the blocks, ZeRO shards over N/tp (default 1; "
                   "docs/tensor-parallel.md)")
    p.add_argument("--muon", action="store_true",
                   help="also show how a whole-parameter optimizer (torch.optim.Muon) spreads "
                   "the matrices over the ranks: work and bytes per rank (docs/optimizers.md)")
    p.add_argument("--profile", metavar="PATH",
                   help="a `zeroshard calibrate` profile: trace each row (as --traced) and "
                   "predict its step time from the trace's ops and collectives priced by "
                   "the profile (columns pred s, pred tok/s; docs/planning.md)")
    p.add_argument("--traced", action="store_true",
                   help="also trace one real step per row on fake tensors (slow: seconds to "
                   "minutes per row; see docs/planning.md)")
    p.set_defaults(handler=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from zeroshard.memory.planner import config_from_params, plan
    from zeroshard.models.config import get_preset

    if args.model is not None:
        try:
            config = get_preset(args.model)
        except ValueError as exc:
            raise UsageError(f"--model {args.model!r}: {exc}") from None
        seq = args.seq or config.seq_len
        if seq > config.seq_len:
            raise UsageError(
                f"--seq {seq} exceeds {args.model}'s maximum sequence length {config.seq_len}; "
                f"use --seq {config.seq_len} or less (or --params for a shape of any length)")
    elif args.hf_config is not None:  # zeroshard[hf]: the shape of an HF config
        from zeroshard.hf import model_config_from_hf

        try:
            config = model_config_from_hf(args.hf_config)
        except (ImportError, ValueError) as exc:
            raise UsageError(f"--hf-config {args.hf_config!r}: {exc}") from None
        seq = args.seq or config.seq_len
    else:
        seq = args.seq or 4096
        config = config_from_params(args.params, seq_len=seq)
    g = args.gpus_per_node
    if args.inter is not None and g is None:
        raise UsageError(f"--inter {args.inter:g} needs --gpus-per-node (devices per node) to "
                         "know which collectives cross nodes; add e.g. --gpus-per-node 8")
    for n in args.gpus:
        if g is not None and n > g and n % g:
            raise UsageError(f"--gpus {n} is not a multiple of --gpus-per-node {g}: several "
                             f"nodes must be whole nodes; use --gpus {n // g * g} or "
                             f"{(n // g + 1) * g}, or a --gpus-per-node that divides {n}")
    for flag, value in (("--host-mem", args.host_mem), ("--pcie", args.pcie),
                        ("--host-bw", args.host_bw)):
        if value is not None and not args.offload:
            raise UsageError(f"{flag} only matters with --offload; add --offload or drop {flag}")
    multi = g is not None and max(args.gpus) > g
    inter = args.inter or (INTERCONNECTS["ib"] if multi else None)
    try:
        result = plan(
            config, gpus=args.gpus, gpu_mem_bytes=args.gpu_mem, seq_len=seq,
            micro_batch=args.micro_batch, interconnect_GBps=args.intra,
            peak_flops=args.peak_tflops * 1e12, mfu=args.mfu, policies=args.policies,
            recipe=args.recipe, gpus_per_node=g, inter_GBps=inter, offload=args.offload,
            host_mem_bytes=args.host_mem, pcie_GBps=args.pcie or _PCIE_GBPS,
            host_GBps=args.host_bw or _HOST_GBPS, tp=args.tp, activation_bytes=args.activations)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.traced and args.activations is not None:
        raise UsageError("--traced measures activations; --activations gives them: drop one")
    if args.traced and args.tp > 1:
        raise UsageError("--traced with --tp is not supported yet (the trace runs the data-"
                         "parallel engine alone); drop one of them")
    prof = None
    if args.profile is not None:
        from zeroshard.timing.profile import Profile

        try:
            prof = Profile.load(args.profile)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if args.tp > 1 or args.activations is not None:
            raise UsageError("--profile traces each row: not with --tp or --activations")
    if args.traced or prof is not None:
        result = _trace(result, prof)
    name = args.model or (f"{args.hf_config} (Hugging Face config)" if args.hf_config else
                          f"--params {args.params / 1e9:g}B -> Llama-like shape")
    traced_muon = _trace_muon(result) if args.muon and args.traced else None
    if args.json:
        out = result.to_dict()
        if args.muon:
            out["muon_owners"] = [dataclasses.asdict(b) for b in _owners(result, args.gpus)]
            out["muon_state"] = [dataclasses.asdict(m) for m in _muon_states(result)]
        if traced_muon is not None:
            out["muon_traced"] = [dataclasses.asdict(t) for t in traced_muon]
        print(json.dumps(out, indent=2))
        return 0
    from zeroshard.memory.plan_render import format_plan

    print(format_plan(result, name))
    if args.muon:
        print(format_owners(_owners(result, args.gpus)))
        print(format_muon_states(_muon_states(result), offload=result.offload))
    if traced_muon is not None:
        print(format_muon_traces(traced_muon))
    return 0


def _trace_muon(p: Plan) -> list:
    from zeroshard.memory.owners import trace_muon

    return trace_muon(p, progress=lambda msg: print(msg, file=sys.stderr, flush=True))


def format_muon_traces(traces: list) -> str:
    """``--muon --traced``: each row without checkpointing traced with Muon + AdamW."""
    gb = 1e9
    lines = ["", "Traced with Muon over the hidden matrices + AdamW over the rest (no "
             "checkpointing; the owners' step", "included: whole parameters, gradients, "
             "exchange buffers, Newton-Schulz's working set), GB per device:",
             f"  {'N':>4} {'stage':>5} {'peak':>8} {'AdamW peak':>11} {'optim':>8}"]
    for t in traces:
        adamw = f"{t.adamw_peak_bytes / gb:11.2f}" if t.adamw_peak_bytes is not None else (
            f"{'-':>11}")
        lines.append(f"  {t.gpus:>4} {t.stage:>5} {t.peak_bytes / gb:8.2f} {adamw} "
                     f"{t.optim_bytes / gb:8.2f}")
    lines.append("  rows with checkpointing, offload or hybrid sharding are not traced with Muon"
                 + ("" if traces else " (none left: pass --policies none)"))
    return "\n".join(lines)


def _muon_states(p: Plan) -> list:
    from zeroshard.memory.owners import muon_states

    return muon_states(p)


def format_muon_states(states: list, offload: bool = False) -> str:
    """``--muon``: each (N, stage)'s model state with Muon + AdamW beside AdamW's."""
    gb = 1e9
    lines = ["", "Model state with Muon over the hidden matrices + AdamW over the rest, GB per "
             "device (masters and AdamW's", "moments sharded as any parameter's, Muon's "
             "momentum whole on its owner; the step's transient is", "not in it: "
             "--traced adds it):",
             f"  {'N':>4} {'stage':>5} {'hybrid':>7} {'optim':>7} {'AdamW optim':>12} "
             f"{'state':>7} {'AdamW state':>12}"]
    for m in states:
        lines.append(f"  {m.gpus:>4} {m.stage:>5} {m.hybrid or '-':>7} "
                     f"{m.optim_bytes / gb:7.2f} {m.adamw_optim_bytes / gb:12.2f} "
                     f"{m.model_state_bytes / gb:7.2f} {m.adamw_model_state_bytes / gb:12.2f}")
    if not states or offload:
        lines.append(("  none" if not states else "  rows with --offload are left out")
                     + ": Muon runs neither with --tp nor with --offload (refused, "
                     "docs/optimizers.md)")
    return "\n".join(lines)


def _owners(p: Plan, gpus: list[int]) -> list:
    """Muon's owner balance over each count's sharding group (G ranks when hybrid)."""
    from zeroshard.memory.owners import matrix_shapes, owner_balance

    shapes = matrix_shapes(p.config)
    g = p.gpus_per_node
    groups = sorted({min(n, g) if g else n for n in gpus})
    return [owner_balance(shapes, max(1, n // p.tp)) for n in groups]


def format_owners(balances: list) -> str:
    """The ``--muon`` section: one line per sharding-group size."""
    lines = ["", "Muon (torch.optim.Muon over the hidden matrices; docs/optimizers.md): each "
             "matrix is stepped whole by one", "owner rank, owners balanced by Newton-Schulz "
             "work (m*n*min(m,n)), not bytes; largest rank over the mean:",
             f"  {'ranks':>5} {'matrices':>8} {'work':>6} {'bytes':>6} "
             f"{'NS share':>9} {'most elements':>14} {'largest matrix':>15}"]
    for b in balances:
        lines.append(f"  {b.ranks:>5} {b.matrices:>8} {b.work_ratio:>5.2f}x {b.bytes_ratio:>5.2f}x "
                     f"{b.share:>8.1%} {b.max_elements / 1e6:>13.1f}M "
                     f"{f'{b.largest[0]}x{b.largest[1]}':>15}")
    lines.append("  NS share: the busiest rank's part of all the orthogonalisation (DDP + Muon: "
                 "100% on every rank)")
    return "\n".join(lines)


def _trace(p: Plan, profile: Any = None) -> Plan:
    """``trace_plan`` for every row: a hybrid row is traced as plain sharding over G ranks
    (the same memory per rank); an offloaded row with the engine's copy path forced, so
    that device and host memory come apart (memory/traced.py)."""
    from dataclasses import replace

    from zeroshard.memory.traced import trace_plan

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if not any(x.hybrid for x in p.rows):
        return trace_plan(p, progress=progress, profile=profile)
    as_plain = [replace(x, gpus=int(x.hybrid.split(" x ")[1]), hybrid=None) if x.hybrid else x
                for x in p.rows]
    traced = trace_plan(replace(p, rows=tuple(as_plain), notes=()), progress=progress,
                        profile=profile)
    rows = [replace(x, traced_model_state_bytes=t.traced_model_state_bytes,
                    traced_peak_bytes=t.traced_peak_bytes, traced_host_bytes=t.traced_host_bytes,
                    predicted_step_s=None if x.hybrid else t.predicted_step_s)
            for x, t in zip(p.rows, traced.rows)]
    return replace(p, rows=tuple(rows), notes=tuple(list(p.notes) + list(traced.notes)))


def _add_bench(subparsers: Any) -> None:
    from zeroshard.bench import cli as bench_cli

    p = subparsers.add_parser(
        "bench", help="side-by-side benchmark of stages and other systems (the main job)",
        description="Train the same model under DDP, ZeRO stages 0-3 with and without "
        "activation checkpointing, FSDP2 and DeepSpeed; record peak memory, throughput "
        "and communication for each. See docs/bench.md.")
    bench_cli.add_arguments(p)
    p.set_defaults(handler=bench_cli.run)


def _add_calibrate(subparsers: Any) -> None:
    from zeroshard.timing import cli as calibrate_cli

    p = subparsers.add_parser(
        "calibrate", help="measure this machine for the time model (a JSON profile)",
        description="Time matrix products, attention, memory-bound kernels, the optimizer "
        "step and the collectives on every rank at once; write the profile that `plan "
        "--profile`, `bench --profile` and shard(stage='auto') price steps with. See "
        "docs/planning.md.")
    calibrate_cli.add_arguments(p)
    p.set_defaults(handler=calibrate_cli.run)


def _add_demo(subparsers: Any) -> None:
    from zeroshard import demo

    p = subparsers.add_parser("demo", help="a short sharded training run on local ranks")
    demo.add_arguments(p)
    p.set_defaults(handler=demo.run)


def _add_train(subparsers: Any) -> None:
    from zeroshard import train

    p = subparsers.add_parser(
        "train", help="train a reference model with sharded checkpoints (for torchrun)",
        description="Train a preset model at a ZeRO stage with periodic sharded checkpoints; "
        "under torchrun --max-restarts K with --resume, a killed rank restarts from the "
        "latest complete checkpoint. See docs/checkpoints.md.")
    train.add_arguments(p)
    p.set_defaults(handler=train.run)


def _add_consolidate(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "consolidate", help="write a sharded checkpoint's full weights to one safetensors file",
        description="Stream the full weights of a zeroshard checkpoint into one safetensors "
        "file, one parameter at a time (bounded memory). See docs/checkpoints.md.")
    p.add_argument("checkpoint", help="a checkpoint directory, or a run's --ckpt-dir "
                   "(its latest complete checkpoint)")
    p.add_argument("out", help="the safetensors file to write")
    p.add_argument("--dtype", default="fp32", choices=["bf16", "fp16", "fp32"],
                   help="dtype of floating tensors (default fp32: the master weights)")
    p.add_argument("--no-verify", action="store_true",
                   help="check file sizes only, not CRC-32 (skips one read of each file)")
    p.add_argument("--lightning", action="store_true",
                   help="a zeroshard Lightning strategy's checkpoint directory -> Lightning's "
                   "one-file .ckpt (whole weights, torch-format optimizer state, loops), which "
                   "the DDP strategy resumes and LightningModule.load_from_checkpoint loads")
    p.set_defaults(handler=_run_consolidate)


def _run_consolidate(args: argparse.Namespace) -> int:
    if args.lightning:
        from zeroshard.errors import UsageError
        from zeroshard.integrations.lightning_checkpoint import to_lightning_checkpoint
        from zeroshard.state.manifest import CheckpointError

        if args.dtype != "fp32":
            raise UsageError("--lightning writes the weights as saved; drop --dtype")
        try:
            out = to_lightning_checkpoint(args.checkpoint, args.out)
        except CheckpointError as e:
            raise UsageError(str(e)) from None
        print(f"wrote {out}: Lightning's one-file checkpoint (LitModel.load_from_checkpoint, "
              "or Trainer(strategy='ddp').fit(..., ckpt_path=...))")
        return 0
    from zeroshard.state.consolidate import run

    return run(args)


_SUBCOMMANDS: tuple[Callable[[Any], None], ...] = (
    _add_plan, _add_bench, _add_calibrate, _add_demo, _add_train, _add_consolidate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeroshard",
        description="Sharded data parallelism (ZeRO 0-3) with measured accounting.")
    parser.add_argument("--version", action="version", version=f"zeroshard {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="<command>")
    for add in _SUBCOMMANDS:
        add(subparsers)
    return parser


def _negative_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``--params -5B`` -> ``--params=-5B``. argparse takes a value that starts with "-"
    for an option unless it is a plain negative number ("-5", not "-5B" or "-1e-3"), and
    would say "expected one argument"; joined to its option, the value reaches the option's
    own check, which names it and the fix (e.g. "'-5B' is negative")."""
    takes_value = {s for a in _all_actions(parser) if a.nargs != 0 for s in a.option_strings}
    out: list[str] = []
    for tok in argv:
        if (out and out[-1] in takes_value and re.fullmatch(r"-\.?\d.*", tok)
                and tok not in takes_value):
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


def _all_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    actions = list(parser._actions)
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                actions += _all_actions(sub)
    return actions


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zeroshard`` console script; returns the exit code."""
    parser = build_parser()
    argv = _negative_values(parser, sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, argparse errors (already printed)
        return exc.code if isinstance(exc.code, int) else 2
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.handler(args))
    except UsageError as exc:
        print(f"zeroshard {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
