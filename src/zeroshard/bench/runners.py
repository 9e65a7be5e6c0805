"""One small runner per system: wrap the model, step it, and say how to measure it.

Every runner trains the same freshly built model (same seed) with ``torch.optim.AdamW``
at the same learning rate on the same batches, computing the loss as
``cross_entropy(logits.float(), targets)``. A runner is built on every rank with the
configuration's own process group (see [Note: failing configurations] in worker.py) and
exposes: ``step(x, y, mark=)`` (one optimizer step, returning the detached local loss;
``mark(phase)`` is called as forward, backward and the optimizer step begin),
``tracker()`` (a fresh :class:`~zeroshard.memory.MemoryTracker` that attributes this
system's params / grads / optimizer state) and, for zeroshard, its communication ledger.

Systems other than zeroshard get 16-bit compute from ``torch.autocast`` (fp32 weights and
optimizer), FSDP2 from its ``MixedPrecisionPolicy``; no loss scaling for fp16 there.
DDP uses ``gradient_as_bucket_view=True`` (its memory-saving mode): gradients are views
of the all-reduce buckets, so they are counted once.

[Note: every system measured the same way]
The tracker counts what a system holds when the measured step starts (its sources) and
everything allocated during the step. So each runner must name, as sources, all memory
its system keeps between steps, or that system would look smaller than it is:
* DDP keeps its gradient buckets for its whole life (the reducer, in C++, allocates them
  at construction; ``zero_grad(set_to_none=True)`` drops only the ``.grad`` views). The
  runner notes (weakly) the storages the last backward's ``.grad`` views, and files them
  as gradients, so the tracker sees the whole buckets from the start of the step.
* ZeroRedundancyOptimizer and DeepSpeed keep buffers as attributes of their optimizer
  (DeepSpeed: flat 16-bit groups, fp32 partitions, gradient partitions, reduction
  buckets). Every tensor held in those attributes (directly, or in lists, tuples and
  dicts of them) is a source: gradients where the attribute's name says so, else other.
* zeroshard and FSDP2 hold nothing outside their parameters, gradients and optimizer
  state that the step does not allocate itself.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zeroshard.bench.configs import BenchSettings, ConfigSpec
from zeroshard.bench.muon import make_naive, muon_optimizers
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


def _held(obj: object, depth: int = 3) -> dict[str, list[torch.Tensor]]:
    """Tensors an object keeps in its attributes, directly or in (nested) lists, tuples and
    dicts, by attribute name (see [Note: every system measured the same way])."""
    def walk(v: object, d: int) -> list[torch.Tensor]:
        if isinstance(v, torch.Tensor):
            return [v]
        if d == 0:
            return []
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, (list, tuple)):
            return [t for x in v for t in walk(x, d - 1)]
        return []
    return {k: ts for k, v in vars(obj).items() if (ts := walk(v, depth))}


def _held_source(*objs: object) -> Callable[[], dict[Category, list[torch.Tensor]]]:
    def source() -> dict[Category, list[torch.Tensor]]:
        grads, other = [], []
        for obj in objs:
            for name, ts in _held(obj).items():
                (grads if "grad" in name or "ipg" in name else other).extend(
                    _local(t) for t in ts if not t.is_meta)
        return {Category.GRADS: grads, Category.OTHER: other}
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


def _no_mark(label: str) -> None:
    pass


def _plain_step(model: nn.Module, opt: torch.optim.Optimizer | tuple, cast,
                after_backward: Callable[[], None] | None = None) -> Callable:
    opts = opt if isinstance(opt, tuple) else (opt,)  # --optimizer muon: (Muon, AdamW)

    def step(x: torch.Tensor, y: torch.Tensor, mark: Callable[[str], None] = _no_mark
             ) -> torch.Tensor:
        mark("forward")
        with cast():
            loss = loss_fn(model(x), y)
        mark("backward")
        loss.backward()
        if after_backward is not None:
            after_backward()
        mark("step")
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def _optimizers(model: nn.Module, s: BenchSettings) -> tuple[torch.optim.Optimizer, ...]:
    """What every system trains ``model`` with: AdamW, or (Muon, AdamW) (bench/muon.py)."""
    if s.optimizer == "muon":
        return muon_optimizers(model, s.lr)
    return (torch.optim.AdamW(model.parameters(), lr=s.lr),)


def _zeroshard(spec, model, group, s: BenchSettings, device, tp_mesh=None) -> Runner:
    import zeroshard

    extra = {} if spec.stage != 3 else {"reshard_after_forward": spec.reshard_after_forward,
                                        "quantize_weights": spec.quantize_weights}
    if spec.quantize_grads is not None:
        extra["quantize_grads"] = spec.quantize_grads
    extra["node_size"] = s.node_size
    where = {"process_group": group} if tp_mesh is None else {"mesh": tp_mesh}
    if s.optimizer == "adamw":
        model, opt = zeroshard.shard(model, torch.optim.AdamW, stage=spec.stage,
                                     mixed_precision=s.mixed_precision, lr=s.lr, **where, **extra)
        inners = [opt.optim]
    else:  # (Muon, AdamW); naive-muon: the same at stage 1, stepped the naive way
        model, opt = zeroshard.shard(model, _optimizers(model, s), stage=spec.stage,
                                     mixed_precision=s.mixed_precision, **where, **extra)
        if spec.prefix == "naive-muon":
            make_naive(opt[0].core)
        inners = opt[0].core.optim.parts

    def tracker() -> MemoryTracker:  # what zeroshard.memory_tracker does, with a device filter
        t = MemoryTracker(device=_tracker_device(device)).track_module(model, params=False)
        for o in inners:
            t.track_optimizer(o)
        return t.add_source(zeroshard.engine_of(model).memory_sources())

    compiled = _compiled(model, _blocks(model), s)
    if tp_mesh is not None:  # no ledger: the measured step counts every collective (dp and
        return Runner(_tp_step(compiled, opt, tp_mesh), tracker)  # tp) at dispatch, as FSDP2's
    return Runner(_plain_step(compiled, opt, contextlib.nullcontext), tracker,
                  zeroshard.engine_of(model).comm.ledger)


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
        opt = _optimizers(model, s)
        inner = opt[0] if len(opt) == 1 else None
    buckets: dict[int, weakref.ref] = {}  # DDP's gradient bucket storages (see the Note)

    def note_buckets() -> None:  # weakly: a bucket rebuild frees the old ones, as it should
        buckets.clear()
        for p in model.parameters():
            if p.grad is not None:
                st = p.grad.untyped_storage()
                buckets[st._cdata] = weakref.ref(st)

    def bucket_tensors() -> dict[Category, list[torch.Tensor]]:
        live = [st for ref in buckets.values() if (st := ref()) is not None]
        return {Category.GRADS: [torch.empty(0, dtype=torch.uint8).set_(st) for st in live]}

    step = _plain_step(_compiled(ddp, _blocks(model), s), opt,
                       _autocast(device, s.mixed_precision), note_buckets)
    if fail_rank is not None:
        good, rank = step, dist.get_rank(group)

        def step(x: torch.Tensor, y: torch.Tensor, **kw) -> torch.Tensor:
            if rank == fail_rank:
                raise RuntimeError(f"deliberate failure on rank {rank} (test-only config 'fail')")
            return good(x, y, **kw)

    def tracker() -> MemoryTracker:
        t = MemoryTracker(device=_tracker_device(device)).track_module(model)
        t.add_source(bucket_tensors)
        if zero:
            t.add_source(_held_source(opt))
        for o in [inner] if inner is not None else opt:
            t.track_optimizer(o)
        return t

    return Runner(step, tracker)


def _fsdp2(spec, model, group, s: BenchSettings, device, tp_mesh=None) -> Runner:
    """FSDP2; with ``tp_mesh``, as torchtitan composes it with tp: on its dp dimension."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from zeroshard.checkpointing import find_blocks

    mesh = DeviceMesh.from_group(group, device.type) if tp_mesh is None else tp_mesh["dp"]
    dt = _DTYPES.get(s.mixed_precision or "")
    mp = MixedPrecisionPolicy(param_dtype=dt, reduce_dtype=dt)
    raf = spec.reshard_after_forward
    kw = {"mesh": mesh, "reshard_after_forward": raf if isinstance(raf, int) else bool(raf),
          "mp_policy": mp}
    for block in find_blocks(model):
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr)

    def tracker() -> MemoryTracker:  # params, grads and state are DTensors: count local shards
        return MemoryTracker(device=_tracker_device(device)).add_source(
            _local_source(model, lambda: _state_tensors(opt)))

    compiled = _compiled(model, find_blocks(model), s)
    if tp_mesh is not None:
        return Runner(_tp_step(compiled, opt, tp_mesh), tracker)
    return Runner(_plain_step(compiled, opt, contextlib.nullcontext), tracker)


def _deepspeed(spec, model, group, s: BenchSettings, device) -> Runner:
    import deepspeed

    # DeepSpeed calls c10d functions torch deprecates, and torch warns at every call:
    # thousands of lines per step in the bench's output.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated",
                            category=FutureWarning)
    if s.compile is not None:
        raise SkipConfig("--compile is not applied to DeepSpeed (its engine wraps the model)")
    config = {
        "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # no runner clips
        "zero_optimization": {"stage": spec.stage, **deepspeed_buckets(model, spec.stage)},
        "bf16": {"enabled": s.mixed_precision == "bf16"},
        "fp16": {"enabled": s.mixed_precision == "fp16"},
    }
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr)
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config,
                                                dist_init_required=False)

    def step(x: torch.Tensor, y: torch.Tensor, mark: Callable[[str], None] = _no_mark
             ) -> torch.Tensor:
        mark("forward")
        loss = loss_fn(engine(x), y)
        mark("backward")
        engine.backward(loss)
        mark("step")
        engine.step()
        return loss.detach()

    def tracker() -> MemoryTracker:
        def flat() -> list[torch.Tensor]:  # DeepSpeed's fp32 partitions and moments
            names = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
            out = [t for n in names for t in getattr(ds_opt, n, None) or []]
            return out + _state_tensors(getattr(ds_opt, "optimizer", opt))
        return MemoryTracker(device=_tracker_device(device)).add_source(
            _local_source(engine.module, flat)).add_source(_held_source(ds_opt))

    return Runner(step, tracker, note="DeepSpeed uses the world process group")


def hidden_size(model: nn.Module) -> int | None:
    """The model's width: its config's ``hidden`` / ``hidden_size``, else the widest
    embedding."""
    cfg = getattr(model, "config", None)
    for name in ("hidden", "hidden_size", "n_embd", "d_model"):
        if isinstance(getattr(cfg, name, None), int):
            return getattr(cfg, name)
    dims = [m.embedding_dim for m in model.modules() if isinstance(m, nn.Embedding)]
    return max(dims) if dims else None


def deepspeed_buckets(model: nn.Module, stage: int) -> dict[str, int]:
    """DeepSpeed's bucket sizes as its Hugging Face integration sets them for ``"auto"``
    (huggingface.co/docs/transformers/deepspeed): reduce bucket hidden², and at stage 3
    prefetch 0.9·hidden², parameters under 10·hidden kept whole. Its own defaults (5e8
    elements, ~1.9 GB of buffers in fp32) are sized for billion-parameter models."""
    h = hidden_size(model)
    if h is None:
        return {}
    out = {"reduce_bucket_size": h * h, "allgather_bucket_size": h * h}
    if stage == 3:
        out.update(stage3_prefetch_bucket_size=int(0.9 * h * h),
                   stage3_param_persistence_threshold=10 * h)
    return out


def _tp_mesh(spec: ConfigSpec, model: nn.Module, device: torch.device):
    """``-tp<k>``: a (world / k, k) mesh and the model parallelised on its tp dimension
    with torchtitan's plan (zeroshard.models.parallel)."""
    from torch.distributed.device_mesh import init_device_mesh

    from zeroshard.models import Llama, parallelize_llama

    world = dist.get_world_size()
    if not isinstance(model, Llama):
        raise SkipConfig(f"-tp{spec.tp} needs a zeroshard Llama preset (--model llama-small), "
                         f"not {type(model).__name__}")
    if world % spec.tp:
        raise SkipConfig(f"-tp{spec.tp} needs a world size divisible by {spec.tp}, not {world}")
    mesh = init_device_mesh(device.type, (world // spec.tp, spec.tp), mesh_dim_names=("dp", "tp"))
    parallelize_llama(model, mesh["tp"])
    return mesh


def _tp_step(model: nn.Module, opt: torch.optim.Optimizer, mesh) -> Callable:
    """A step under tensor parallelism: the ranks of a tp group train their batches
    together (gathered over tp, so every configuration trains the same sequences per
    step), the loss over vocabulary shards under ``loss_parallel``."""
    from torch.distributed.tensor.parallel import loss_parallel

    tp_group, tp = mesh.get_group("tp"), mesh["tp"].size()

    def together(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty((tp * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_single(out, t.contiguous(), group=tp_group)
        return out

    def step(x: torch.Tensor, y: torch.Tensor, mark: Callable[[str], None] = _no_mark
             ) -> torch.Tensor:
        mark("forward")
        x, y = together(x), together(y)
        logits = model(x)
        with loss_parallel():
            loss = loss_fn(logits, y)
            mark("backward")
            loss.backward()
        mark("step")
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach().to_local()  # replicated: every rank holds the mean
    return step


class _ForeignLinear(torch.autograd.Function):
    """The test-only ``patch-linear`` row's replacement for ``F.linear``: shaped as
    DeepSpeed ZeRO-3's (matmul, bias added in place) and scaled by 1 + 2^-8, so any other
    row that steps through it ends at another loss."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        out = x.matmul(w.t())
        if b is not None:
            out += b
        return out * (1 + 2**-8)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0], inputs[1])
        ctx.bias = len(inputs) > 2 and inputs[2] is not None

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        x, w = ctx.saved_tensors
        g = g * (1 + 2**-8)
        g2 = g.reshape(-1, g.shape[-1])
        return g @ w, g2.t() @ x.reshape(-1, x.shape[-1]), g2.sum(0) if ctx.bias else None


def build_runner(spec: ConfigSpec, model: nn.Module, group: dist.ProcessGroup,
                 settings: BenchSettings, device: torch.device) -> Runner:
    """Wrap ``model`` (already on ``device``, checkpointing applied) for ``spec``."""
    if spec.tp > 1:  # zeroshard or FSDP2 over the dp dimension of a tp-parallelised model
        tp_mesh = _tp_mesh(spec, model, device)
        wrap = _zeroshard if spec.system == "zeroshard" else _fsdp2
        return wrap(spec, model, group, settings, device, tp_mesh=tp_mesh)
    if spec.prefix == "fail":
        return _ddp(spec, model, group, settings, device, fail_rank=1)
    if spec.prefix == "patch-linear":
        runner = _ddp(spec, model, group, settings, device)
        torch.nn.functional.linear = _ForeignLinear.apply  # what deepspeed.initialize does
        return runner
    if spec.system in ("zeroshard", "naive_muon"):
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
