"""What the benchmark runs: configuration names and the validated run settings.

A *configuration* is one way to train the same model: a system (zeroshard, torch DDP,
DDP + ZeroRedundancyOptimizer, FSDP2, DeepSpeed), its ZeRO-equivalent stage, whether
stage-3 weights are freed after forward, and an activation-checkpointing policy. Its name
is ``<system>[-noreshard][-<policy>]``, e.g. ``ddp``, ``zs-s1``, ``zs-s3-full``,
``fsdp2-noreshard``, ``zs-s2-every-2``; see :func:`describe_configs`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ..sizes import parse_bytes as _parse_bytes

__all__ = [
    "BenchSettings",
    "ConfigSpec",
    "DEFAULT_CONFIGS",
    "MUON_CONFIGS",
    "MUON_SYSTEMS",
    "SYSTEMS",
    "describe_configs",
    "parse_bytes",
    "parse_config",
    "parse_configs",
]

#: system prefix -> (JSON ``system``, ZeRO-equivalent stage, what it is)
SYSTEMS: dict[str, tuple[str, int, str]] = {
    "ddp": ("ddp", 0, "torch DistributedDataParallel + AdamW (plain data parallelism)"),
    "zero-redundancy": (
        "ddp_zero_redundancy", 1,
        "DDP + torch.distributed.optim.ZeroRedundancyOptimizer (whole params per rank)"),
    "fsdp2": ("fsdp2", 3, "torch fully_shard per block + root (reshard_after_forward=True)"),
    "ds-z1": ("deepspeed", 1, "DeepSpeed ZeRO stage 1 (needs zeroshard[compare])"),
    "ds-z2": ("deepspeed", 2, "DeepSpeed ZeRO stage 2 (needs zeroshard[compare])"),
    "ds-z3": ("deepspeed", 3, "DeepSpeed ZeRO stage 3 (needs zeroshard[compare])"),
    "zs-s0": ("zeroshard", 0, "zeroshard stage 0 (flat buckets, all-reduce)"),
    "zs-s1": ("zeroshard", 1, "zeroshard stage 1 (optimizer state sharded)"),
    "zs-s2": ("zeroshard", 2, "zeroshard stage 2 (+ gradients sharded)"),
    "zs-s3": ("zeroshard", 3, "zeroshard stage 3 (+ parameters sharded, per block)"),
    "naive-muon": (
        "naive_muon", 1,
        "--optimizer muon only: sharded Muon as Megatron and Moonlight run it (ZeRO-1 layout,"
        " each full gradient all-gathered, Newton-Schulz on every rank)"),
}
#: The configurations ``--optimizer muon`` runs (Muon + AdamW where the system takes two
#: optimizers), and its default list.
MUON_SYSTEMS = ("ddp", "naive-muon", "zs-s0", "zs-s1", "zs-s2", "zs-s3")
MUON_CONFIGS = ("ddp", "naive-muon", "zs-s1", "zs-s3")
#: Test-only (not listed): a DDP run whose step raises on rank 1; a DDP run whose build
#: replaces torch.nn.functional.linear with a function of its own, as DeepSpeed's ZeRO-3
#: does (see [Note: the rows must not touch each other] in isolation.py).
HIDDEN = {"fail": ("ddp", 0, "test-only: raises inside its step on rank 1"),
          "patch-linear": ("ddp", 0, "test-only: replaces torch.nn.functional.linear")}
_RESHARDABLE = ("fsdp2", "zs-s3")
POLICIES = ("none", "full", "selective", "selective-op", "sqrt")  # plus every-<k>
HF_FACTORY = "zeroshard.hf:bench_model"
"""The factory ``--hf-config`` uses (an HF model: checkpointed with zeroshard.hf's policies)."""

DEFAULT_CONFIGS = (
    "ddp", "zero-redundancy", "fsdp2", "fsdp2-noreshard",
    "zs-s0", "zs-s1", "zs-s2", "zs-s2-full", "zs-s3", "zs-s3-full", "zs-s3-selective-op",
    "ds-z1", "ds-z2", "ds-z3",
)


@dataclass(frozen=True, kw_only=True)
class ConfigSpec:
    """One parsed configuration name."""

    name: str
    prefix: str
    """Key of :data:`SYSTEMS` (or ``fail``)."""
    system: str
    """JSON ``system``: zeroshard, ddp, ddp_zero_redundancy, fsdp2 or deepspeed."""
    stage: int
    """ZeRO-equivalent stage; FSDP2 without resharding counts as 2 ("2-like")."""
    reshard_after_forward: bool | int | None
    """Stage 3 only: free gathered weights after forward, or keep a secondary shard over
    k ranks (an int, ``-hpz<k>``); None where not applicable."""
    activation_checkpointing: str
    quantize_weights: str | None = None
    """zs-s3 only: ``-w8`` int8, ``-wf8`` fp8 weight all-gathers (ZeRO++'s qwZ)."""
    quantize_grads: str | None = None
    """zs-s2 / zs-s3: ``-g8`` int8, ``-g4`` int4 two-hop gradient reduce-scatter (qgZ)."""
    tp: int = 1
    """Tensor-parallel degree (``-tp<k>``): the model is parallelised with torchtitan's
    plan on a (dp, tp) mesh first (Llama presets only); see docs/tensor-parallel.md."""


_TP_SYSTEMS = ("fsdp2", "zs-s1", "zs-s2", "zs-s3")


def parse_config(name: str) -> ConfigSpec:
    """``zs-s3-noreshard-full`` -> ConfigSpec; ValueError naming the name and the fix."""
    prefix = next((p for p in sorted({**SYSTEMS, **HIDDEN}, key=len, reverse=True)
                   if name == p or name.startswith(p + "-")), None)
    if prefix is None:
        raise ValueError(
            f"unknown configuration {name!r}; names are <system>[-noreshard][-<policy>] with "
            f"system one of {', '.join(SYSTEMS)} (see --list-configs), e.g. zs-s3-full")
    system, stage, _ = {**SYSTEMS, **HIDDEN}[prefix]
    rest = name[len(prefix) + 1:]
    reshard: bool | None = True if prefix in _RESHARDABLE else None
    if rest == "noreshard" or rest.startswith("noreshard-"):
        if prefix not in _RESHARDABLE:
            raise ValueError(f"{name!r}: -noreshard applies to {' and '.join(_RESHARDABLE)} "
                             "only (stage 3); drop it")
        reshard, rest = False, rest[len("noreshard") + 1:]
        stage = 2 if prefix == "fsdp2" else stage
    if m := re.match(r"hpz(\d+)(?:-|$)", rest):
        if prefix not in _RESHARDABLE or reshard is False or int(m.group(1)) < 2:
            raise ValueError(f"{name!r}: -hpz<k> (k >= 2) applies to "
                             f"{' and '.join(_RESHARDABLE)} (stage 3, resharding); e.g. "
                             "zs-s3-hpz2")
        reshard, rest = int(m.group(1)), rest[m.end():]
    quant = None
    if m := re.match(r"(w8|wf8)(?:-|$)", rest):
        if prefix != "zs-s3":
            raise ValueError(f"{name!r}: -w8 / -wf8 (quantised weight gathers) apply to "
                             "zs-s3 only; e.g. zs-s3-w8")
        quant, rest = {"w8": "int8", "wf8": "fp8"}[m.group(1)], rest[m.end():]
    grads = None
    if m := re.match(r"(g8|g4)(?:-|$)", rest):
        if prefix not in ("zs-s2", "zs-s3"):
            raise ValueError(f"{name!r}: -g8 / -g4 (quantised gradient reduce-scatter) apply "
                             "to zs-s2 and zs-s3; e.g. zs-s3-g4")
        grads, rest = {"g8": "int8", "g4": "int4"}[m.group(1)], rest[m.end():]
    tp = 1
    if m := re.match(r"tp(\d+)(?:-|$)", rest):
        tp, rest = int(m.group(1)), rest[m.end():]
        if prefix not in _TP_SYSTEMS or tp < 2:
            raise ValueError(f"{name!r}: -tp<k> (k >= 2) applies to {', '.join(_TP_SYSTEMS)}; "
                             "e.g. zs-s3-tp2 or fsdp2-tp2")
    policy = rest or "none"
    if policy not in POLICIES and not re.fullmatch(r"every-[1-9]\d*", policy):
        if re.match(r"(noreshard|hpz\d*|w\d+|wf\d+|g\d+|tp\d*)(?:-|$)", policy):
            raise ValueError(
                f"{name!r}: {policy.split('-')[0]!r} is not a suffix here; suffixes come in "
                "the order <system>[-noreshard|-hpz<k>][-w8|-wf8][-g8|-g4][-tp<k>]"
                "[-<policy>] (w8/wf8: int8/fp8 weights, g8/g4: int8/int4 gradients), e.g. "
                "zs-s3-hpz2-w8-g4-full; see --list-configs")
        raise ValueError(
            f"{name!r}: unknown activation checkpointing {policy!r}; append one of "
            f"{', '.join(POLICIES)} or every-<k>, e.g. {prefix}-full")
    return ConfigSpec(name=name, prefix=prefix, system=system, stage=stage,
                      reshard_after_forward=reshard, activation_checkpointing=policy, tp=tp,
                      quantize_weights=quant, quantize_grads=grads)


def parse_configs(text: str) -> list[ConfigSpec]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--configs {text!r} names no configuration; e.g. --configs ddp,zs-s1")
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"--configs lists {', '.join(dup)} twice; name each once")
    return [parse_config(n) for n in names]


def describe_configs() -> str:
    """The text of ``--list-configs``."""
    lines = ["Configuration names: "
             "<system>[-noreshard|-hpz<k>][-w8|-wf8][-g8|-g4][-tp<k>][-<policy>]",
             "",
             "systems:"]
    lines += [f"  {p:<16} stage {s}  {what}" for p, (_, s, what) in SYSTEMS.items()]
    lines += [
        "", "suffixes:",
        "  -noreshard       fsdp2 / zs-s3: keep gathered weights from forward to backward",
        "                   (2 Psi traffic instead of 3 Psi; fsdp2-noreshard is reported as",
        "                   stage 2, '2-like')",
        "  -hpz<k>          fsdp2 / zs-s3: after forward keep a secondary shard over k",
        "                   consecutive ranks (reshard_after_forward=k, ZeRO++'s hpZ), so",
        "                   backward's all-gather stays inside them (docs/links.md)",
        "  -w8, -wf8        zs-s3: int8 / fp8 blockwise weight all-gathers (ZeRO++'s",
        "                   qwZ, quantize_weights=; docs/links.md)",
        "  -g8, -g4         zs-s2 / zs-s3: int8 / int4 two-hop gradient reduce-scatter,",
        "                   inside the node then across (ZeRO++'s qgZ, quantize_grads=)",
        "  -tp<k>           fsdp2 / zs-s1..3: tensor parallelism of degree k first",
        "                   (torchtitan's plan on a (world/k, k) mesh; Llama presets only;",
        "                   the same sequences per step: each tp group trains its ranks'",
        "                   batches together; docs/tensor-parallel.md)",
        "  -full, -selective, -selective-op, -sqrt, -every-<k>   activation checkpointing",
        "                   (default none; docs/activation-checkpointing.md)",
        "", "default: " + ",".join(DEFAULT_CONFIGS),
        "(deepspeed configurations are skipped with a note when deepspeed is not installed)",
    ]
    return "\n".join(lines)


def parse_bytes(text: str) -> int:
    """``"1.5GiB"`` -> 1610612736 (``--budget``'s sizes; see zeroshard.sizes)."""
    return _parse_bytes(text, what="--budget")


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """Everything one benchmark run needs; validated on construction."""

    model: str | None = "gpt2-small"
    """A preset name (``zeroshard.models.PRESETS``); ignored when ``model_factory`` is set."""
    model_factory: str | None = None
    """``module:function`` returning an nn.Module mapping LongTensor[B, T] to logits."""
    model_label: str | None = None
    """What tables and plots call the model (default: the preset or the factory)."""
    vocab: int | None = None
    """Vocabulary of a factory model (default: its ``config.vocab`` or first Embedding)."""
    world_size: int = 2
    micro_batch: int = 2
    """Sequences per rank per step (global batch = micro_batch x world_size)."""
    seq: int = 128
    steps: int = 5
    """Timed steps per configuration (the memory is measured in one more step after them)."""
    warmup: int = 2  # see docs/bench.md, 'How it measures': one left the timed steps noisy
    configs: tuple[ConfigSpec, ...] = field(
        default_factory=lambda: tuple(parse_config(n) for n in DEFAULT_CONFIGS))
    baseline: str = "ddp"
    mixed_precision: str | None = None
    budget_bytes: int | None = None
    lr: float = 1e-3
    seed: int = 0
    timeout_s: float = 120.0
    """How long a rank waits in one collective before its configuration is failed."""
    loss_tolerance: float | None = None
    """Relative loss deviation allowed vs the baseline; None: 2% (fp32), 5% (16-bit)."""
    compile: str | None = None
    """torch.compile every configuration: "block" (each block in place) or "whole"."""
    compile_backend: str = "inductor"
    node_size: int | None = None
    """Ranks per (logical) node for zeroshard's rows: the ledger splits their wire bytes
    into intra- and inter-node (None: torchrun's LOCAL_WORLD_SIZE, else one node)."""
    profile: str | None = None
    """``--profile PATH``: predict zeroshard rows' step times from this calibration
    profile (calibrated by the ranks and written there if missing or measured elsewhere)."""
    calibrate_shapes: tuple[tuple, tuple, tuple] | None = None
    """Set by the launcher when the ranks must calibrate: (matrix-product shapes,
    attention shapes, collectives) of the traced rows."""
    optimizer: str = "adamw"
    """"adamw" (every parameter), or "muon": torch's Muon for the hidden matrices and
    AdamW for the rest (embeddings, head, norms, biases), as two optimizers."""

    def __post_init__(self) -> None:
        for name in ("world_size", "micro_batch", "seq", "steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} {v!r} must be an integer >= 1, "
                                 f"e.g. --{name.replace('_', '-')} 2")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"--warmup {self.warmup!r} must be an integer >= 0, e.g. 2")
        if self.compile not in (None, "block", "whole"):
            raise ValueError(f"--compile {self.compile!r} must be 'block' (each block, as "
                             "torchtitan does) or 'whole' (the whole model)")
        if self.mixed_precision not in (None, "bf16", "fp16"):
            raise ValueError(f"--mixed-precision {self.mixed_precision!r} is not supported; "
                             "use bf16 or fp16 (omit it for fp32)")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ValueError(f"--timeout {self.timeout_s!r} must be a positive number of seconds")
        if self.model_factory is None and self.model is None:
            raise ValueError("give --model PRESET or --model-factory module:function")
        if self.model_factory is not None and not re.fullmatch(
                r"[\w.]+:[\w.]+", self.model_factory):
            raise ValueError(f"--model-factory {self.model_factory!r} is not module:function; "
                             "e.g. --model-factory mypkg.models:build")
        if self.node_size is not None and (isinstance(self.node_size, bool) or not isinstance(
                self.node_size, int) or self.node_size < 1 or self.world_size % self.node_size):
            raise ValueError(f"--node-size {self.node_size!r} must divide --world-size "
                             f"{self.world_size} (ranks per node), e.g. --node-size 2")
        for c in self.configs:
            k = c.reshard_after_forward
            if isinstance(k, int) and not isinstance(k, bool) and (
                    self.world_size % k or (self.node_size or self.world_size) % k):
                raise ValueError(
                    f"{c.name}: -hpz{k} needs k dividing --world-size {self.world_size} and "
                    f"--node-size {self.node_size or self.world_size} (a secondary shard "
                    "over k ranks of a node); e.g. --node-size 2 with -hpz2")
        names = [c.name for c in self.configs]
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"--optimizer {self.optimizer!r}: choose adamw or muon")
        if self.optimizer == "muon":
            odd = [c.name for c in self.configs if c.prefix not in MUON_SYSTEMS]
            if odd:
                raise ValueError(f"--optimizer muon runs {', '.join(MUON_SYSTEMS)} (any "
                                 f"checkpointing suffix); drop {', '.join(odd)} from --configs")
        elif any(c.prefix == "naive-muon" for c in self.configs):
            raise ValueError("naive-muon compares sharded Muon implementations: add "
                             "--optimizer muon, or drop it from --configs")
        if self.baseline not in names:
            raise ValueError(f"--baseline {self.baseline!r} is not among the configurations "
                             f"run ({', '.join(names)}); add it to --configs or pick one of them")

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.world_size

    @property
    def tolerance(self) -> float:
        if self.loss_tolerance is not None:
            return self.loss_tolerance
        return 0.02 if self.mixed_precision is None else 0.05
