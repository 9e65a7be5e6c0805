"""One small runner per system: wrap the model, step it, and say how to measure it.

Every runner trains the same freshly built model (same seed) with ``torch.optim.AdamW``
at the same learning rate on the same batches, computing the loss as
``cross_entropy(logits.float(), targets)``. A runner is built on every rank with the
configuration's own process group (see [Note: failing configurations] in worker.py) and
exposes: ``step(x, y)`` (one optimizer step, returning the detached local loss),
``tracker()`` (a fresh :class:`~zeroshard.memory.MemoryTracker` that attributes this
system's params / grads / optimizer state) and, for zeroshard, its communication ledger.

Systems other than zeroshard get 16-bit compute from ``torch.autocast`` (fp32 weights and
optimizer), FSDP2 from its ``MixedPrecisionPolicy``; no loss scaling for fp16 there.
DDP uses ``gradient_as_bucket_view=True`` (its memory-saving mode): gradients are views
of the all-reduce buckets, so they are counted once.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zeroshard.bench.configs import BenchSettings, ConfigSpec
from zeroshard.comm import CommLedger
from zeroshard.memory.tracker import Category, MemoryTracker

__all__ = ["Runner", "SkipConfig", "build_runner", "deepspeed_missing"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class SkipConfig(Exception):
    """Raised (the same way on every rank) when a configuration cannot run here."""


@dataclass
class Runner:
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    tracker: Callable[[], MemoryTracker]
    ledger: CommLedger | None = None
    note: str = ""


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def deepspeed_missing() -> str | None:
    """Why DeepSpeed configurations cannot run, or None when ``import deepspeed`` works."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed; pip install 'zeroshard[compare]' to compare with it"
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # a broken install must not break the benchmark
        return f"import deepspeed failed: {type(exc).__name__}: {exc}"
    return None


def _tracker_device(device: torch.device) -> str | None:
    return "cuda" if device.type == "cuda" else None  # CPU: every storage is host memory


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank really holds); other tensors as they are."""
    return getattr(t, "_local_tensor", t)


def _local_source(model: nn.Module, optim_state: Callable[[], Iterable[torch.Tensor]]):
    def source() -> dict[Category, list[torch.Tensor]]:
        params = list(model.parameters())
        return {
            Category.PARAMS: [_local(p) for p in params],
            Category.GRADS: [_local(p.grad) for p in params if p.grad is not None],
            Category.OPTIM: [_local(t) for t in optim_state()],
            Category.OTHER: list(model.buffers()),
        }
    return source


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]


def _compiled(model: nn.Module, blocks: nn.Module, s: BenchSettings) -> nn.Module:
    """``--compile``: each block compiled in place (what torchtitan and FSDP2 recipes do),
    or the whole (wrapped) model; returns what to call for the forward."""
    if s.compile == "block":
        for block in blocks:
            block.compile(backend=s.compile_backend)
        return model
    if s.compile == "whole":
        return torch.compile(model, backend=s.compile_backend)
    return model


def _blocks(model: nn.Module) -> nn.Module:
    from zeroshard.checkpointing import find_blocks

    return find_blocks(model)


def _autocast(device: torch.device, mp: str | None) -> Callable[[], contextlib.AbstractContextManager]:
    if mp is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=_DTYPES[mp])


def _plain_step(model: nn.Module, opt: torch.optim.Optimizer, cast) -> Callable:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with cast():
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def _zeroshard(spec, model, group, s: BenchSettings, device) -> Runner:
    import zeroshard

    extra = {} if spec.stage != 3 else {"reshard_after_forward": bool(spec.reshard_after_forward)}
    model, opt = zeroshard.shard(model, torch.optim.AdamW, stage=spec.stage, process_group=group,
                                 mixed_precision=s.mixed_precision, lr=s.lr, **extra)

    def tracker() -> MemoryTracker:  # what zeroshard.memory_tracker does, with a device filter
        t = MemoryTracker(device=_tracker_device(device)).track_module(model, params=False)
        return t.track_optimizer(opt.optim).add_source(zeroshard.engine_of(model).memory_sources())

    return Runner(_plain_step(_compiled(model, _blocks(model), s), opt, contextlib.nullcontext),
                  tracker, zeroshard.engine_of(model).comm.ledger)


def _ddp(spec, model, group, s: BenchSettings, device, *, zero: bool = False,
         fail_rank: int | None = None) -> Runner:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids, process_group=group, gradient_as_bucket_view=True)
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, process_group=group, lr=s.lr)
        inner = opt.optim  # the local optimizer over this rank's whole parameters
    else:
        opt = inner = torch.optim.AdamW(model.parameters(), lr=s.lr)
    step = _plain_step(_compiled(ddp, _blocks(model), s), opt,
                       _autocast(device, s.mixed_precision))
    if fail_rank is not None:
        good, rank = step, dist.get_rank(group)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if rank == fail_rank:
                raise RuntimeError(f"deliberate failure on rank {rank} (test-only config 'fail')")
            return good(x, y)

    def tracker() -> MemoryTracker:
        return MemoryTracker(device=_tracker_device(device)).track_module(model).track_optimizer(
            inner)

    return Runner(step, tracker)


def _fsdp2(spec, model, group, s: BenchSettings, device) -> Runner:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from zeroshard.checkpointing import find_blocks

    mesh = DeviceMesh.from_group(group, device.type)
    dt = _DTYPES.get(s.mixed_precision or "")
    mp = MixedPrecisionPolicy(param_dtype=dt, reduce_dtype=dt)
    kw = {"mesh": mesh, "reshard_after_forward": bool(spec.reshard_after_forward), "mp_policy": mp}
    for block in find_blocks(model):
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr)

    def tracker() -> MemoryTracker:  # params, grads and state are DTensors: count local shards
        return MemoryTracker(device=_tracker_device(device)).add_source(
            _local_source(model, lambda: _state_tensors(opt)))

    return Runner(_plain_step(_compiled(model, find_blocks(model), s), opt,
                              contextlib.nullcontext), tracker)


def _deepspeed(spec, model, group, s: BenchSettings, device) -> Runner:
    import deepspeed

    if s.compile is not None:
        raise SkipConfig("--compile is not applied to DeepSpeed (its engine wraps the model)")
    config = {
        "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": spec.stage},
        "bf16": {"enabled": s.mixed_precision == "bf16"},
        "fp16": {"enabled": s.mixed_precision == "fp16"},
    }
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr)
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config,
                                                dist_init_required=False)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    def tracker() -> MemoryTracker:
        def flat() -> list[torch.Tensor]:  # DeepSpeed's fp32 partitions and moments
            names = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
            out = [t for n in names for t in getattr(ds_opt, n, None) or []]
            return out + _state_tensors(getattr(ds_opt, "optimizer", opt))
        return MemoryTracker(device=_tracker_device(device)).add_source(
            _local_source(engine.module, flat))

    return Runner(step, tracker, note="DeepSpeed uses the world process group")


def build_runner(spec: ConfigSpec, model: nn.Module, group: dist.ProcessGroup,
                 settings: BenchSettings, device: torch.device) -> Runner:
    """Wrap ``model`` (already on ``device``, checkpointing applied) for ``spec``."""
    if spec.prefix == "fail":
        return _ddp(spec, model, group, settings, device, fail_rank=1)
    if spec.system == "zeroshard":
        return _zeroshard(spec, model, group, settings, device)
    if spec.system in ("ddp", "ddp_zero_redundancy"):
        return _ddp(spec, model, group, settings, device, zero=spec.system != "ddp")
    if spec.system == "fsdp2":
        return _fsdp2(spec, model, group, settings, device)
    if spec.system == "deepspeed":
        if (why := deepspeed_missing()) is not None:
            raise SkipConfig(why)
        return _deepspeed(spec, model, group, settings, device)
    raise ValueError(f"no runner for system {spec.system!r}")
