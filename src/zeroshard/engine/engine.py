"""The data-parallel engine: the buckets every phase works on, and the wiring of the
phases around them.

One training step, by file (docs/architecture.md draws it):

* set-up, once — materialize.py cuts the parameters into flat buckets (flat.py; stage 3:
  per unit, units.py) and allocates their buffers; buffers.py syncs the model's buffers;
  params.py gives each parameter the face the user sees;
* forward — forward.py's :class:`RootHooks` around the model (stage 3: stage3.py's
  :class:`UnitSchedule` gathers each unit from its module's hooks);
* backward — backward.py's :class:`BackwardPass` takes each gradient (tied.py sums a
  tied parameter's parts) and hands complete buckets to reduction.py's :class:`Reducer`
  in a fixed order; at the end of backward it agrees on usage and publishes the
  gradients;
* step — step_grads.py forms the masters' gradients, the optimizer (optimizer.py) steps
  the chunks (chunks.py), refresh.py re-derives the compute weights;
* anywhere — sources.py reads the engine's tensors out (memory tracker, state dicts);
  replay.py's :class:`JoinReplay` serves a rank out of data inside ``join()``.

The engine builds these objects, wires them (each is given the ones it calls; calls run
one way: root hooks -> schedule, backward pass, replay; replay -> backward pass ->
schedule, reducer) and registers their hooks. It keeps what every phase reads (config,
policy, communicators, buckets, faces) and no phase logic of its own.

[Note: buffer lifetimes]
Per bucket (see [Note: flat buckets] in flat.py), on every rank:

* ``full`` — compute-dtype weights, whole, parameter-major (stages 0-2: allocated at
  shard time, lives forever; stage 3: see units.py). Compute parameters are views into it.
* ``master`` — what the optimizer steps, in fp32 under mixed precision, in the shard
  layout. Stage 0: whole, and without mixed precision it *is* ``full`` (no copy).
  Stages 1-2 without mixed precision or offload: none — the optimizer steps this rank's
  chunks of ``full`` in place (see [Note: masters inside the weights] in chunks.py).
  Otherwise (stage 3, mixed precision, offload): this rank's shard only, a tensor of its own.
* ``grad`` — compute-dtype gradients, whole, in the gathered layout (stage 0: the same as
  full). Every stage allocates it with the bucket's first gradient in backward, never
  at shard time. Stage 0: a parameter's first gradient after ``zero_grad`` is copied in
  and its ``.grad`` becomes a view of the buffer, so further backwards (accumulation)
  add in place. Stage 1: each gradient is copied (or added) into its chunks and the
  parameter's ``.grad`` dropped. Stages 0-1 keep it until ``zero_grad(set_to_none=True)``
  (torch's default) frees it, so it never lives through a forward as DDP's buckets do.
  Keeping it from step to step instead (tried, commit 4b34238, reverted) spares the CPU
  the page faults of a fresh buffer (gpt2-small: ~17,000 minor faults per step and rank
  down to DDP's ~10), but bought ~2% tokens/s at stage 0 and none at stage 1 on the
  default bench, and raised the real peak by the whole buffer wherever activations set
  it (micro-batch 8, seq 256: peak RSS +83 MiB at stage 0, +98 MiB at stage 1, to DDP's
  and ZeroRedundancyOptimizer's level). On GPUs the caching allocator recycles a freed
  buffer without faults, so freeing costs nothing there.
  Stages 2-3: freed once its reduction has completed, at the latest before the next
  whole buffer is allocated (``Reducer.complete_done``), so at most ``_MAX_PENDING`` + 1 whole
  buckets (stage 3: ``_MAX_PENDING_UNITS`` + 1 units; both in reduction.py) exist at once, fewer where the
  reductions keep up with backward.
* ``reduction.shard`` — stages 2-3: this rank's reduced slice in the reduce dtype, kept until
  the step: the first reduction's result itself, and reductions of later backwards
  (accumulation without ``no_sync``) add up in it. ``zero_grad(set_to_none=True)`` frees
  it, as FSDP2 frees its sharded gradients. Stage 1 keeps its reduced slice *in* ``grad`` (rank r's slice of the buffer), so
  it costs nothing beyond the whole buffer; the rest of ``grad`` is marked stale (see
  ``FlatParam.valid``), since a reduce-scatter leaves other ranks' slices unreduced. Only
  if another backward is about to reuse the buffer before the step is the reduced slice
  moved to a ``reduction.shard`` stash (``Reducer.stash``), where later reductions add up. With a
  ``reduce_dtype`` other than the compute dtype, stage 1 keeps ``reduction.shard`` like stage 2.
  With offload there is no device ``reduction.shard``: each reduced slice goes straight to the
  bucket's ``host.grad`` (see [Note: offload] in offload.py).
* ``master_grad`` — fp32, unscaled, formed when a synchronised backward ends (a view of
  ``reduction.shard`` where dtypes agree); the user parameters' ``.grad`` are views of it
  (see [Note: parameters the user sees] in params.py).
* stages 1-2, after the step: on NCCL a transient gathered buffer per bucket for the
  all-gather of the updated weights, copied out into ``full``; on gloo none (each rank's
  chunk of each parameter is broadcast straight into ``full``, see refresh.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..comm import Comm
from ..config import ShardConfig
from .backward import BackwardPass
from .buffers import materialize_buffers, sync_module_states
from .flat import FlatBucket
from .forward import RootHooks
from .materialize import (
    Build,
    ParamInit,
    check_shardable,
    cut_layout,
    materialize,
    named_params,
    placements,
    user_mesh,
)
from .offload import Offload
from .params import Faces
from .policy import StagePolicy
from .precision import LossScaler
from .quantized_grads import TwoHop
from .reduction import Reducer
from .refresh import WeightRefresh
from .replay import JoinReplay
from .root_guard import root_guards
from .shard_server import server_for
from .sources import full_master, gather_shard, memory_sources
from .stage3 import UnitSchedule, in_backward
from .state_clock import StateClock
from .step_grads import StepGrads
from .storage import same_memory, shares
from .tensor_parallel import TensorParallel
from .tied import TiedGrads
from .units import Unit, UnitSpec

__all__ = ["Engine", "ParamInit", "engine_of"]

# Tests only: take the offload path's copies even when the device is the host (CPU), so
# its logic is exercised on machines without an accelerator.
_FORCE_HOST_COPIES = False


class Engine:
    """Drives buckets through forward, backward and step according to a StagePolicy.

    Each phase is an object that owns its state: ``root`` (the root module's forward
    hooks, forward.py), ``schedule`` (stage 3's units, stage3.py), ``backward`` (the
    gradient hooks and the end of backward, backward.py), ``replay`` (uneven inputs,
    replay.py), ``reducer`` (reduction.py), ``tied`` (tied.py), ``grads``
    (step_grads.py) and ``weights`` (refresh.py). The engine builds and wires them; its
    methods are the API the optimizer, state dicts and the public functions call.
    """

    def __init__(
        self, model: nn.Module, config: ShardConfig, comm: Comm, *,
        units: UnitSpec = None, param_init: ParamInit | None = None,
        device: torch.device | None = None, replicate: Comm | None = None,
        world: Comm | None = None, param_groups: dict[str, int] | None = None,
        mesh: Any = None, tp: TensorParallel | None = None, secondary: Comm | None = None,
        two_hop: TwoHop | None = None,
    ) -> None:
        self.model = model
        # Optimizer parameter groups by parameter name (0: the default group); the
        # optimizer's chunks never span two (engine/chunks.py).
        self.group_of = param_groups or {}
        self.config = config
        # ``comm`` is the sharding group. Hybrid sharding adds ``replicate`` (ranks holding
        # the same slices: reduced slices are all-reduced across it) and ``world`` (the
        # start-up broadcast and the flags every rank must agree on); see docs/hybrid.md.
        self.comm = comm
        self.replicate = replicate
        self.world = world or comm
        # Tensor parallelism (tensor_parallel.py): ``world`` is then the dp ranks of this
        # tp coordinate; what every rank must agree on (an fp16 overflow, the gradient
        # norm) spans ``tp.comm`` too.
        self.tp = tp
        # Stage 3 with reshard_after_forward=k: the k ranks of this rank's block, where
        # backward gathers from the secondary shards ([Note: the secondary shard]).
        self.secondary = secondary
        #: What shard(stage="auto") chose and weighed (timing/auto.py: AutoChoice), else None.
        self.auto_choice: Any = None
        # quantize_grads over several nodes: the reduce-scatter's two quantised hops
        # ([Note: quantised gradients] in quantized_grads.py).
        self.two_hop = two_hop
        self.dp_size = comm.size * (replicate.size if replicate else 1)
        for c in self.comms():
            c.timeout = config.timeout
            if config.check_collectives:
                c.enable_check(config.check_collectives)
        self.policy = StagePolicy(config.stage)
        self.compute_dtype = config.compute_dtype
        self.scaler = LossScaler(
            config.init_scale, config.growth_factor, config.backoff_factor,
            config.growth_interval, enabled=config.mixed_precision == "fp16",
        )
        named = named_params(model)
        check_shardable(named, self.policy)
        # Each parameter's dtype as built (state dicts return it; see model_state.py).
        self.orig_dtype = {n: p.dtype for n, p in model.named_parameters(remove_duplicate=False)}
        self.units, self.all_buckets, self.frozen = cut_layout(
            model, named, config=config, policy=self.policy, comm=comm, units=units)
        self.buckets = [b for b in self.all_buckets if b.requires_grad]
        self.device = device or next(model.parameters()).device
        # ZeRO-Offload (see [Note: offload] in offload.py). Where the device *is* the
        # host (a CPU run) nothing moves and nothing is copied.
        self.offloader = Offload(config.offload, self.device, _FORCE_HOST_COPIES)
        self.offload = self.offloader.enabled
        self.reducer = Reducer(
            policy=self.policy, config=config, comm=comm, replicate=replicate,
            offloader=self.offloader, dp_size=self.dp_size, buckets=self.buckets,
            by_unit=bool(self.units), two_hop=two_hop)
        self._materialize(param_init, mesh)
        self.weights = WeightRefresh(policy=self.policy, comm=comm, offloader=self.offloader,
                                     faces=self.faces, buckets=self.buckets)
        self.weights.note_edits(self.buckets)  # compute weights derived from them
        self.tied = TiedGrads(self.buckets)
        self.grads = StepGrads(
            policy=self.policy, comm=comm, world=self.world, device=self.device,
            buckets=self.buckets, faces=self.faces, reducer=self.reducer,
            offloader=self.offloader, scaler=self.scaler, tied=self.tied, tp=self.tp)
        self._wire()
        # State dicts read from the peers, so one rank may take them alone ([Note: state
        # dicts served] in shard_server.py); every change to the shards ticks the clock.
        self.clock = StateClock()
        self.server = server_for(self) if self.policy.shard_optimizer else None
        self.server_id = self.server.register(self) if self.server is not None else -1
        if self.server is not None:
            self.clock.peers = {p for p in comm.peers if p != comm.global_rank}
            ledger = comm.ledger
            self.clock.issued = lambda: ledger.issued

    # -- set-up -----------------------------------------------------------------------------
    def _materialize(self, param_init: ParamInit | None, mesh: Any) -> None:
        """Real buffers and weights for every bucket (materialize.py), then the faces."""
        meta = next(self.model.parameters()).is_meta
        if meta:
            materialize_buffers(self.model, self.device)
        else:
            sync_module_states(self.model, self.frozen, self.world, self.compute_dtype,
                               buffers=self.config.broadcast_buffers)
        build = Build(model=self.model, world=self.world, device=self.device,
                      policy=self.policy, compute_dtype=self.compute_dtype,
                      offloader=self.offloader, tensor_parallel=self.tp is not None,
                      group_of=self.group_of)
        for b in self.all_buckets:
            materialize(build, b, param_init if meta else None)
        if self.tp is not None:  # the faces view the compute parameters' memory
            self.tp.make_faces([s.param for b in self.all_buckets for s in b.slots])
        # See [Note: parameters the user sees] in params.py.
        self.faces = Faces(
            self.model, self.all_buckets, sharded=self.policy.shard_optimizer,
            # Offloaded stages 1-2 step a host master: the user parameters must be it (so
            # an in-place edit between steps is what the next step starts from), not the
            # device weights the next gather overwrites.
            swap=self.compute_dtype is not None or self.policy.shard_params
            or (self.offload and self.policy.shard_optimizer) or self.tp is not None,
            mesh=(user_mesh(self.comm, self.device, mesh)
                  if self.policy.shard_optimizer else None),
            placements=placements(self.replicate), tp=self.tp,
        )
        self.faces.show(self.all_buckets, compute=False)

    def _wire(self) -> None:
        """The phase objects, each given what it calls, and their hooks."""
        self.schedule = UnitSchedule(self.units, self.comm, self.config, self.faces,
                                     secondary=self.secondary)
        self.backward = BackwardPass(
            policy=self.policy, config=self.config, faces=self.faces, buckets=self.buckets,
            reducer=self.reducer, tied=self.tied, grads=self.grads, scaler=self.scaler,
            tp=self.tp, world=self.world, device=self.device, schedule=self.schedule)
        self.schedule.connect(backward_reached=self.backward.queue_finish,
                              unit_done=self.backward.unit_done)
        self.weights.on_refresh = self.schedule.drop_stale
        self.replay = JoinReplay(
            model=self.model, config=self.config, comm=self.comm, world=self.world,
            reducer=self.reducer, schedule=self.schedule, backward=self.backward,
            buckets=self.buckets, device=self.device)
        self.root = RootHooks(
            model=self.model, config=self.config, comm=self.comm, world=self.world,
            faces=self.faces, weights=self.weights, schedule=self.schedule,
            backward=self.backward, replay=self.replay, scaler=self.scaler,
            frozen=self.frozen,
            compute=[s.param for b in self.all_buckets for s in b.slots])
        self._handles = self.backward.install()
        # Eager only: see [Note: compile] in stage3.py.
        eager = torch.compiler.disable
        self._handles.append(self.model.register_forward_pre_hook(
            eager(self.root.pre_forward), with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(eager(self.root.post_forward)))
        unit_pre = eager(self.schedule.pre_forward)
        unit_post = eager(self.schedule.post_forward)
        for u in self.units:
            if not u.is_root:
                self._handles.append(u.module.register_forward_pre_hook(
                    lambda m, a, u=u: unit_pre(u, a)))
                self._handles.append(u.module.register_forward_hook(
                    lambda m, a, o, u=u: unit_post(u, o)))
            elif self.tp is None:  # [Note: forwards outside the sharded model's]
                for module, check in root_guards(u, self.model):
                    self._handles.append(module.register_forward_pre_hook(check))

    def comms(self) -> list[Comm]:
        """The engine's distinct communicators (sharding, replicate, world)."""
        tp = self.tp.comm if self.tp is not None else None
        unique: list[Comm] = []
        hops = (self.two_hop.node, self.two_hop.across) if self.two_hop else ()
        for c in (self.comm, self.replicate, self.world, tp, self.secondary, *hops):
            if c is not None and not any(c is u for u in unique):
                unique.append(c)
        return unique

    def reduce_dtype_of(self, b: FlatBucket) -> torch.dtype:
        return self.reducer.reduce_dtype_of(b)

    # -- what the collaborators count, read and set by others ------------------------------
    @property
    def active_ranks(self) -> int | None:
        """Ranks with data this step, inside join() (None outside it)."""
        return self.reducer.active_ranks

    @active_ranks.setter
    def active_ranks(self, n: int | None) -> None:
        self.reducer.active_ranks = n

    @property
    def peak_grad_buffer_bytes(self) -> int:
        """The most whole-bucket gradient bytes (``b.grad``) alive at once (reduction.py)."""
        return self.reducer.peak_grad_buffer_bytes

    @peak_grad_buffer_bytes.setter
    def peak_grad_buffer_bytes(self, n: int) -> None:
        self.reducer.peak_grad_buffer_bytes = n

    @property
    def sync(self) -> bool:
        """False inside ``no_sync()``: gradients accumulate locally (backward.py)."""
        return self.backward.sync

    @sync.setter
    def sync(self, value: bool) -> None:
        self.backward.sync = value

    @property
    def unsharded_bytes(self) -> int:
        """Stage 3: gathered weight bytes alive now (stage3.py)."""
        return self.schedule.unsharded_bytes

    @property
    def peak_unsharded_bytes(self) -> int:
        """Stage 3: the most gathered weight bytes alive at once (stage3.py)."""
        return self.schedule.peak_unsharded_bytes

    @peak_unsharded_bytes.setter
    def peak_unsharded_bytes(self, n: int) -> None:
        self.schedule.peak_unsharded_bytes = n

    def set_reshard_after_forward(self, flag: bool) -> None:
        """Stage 3: free (True) or keep (False) each unit's weights after its forward."""
        self.config = dataclasses.replace(self.config, reshard_after_forward=flag)
        self.schedule.reshard_after_forward = flag
        if flag:
            self.schedule.free_idle()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication (see docs/stages.md)."""
        prev, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = prev

    # -- step ------------------------------------------------------------------------------
    def master_params(self) -> list[nn.Parameter]:
        """What the torch optimizer steps: each master in chunks (engine/chunks.py)."""
        return [c for b in self.buckets for c in b.chunks]

    def user_params_by_name(self) -> dict[str, nn.Parameter]:
        """Every parameter name -> the parameter the user sees (see params.py)."""
        out = {n: p for n, p in nn.Module.named_parameters(self.model, remove_duplicate=False)}
        for b in self.all_buckets:
            for s in b.slots:
                for n in s.names:
                    out[n] = s.user
        return out

    def optimizer_groups(self, options: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Torch param-group dicts: group i's chunks with ``options[i]`` (every group on
        every rank, even one with no chunk in this rank's shard)."""
        return [{**opts, "params": [c for b in self.buckets
                                    for c, g in zip(b.chunks, b.chunking.groups) if g == i]}
                for i, opts in enumerate(options)]

    def publish_grads(self) -> None:
        """See StepGrads.publish (step_grads.py)."""
        self.grads.publish()

    def adopt_user_grads(self) -> None:
        """See [Note: assigned gradients] in step_grads.py."""
        self.grads.adopt_user_grads()

    def prepare_grads(self) -> bool:
        """Every master's fp32, unscaled gradient; True if any overflowed (step_grads.py)."""
        return self.grads.prepare()

    def grad_norm(self, norm_type: float) -> torch.Tensor:
        """The global gradient norm, equal to clip_grad_norm_'s on the unsharded model."""
        return self.grads.norm(norm_type)

    def scale_grads(self, coef: torch.Tensor) -> None:
        self.grads.scale(coef)

    def gather_used_flags(self) -> torch.Tensor:
        """Every rank's "got a gradient" flags, summed (step_grads.py)."""
        return self.grads.gather_used_flags()

    def unused_slots(self) -> list[tuple[FlatBucket, set[int]]]:
        """Per bucket, the slots of parameters no rank produced a gradient for (or whose
        ``.grad`` every rank set to None): the step skips them (chunks.skip_slots)."""
        return self.grads.unused_slots(self.gather_used_flags().tolist())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every gradient (see StepGrads.zero in step_grads.py)."""
        self.grads.zero(set_to_none)

    def skip_step(self) -> None:
        self.grads.clear()
        self.comm.ledger.mark_step()

    def reshard_all(self) -> None:
        """Free every gathered stage-3 unit, resident ones included, but those a backward
        still needs (see ShardedModule.reshard and UnitSchedule.reshard_resident)."""
        self.between_steps("reshard()")
        self.schedule.reshard_resident()

    def hold(self, units: list[Unit], *, async_op: bool = False) -> list[Unit]:
        """Gather ``units`` (in unit order) and keep them gathered until :meth:`release`
        (see [Note: resident units] in stage3.py); returns those newly held. Collective:
        every rank, the same units."""
        self.between_steps("unshard()")
        self.comm.sync_point("unshard", phase="forward")
        return self.schedule.hold([u for u in self.units if u in units], async_op=async_op)

    def release(self, units: list[Unit] | None = None) -> None:
        self.between_steps("reshard()")
        self.schedule.release(units)

    def between_steps(self, what: str) -> None:
        if in_backward() or self.backward.queued:
            raise RuntimeError(f"{what} during a backward: zeroshard gathers and frees each "
                               "unit itself there; call it between steps")

    def settle_gathers(self) -> None:
        """Finish stage-3 gathers still in flight (a forward that raised after a
        prefetch) before the optimizer writes the slices they send from (on gloo this
        rank's slice is sent from ``shard16``, the masters themselves in fp32; see
        Comm.all_gather_from). The values gathered are dropped by ``after_step``, but
        a broadcast of device tensors over gloo may write its input back when done."""
        self.schedule.settle()

    def after_step(self, close: bool = True) -> None:
        """Return updated weights to the compute buffers (and to every rank). ``close``:
        the iteration's step is done (with several optimizers, the last one's; see
        [Note: several optimizers] in composite.py): the ledger and join's record end it."""
        # Units gathered by a forward no backward followed are now stale (see [Note:
        # between forward and backward] in forward.py).
        self.schedule.reshard_all()
        self.weights.refresh(phase="step")
        if close:
            self.replay.step_done()
            self.comm.ledger.mark_step()

    @contextmanager
    def loading(self, what: str) -> Iterator[None]:
        """Around a load into the shards (every rank loads): where peers read this rank's
        state ([Note: state dicts served]), the ranks first agree they all reached it — a
        peer still reading this rank's shards for a state dict taken just before is done
        then — and the load ticks the clock ([Note: the state clock])."""
        if self.server is not None:
            self.comm.all_reduce(torch.zeros(1, device=self.device), phase="state", unit=what)
        if self.two_hop is not None:
            self.two_hop.forget()  # torch's state dicts carry no residuals
        with self.clock.change():
            yield

    def refresh_weights(self, *, phase: str, buckets: list[FlatBucket] | None = None) -> None:
        """Re-derive the compute weights from the masters (refresh.py); resident stage-3
        units holding them (frozen ones included: a load writes those too) are stale."""
        self.weights.refresh(phase=phase, buckets=buckets)
        self.schedule.drop_stale(self.all_buckets if buckets is None else buckets)

    def refresh_handed_out(self, what: str) -> None:
        """Before reading the whole weights (``what``: a state dict): re-derive buckets
        whose masters ``dcp.load`` wrote through handed-out views with no forward or
        ``set_state_dict`` since ([Note: sharded state dicts for torch's DCP API]). A
        collective where the refresh is (stages 1-2): every rank loaded, so every rank
        calls it; one rank alone gets the divergence error, not stale weights."""
        stale = self.weights.stale_watched()
        if stale:
            self.world.sync_point(what)
            self.refresh_weights(phase="load", buckets=stale)

    # -- state -----------------------------------------------------------------------------
    def full_master(self, b: FlatBucket) -> torch.Tensor:
        """The whole master-precision weights of a bucket, every rank (sources.py)."""
        return full_master(self.policy, self.comm, b)

    def gather_shard(self, b: FlatBucket, shard: torch.Tensor, *, phase: str) -> torch.Tensor:
        """Every rank's ``shard`` (shard layout, any dtype) as one full-layout tensor."""
        return gather_shard(self.comm, b, shard, phase=phase)

    def memory_sources(self) -> Callable[[], dict[str, list[torch.Tensor]]]:
        """Tensors by category, for the memory tracker (sources.py)."""
        root = self.root
        hop = self.two_hop
        return memory_sources(self.all_buckets, self.frozen, self.tied, self.grads,
                              by_unit=bool(self.units),
                              kv_cache=lambda: root.kv_cache() if root.kv_cache else None,
                              residuals=hop.tensors if hop is not None else list)

    def host_tensors(self) -> list[torch.Tensor]:
        """Engine tensors in host memory by design (offload); see [Note: device and host]."""
        return self.offloader.host_tensors(self.all_buckets)

    # Storage identity (storage.py), kept here for callers that reach it via the engine.
    _shares = staticmethod(shares)
    _same_memory = staticmethod(same_memory)


def engine_of(model: nn.Module) -> Engine:
    """The engine of a model ``zeroshard.shard`` (or ``shard_for_inference``) sharded."""
    engine = getattr(model, "_zeroshard_engine", None)
    if engine is None:
        raise ValueError(
            f"{type(model).__name__} was not sharded by zeroshard; call "
            "zeroshard.shard(model, ...) first"
        )
    return engine
