"""Traced estimates: one real training step of the real engine, on fake tensors.

[Note: how a trace works]
The analytic planner (analytic.py) prices formulas; a trace prices the code. Under
``FakeTensorMode`` every tensor carries a shape, dtype, device and a ``meta`` storage of
the right size, but no data, so no memory proportional to the model is allocated and no
arithmetic is done: a 7B model "trains" in seconds on a laptop. Communication goes
through a fake process group (``FakeStore`` + backend ``"fake"``) of any world size N:
its collectives return at once, so one process plays rank ``rank`` of N. The steps:

1. Build the model on the meta device (presets via ``build_model(..., device="meta")``,
   or the caller's meta model, deep-copied), apply the checkpointing policy.
2. Stages 0-2 need real weights before ``shard()``: each parameter is replaced by a fake
   CPU tensor (ties kept) and buffers are recomputed by ``reset_buffers()``. Stage 3
   materialises unit by unit inside the engine, as on a real run (with a no-op init:
   fake tensors have no values to initialise).
3. Run ``steps`` optimizer steps (forward, backward, step, zero_grad) with the category
   :class:`~zeroshard.memory.MemoryTracker` active. AdamW's moments appear during the
   first step, so the steady-state peak is only reached in the second: ``steps=2``.
4. Read: the per-category breakdown at the peak total, each category's own maximum,
   model state after the last optimizer step, before its ``zero_grad`` frees the
   gradients (params + grads + optimizer state),
   the engine's stage-3 unsharded peak, its stage-3 buffers (see [Note: stage-3 buffers,
   traced]) and the communication ledger of the last step.

Offload (``offload=`` in the options): a trace runs on CPU, where host and device are one
memory and the engine would copy nothing, so the trace forces the engine's copy path
(as tests do) and the tracker splits device from host (see [Note: device and host] in
tracker.py): ``device_*`` fields are what the accelerator would hold, ``host_*`` the
host's share per rank.

The optimizer: a real CPU run steps each master in ≤256K-element chunks, never across a
parameter (engine/chunks.py), whose temporaries are negligible; a trace keeps one tensor
per parameter (each size cut would cost it ~20 dispatched ops) and steps Adam/AdamW fused
(no temporaries), which matches that within a chunk's temporaries, and counts one 4-byte
AdamW ``step`` per parameter, not per chunk. (torch's default on CUDA, ``foreach``, allocates list-wide temporaries during
the step that no trace here models: pass ``foreach=True`` to trace them.)

What fake tensors cannot do is read a value. Two places in a step do: the engine's
"which parameters got no gradient on any rank" checks, at the end of backward and at the
step (so the trace assumes all did, as in every reference model) and fp16's overflow check (so fp16 is traced as bf16: the same
bytes, only the loss scale differs). Any other op that reads values or lacks a fake
kernel fails with a :class:`TraceError` naming the model, stage, N and phase.

One artefact of fake tensors is undone after ``shard()``: a view of a tensor whose storage
was resized to 0 bytes (a stage-3 unit's weights, freed until its gather) grows that
storage back to full size under ``FakeTensorMode`` (real tensors leave it empty), and the
engine takes such views once at shard time (``view_as`` to reach each parameter's
AccumulateGrad node). Without ``_free_sharded_units`` every unit would look gathered until
its first forward, and a trace of a stage-3 row whose activations are small reported that
(all 2Ψ of weights at once) as its peak.

[Note: stage-3 buffers, traced]
At stage 3 a trace also follows, after every op, the bytes the engine holds beyond its
1/N shards (:class:`_Stage3Buffers`): gathered unit weights (``full``), all-gathers in
flight (``gathering``), the gradients autograd left on unit parameters (until the unit's
fold) and the whole-unit gradient buffers (until their reduce-scatter completes).
``stage3_buffer_bytes`` is their most at once over the traced steps, and
``stage3_backward_buffer_bytes`` the most while a block is gathered or holds gradients:
the blocks' forward and backward, with their activations alive (not the root's reduction
at the end of backward, after every unit's weights are freed). These are the two moments
:func:`zeroshard.memory.analytic.stage3_buffer_bytes` prices; tests/test_traced.py checks
them to the byte. What else exists at each (gradient slices, activations) is in the
tracker's ``peak`` breakdown; the planner prices it by [Note: stage-3 peak] in
stage3_buffers.py. The fake process group never completes a collective before it is waited
for, so a trace sees the engine's worst case: each unit's reduce-scatter still in flight
when the next unit's gradient buffer is allocated.

[Note: one default process group per process]
``torch.distributed`` holds one default group per process. With none initialised the
trace runs in-process: it creates the fake group and destroys it afterwards. If the
caller already has one (a training script), the trace runs in a fresh *spawned* process
(``subprocess=True`` forces that; useful to measure the trace's own peak RSS).
"""

from __future__ import annotations

import contextlib
import copy
import resource
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from zeroshard.memory.tracker import Category
from zeroshard.models.config import ModelConfig
from zeroshard.step_ops import OpRecorder

if TYPE_CHECKING:
    from zeroshard.memory.planner import Plan

__all__ = [
    "LossFn", "TraceError", "TracedResult", "lm_loss", "run_steps", "trace_plan", "trace_step",
]

LossFn = Callable[[nn.Module, int, int], torch.Tensor]
"""``loss_fn(model, micro_batch, seq_len) -> scalar loss``: makes a batch and runs forward."""


class TraceError(RuntimeError):
    """A trace failed; the message names the model, stage, world size and phase."""


def lm_loss(model: nn.Module, micro_batch: int, seq_len: int) -> torch.Tensor:
    """Next-token cross-entropy on random tokens (``model.config.vocab``), fp32 logits,
    made on the model's device (a measured run on a GPU; fake tensors in a trace)."""
    vocab = model.config.vocab
    dev = next(model.parameters()).device
    x = torch.randint(0, vocab, (micro_batch, seq_len), device=dev)
    y = torch.randint(0, vocab, (micro_batch, seq_len), device=dev)
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def run_steps(model: nn.Module, optim: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
              *, micro_batch: int,
              seq_len: int, steps: int, loss_fn: LossFn = lm_loss,
              phase: list[str] | None = None,
              after_step: Callable[[], None] | None = None) -> None:
    """The training loop both a trace and a measured run execute (so they compare).

    ``phase[0]`` is kept up to date for error messages. ``after_step`` runs after the
    last optimizer step, before its ``zero_grad``: the moment ZeRO's model state
    (parameters, gradients, optimizer state) is all alive.
    """
    where = phase if phase is not None else [""]
    optims = list(optim) if isinstance(optim, (list, tuple)) else [optim]
    for i in range(1, steps + 1):
        where[0] = f"forward of step {i}"
        loss = loss_fn(model, micro_batch, seq_len)
        where[0] = f"backward of step {i}"
        loss.backward()
        del loss
        where[0] = f"optimizer step {i}"
        for o in optims:
            o.step()
        if i == steps and after_step is not None:
            after_step()
        for o in optims:
            o.zero_grad()


@dataclass(frozen=True, kw_only=True)
class TracedResult:
    """Bytes are per rank (rank ``rank`` of ``world_size``); categories as in tracker.py."""

    model: str
    stage: int
    world_size: int
    rank: int
    mixed_precision: str | None
    micro_batch: int
    seq_len: int
    checkpointing: str
    steps: int
    params: int
    """Trainable parameter elements Ψ (tied weights once), unpadded."""
    current: dict[str, int]
    """Per category after the last optimizer step, before its ``zero_grad``."""
    peak: dict[str, int]
    """Per category at the moment the total was highest."""
    max_per_category: dict[str, int]
    peak_bytes: int
    """The highest total over the traced steps."""
    model_state_bytes: int
    """params + grads + optim between steps, less ``reduced_grad_bytes`` (the planner's
    convention: stage 1's reduced slice is a buffer, not ZeRO's model state)."""
    reduced_grad_bytes: int
    """Stage 1's ``reduction.shard``, if it keeps one between steps (see [Note: buffer
    lifetimes] in engine.py); 0 otherwise."""
    activation_peak_bytes: int
    """The largest amount of saved-for-backward memory seen."""
    peak_unsharded_bytes: int
    """Stage 3: most gathered unit weights alive at once (engine); 0 otherwise."""
    stage3_buffer_bytes: int
    """Stage 3: the most bytes held beyond the shards at once: gathered weights, gathers in
    flight, unit gradients and whole-unit gradient buffers (see [Note: stage-3 buffers,
    traced]); 0 otherwise."""
    stage3_backward_buffer_bytes: int
    """Stage 3: the same while a block is gathered or holds gradients (the blocks' forward
    and backward, activations alive); 0 otherwise."""
    device_model_state_bytes: int
    """``model_state_bytes`` on the device alone: less than it only with offload."""
    device_peak_bytes: int
    """The highest total of device memory (= ``peak_bytes`` without offload)."""
    host_peak_bytes: int
    """The highest total of host memory (offloaded state); 0 without offload."""
    comm_per_step: dict[str, dict[str, int]]
    """The last step's ledger by phase: {phase: {logical_bytes, wire_bytes, calls}}."""
    comm_logical_bytes: int
    """ZeRO volume of the last step (forward + backward + step phases)."""
    wall_s: float
    peak_rss_bytes: int
    """The tracing process's peak resident memory (lifetime of that process)."""
    notes: tuple[str, ...] = ()
    ops: dict[str, list] | None = None
    """With ``record_ops``: the last step's ops by phase (``zeroshard.timing.StepOps``)."""
    collectives: tuple[dict[str, Any], ...] | None = None
    """With ``record_ops``: the last step's ledger records (op, impl, bytes, group, phase)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def trace_step(
    model_or_preset: nn.Module | str | ModelConfig, *, world_size: int, rank: int = 0,
    stage: int, mixed_precision: str | None = "bf16", micro_batch: int, seq_len: int,
    checkpointing: str = "none",
    optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW, steps: int = 2,
    loss_fn: LossFn = lm_loss, subprocess: bool | None = None, collectives: str = "native",
    optimizers: Callable[[nn.Module], Sequence[torch.optim.Optimizer]] | None = None,
    record_ops: bool = False, stage3_buffers: bool = True, **options: Any,
) -> TracedResult:
    """Trace ``steps`` training steps of rank ``rank`` of ``world_size`` at ``stage``.

    ``model_or_preset``: a preset name, a model config, or an ``nn.Module`` built on the
    meta device (deep-copied; for a non-language model pass ``loss_fn``). ``options`` go
    to :func:`zeroshard.shard` (``lr``, ``bucket_bytes``, ``prefetch`` ...).
    ``collectives``: "native" (NCCL's reduce-scatter and all-gather, each with its own
    output buffer: a GPU run) or "gloo" (zeroshard's in-place decomposition on gloo, see
    [Note: collectives per backend] in comm.py: a CPU run, e.g. ``zeroshard bench``'s).
    ``optimizers``: instead of ``optimizer``, a picklable function that builds several on
    the model about to be sharded (e.g. Muon over the matrices and AdamW over the rest,
    ``zeroshard.bench.muon.muon_optimizers``): whole-parameter owners' step is traced too.
    ``record_ops``: also record the last step's ops and collectives, what the time model
    prices ([Note: ops of a step] in step_ops.py). ``stage3_buffers=False``: skip following
    stage 3's buffers after every op (``stage3_*buffer_bytes`` are then 0; faster). See [Note: how a trace works] and [Note: one default process group per process].
    """
    if collectives not in ("native", "gloo"):
        raise ValueError(f"collectives={collectives!r}: use 'native' (NCCL) or 'gloo'")
    kwargs = dict(world_size=world_size, rank=rank, stage=stage,
                  mixed_precision=mixed_precision, micro_batch=micro_batch, seq_len=seq_len,
                  checkpointing=checkpointing, optimizer=optimizer, steps=steps,
                  loss_fn=loss_fn, collectives=collectives, optimizers=optimizers,
                  record_ops=record_ops, stage3_buffers=stage3_buffers, **options)
    for name in ("world_size", "micro_batch", "seq_len", "steps"):
        v = kwargs[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be in [0, world_size={world_size})")
    if subprocess is None:
        subprocess = dist.is_available() and dist.is_initialized()
    if not subprocess:
        return _trace(model_or_preset, **kwargs)
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(_trace, model_or_preset, **kwargs).result()


def grad_buffer_bytes(engine: Any) -> tuple[int, int]:
    """Gradient bytes alive at the step that ZeRO's model state does not count (the
    planner prices them as buffers): stage 1's reduced-slice stash (see [Note: buffer
    lifetimes] in engine.py) and the fp32 master gradients where they are a cast of the
    reduced gradient (mixed precision), not a view of it. (all, on the device)"""
    total = device = 0
    for b in engine.buckets:
        held = []
        if engine.policy.shard_optimizer and engine.policy.keep_full_grads and (
                b.reduction.shard is not None):
            held.append(b.reduction.shard)
        g = b.master_grad
        if g is not None and not any(engine._shares(g, t) for t in (
                b.grad, b.reduction.shard, b.host.grad) if t is not None):
            held.append(g)
        for t in held:
            n = t.untyped_storage().nbytes()
            total += n
            device += 0 if engine.offload and t.device.type == "cpu" else n
    return total, device


def _trace(model_or_preset: Any, *, world_size: int, rank: int, stage: int,
           mixed_precision: str | None, micro_batch: int, seq_len: int, checkpointing: str,
           optimizer: Callable[..., torch.optim.Optimizer], steps: int, loss_fn: LossFn,
           collectives: str = "native",
           optimizers: Callable[[nn.Module], Sequence[torch.optim.Optimizer]] | None = None,
           record_ops: bool = False, stage3_buffers: bool = True,
           **options: Any) -> TracedResult:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zeroshard.engine.engine as engine_mod
    from zeroshard.api import engine_of, memory_tracker, shard
    from zeroshard.checkpointing import apply_checkpointing

    if dist.is_initialized():
        raise RuntimeError("a default process group exists; trace with subprocess=True")
    name, model = _meta_model(model_or_preset)
    notes: list[str] = []
    if mixed_precision == "fp16":  # see [Note: how a trace works]
        mixed_precision = "bf16"
        notes.append("fp16 traced as bf16 (same bytes; the loss-scale check reads values)")
    phase = ["setup"]
    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    forced = engine_mod._FORCE_HOST_COPIES
    engine_mod._FORCE_HOST_COPIES = options.get("offload") is not None  # see the note above
    try:
        with FakeTensorMode():
            if checkpointing != "none":
                apply_checkpointing(model, checkpointing)
            _fake_weights(model, params=stage < 3)  # stage 3: the engine does it per unit
            phase[0] = "shard"
            if optimizers is None and optimizer in (torch.optim.AdamW, torch.optim.Adam) and not (
                    {"fused", "foreach"} & set(options)):
                options = {**options, "fused": True}  # see [Note: how a trace works]
            model, optim = shard(
                model, optimizer if optimizers is None else tuple(optimizers(model)),
                stage=stage, mixed_precision=mixed_precision,
                param_init=_no_init if stage == 3 else None, **options)
            engine = engine_of(model)
            _free_sharded_units(engine)  # see [Note: how a trace works]
            for c in engine.comms():
                c.decompose = collectives == "gloo"
            engine.unused_slots = _all_used(engine)  # type: ignore[method-assign]
            tracker = memory_tracker(model, optim)
            seen: dict[str, Any] = {}

            def after_step() -> None:
                seen["now"] = {c.value: v for c, v in tracker.current().items()}
                seen["dev"] = tracker.current_by_location()["device"]
                seen["reduced"], seen["dev_reduced"] = grad_buffer_bytes(engine)

            buffers = _Stage3Buffers(engine) if stage3_buffers else None
            recorder = OpRecorder(phase, steps) if record_ops else contextlib.nullcontext()
            with tracker, buffers or contextlib.nullcontext(), recorder:
                run_steps(model, optim, micro_batch=micro_batch, seq_len=seq_len,
                          steps=steps, loss_fn=loss_fn, phase=phase, after_step=after_step)
            now, dev_now, reduced = seen["now"], seen["dev"], seen["reduced"]
            dev_reduced = seen["dev_reduced"]
            ledger = engine.comm.ledger
            last = ledger.last_step()
            zero = [r for r in last if r.phase in ("forward", "backward", "step")]
            return TracedResult(
                model=name, stage=stage, world_size=world_size, rank=rank,
                mixed_precision=mixed_precision, micro_batch=micro_batch, seq_len=seq_len,
                checkpointing=checkpointing if isinstance(checkpointing, str) else getattr(
                    checkpointing, "name", type(checkpointing).__name__), steps=steps,
                params=sum(b.numel for b in engine.buckets),
                current=now, peak={c.value: v for c, v in tracker.peak().items()},
                max_per_category={c.value: v for c, v in tracker.max_per_category().items()},
                peak_bytes=tracker.peak_total(),
                model_state_bytes=now["params"] + now["grads"] + now["optim"] - reduced,
                reduced_grad_bytes=reduced,
                activation_peak_bytes=tracker.max_per_category()[Category.ACTIVATIONS],
                peak_unsharded_bytes=engine.peak_unsharded_bytes,
                stage3_buffer_bytes=buffers.peak if buffers else 0,
                stage3_backward_buffer_bytes=buffers.backward_peak if buffers else 0,
                device_model_state_bytes=dev_now[Category.PARAMS] + dev_now[Category.GRADS]
                + dev_now[Category.OPTIM] - dev_reduced,
                device_peak_bytes=tracker.peak_total_by_location()["device"],
                host_peak_bytes=tracker.peak_total_by_location()["host"],
                comm_per_step=ledger.by("phase", last),
                comm_logical_bytes=ledger.totals(zero)["logical_bytes"],
                wall_s=time.perf_counter() - start,
                peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                notes=tuple(notes),
                ops=recorder.ops.to_dict() if record_ops else None,
                collectives=tuple(_record(r) for r in last) if record_ops else None)
    except Exception as exc:
        raise TraceError(
            f"tracing {name} at stage {stage}, world size {world_size} (rank {rank}, "
            f"{mixed_precision or 'fp32'}, checkpointing {checkpointing!r}) failed in "
            f"{phase[0]}: {type(exc).__name__}: {exc}{_hint(exc)}") from exc
    finally:
        engine_mod._FORCE_HOST_COPIES = forced
        dist.destroy_process_group()


def _record(r: Any) -> dict[str, Any]:
    return {k: getattr(r, k) for k in ("op", "impl", "logical_bytes", "wire_bytes", "group",
                                       "group_size", "phase", "unit", "dtype", "calls")}


def _free_sharded_units(engine: Any) -> None:
    """Free again the weights of stage-3 units that are not gathered: a fake-tensor view
    taken at shard time grew their storage back (see [Note: how a trace works])."""
    from zeroshard.engine.units import UnitState

    for u in engine.units:
        if u.state is UnitState.SHARDED:
            for b in u.buckets:
                b.full.untyped_storage().resize_(0)


class _Stage3Buffers(TorchDispatchMode):
    """After every op, the bytes a stage-3 engine holds beyond its shards; see [Note:
    stage-3 buffers, traced]. They grow at an op (an allocation), at a ``resize_`` that
    an op follows (the copy-out of a gather), or when autograd hands a parameter the
    gradient an earlier op computed, before the next op: sampling after each op sees
    every maximum."""

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.peak = self.backward_peak = 0
        self._buckets = [(u, b, [leaf for s in b.slots for leaf in s.leaves])
                         for u in engine.units for b in u.buckets]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # DTensor desugars first; we see its local ops
        out = func(*args, **(kwargs or {}))
        if self._buckets:
            self._sample()
        return out

    def _sample(self) -> None:
        seen: set[int] = set()
        total, blocks = 0, False  # blocks: a block is gathered or holds gradients

        def add(t: torch.Tensor | None) -> int:
            nonlocal total
            if t is None:
                return 0
            st = t.untyped_storage()
            if st._cdata in seen:
                return 0
            seen.add(st._cdata)
            total += st.nbytes()
            return st.nbytes()

        for u, b, leaves in self._buckets:
            # Most units hold nothing at any op (sharded, no gather or reduction in flight,
            # not in their backward): skip them with one storage read, not four.
            in_bwd = u.is_root or (u.in_backward and not b.reduction.launched)
            if (b.gathering is None and b.grad is None and not in_bwd
                    and (b.full is None or b.full.untyped_storage().nbytes() == 0)):
                continue
            held = add(b.full) + add(b.gathering)
            add(b.grad)  # a reduction in flight outlives its unit's backward
            # Autograd's gradients sit on a block's parameters only in its backward, until
            # its fold (then launched); checking just those keeps a 7B trace's cost low.
            if in_bwd:
                held += sum(add(leaf.grad) for leaf in leaves)
            blocks = blocks or (held > 0 and not u.is_root)
        self.peak = max(self.peak, total)
        if blocks:
            self.backward_peak = max(self.backward_peak, total)


def _hint(exc: Exception) -> str:
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        UnsupportedOperatorException,
    )

    if isinstance(exc, DataDependentOutputException):
        return ("\n  An op read a tensor's value (.item(), a data-dependent branch or shape); "
                "fake tensors have shapes only. Move that code out of the traced step or "
                "make it shape-only.")
    if isinstance(exc, UnsupportedOperatorException):
        return ("\n  This op has no fake (meta) kernel; register one with "
                "torch.library.register_fake, or trace without it.")
    return ""


def _meta_model(model_or_preset: Any) -> tuple[str, nn.Module]:
    """(display name, a meta-device model the trace may modify)."""
    from zeroshard.models import build_model

    if isinstance(model_or_preset, nn.Module):
        params = list(model_or_preset.parameters())
        if not params or not all(p.is_meta for p in params):
            raise ValueError(
                f"{type(model_or_preset).__name__} must be built on the meta device to be "
                "traced (with torch.device('meta'): model = ...); real weights would use "
                "real memory")
        return type(model_or_preset).__name__, copy.deepcopy(model_or_preset)
    name = model_or_preset if isinstance(model_or_preset, str) else "custom config"
    return name, build_model(model_or_preset, device="meta")


def _fake_weights(model: nn.Module, params: bool) -> None:
    """Fake CPU buffers (recomputed by ``reset_buffers()`` if the model has one) and, if
    ``params``, parameters, keeping ties. Run under FakeTensorMode. ``to_empty`` cannot
    swap a meta parameter for a fake one and would untie weights; ``torch.empty``, not
    ``empty_like``: fake mode refuses real (meta) inputs."""
    for m in model.modules():
        for n, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[n] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
    if callable(reset := getattr(model, "reset_buffers", None)):
        reset()
    new: dict[int, nn.Parameter] = {}
    for full, p in list(model.named_parameters(remove_duplicate=False)) if params else []:
        if id(p) not in new:
            fake = torch.empty(p.shape, dtype=p.dtype, device="cpu")
            new[id(p)] = nn.Parameter(fake, requires_grad=p.requires_grad)
        owner, _, attr = full.rpartition(".")
        setattr(model.get_submodule(owner), attr, new[id(p)])


def _no_init(model: nn.Module, names: list[str]) -> None:
    """Stage 3's per-unit init: fake tensors hold no values, so there is nothing to do."""


def _all_used(engine: Any) -> Callable[[], list]:
    """``Engine.unused_slots`` without reading the flags (see [Note: how a trace works]);
    the control all-reduce is still issued so the ledger matches a real step."""

    def unused_slots() -> list:
        engine.gather_used_flags()
        return []

    return unused_slots


_PRECISION = {"bf16-adamw": "bf16", "fp16-adamw": "fp16", "fp32-adamw": None}


def trace_plan(p: Plan, *, steps: int = 2,
               progress: Callable[[str], None] | None = None, profile: Any = None) -> Plan:
    """``p`` with ``traced_model_state_bytes`` / ``traced_peak_bytes`` (device) and, for
    offloaded rows, ``traced_host_bytes`` filled in.

    [Note: traced plan]
    Every row (N, stage, policy) is traced on its own: a policy changes what backward
    recomputes and when the peak happens, which an activation delta on top of the
    'none' trace would only approximate, and a trace costs seconds (llama-7b at N=8:
    ~10-20 s per row). Rows zeroshard refuses to run (``sqrt`` segments at stage 3) stay
    untraced, with a note saying why.

    ``profile`` (a :class:`zeroshard.timing.profile.Profile`): each row's trace also
    records its ops and collectives, priced by it into ``predicted_step_s``
    (timing/model.py).
    """
    from dataclasses import replace

    if p.recipe.name not in _PRECISION:
        raise ValueError(f"recipe {p.recipe.name!r} cannot be traced; use {', '.join(_PRECISION)}")
    rows, notes = [], list(p.notes)
    if any(row.secondary for row in p.rows):
        notes.append("stage 3 hpz rows: not traced (a trace runs in one process on a fake "
                     "group, without the secondary shard's groups); their peak is priced: "
                     "the blocks' 1/k beside stage 3's")
    for row in p.rows:
        if row.secondary:
            rows.append(row)
            continue
        offload = ("optimizer+params" if row.offload_params else "optimizer" if row.offload
                   else None)
        try:
            r = trace_step(p.config, world_size=row.gpus, stage=row.stage, steps=steps,
                           mixed_precision=_PRECISION[p.recipe.name], micro_batch=p.micro_batch,
                           seq_len=p.seq_len, checkpointing=row.activation_checkpointing,
                           offload=offload, record_ops=profile is not None,
                           collectives="gloo" if profile is not None
                           and profile.backend == "gloo" else "native")
        except TraceError as exc:
            if not isinstance(exc.__cause__, ValueError):  # a refusal, not a broken trace
                raise
            notes.append(f"N={row.gpus} stage {row.stage} {row.activation_checkpointing}: "
                         f"not traced ({exc.__cause__})")
            rows.append(row)
            continue
        if progress is not None:
            progress(f"traced N={row.gpus} stage {row.stage} {row.activation_checkpointing}: "
                     f"{r.wall_s:.1f} s")
        predicted = None
        if profile is not None:
            from zeroshard.timing.model import predict

            predicted = predict(r.ops, r.collectives, profile).total_s
        rows.append(replace(row, traced_model_state_bytes=r.device_model_state_bytes,
                            traced_peak_bytes=r.device_peak_bytes,
                            traced_host_bytes=r.host_peak_bytes if offload else None,
                            predicted_step_s=predicted))
    return replace(p, rows=tuple(rows), notes=tuple(notes))
