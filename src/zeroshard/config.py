"""Typed, frozen, validated configuration of a sharded model.

Every field is validated on construction; an error names the field, the value seen and
the fix. :func:`zeroshard.shard` builds a :class:`ShardConfig` from its keywords.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from .sizes import parse_bytes

__all__ = ["ShardConfig", "MIXED_PRECISION", "OFFLOAD", "auto_bucket_bytes", "ignored_options",
           "suggest_option"]

MAX_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb
MIN_BUCKET_BYTES = 2**20


def auto_bucket_bytes(grad_bytes: int, *, keep_full_grads: bool = False) -> int:
    """The default reduction bucket, within [1 MiB, 25 MiB] (25 MiB: DDP's bucket_cap_mb):
    a 16th of the model's gradient bytes at stage 2, an 8th at stages 0-1
    (``keep_full_grads``).

    Stage 2 holds up to three whole buckets in backward (two reductions in flight and
    one filling), so a fixed 25 MiB would be most of a small model's gradient (gpt2-small:
    97 MiB in 4 buckets). Stages 0-1 keep the whole gradient to the step anyway, so their
    buckets cost no memory of their own and only speed sets their size: every gloo
    collective costs a fixed ~0.5 ms (fewer buckets) while the last bucket's reduction
    waits for the end of backward (more buckets). On gpt2-small, interleaved
    (``benchmarks/ab-results.txt``): stage 1 / ZeroRedundancyOptimizer 1.015-1.037 with 8
    buckets, 1.07-1.08 with 16, 1.07-1.09 with 4; stage 0 / DDP 1.036, 1.072, 1.045.
    Big models get 25 MiB either way."""
    share = 8 if keep_full_grads else 16
    return min(MAX_BUCKET_BYTES, max(MIN_BUCKET_BYTES, grad_bytes // share))

#: Supported mixed-precision recipes: the compute (and communication) dtype of weights
#: and gradients. Master weights and optimizer state are always fp32.
MIXED_PRECISION: dict[str | None, torch.dtype | None] = {
    None: None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}

#: Offload modes (docs/offload.md): what moves to host memory.
OFFLOAD = (None, "optimizer", "optimizer+params")

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def _as_dtype(field: str, value: object) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in _DTYPES:
        return _DTYPES[value]
    raise ValueError(
        f"{field}={value!r} is not a dtype; use one of {sorted(set(_DTYPES))} or a torch.dtype"
    )


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """How a model is sharded. See docs/stages.md for what each stage keeps per rank."""

    #: ZeRO stage: 0 plain data parallel, 1 optimizer state, 2 + gradients, 3 + parameters.
    stage: int = 0
    #: None (fp32 everywhere), "bf16" or "fp16" compute weights and gradients.
    mixed_precision: str | None = None
    #: dtype gradients are reduced (and, at stage >= 1, kept) in. Default: the compute
    #: dtype (ZeRO's 2-byte gradients); "fp32" trades 2x gradient traffic for exact sums.
    reduce_dtype: torch.dtype | str | None = None
    #: Stages 0-2: bytes of gradient per reduction bucket (at the compute dtype); None:
    #: auto_bucket_bytes of the model's gradient bytes (1/8 of them at stages 0-1, 1/16
    #: at stage 2; 1-25 MiB).
    bucket_bytes: int | None = None
    #: Reduce gradients asynchronously while backward continues (stages 0-3).
    overlap: bool = True
    #: Stage 3: free gathered weights after forward (3 Psi traffic) or keep them (2 Psi);
    #: an int k (FSDP2's meaning, ZeRO++'s hpZ): keep a secondary shard over groups of k
    #: consecutive ranks, so backward's all-gather stays inside them (k divides the shard
    #: group and node_size; 1 means False, the shard group's size True). See
    #: docs/links.md and [Note: the secondary shard] in engine/secondary.py.
    reshard_after_forward: bool | int = True
    #: Stage 3: "int8" or "fp8" quantise each rank's weight slice blockwise before the
    #: training all-gathers (ZeRO++'s qwZ; [Note: quantised weights] in
    #: engine/quantize.py): ~half of bf16's bytes on the wire; masters untouched.
    quantize_weights: str | None = None
    #: Stages 2-3: "int8" or "int4" reduce-scatter the gradients as two quantised hops,
    #: inside the node then across nodes (ZeRO++'s qgZ; [Note: quantised gradients] in
    #: engine/quantized_grads.py); the plain reduce-scatter on one node.
    quantize_grads: str | None = None
    #: With quantize_grads: add what quantising lost back into the next step's gradient.
    #: Off by default: its float32 residuals hold 4 bytes per parameter per rank (and
    #: 1/g more), a whole fp32 gradient beside stage 3's 1/N state.
    grad_error_feedback: bool = False
    #: Stage 3: how many units ahead to gather (0 disables prefetch).
    prefetch: int = 1
    #: Stage 3: bytes of gathered weights ``model.generate()`` keeps resident for the
    #: whole call (an int or a size such as "2GiB"): units that fit are gathered once per
    #: call, the others once per token. None: every unit on a CPU; on a GPU half the
    #: smallest free memory among the ranks. See docs/generation.md.
    generate_budget: int | str | None = None
    #: The optimizer's update needs each parameter whole (a Shampoo, SOAP or LAMB of the
    #: user's own): each parameter is then stepped whole by one owner rank (see
    #: docs/optimizers.md). A callable takes a param group's options (the group dict
    #: without "params") and says whether that group is stepped whole (a mixed optimizer;
    #: groups with a "use_muon" key are told apart by it without this). Known classes
    #: (torch's Muon and Adafactor, transformers' Adafactor) need nothing.
    whole_params: bool | Callable[[dict], bool] = False
    #: "optimizer": fp32 master weights, optimizer state and the step live in host memory
    #: (ZeRO-Offload); stages 1-3. "optimizer+params" (stage 3): the compute-dtype weight
    #: slices too. On a CPU-only run host and device coincide: no copies.
    offload: str | None = None
    #: Seconds a collective may wait for its peers before raising CollectiveTimeout.
    #: None: collective checks wait comm.CHECK_TIMEOUT (600 s), collectives themselves
    #: the process group's own timeout.
    timeout: float | None = None
    #: DDP's ``broadcast_buffers``: rank 0's buffers (BatchNorm's running statistics;
    #: every buffer, persistent or not) go to every rank at start-up and before a forward
    #: that follows a forward with gradients and gradient sync. False: neither (each rank
    #: keeps its own buffers from the start).
    broadcast_buffers: bool = True
    #: DDP's ``forward_sync_buffers`` (torch 2.13): when given, it alone decides the
    #: forward broadcasts and the start-up sync always happens (False: rank 0's buffers
    #: at start-up, then each rank's own).
    forward_sync_buffers: bool | None = None
    #: Verify that all ranks issue the same collectives, so a rank that diverges
    #: (evaluates or saves a stage-3 state dict alone) raises an error on every rank
    #: instead of hanging (see [Note: divergence] in comm_check.py). "strict": every collective
    #: waits for its check first (debug runs of models with data-dependent branches).
    check_collectives: bool | str = True
    #: Ranks per node: nodes are groups of ``node_size`` consecutive global ranks, and the
    #: ledger tells the bytes each rank sends inside its node from those it sends to
    #: others ([Note: bytes by link] in comm_links.py). None: torchrun's LOCAL_WORLD_SIZE,
    #: else the whole world (one node). Any divisor of the world may be declared (world 4
    #: as 2 logical nodes of 2 on one machine). See docs/links.md.
    node_size: int | None = None
    #: fp16 dynamic loss scaling: initial scale, growth factor/interval, backoff.
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or not isinstance(self.stage, int):
            raise TypeError(f"stage={self.stage!r} must be an int 0, 1, 2 or 3")
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(
                f"stage={self.stage} is not a ZeRO stage; use 0 (plain data parallel), "
                "1 (shard optimizer state), 2 (+ gradients) or 3 (+ parameters)"
            )
        if not isinstance(self.whole_params, bool) and not callable(self.whole_params):
            raise TypeError(f"whole_params={self.whole_params!r} must be True, False, or a "
                            "function of a param group's options (e.g. lambda g: "
                            "g['use_muon'])")
        budget = self.generate_budget
        if isinstance(budget, str):
            parse_bytes(budget, what="generate_budget", zero=True)
        elif budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
            raise TypeError(f"generate_budget={budget!r}: give bytes (an int), a size such "
                            "as '2GiB', or None (every unit the device has room for)")
        elif budget is not None and budget < 0:
            raise ValueError(f"generate_budget={budget} bytes is negative; give 0 or more "
                             "(0 keeps nothing resident: every token gathers every unit)")
        if self.forward_sync_buffers is not None and not self.broadcast_buffers:
            raise ValueError(
                f"broadcast_buffers=False with forward_sync_buffers="
                f"{self.forward_sync_buffers!r}: give one. broadcast_buffers=False turns "
                "off both the start-up and the forward broadcasts; forward_sync_buffers="
                "False only the forward ones (as DDP's two switches)"
            )
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(
                f"mixed_precision={self.mixed_precision!r} is not supported; use None, "
                "'bf16' or 'fp16'"
            )
        object.__setattr__(self, "reduce_dtype", _as_dtype("reduce_dtype", self.reduce_dtype))
        for name in ("bucket_bytes", "growth_interval"):
            value = getattr(self, name)
            if name == "bucket_bytes" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.quantize_weights not in (None, "int8", "fp8"):
            raise ValueError(f"quantize_weights={self.quantize_weights!r} is not a "
                             "quantisation; use 'int8', 'fp8' or None")
        if self.quantize_weights == "fp8" and not hasattr(torch, "float8_e4m3fn"):
            raise ValueError("quantize_weights='fp8' needs torch.float8_e4m3fn, which this "
                             "torch lacks; use 'int8'")
        if self.quantize_grads not in (None, "int8", "int4"):
            raise ValueError(f"quantize_grads={self.quantize_grads!r} is not a gradient "
                             "quantisation; use 'int8', 'int4' or None")
        if self.quantize_grads is not None and self.stage < 2:
            raise ValueError(
                f"quantize_grads={self.quantize_grads!r} needs stage 2 or 3, whose "
                "gradients are reduce-scattered (stage 0 all-reduces, stage 1 keeps whole "
                f"gradients); stage={self.stage}: use stage=2 or 3, or drop it")
        raf = self.reshard_after_forward
        if not isinstance(raf, bool) and (not isinstance(raf, int) or raf < 1):
            raise ValueError(f"reshard_after_forward={raf!r} must be True, False or a "
                             "positive int k (a secondary shard over k ranks: a divisor of "
                             "the ranks per node)")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or (
            self.prefetch < 0
        ):
            raise ValueError(f"prefetch={self.prefetch!r} must be an int >= 0 (0 disables it)")
        if self.offload not in OFFLOAD:
            raise ValueError(
                f"offload={self.offload!r} is not supported; use None, 'optimizer' or "
                "'optimizer+params' (stage 3)"
            )
        if self.offload is not None and self.stage == 0:
            raise ValueError(
                f"offload={self.offload!r} needs stage 1, 2 or 3 (each rank offloads its "
                "slice); use stage=1 or higher"
            )
        if self.offload == "optimizer+params" and self.stage != 3:
            raise ValueError(
                f"offload='optimizer+params' needs stage=3 (stage={self.stage} keeps whole "
                "weights on every device, which cannot live on the host); use stage=3, or "
                "offload='optimizer'"
            )
        if self.node_size is not None and (
            isinstance(self.node_size, bool) or not isinstance(self.node_size, int)
            or self.node_size < 1
        ):
            raise ValueError(f"node_size={self.node_size!r} must be None or a positive int: "
                             "the ranks per node (a divisor of the world)")
        if self.check_collectives not in (True, False, "strict"):
            raise ValueError(
                f"check_collectives={self.check_collectives!r} must be True (the default: "
                "checks that never stall a collective), 'strict' (each collective waits for "
                "its check: for debugging data-dependent models) or False")
        if self.timeout is not None and (
            isinstance(self.timeout, bool) or not isinstance(self.timeout, int | float)
            or self.timeout <= 0
        ):
            raise ValueError(f"timeout={self.timeout!r} must be None or seconds > 0, e.g. 300")
        if not self.init_scale > 0:
            raise ValueError(f"init_scale={self.init_scale!r} must be > 0")
        if not self.growth_factor > 1:
            raise ValueError(f"growth_factor={self.growth_factor!r} must be > 1")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor={self.backoff_factor!r} must be in (0, 1)")

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The 16-bit compute dtype, or None to keep each parameter's own dtype."""
        return MIXED_PRECISION[self.mixed_precision]

    @property
    def sync_buffers_in_forward(self) -> bool:
        """Broadcast buffers before a forward that follows a training one."""
        if self.forward_sync_buffers is not None:
            return self.forward_sync_buffers
        return self.broadcast_buffers

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


_LOSS_SCALE = ("init_scale", "growth_interval", "growth_factor", "backoff_factor")

#: (option, does it have an effect under this config, why not, what to do instead).
_EFFECTIVE = (
    ("bucket_bytes", lambda c: c.stage != 3,
     "stage 3 reduces each unit's gradients in one collective, so the units set the "
     "sizes", "drop it, or choose units= to size stage 3's collectives"),
    ("reshard_after_forward", lambda c: c.stage == 3,
     "stages 0-2 keep the whole weights on every rank: nothing is gathered or freed",
     "drop it, or use stage=3"),
    ("quantize_weights", lambda c: c.stage == 3,
     "stages 0-2 keep the whole weights on every rank: no weight is gathered",
     "drop it, or use stage=3"),
    ("grad_error_feedback", lambda c: c.quantize_grads is not None,
     "error feedback corrects quantised gradients, and quantize_grads is None",
     "drop it, or set quantize_grads='int8' or 'int4'"),
    ("prefetch", lambda c: c.stage == 3,
     "stages 0-2 gather no weights, so there is nothing to prefetch",
     "drop it, or use stage=3"),
    ("generate_budget", lambda c: c.stage == 3,
     "stages 0-2 keep the whole weights on every rank: generate() gathers nothing",
     "drop it, or use stage=3"),
    *((name, lambda c: c.mixed_precision == "fp16",
       "loss scaling runs under mixed_precision='fp16' only (fp32 and bf16 gradients do "
       "not underflow)", "drop it, or use mixed_precision='fp16'")
      for name in _LOSS_SCALE),
)


def ignored_options(config: ShardConfig, given: set[str]) -> list[str]:
    """One message per option in ``given`` (the keywords the caller passed) set to
    something other than its default where it has no effect under ``config``: shard()
    warns with each, so no option is dropped silently (docs/stages.md lists them)."""
    defaults = {f.name: f.default for f in fields(ShardConfig)}
    out = []
    for name, effective, why, instead in _EFFECTIVE:
        value = getattr(config, name)
        if name in given and value != defaults[name] and not effective(config):
            under = (f"mixed_precision={config.mixed_precision!r}" if name in _LOSS_SCALE
                     else f"stage={config.stage}")
            out.append(f"{name}={value!r} has no effect with {under}: {why}; {instead}")
    return out


def suggest_option(name: str, extra: list[str] | None = None) -> str | None:
    """The zeroshard option ``name`` was probably meant to be, if any."""
    candidates = ShardConfig.option_names() + (extra or [])
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.75)
    return match[0] if match else None
