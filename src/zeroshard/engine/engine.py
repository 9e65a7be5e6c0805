"""The data-parallel engine: buffers, backward hooks, gradient reduction, post-step gather.

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
  Stages 2-3: freed once its reduction has completed, at the latest before the next
  whole buffer is allocated (``_complete_done``), so at most ``_MAX_PENDING`` + 1 whole
  buckets (stage 3: ``_MAX_PENDING_UNITS`` + 1 units) exist at once, fewer where the
  reductions keep up with backward.
* ``grad_shard`` — stages 2-3: this rank's reduced slice in the reduce dtype, kept until
  the step: the first reduction's result itself, and reductions of later backwards
  (accumulation without ``no_sync``) add up in it. ``zero_grad(set_to_none=True)`` frees
  it, as FSDP2 frees its sharded gradients. Stage 1 keeps its reduced slice *in* ``grad`` (rank r's slice of the buffer), so
  it costs nothing beyond the whole buffer; the rest of ``grad`` is marked stale (see
  ``FlatBucket.valid``), since a reduce-scatter leaves other ranks' slices unreduced. Only
  if another backward is about to reuse the buffer before the step is the reduced slice
  moved to a ``grad_shard`` stash (``_stash``), where later reductions add up. With a
  ``reduce_dtype`` other than the compute dtype, stage 1 keeps ``grad_shard`` like stage 2.
  With offload there is no device ``grad_shard``: each reduced slice goes straight to the
  bucket's ``host_grad`` (see [Note: offload] in offload.py).
* ``master_grad`` — fp32, unscaled, formed when a synchronised backward ends (a view of
  ``grad_shard`` where dtypes agree); the user parameters' ``.grad`` are views of it
  (see [Note: parameters the user sees] in params.py).
* stages 1-2, after the step: on NCCL a transient gathered buffer per bucket for the
  all-gather of the updated weights, copied out into ``full``; on gloo none (each rank's
  chunk of each parameter is broadcast straight into ``full``, see refresh_weights).

[Note: collective order in backward]
Collectives pair up by their order on each rank, so the order of the reductions in
backward must not depend on the data: which parameters a rank used in a step does. In a
mixture-of-experts model one rank routes no token to an expert another rank keeps busy;
an adapter or an auxiliary head runs on some micro-batches only. Launching each bucket
as soon as all its gradients arrived (this engine once did) launched a bucket with such
a parameter early on the rank that used it and at the end of backward on the other: the
ranks reduced different buckets against each other (gloo aborts; NCCL mixes data). So:

* stages 0-2 launch buckets in one fixed order, ``self.buckets`` (reverse registration,
  about the order backward produces gradients), each once it is complete and every
  bucket before it has been launched (``_launch_in_order``), as DDP's reducer does; the
  end of backward launches the rest, in the same order, with zeros for what this rank
  did not produce. A bucket that waits for a parameter this rank will not use holds the
  buckets after it until the end of backward on that rank: less overlap, same result.
* stage 3 reduces all of a unit's buckets at its post-backward, whatever its parameters
  received (zeros for the rest), as FSDP2 does; units without a post-backward signal
  (the root; a unit whose inputs need no gradient) at the end of backward, in order.
  Which units run is the same on every rank (the forward's collective checks refuse
  otherwise, naming the unit), so the order is too.
* gradient parts that arrive after their bucket was reduced (stage 3: a unit's
  parameter used after its post-backward, reentrant checkpointing) are reduced again at
  the end — by every rank, for the buckets *any* rank flagged: the flags travel in the
  one all-reduce of usage flags every synchronised backward ends with
  (``_agree_on_usage``), so what is reduced never depends on one rank's data.

That all-reduce also tells every rank which parameters no rank used: they keep
``grad = None`` and the step skips them exactly as torch's optimizer does, state and
AdamW's ``step`` untouched (chunks.skip_slots, [Note: optimizer chunks]). A parameter
used on some ranks gets DDP's gradient: the others contribute zeros. An MoE step issues
exactly the collectives of a dense step of the same buckets.

[Note: end of backward]
The first gradient hook of a backward queues :meth:`Engine._finish_backward` on the
autograd engine; it runs once backward is done, launches reductions of buckets that
never became complete (parameters unused in this step), waits for all in flight and,
after a synchronised backward, agrees with the other ranks on which parameters were
used ([Note: collective order in backward]) and publishes the gradients to the user
parameters.
Reentrant activation checkpointing runs a backward per region from inside the outer
one; a callback queued from inside ends with that region, so the finish then defers
itself to the outer node's completion (and so on outwards). A parameter used in several
such regions gets its gradient in parts: only the first counts towards its bucket being
complete; at stage 3 later parts are reduced again at the end (the reduced slices add
up); at stages 0-2 a part arriving after its bucket's reduction started is refused with
the fix (tests/test_backward_edges.py).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_flatten

from ..comm import Comm
from ..config import ShardConfig, auto_bucket_bytes
from .chunks import make_chunks, set_master_grad
from .flat import FlatBucket, cut_buckets
from .offload import Offload
from .params import Faces
from .policy import StagePolicy
from .precision import LossScaler
from .replay import JoinReplay
from .stage3 import Stage3Hooks, in_backward
from .units import Unit, UnitSpec, UnitState, build_units, iter_buckets

ParamInit = Callable[[nn.Module, list[str]], None]

__all__ = ["Engine"]

# Tests only: take the offload path's copies even when the device is the host (CPU), so
# its logic is exercised on machines without an accelerator.
_FORCE_HOST_COPIES = False

# Stages 2-3: reductions allowed in flight before backward waits for the oldest; bounds
# the number of whole-bucket gradient buffers alive at once. Stage 3's buckets are whole
# units, so it allows one, as FSDP2 does (a unit's reduce-scatter overlaps the next
# unit's backward).
_MAX_PENDING = 2
_MAX_PENDING_UNITS = 1


def _accumulate_node(leaf: torch.Tensor):
    """The AccumulateGrad node of a leaf (created if it has none yet)."""
    with torch.enable_grad():
        return leaf.view_as(leaf).grad_fn.next_functions[0][0]


def _named_params(model: nn.Module) -> list[tuple[tuple[str, ...], nn.Parameter]]:
    """Unique parameters in registration order, each with every name it is known by."""
    names: dict[int, list[str]] = {}
    order: list[nn.Parameter] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in names:
            names[id(p)] = []
            order.append(p)
        names[id(p)].append(name)
    return [(tuple(names[id(p)]), p) for p in order]


class Engine(Stage3Hooks, JoinReplay):
    """Drives buckets through forward, backward and step according to a StagePolicy.

    Stage 3's unit hooks live in stage3.py, the replay for uneven inputs in replay.py.
    """

    def __init__(
        self, model: nn.Module, config: ShardConfig, comm: Comm, *,
        units: UnitSpec = None, param_init: ParamInit | None = None,
        device: torch.device | None = None, replicate: Comm | None = None,
        world: Comm | None = None, param_groups: dict[str, int] | None = None,
        mesh: Any = None,
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
        self.dp_size = comm.size * (replicate.size if replicate else 1)
        for c in self.comms():
            c.timeout = config.timeout
            if config.check_collectives:
                c.enable_check(config.check_collectives)
        self.policy = StagePolicy(config.stage)
        self.compute_dtype = config.compute_dtype
        self.sync = True  # False inside no_sync(): accumulate locally, no communication
        self.scaler = LossScaler(
            config.init_scale, config.growth_factor, config.backoff_factor,
            config.growth_interval, enabled=config.mixed_precision == "fp16",
        )
        named = _named_params(model)
        _check_shardable(named, self.policy)
        # Each parameter's dtype as built (state dicts return it; see model_state.py).
        self.orig_dtype = {n: p.dtype for n, p in model.named_parameters(remove_duplicate=False)}
        self.units: list[Unit] = []
        if self.policy.units_by_module:
            self.units = build_units(model, units, comm.size, comm.rank)
            self.all_buckets = list(iter_buckets(self.units))
            self.frozen: list[nn.Parameter] = []
        else:
            self.frozen = [p for _, p in named if not p.requires_grad]
            trainable = [(n, p) for n, p in named if p.requires_grad]
            # Reverse registration order approximates the order backward produces grads.
            # Stage 0 shards nothing: its layout is that of one rank (no padding, and the
            # gathered and full layouts coincide, see [Note: flat buckets]).
            world_, rank_ = (comm.size, comm.rank) if self.policy.shard_optimizer else (1, 0)
            itemsize = (self.compute_dtype or torch.float32).itemsize
            bucket = config.bucket_bytes or auto_bucket_bytes(
                sum(p.numel() for _, p in trainable) * itemsize,
                keep_full_grads=self.policy.keep_full_grads)
            self.all_buckets = cut_buckets(list(reversed(trainable)), bucket, world_, rank_)
        self.buckets = [b for b in self.all_buckets if b.requires_grad]
        self._unit_of = {id(b): u for u in self.units for b in u.buckets}
        self._pending: deque[FlatBucket] = deque()
        self._next_launch = 0  # stages 0-2: the next bucket to launch, in order
        self._backward_flags: torch.Tensor | None = None  # see _agree_on_usage
        self._used_flags: torch.Tensor | None = None  # see gather_used_flags
        self._backward_queued = False
        self._backward_ended = False  # a backward ended since the last forward
        self._grads_prepared = False
        self._overflow = False
        # Stage 3 schedule (see [Note: prefetch] in units.py) and its accounting.
        self._order: list[Unit] = []
        self._recording = True
        self._fwd_cursor = 0
        self._bwd_cursor = 0
        self._prefetch_due = False
        self.unsharded_bytes = 0
        self.peak_unsharded_bytes = 0
        # Whole-bucket gradient bytes (``b.grad``) alive now and at most (tests, plans).
        self._grad_buffer_bytes = 0
        self.peak_grad_buffer_bytes = 0
        # Uneven inputs (see [Note: join] in join.py).
        self._joinable: Any = None
        self.active_ranks: int | None = None  # ranks with data this step, inside join()
        self._iter_start = 0
        self._last_iter: list = []
        self._clip_this_iter: tuple[float, float] | None = None
        self._last_clip: tuple[float, float] | None = None
        self._replaying = False
        self.device = device or next(model.parameters()).device
        # ZeRO-Offload (see [Note: offload] in offload.py). Where the device *is* the
        # host (a CPU run) nothing moves and nothing is copied.
        self.offloader = Offload(config.offload, self.device, _FORCE_HOST_COPIES)
        self.offload = self.offloader.enabled
        meta = next(model.parameters()).is_meta
        if meta:
            _materialize_buffers(model, self.device)
        else:
            self._sync_module_states()
        # DDP syncs buffers before a forward that follows a training forward (and before
        # the first): see _broadcast_buffers.
        self._sync_buffers = True
        for b in self.all_buckets:
            self._materialize(b, param_init if meta else None)
        # See [Note: parameters the user sees] in params.py.
        self.faces = Faces(
            model, self.all_buckets, sharded=self.policy.shard_optimizer,
            # Offloaded stages 1-2 step a host master: the user parameters must be it (so
            # an in-place edit between steps is what the next step starts from), not the
            # device weights the next gather overwrites.
            swap=self.compute_dtype is not None or self.policy.shard_params
            or (self.offload and self.policy.shard_optimizer),
            mesh=self._mesh(mesh) if self.policy.shard_optimizer else None,
            placements=self._placements(),
        )
        self.faces.show(self.all_buckets, compute=False)
        self._shown_compute = False  # stages 0-2: the modules hold the compute params
        self._note_edits(self.buckets)  # compute weights derived from them
        # After materialising: a meta model's parameters are new objects by now.
        self._known_params = {id(p) for p in model.parameters()} | self.faces.known() | {
            id(s.param) for b in self.all_buckets for s in b.slots}
        # requires_grad as sharded, per parameter the user holds (see _check_params).
        self._grad_flags = {id(u): u.requires_grad for u in self.faces.user.values()}
        self._grad_flags.update((id(p), False) for p in self.frozen)
        self._slot_of: dict[int, tuple[FlatBucket, int]] = {}
        for b in self.buckets:
            for i, s in enumerate(b.slots):
                for leaf in self.faces.leaves(s.param):
                    self._slot_of[id(leaf)] = (b, i)
        self._tied_slots = [(b, i) for b in self.buckets for i, s in enumerate(b.slots)
                            if len(self.faces.leaves(s.param)) > 1]
        self._tied_earlier: dict[int, torch.Tensor] = {}  # see _before_own_part
        self._handles = [
            leaf.register_post_accumulate_grad_hook(self._on_grad)
            for b in self.buckets for s in b.slots for leaf in self.faces.leaves(s.param)
        ]
        # Hooks that prepare a leaf's .grad for accumulation sit on its AccumulateGrad
        # node, not on the tensor: they must not run in torch.autograd.grad(..., params),
        # which reads the gradients without accumulating (a tensor hook runs there too,
        # and dropping the published gradients then left clip_grad_norm_ a norm of 0).
        # A leaf holds its node weakly: keep them alive, or the hooks go with them.
        self._acc_nodes = {id(leaf): _accumulate_node(leaf) for b in self.buckets
                           for s in b.slots for leaf in self.faces.leaves(s.param)}
        if self.faces.sharded and not self.faces.swap:  # before the tied hooks below
            self._handles += [self._acc_nodes[id(leaf)].register_prehook(self._drop_published)
                              for b in self.buckets for s in b.slots
                              for leaf in self.faces.leaves(s.param)]
        self._handles += [self._acc_nodes[id(b.slots[i].param)].register_prehook(
            functools.partial(self._before_own_part, b, i)) for b, i in self._tied_slots]
        self._handles.append(model.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._post_forward))
        for u in self.units:
            if not u.is_root:
                self._handles.append(u.module.register_forward_pre_hook(
                    lambda m, a, u=u: self._unit_pre_forward(u, a)))
                self._handles.append(u.module.register_forward_hook(
                    lambda m, a, o, u=u: self._unit_post_forward(u, o)))

    # -- set-up -----------------------------------------------------------------------------
    def comms(self) -> list[Comm]:
        """The engine's distinct communicators (sharding, replicate, world)."""
        unique = {id(c): c for c in (self.comm, self.replicate, self.world) if c is not None}
        return list(unique.values())

    def _mesh(self, mesh: Any):
        """The DeviceMesh the user parameters' DTensors live on: the sharding group, or
        with hybrid sharding the 2-D (replicate, shard) mesh."""
        if mesh is not None:
            return mesh
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.device_mesh import DeviceMesh

        group = self.comm.group if self.comm.group is not None else dist.group.WORLD
        with unset_fake_temporarily():  # a trace (memory/traced.py) runs under fake mode
            return DeviceMesh.from_group(group, self.device.type)

    def _placements(self) -> tuple:
        from torch.distributed.tensor import Replicate, Shard

        if self.replicate is not None:
            return (Replicate(), Shard(0))
        return (Shard(0),)

    def reduce_dtype_of(self, b: FlatBucket) -> torch.dtype:
        return self.config.reduce_dtype or self.compute_dtype or b.dtype

    def _materialize(self, b: FlatBucket, param_init: ParamInit | None) -> None:
        """Allocate a bucket's buffers (see [Note: buffer lifetimes]).

        Every rank starts from rank 0's weights, as DDP does, except for a model built on
        the meta device: its bucket is initialised here by ``param_init`` — a function of
        (seed, name), identical on every rank — and only the slice is kept, so no rank
        ever holds more than one whole unit.
        """
        if param_init is not None:
            flat = torch.zeros(b.padded_numel, dtype=b.dtype, device=self.device)
            b.device = flat.device
            b.replace_meta_params(self.model, flat)
            with torch.no_grad():
                param_init(self.model, [s.names[0] for s in b.slots])
        else:
            flat = b.flatten()
            self.world.broadcast(flat, 0, phase="init", unit=b.name)
        compute = self.compute_dtype or b.dtype
        full = flat if compute == flat.dtype else flat.to(compute)
        b.full = full
        b.point_params_at(full)
        b.used = torch.zeros(len(b.slots), dtype=torch.float32, device=b.device)
        if self.policy.shard_params:
            self._materialize_sharded(b, flat)
            return
        if self.policy.shard_optimizer and not self.offload and self.compute_dtype is None:
            b.master_in_full = True  # see [Note: masters inside the weights] in chunks.py
            make_chunks(b, self.group_of)
            return
        if self.policy.shard_optimizer:
            master_src = b.shard_from_full(flat)  # only the slice stays alive
            if self.compute_dtype is not None:
                master_src = master_src.float()
        else:
            master_src = flat if self.compute_dtype is None else flat.float()
        b.master = nn.Parameter(self._on_host(master_src))
        make_chunks(b, self.group_of)
        # Gradient buffers are allocated by the first gradient of a backward and freed by
        # zero_grad(set_to_none=True): see [Note: buffer lifetimes].

    @torch.no_grad()
    def _sync_module_states(self) -> None:
        """Start every rank from rank 0's buffers and (stages 0-2) frozen parameters, as
        DDP does; trainable weights are broadcast per bucket. Frozen floating parameters
        then take the compute dtype, as stage 3 keeps them (its frozen buckets)."""
        for name, t in self.model.named_buffers():
            buf = t if t.is_contiguous() else t.contiguous()
            self.world.broadcast(buf, 0, phase="init", unit=f"buffer {name}")
            if buf is not t:
                t.copy_(buf)
        for p in self.frozen:
            self.world.broadcast(p.data, 0, phase="init", unit="frozen")
            if self.compute_dtype is not None and p.is_floating_point():
                p.data = p.data.to(self.compute_dtype)

    def _state_buffers(self) -> list[list[tuple[str, torch.Tensor]]]:
        """The model's persistent buffers (state, such as BatchNorm's running statistics;
        non-persistent ones are derived, such as RoPE tables), grouped by dtype and
        device: one broadcast each."""
        groups: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
        for prefix, m in self.model.named_modules():
            for n, t in m._buffers.items():
                if t is None or n in m._non_persistent_buffers_set or t.is_meta:
                    continue
                name = f"{prefix}.{n}" if prefix else n
                groups.setdefault((t.dtype, t.device), []).append((name, t))
        return list(groups.values())

    @torch.no_grad()
    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers to every rank before a forward that follows a training one —
        DDP's ``broadcast_buffers`` (its default), so BatchNorm's running statistics are
        rank 0's everywhere as under DDP. Version counters are kept (as DDP does): a
        forward may have saved a buffer for a backward still to come."""
        for group in self._state_buffers():
            tensors = [t for _, t in group]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            self.world.broadcast(flat, 0, phase="forward", unit="buffers")
            with torch.autograd._unsafe_preserve_version_counter(tuple(tensors)):
                torch._foreach_copy_(tensors, [v.view_as(t) for v, t in zip(
                    flat.split([t.numel() for t in tensors]), tensors)])

    def _on_host(self, t: torch.Tensor) -> torch.Tensor:
        """With offload, a pinned host copy of ``t``; otherwise ``t`` itself."""
        return self.offloader.to_host(t) if self.offload else t

    def _in_place(self, b: FlatBucket) -> bool:
        """Stage 1: the reduced slice stays in the whole buffer (see [Note: buffer
        lifetimes]) unless it is reduced in another dtype."""
        return (self.policy.keep_full_grads and self.policy.shard_optimizer
                and self.reduce_dtype_of(b) == (self.compute_dtype or b.dtype))

    def _stash(self, b: FlatBucket) -> None:
        """Stage 1: move a reduced slice out of the way before the buffer is reused."""
        if not b.reduced:
            return
        own = b.shard_of(b.grad)
        b.grad_shard = own.clone() if b.grad_shard is None else b.grad_shard.add_(own)
        b.reduced = False

    def _materialize_sharded(self, b: FlatBucket, flat: torch.Tensor) -> None:
        """Stage 3: keep the slices; free the whole buffer's storage."""
        if b.requires_grad:
            src = b.shard_from_full(flat)
            master = src.float() if self.compute_dtype else src
            b.master = nn.Parameter(self._on_host(master))
            make_chunks(b, self.group_of)
        params_on_host = self.offloader.params
        if b.master is not None and b.master.dtype == b.full.dtype and (
            params_on_host or not self.offload
        ):
            b.shard16 = b.master.detach()  # fp32 without mixed precision: one copy only
        elif params_on_host:
            b.shard16 = self.offloader.to_host(b.shard_from_full(b.full))
        else:
            b.shard16 = b.shard_from_full(b.full)
        # Compute parameters stay views of ``full``; between uses the modules hold the
        # user parameters (params.py), so nothing reads the freed storage.
        b.full.untyped_storage().resize_(0)

    # -- forward hooks ------------------------------------------------------------------------
    @torch.compiler.disable  # see [Note: compile] in stage3.py
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        self._check_params()
        if not in_backward():
            self._refresh_edited()
            self._backward_ended = False
        if self._joinable is not None and not in_backward():
            from torch.distributed.algorithms.join import Join

            if Join.notify_join_context(self._joinable) is not None:  # join() is active
                self._count_active(1)
                self._iter_start = len(self.comm.ledger.records)
        if self.units:
            # One rank alone in a forward (evaluation on rank 0 only) is refused here,
            # before any gather; see [Note: divergence] in comm.py.
            self.comm.sync_point("forward", phase="forward")
        if self.config.broadcast_buffers and self._sync_buffers and not in_backward():
            self._broadcast_buffers()
        if self.units:
            root = self.units[-1]
            self._fwd_cursor = 0
            self._unshard(root, "forward")
            root.wait()
            self._prefetch(self._order, 0)
        else:
            self._show_compute()
        if self.compute_dtype is None:
            return None
        cast = self._cast_floating
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    def _cast_floating(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(self.compute_dtype)
        return x

    @torch.compiler.disable  # see [Note: compile] in stage3.py
    def _post_forward(self, module: nn.Module, args, output):
        if not in_backward():  # as DDP: the next forward syncs buffers after a training one
            self._sync_buffers = torch.is_grad_enabled() and self.sync
        if self.units:
            self._recording = False
            if not torch.is_grad_enabled():
                self._reshard(self.units[-1])
        elif self._shown_compute and not torch.is_grad_enabled():
            self._show_user()  # no backward follows
        if torch.is_grad_enabled() and not in_backward():
            self._between_forward_and_backward(output)
        if self.scaler.enabled and torch.is_grad_enabled():
            # Scaling the gradient that enters the model equals scaling the loss (backward
            # is linear) and keeps the plain ``loss.backward()`` API. If the model returns a
            # scalar (a loss computed inside), scale only that: its gradient already flows
            # through the other outputs.
            leaves = [t for t in tree_flatten(output)[0]
                      if isinstance(t, torch.Tensor) and t.requires_grad]
            scalars = [t for t in leaves if t.dim() == 0]
            for t in scalars or leaves:
                t.register_hook(self._scale_grad)
        return output

    def _between_forward_and_backward(self, output: Any) -> None:
        """[Note: between forward and backward]
        A forward with gradients may have no backward after it (a validation loss computed
        without ``torch.no_grad()``). Until a backward starts, the modules must hold the
        user parameters, as they do between steps: torch APIs on ``model.parameters()``
        (``clip_grad_norm_``, an optimizer, ``p.grad``) read those, and under DDP that
        forward changes nothing. The autograd graph already holds the compute
        parameters, so the backward needs them in the modules only to recompute
        (activation checkpointing): the first gradient reaching an output shows them again
        (_backward_begins). Gathered stage-3 units stay gathered for that backward; a
        step frees them (after_step), so no forward uses weights gathered before it."""
        if not (self.units or self.faces.swaps):
            return  # the modules hold the user parameters throughout
        if self.units:
            self._show_gathered(compute=False)
        else:
            self._show_user()
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._backward_begins)

    def _backward_begins(self, grad: torch.Tensor) -> None:
        """See [Note: between forward and backward]."""
        if self.units and self._backward_ended:
            # The units were freed at the end of the last backward, and the graph's saved
            # tensors view their (now empty) storage: refuse before autograd reads them.
            raise RuntimeError(
                "stage 3 runs one backward per forward: this backward goes through a graph "
                "that an earlier backward already went through (retain_graph=True), or "
                "through a second forward's graph after the first one's backward. Sum the "
                "losses and call backward once ((loss_a + loss_b).backward()), run a "
                "forward before each backward, or use stage 2")
        if self.units:
            self._show_gathered(compute=True)
        else:
            self._show_compute()

    def _show_gathered(self, compute: bool) -> None:
        """Stage 3: which face the modules of the gathered units hold."""
        for u in self.units:
            if u.state is not UnitState.SHARDED:
                self.faces.show(u.buckets, compute=compute)

    def _show_compute(self) -> None:
        """Stages 0-2: the modules hold the compute parameters (forward and backward)."""
        if self.faces.swaps and not self._shown_compute:
            self.faces.show(self.all_buckets, compute=True)
            self._shown_compute = True

    def _scale_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.scaler.scale

    def _show_user(self) -> None:
        """Stages 0-2: the modules hold the user parameters again (end of backward, or of
        a forward without gradients)."""
        if self._shown_compute:
            self.faces.show(self.all_buckets, compute=False)
            self._shown_compute = False

    def _check_params(self) -> None:
        for name, p in self.model.named_parameters():
            if id(p) not in self._known_params:
                raise RuntimeError(
                    f"parameter {name!r} was replaced after zeroshard.shard(); sharded "
                    "buffers no longer back it. Change the model before sharding it, or "
                    "build a new model and shard that"
                )
            was = self._grad_flags.get(id(p))
            if was is None or p.requires_grad == was:
                continue
            # Freezing is honoured where the modules compute with the parameters you
            # hold (fp32 stages 0-2: autograd skips them, the step restores them as
            # unused). Elsewhere the model computes with other tensors, whose flag is
            # the engine's; and a parameter frozen at shard() time has no optimizer
            # state or bucket slot at all: either would train (or not) silently.
            if was and not self.faces.swap:
                continue
            raise RuntimeError(
                f"parameter {name!r} had requires_grad={was} when the model was sharded "
                f"and has requires_grad={p.requires_grad} now: "
                + ("a parameter frozen at shard() time has no optimizer state and is never "
                   "stepped" if not was else "at this stage (or under mixed precision or "
                   "offload) the model computes with zeroshard's own tensors, so the flag "
                   "would not reach the backward")
                + ". Set requires_grad before zeroshard.shard() (for a schedule that "
                "unfreezes layers later, shard them trainable and keep their gradient out "
                "with lr=0 in their own parameter group)")

    # -- backward ---------------------------------------------------------------------------
    def _drop_published(self, grads: tuple) -> None:
        """Stages 1-2 without mixed precision or offload: the user parameters are the
        compute ones, and their ``.grad`` are DTensor views of the reduced slices. Drop
        them as the next backward reaches its first parameter, before autograd would add
        into one (the sums live in the engine's buffers and are published again at the
        end). Not at the forward: one under ``torch.no_grad()`` (an evaluation between
        backward and step) or with no backward after it must leave the gradients that
        ``clip_grad_norm_`` and the step read, as under DDP."""
        if self.faces.published:
            self.faces.unpublish(self.buckets)

    def _queue_finish(self) -> None:
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_grad(self, p: torch.Tensor) -> None:
        self._queue_finish()
        b, i = self._slot_of[id(p)]
        b.used[i] = 1.0
        self._grads_prepared = False
        # A parameter's gradient can arrive in several parts in one backward: reentrant
        # activation checkpointing (use_reentrant=True) runs a backward per region, each
        # accumulating into .grad. Only the first part counts towards the bucket's
        # readiness; a part arriving after the bucket's reduction has started is reduced
        # again at the end of backward (stage 3) or refused (stages 0-2: it would land
        # in a buffer being reduced).
        leaves = b.arrived[i]  # ids of the slot's leaves heard from in this backward
        first = id(p) not in leaves
        was_complete = len(leaves) == len(tied := self.faces.leaves(b.slots[i].param))
        leaves.add(id(p))
        completes = first and len(leaves) == len(tied)
        if self.sync and b.launched and not self.units:
            raise RuntimeError(
                f"parameter {b.slots[i].names[0]!r} received a second gradient in one "
                "backward after its bucket's reduction started. Reentrant activation "
                "checkpointing (torch.utils.checkpoint with use_reentrant=True, the "
                "default of HF's gradient_checkpointing_enable()) does this when a "
                "parameter is used in several checkpointed regions. Use "
                "use_reentrant=False (HF: gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False})), or shard "
                "with overlap=False (buckets are then reduced once backward is done)")
        if len(tied) > 1:  # see [Note: tied parameters] in params.py
            if was_complete:  # a late part (reentrant): onto the parameter's own .grad
                p = self._move_part(p, tied[0])
            else:
                held = self._merge_parts(tied, p, leaves)
                if len(leaves) < len(tied):  # other uses still to deliver
                    if self.units:
                        self.prefetch_backward()
                    return
                p = self._settle(tied[0], held, leaves)
        if not self.policy.shard_optimizer:  # stage 0: .grad views the buffer
            if b.grad is None:
                self._new_grad(b)
            view = b.slot_view(b.grad, i)
            if not self._same_memory(p.grad, view):  # fresh: we (or the user) set None
                self._stage0_put(b, i, view, p.grad)
                p.grad = view  # later backwards accumulate into the buffer in place
            b.valid[i] = True
        elif self.units:  # stage 3: autograd's .grad stays until the unit's last one (_fold)
            self.prefetch_backward()
        elif self.policy.keep_full_grads or self.sync:
            if self.policy.keep_full_grads:
                self._stash(b)
            if b.grad is None:
                self._new_grad(b)
            b.put_grad(b.grad, i, p.grad, add=b.valid[i])
            b.valid[i] = True
            p.grad = None
        # Inside no_sync() at stages 2-3 the parameter keeps its own (whole) .grad, which
        # autograd accumulates; the first synced backward folds it into the bucket.
        if not self.sync or not completes or b.launched:
            return
        b.ready += 1
        # Stage 3 reduces a unit at its post-backward, or at the end of backward (see
        # [Note: collective order in backward]); stages 0-2 in bucket order.
        if b.ready == len(b.slots) and self.config.overlap and not self.units:
            self._launch_in_order()

    def _launch_in_order(self) -> None:
        """Stages 0-2: launch the complete buckets at the head of the launch order
        (``self.buckets``), never one ahead of an incomplete one: see [Note: collective
        order in backward]."""
        order = self.buckets
        while self._next_launch < len(order):
            b = order[self._next_launch]
            if not b.launched:
                if b.ready < len(b.slots):
                    return
                self._launch(b)
            self._next_launch += 1

    # -- tied parameters (see [Note: tied parameters] in params.py) ------------------------
    @staticmethod
    def _merge_parts(tied: list[nn.Parameter], p: nn.Parameter, leaves: set[int]
                     ) -> nn.Parameter:
        """Add ``p``'s gradient part into the part another leaf of the same parameter
        holds from this backward (``leaves``: those heard from), in place (autograd gave
        that tensor to ``.grad``: it is ours alone), and return the leaf holding the sum:
        one part alive, not two. Parts add up in arrival order, as in autograd's input
        buffer."""
        held = next((t for t in tied if t is not p and id(t) in leaves
                     and t.grad is not None), None)
        if held is None:
            return p
        held.grad.add_(p.grad)
        p.grad = None
        return held

    def _settle(self, own: nn.Parameter, held: nn.Parameter, leaves: set[int]
                ) -> nn.Parameter:
        """This backward's parts are summed on ``held``: the parameter's ``.grad``
        becomes what earlier backwards left plus that sum, added in autograd's order
        (earlier + (part + part), as ``AccumulateGrad`` adds the summed input), so
        accumulation rounds exactly as under DDP. What earlier backwards left is still
        on ``own.grad`` if its own use did not deliver, else set aside (_before_own_part)."""
        total, held.grad = held.grad, None
        if id(own) in leaves:
            earlier = self._tied_earlier.pop(id(own), None)
        else:
            earlier = own.grad
        if earlier is not None:
            total = earlier.add_(total)
        own.grad = total
        return own

    def _before_own_part(self, b: FlatBucket, i: int, grads: tuple) -> None:
        """Before autograd accumulates the parameter's own use's part: set aside what
        earlier backwards left on its ``.grad``, so this backward's parts are summed
        apart first (see _settle). Not for a late part, which accumulates as usual."""
        own = b.slots[i].param
        leaves = b.arrived[i]
        if (own.grad is not None and id(own) not in leaves
                and len(leaves) < len(self.faces.leaves(own))):
            self._tied_earlier[id(own)] = own.grad
            own.grad = None

    @staticmethod
    def _move_part(p: nn.Parameter, own: nn.Parameter) -> nn.Parameter:
        """A part arriving after every use delivered (reentrant checkpointing): onto the
        parameter's own ``.grad``, where autograd would have accumulated it."""
        if p is not own:
            if own.grad is None:
                own.grad = p.grad
            else:
                own.grad.add_(p.grad)
            p.grad = None
        return own

    def _settle_unfinished_tied(self) -> None:
        """End of backward: a tied parameter some use of which delivered nothing (its
        module did not run) still gets this backward's parts, or its earlier gradient
        back."""
        for b, i in self._tied_slots:
            tied, leaves = self.faces.leaves(b.slots[i].param), b.arrived[i]
            if len(leaves) == len(tied):
                continue
            held = next((t for t in tied if id(t) in leaves and t.grad is not None), None)
            if held is not None:
                self._settle(tied[0], held, leaves)

    def _stage0_put(self, b: FlatBucket, i: int, view: torch.Tensor, grad: torch.Tensor
                    ) -> None:
        """Stage 0: a fresh gradient into the parameter's view of the buffer. Without
        mixed precision a fresh ``.grad`` means it was None (zero_grad, or the user):
        it replaces. Under mixed precision the compute ``.grad`` is ours and detached at
        every reduction, and the user's ``.grad`` (fp32, unscaled) is the sum so far,
        which DDP would accumulate into: start from it (edits included), then add."""
        user = self.faces.user[id(b.slots[i].param)]
        if not self.faces.swap or user.grad is None:
            view.copy_(grad)
            return
        base = user.grad.detach()
        view.copy_(base * self.scaler.scale if self.scaler.enabled else base)
        view.add_(grad)

    def _post_backward(self, u: Unit) -> None:
        """Stage 3: every node that read the unit's weights has run (see _PostBackward):
        free the weights, then reduce the buckets whose gradients have all arrived, so the
        whole gradient buffer is never allocated beside the whole weights (FSDP2's order)."""
        u.backward_done = True
        self._reshard(u)
        if not self.sync:
            return
        for b in u.trainable:  # whatever its parameters received: see [Note: collective
            if not b.launched:  # order in backward]; a missing gradient counts as zeros
                self._fold(b)
                self._launch(b)

    def _fold(self, b: FlatBucket) -> None:
        """Stage 3: move a unit's gradients, as autograd left them on its parameters, into
        one whole buffer for its reduce-scatter. A unit's buffer is allocated only once its
        last gradient has arrived, as FSDP2 does: early in a unit's backward, where its
        activations are all still alive, the unit holds only the gradients produced so far,
        not a whole unit's worth (the cost: both for a moment at the end, once the unit's
        activations are gone)."""
        self._new_grad(b)
        self._take_param_grads(b)

    def _take_param_grads(self, b: FlatBucket) -> None:
        """Move gradients autograd left on the bucket's parameters into its buffer, for
        slots the buffer has none for: stage 3 (see _fold), and at stage 2 a parameter
        unused in a synchronised backward that still holds gradients from no_sync()."""
        for i, s in enumerate(b.slots):
            for leaf in self.faces.leaves(s.param):
                # Stage 0's .grad may be the buffer's own view: already in.
                g = leaf.grad
                if g is None or (b.valid[i] and self._same_memory(g, b.slot_view(b.grad, i))):
                    continue
                if not self.policy.shard_optimizer:
                    self._stage0_put(b, i, b.slot_view(b.grad, i), g)
                else:
                    if self.policy.keep_full_grads:
                        self._stash(b)
                    b.put_grad(b.grad, i, g, add=b.valid[i])
                b.valid[i] = True
                leaf.grad = None

    def _new_grad(self, b: FlatBucket, zeros: bool = False) -> None:
        """Allocate the bucket's whole gradient buffer (compute dtype, gathered layout),
        counting the most alive at once (``peak_grad_buffer_bytes``)."""
        self._complete_done()
        self._drop_grad(b)
        make = torch.zeros if zeros else torch.empty
        b.grad = make(b.padded_numel, dtype=self.compute_dtype or b.dtype, device=b.device)
        self._grad_buffer_bytes += b.grad.untyped_storage().nbytes()
        self.peak_grad_buffer_bytes = max(self.peak_grad_buffer_bytes, self._grad_buffer_bytes)

    def _drop_grad(self, b: FlatBucket) -> None:
        if b.grad is not None:
            self._grad_buffer_bytes -= b.grad.untyped_storage().nbytes()
            b.grad = None

    def _launch(self, b: FlatBucket, phase: str = "backward") -> None:
        """Start reducing a bucket's gradient (average over ranks)."""
        src = b.grad
        assert src is not None
        if not self.policy.shard_optimizer:
            # Stage 0's .grad are views of the buffer being reduced: detach them, so a late
            # part of a gradient (see _on_grad) arrives as a new tensor and is refused
            # instead of being added into the buffer in flight. publish_grads restores them.
            for s in b.slots:
                s.param.grad = None
        if self.policy.keep_full_grads:
            self._stash(b)
        for i, ok in enumerate(b.valid):
            if not ok:  # no gradient since the last reduction: contributes zeros
                b.grad_region(src, i).zero_()
        rdtype = self.reduce_dtype_of(b)
        buf = src if src.dtype == rdtype else src.to(rdtype)
        if self._predivide(rdtype):
            buf.div_(self._divisor())
        if self.policy.reduce_op == "all_reduce":
            pending = self.comm.all_reduce(buf, phase=phase, unit=b.name,
                                           async_op=self.config.overlap)
        else:
            pending = self.comm.reduce_scatter(buf, phase=phase, unit=b.name,
                                               async_op=self.config.overlap)
        b.pending = (pending, buf)
        b.launched = True
        self._pending.append(b)
        limit = _MAX_PENDING_UNITS if self.units else _MAX_PENDING
        if not self.policy.keep_full_grads and len(self._pending) > limit:
            self._complete(self._pending.popleft())

    def _complete_done(self) -> None:
        """Stages 2-3, before a new whole buffer is allocated: complete the reductions
        that have finished, oldest first, so their whole buffers are freed first rather
        than when the in-flight limit or the end of backward next waits for them (on
        gpt2-small a finished bucket's buffer beside the next one was most of stage 2's
        peak above its floor). Only here: completing keeps the reduced slice (a copy, 1/N
        of the bucket, where it views the whole buffer), and that transient must not land
        on a gradient's arrival, which can be backward's largest moment (a tied table's
        second part). Not with hybrid sharding: there completing issues a collective (the
        replicas' all-reduce), which must not depend on when each rank polls."""
        if self.policy.keep_full_grads or self.replicate is not None:
            return
        while self._pending and self._pending[0].pending[0].done():
            self._complete(self._pending.popleft())

    def _complete(self, b: FlatBucket) -> None:
        pending, buf = b.pending
        out = pending.wait()
        b.pending = None
        if self.policy.reduce_op == "all_reduce":
            if buf is not b.grad:  # reduced in another dtype: keep the reduced values
                b.grad.copy_(buf)
            # Every slot now holds the average on every rank, also where this rank had
            # no gradient: a later backward before the step adds to it (accumulation).
            b.valid = [True] * len(b.slots)
            return
        if self.replicate is not None:  # hybrid: sum the slice over the replicas too
            self.replicate.all_reduce(out, phase="backward", unit=b.name).wait()
        if not self._predivide(buf.dtype):
            out.div_(self._divisor())  # 1/N of the work of dividing the whole bucket
        if self._in_place(b):
            own = b.shard_of(b.grad)
            if not self._same_memory(out, own):
                own.copy_(out)
            b.reduced = True
            if self.offload:
                self._start_host_copy(b)
        elif self.offload:
            self._add_to_host(b, out)
        elif b.grad_shard is None:  # the first reduction since zero_grad: keep its result
            # (a copy where it is a view of the whole buffer, which is freed below)
            b.grad_shard = out.clone() if self._shares(out, buf) else out
        else:
            b.grad_shard.add_(out)
        b.valid = [False] * len(b.slots)  # see [Note: buffer lifetimes]
        if self.policy.keep_full_grads:
            for s in b.slots:
                s.param.grad = None  # the next gradient is copied in, not added
        else:
            self._drop_grad(b)

    def _start_host_copy(self, b: FlatBucket) -> None:
        """Offload, stage 1: start copying the reduced slice (inside the whole gradient
        buffer) to the host now. A later reduction before the step (accumulation) copies
        again."""
        if b.grad_shard is not None:  # a stash: the sum is formed at the step
            b.host_fresh = False
            return
        self.offloader.start_grad_copy(b, self._reduced_slice(b))

    def _add_to_host(self, b: FlatBucket, out: torch.Tensor) -> None:
        """Offload, stages 2-3: the reduced slice goes to the host at once (non-blocking,
        overlapping the rest of backward); the device keeps no copy. A second reduction
        before the step (accumulation without no_sync) adds on the host, synchronously."""
        if b.host_fresh:
            self.offloader.wait_copies()  # the first slice's copy into host_grad has landed
            b.host_grad.add_(out.to(b.host_grad.device))
        else:
            self.offloader.start_grad_copy(b, out)

    def _divisor(self) -> int:
        """Ranks whose gradients are averaged: all, or those with data inside join()."""
        return self.active_ranks or self.dp_size

    def _predivide(self, dtype: torch.dtype) -> bool:
        """Average before summing where a sum could overflow (fp16) and at stage 0 (whose
        result is the whole gradient anyway); otherwise divide only the reduced slice."""
        return dtype == torch.float16 or self.policy.reduce_op == "all_reduce"

    def _finish_backward(self) -> None:
        """See [Note: end of backward]."""
        outer = torch._C._current_autograd_node()
        if outer is not None:
            # A reentrant backward (torch.utils.checkpoint with use_reentrant=True runs one
            # per region, from inside the outer backward's node) has ended, not the
            # backward: finish when the outer node is done, in the outer backward.
            outer.register_hook(lambda *_: torch.autograd.Variable._execution_engine
                                .queue_callback(self._finish_backward))
            return
        self._settle_unfinished_tied()
        self._backward_queued = False
        self._backward_ended = True  # see _backward_begins
        self._bwd_cursor = 0
        self._prefetch_due = False
        for u in self.units:
            u.in_backward = False
            self._reshard(u)
        self._show_user()
        if not self.sync:
            for b in self.buckets:
                b.ready = 0
                b.launched = False
                b.arrived = [set() for _ in b.slots]
            return
        for b in self.buckets:  # in order: see [Note: collective order in backward]
            if not b.launched:
                if self.units:
                    self._fold(b)  # some parameters got no gradient in this backward
                else:
                    if b.grad is None:  # stage 2, no gradient at all for this bucket
                        self._new_grad(b, zeros=True)
                    self._take_param_grads(b)
                self._launch(b)
            b.ready = 0
            b.arrived = [set() for _ in b.slots]
        self._next_launch = 0
        while self._pending:
            self._complete(self._pending.popleft())
        late = self._agree_on_usage()
        for b in late:  # parts of gradients that arrived after their unit's reduction
            self._fold(b)  # zeros where this rank has none: every rank reduces it
            self._launch(b, phase="late")  # its reduced slice adds to the first one's
        while self._pending:
            self._complete(self._pending.popleft())
        for b in self.buckets:
            b.launched = False
        self.publish_grads()

    def _agree_on_usage(self) -> list[FlatBucket]:
        """End of a synchronised backward: every rank learns which parameters some rank
        produced a gradient for (the others keep ``grad = None``, as under DDP, and the
        step skips them) and, at stage 3, which buckets some rank holds a late gradient
        part for (every rank then reduces those buckets again, so that what is reduced
        never depends on one rank's data). One small all-reduce per synchronised
        backward, as DDP's ``find_unused_parameters``. Returns the late buckets."""
        n = sum(len(b.slots) for b in self.buckets)
        flags = self._backward_flags
        if flags is None:
            flags = self._backward_flags = torch.empty(n + len(self.buckets),
                                                       device=self.device)
        torch.cat([b.used for b in self.buckets], out=flags[:n])
        if self.units:
            late = [float(any(leaf.grad is not None for s in b.slots
                              for leaf in self.faces.leaves(s.param))) for b in self.buckets]
            flags[n:].copy_(torch.tensor(late))
        else:
            flags[n:].zero_()
        self.world.all_reduce(flags, phase="control", unit="used").wait()
        if is_fake(flags):  # a trace (memory/traced.py) reads no values: all were used
            for b in self.buckets:
                b.unused = set()
            return []
        values = flags.tolist()  # one read, not one per slot
        k = 0
        for b in self.buckets:
            b.unused = {j for j in range(len(b.slots)) if values[k + j] == 0}
            k += len(b.slots)
        return [b for b, f in zip(self.buckets, values[n:]) if f > 0]

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
                    out[n] = self.faces.user[id(s.param)]
        return out

    def optimizer_groups(self, options: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Torch param-group dicts: group i's chunks with ``options[i]`` (every group on
        every rank, even one with no chunk in this rank's shard)."""
        return [{**opts, "params": [c for b in self.buckets
                                    for c, g in zip(b.chunks, b.chunk_groups) if g == i]}
                for i, opts in enumerate(options)]

    def publish_grads(self) -> None:
        """Form the masters' fp32 gradients and show them on the user parameters (None
        for those no rank produced one for, see _agree_on_usage)."""
        self.prepare_grads()
        for b in self.buckets:
            self.faces.publish_grads(b, b.unused)

    def adopt_user_grads(self) -> None:
        """Before the step (and zeroshard's own clipping): take in ``.grad`` the user
        assigned since the gradients were published.

        [Note: assigned gradients]
        The optimizer steps the engine's ``master_grad``, and each parameter's ``.grad``
        is a view of its part, so in-place edits (``p.grad.mul_``, torch's clipping) reach
        the step. Torch also lets a script *assign* ``.grad``: ``p.grad = None`` makes
        torch's optimizers skip the parameter, ``p.grad = p.grad * 0.5`` steps the new
        tensor. Both once went unseen (the step used the reduced gradient: silently
        wrong, at every stage). Now a new tensor's values (a DTensor like the published
        one, or the whole gradient, of which this rank takes its rows) are copied into
        ``master_grad`` and ``.grad`` views it again; ``None`` marks the parameter unused on
        this rank, so where every rank cleared it the step skips it as torch does, its
        optimizer state and AdamW's ``step`` untouched (as for a parameter no rank used,
        see chunks.skip_slots)."""
        if not self.faces.published:
            return
        for b in self.buckets:
            for i, s in enumerate(b.slots):
                user = self.faces.user[id(s.param)]
                g = user.grad
                target = (b.local(b.master_grad, i) if self.faces.sharded
                          else b.slot_view(b.master_grad, i))
                if g is None:  # torch's optimizers skip it: so does the step (unused)
                    b.used[i] = 0.0
                    target.zero_()
                    continue
                local = self._local_grad(b, i, g)
                if self._same_memory(local, target):
                    continue
                target.copy_(local)
                self.faces.publish_slot(b, i)

    def _local_grad(self, b: FlatBucket, i: int, g: torch.Tensor) -> torch.Tensor:
        """This rank's part of a gradient the user assigned to slot ``i``'s parameter."""
        from torch.distributed.tensor import DTensor

        s = b.slots[i]
        name = s.names[0]
        if tuple(g.shape) != tuple(s.shape):
            raise ValueError(
                f"the .grad assigned to parameter {name!r} has shape {tuple(g.shape)}, the "
                f"parameter {tuple(s.shape)}: assign a gradient shaped like the parameter")
        if isinstance(g, DTensor):
            if tuple(g.placements) != tuple(self.faces.placements) or g.device_mesh != \
                    self.faces.mesh:
                raise ValueError(
                    f"the .grad assigned to parameter {name!r} is a DTensor placed as "
                    f"{g.placements} on another mesh or layout than the parameter's "
                    f"{self.faces.placements}: build it from the parameter's own .grad "
                    "(e.g. p.grad * 0.5), or assign a whole (non-DTensor) tensor")
            return g._local_tensor  # not to_local(): an autograd op, per slot and step
        if not self.faces.sharded:
            return g
        lo, hi = s.piece(b.rank)
        return g.detach().reshape(-1)[lo:hi].view(s.local_shape(b.rank))

    def prepare_grads(self) -> bool:
        """Give every master its fp32, unscaled gradient; return True if any overflowed.

        Idempotent until the next backward.
        """
        if self._grads_prepared:
            return self._overflow
        grads = []
        for b in self.buckets:
            if self.offload:  # copies started in backward; buckets without one go now
                if not b.host_fresh and self._in_place(b):
                    self.offloader.start_grad_copy(b, self._reduced_slice(b))
                elif not b.host_fresh:  # no backward since zero_grad: a zero gradient
                    self.offloader.zero_grad(b, self.reduce_dtype_of(b))
                grads.append(b.host_grad)
                continue
            if self.policy.reduce_op == "all_reduce" and b.grad is None:
                self._new_grad(b, zeros=True)  # no backward since zero_grad
            grads.append(b.grad if self.policy.reduce_op == "all_reduce"
                         else self._reduced_slice(b))
        if self.offload:
            self.offloader.wait_copies()
        for b, g in zip(self.buckets, grads):
            if g.dtype == b.master_dtype and not self.scaler.enabled:
                set_master_grad(b, g)
            else:
                # A copy even where the dtypes agree: ``g`` is the accumulator later
                # backwards add (scaled) gradients to, so it must stay scaled.
                set_master_grad(b, g.to(b.master_dtype, copy=True))
                if self.scaler.enabled:
                    b.master_grad.div_(self.scaler.scale)
        self._overflow = False
        if self.scaler.enabled:
            bad = torch.zeros(1, device=b.master_grad.device)
            for b in self.buckets:
                bad += (~torch.isfinite(b.master_grad)).any().float()
            bad = bad.to(self.device)  # collectives run on the device (NCCL needs it)
            self.world.all_reduce(bad, phase="control", unit="overflow").wait()
            self._overflow = bool(bad.item() > 0)
        self._grads_prepared = True
        return self._overflow

    def _reduced_slice(self, b: FlatBucket) -> torch.Tensor:
        if b.grad_shard is None and (not self._in_place(b) or b.grad is None):
            # no backward since zero_grad: a zero gradient
            b.grad_shard = torch.zeros(b.shard_numel, dtype=self.reduce_dtype_of(b),
                                       device=b.device)
        if not self._in_place(b) or b.grad is None:
            return b.grad_shard
        own = b.shard_of(b.grad)
        if not b.reduced and b.grad_shard is None:  # no backward since zero_grad
            own.zero_()
            b.reduced = True
        if b.grad_shard is None:
            return own
        self._stash(b)  # accumulated over several synced backwards: sum in the stash
        return b.grad_shard

    def grad_norm(self, norm_type: float) -> torch.Tensor:
        """The global gradient norm, equal to clip_grad_norm_'s on the unsharded model."""
        self.prepare_grads()
        self.adopt_user_grads()
        grads = [b.master_grad for b in self.buckets]
        device = grads[0].device
        sharded = self.policy.shard_optimizer
        if norm_type == float("inf"):
            local = torch.stack([g.abs().max() for g in grads]).max().float().to(self.device)
            if sharded:
                self.comm.all_reduce(local, phase="control", unit="grad_norm",
                                     op=dist.ReduceOp.MAX).wait()
            return local.to(device)
        local = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            local += g.float().pow(norm_type).sum()
        if sharded:
            local = local.to(self.device)  # offloaded grads live on the host
            self.comm.all_reduce(local, phase="control", unit="grad_norm").wait()
        return local.pow(1.0 / norm_type).to(device)

    def scale_grads(self, coef: torch.Tensor) -> None:
        for b in self.buckets:
            b.master_grad.mul_(coef.to(b.master_grad.dtype))

    def gather_used_flags(self) -> torch.Tensor:
        """Every rank's "got a gradient" flags, summed, in one persistent buffer (a new
        tensor per step would be held for a while by the collective library)."""
        flags = self._used_flags
        if flags is None:
            flags = self._used_flags = torch.empty(sum(len(b.slots) for b in self.buckets),
                                                   device=self.device)
        torch.cat([b.used for b in self.buckets], out=flags)
        self.world.all_reduce(flags, phase="control", unit="used").wait()
        return flags

    def unused_slots(self) -> list[tuple[FlatBucket, set[int]]]:
        """Per bucket, the slots of parameters no rank produced a gradient for (or whose
        ``.grad`` every rank set to None): the step skips them (chunks.skip_slots)."""
        flags = self.gather_used_flags().tolist()
        out: list[tuple[FlatBucket, set[int]]] = []
        k = 0
        for b in self.buckets:
            unused = {j for j in range(len(b.slots)) if flags[k + j] == 0}
            k += len(b.slots)
            if unused:
                out.append((b, unused))
        return out

    def reshard_all(self) -> None:
        """Free every gathered stage-3 unit (between steps; see ShardedModule.reshard)."""
        if in_backward() or self._backward_queued:
            raise RuntimeError("reshard() during a backward: zeroshard frees each unit once its "
                               "backward is done; call it between steps")
        for u in self.units:
            u.wait()
            self._reshard(u)

    def after_step(self) -> None:
        """Return updated weights to the compute buffers (and to every rank)."""
        for u in self.units:  # gathered by a forward no backward followed: now stale
            self._reshard(u)  # (see [Note: between forward and backward])
        self.refresh_weights(phase="step")
        if self._joinable is not None and not self._replaying:
            self._last_iter = self.comm.ledger.records[self._iter_start :]
            self._last_clip, self._clip_this_iter = self._clip_this_iter, None
        self.comm.ledger.mark_step()

    @torch.no_grad()
    def refresh_weights(self, *, phase: str, buckets: list[FlatBucket] | None = None) -> None:
        """Re-derive the compute weights from the masters (after a step or a load, or
        for ``buckets`` whose masters the user edited; see _refresh_edited)."""
        pending = []
        for b in self.buckets if buckets is None else buckets:
            if self.policy.shard_params:
                if self.offload and not self.offloader.params:
                    self.offloader.upload(b, b.shard16)
                elif not self._same_memory(b.shard16, b.master):
                    b.shard16.copy_(b.master.detach())
                continue
            if not self.policy.gather_after_step:  # stage 0: the whole master
                if not self._same_memory(b.full, b.master):
                    b.full.copy_(b.master.detach())
                continue
            if self.comm.decompose and not self.offload:
                # gloo: the updated slice into this rank's chunks of ``full`` (nothing to
                # do where the optimizer stepped them in place), every rank's chunk of
                # every parameter broadcast straight into place: no gathered buffer, no
                # copy-out; all buckets in flight at once.
                if not b.master_in_full:
                    b.shard_to_full(b.master.detach(), b.full)
                pending.append(self.comm.all_gather_pieces(
                    b.full, b.rank_pieces(b.full), phase=phase, unit=b.name, async_op=True))
                continue
            # Stages 1-2: the updated slice into a gathered buffer, all-gather, copy out.
            gathered = torch.empty(b.padded_numel, dtype=b.full.dtype, device=b.device)
            target = b.shard_of(gathered)
            if self.offload:
                self.offloader.upload(b, target)
            elif b.master_in_full:  # this rank's chunks of ``full``, already stepped
                b.shard_from_full(b.full, out=target)
            else:
                target.copy_(b.master.detach())
            self.comm.all_gather(gathered, phase=phase, unit=b.name).wait()
            b.gathered_to_full(gathered, b.full)
            del gathered
        for p in pending:
            p.wait()
        self._note_edits(self.buckets if buckets is None else buckets)

    def _note_edits(self, buckets: list[FlatBucket]) -> None:
        if self.faces.swap:
            for b in buckets:
                b.edits_seen = self.faces.edits(b)

    def _refresh_edited(self) -> None:
        """Before a forward: re-derive the compute weights of buckets whose masters
        changed since they were last derived — the user edited a parameter in place
        (``p.mul_()``, an EMA copy-in) where the user parameters are the masters (mixed
        precision, stage 3, offload). Under DDP the next forward sees such an edit; here
        the compute weights are a copy of (or gathered from) the masters, so they are
        refreshed. Edits are seen as a change of the user parameters' version counters
        (the optimizer steps the masters' chunks, which leaves those alone). At stages
        1-2 the refresh is an all-gather: every rank must make the same edit, as DDP's
        replicas must."""
        if not self.faces.swap:
            return  # the modules' parameters are the compute weights: edits are seen
        stale = [b for b in self.buckets if self.faces.edits(b) != b.edits_seen]
        if stale:
            self.refresh_weights(phase="forward", buckets=stale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every gradient. ``set_to_none=True``: free the gradient buffers (the next
        backward allocates them; see [Note: buffer lifetimes]). False, as torch: the parameters' ``.grad``
        stay, as zeros (stage 0: the buffer's views; otherwise the masters' gradients)."""
        self._clear_grads()
        if set_to_none:
            return
        for b in self.buckets:
            if not self.policy.shard_optimizer and not self.faces.swap:
                self._new_grad(b, zeros=True)
                b.grad_views(b.grad)
                continue
            set_master_grad(b, torch.zeros(b.shard_numel, dtype=b.master_dtype,
                                           device=b.master_device))
            self.faces.publish_grads(b)

    def _clear_grads(self) -> None:
        """Free every gradient buffer (see [Note: buffer lifetimes]); the next backward
        allocates them again."""
        for b in self.buckets:
            b.grad_shard = None
            self._drop_grad(b)
            b.reduced = False
            b.host_fresh = False
            set_master_grad(b, None)
            b.used.zero_()
            b.valid = [False] * len(b.slots)
            self.faces.clear_grads(b)
        self._tied_earlier.clear()
        self._grads_prepared = False

    def skip_step(self) -> None:
        self._clear_grads()
        self.comm.ledger.mark_step()

    # -- state --------------------------------------------------------------------------
    def full_master(self, b: FlatBucket) -> torch.Tensor:
        """The whole master-precision weights of a bucket in the full layout, every rank.

        Collective at stages >= 1 unless the compute weights are the master values
        (stages 1-2 without mixed precision).
        """
        if not self.policy.shard_optimizer:
            return b.master.detach()
        if b.master_in_full:
            return b.full  # the masters are the weights' own chunks: whole and current
        src = (b.master if b.master is not None else b.shard16).detach()
        return self.gather_shard(b, src, phase="state")

    def gather_shard(self, b: FlatBucket, shard: torch.Tensor, *, phase: str) -> torch.Tensor:
        """Every rank's ``shard`` (shard layout, any dtype) as one full-layout tensor."""
        # Offloaded slices are on the host; collectives run on the device (NCCL needs it).
        gathered = torch.empty(b.padded_numel, dtype=shard.dtype, device=b.device)
        self.comm.all_gather_into(gathered, shard.to(b.device), phase=phase, unit=b.name)
        if b.world == 1:
            return gathered
        full = torch.empty_like(gathered)
        b.gathered_to_full(gathered, full)
        return full

    def memory_sources(self) -> Callable[[], dict[str, list[torch.Tensor]]]:
        """Tensors by category, for the memory tracker (names match memory.Category)."""

        def sources() -> dict[str, list[torch.Tensor]]:
            params, grads, optim = [], [], []
            for b in self.all_buckets:
                params += [t for t in (b.full, b.shard16, b.host_weights) if t is not None]
                grads += [t for t in (b.grad, b.grad_shard, b.host_grad) if t is not None]
                if b.master_grad is not None:
                    grads.append(b.master_grad)
                if b.master is None:
                    continue
                if not self._shares(b.master, b.full) and not (
                    b.shard16 is not None and self._shares(b.master, b.shard16)
                ):
                    optim.append(b.master)
            params += self.frozen
            if self.units:  # stage 3: gradients autograd left on a unit until its _fold
                grads += [s.param.grad for b in self.buckets for s in b.slots
                          if s.param.grad is not None]
            # A tied parameter's parts held until its other uses deliver (params.py).
            grads += [t.grad for b, i in self._tied_slots
                      for t in self.faces.leaves(b.slots[i].param) if t.grad is not None]
            # Stage 3's all-gathers in flight (gathered layout, before the copy-out).
            comm = [b.gathering for b in self.all_buckets if b.gathering is not None]
            # The per-parameter "got a gradient" flags: bookkeeping, whenever first seen.
            other = [b.used for b in self.all_buckets if b.used is not None]
            other += [self._used_flags] if self._used_flags is not None else []
            return {"params": params, "grads": grads, "optim": optim, "comm": comm,
                    "other": other}

        return sources

    def host_tensors(self) -> list[torch.Tensor]:
        """Engine tensors in host memory by design (offload); see [Note: device and host]."""
        return self.offloader.host_tensors(self.all_buckets)

    @staticmethod
    def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata

    @staticmethod
    def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
        """Same storage, same offset. Not ``data_ptr()``: fake tensors (traced planning,
        memory/traced.py) have null-based data pointers, so every storage's first element
        would compare equal."""
        return Engine._shares(a, b) and a.storage_offset() == b.storage_offset()


def _check_shardable(named: list[tuple[tuple[str, ...], nn.Parameter]],
                     policy: StagePolicy) -> None:
    """Stages >= 1 cut parameters along dim 0 (see [Note: flat buckets]); a 0-dim one has
    no dim 0, and no DTensor can shard it."""
    for names, p in named:
        sharded = policy.shard_params or (policy.shard_optimizer and p.requires_grad)
        if sharded and p.dim() == 0:
            raise ValueError(
                f"parameter {names[0]!r} is 0-dimensional; stages 1-3 shard each parameter "
                "along dim 0, which a scalar does not have. Give it shape (1,) (e.g. "
                "nn.Parameter(torch.ones(1)) and index [0] where it is used), or use stage 0")


def _materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """Give a meta-built model real buffers, recomputed by its ``reset_buffers()``."""
    metas = [(m, n) for m in model.modules() for n, t in m._buffers.items()
             if t is not None and t.is_meta]
    if not metas:
        return
    reset = getattr(model, "reset_buffers", None)
    if not callable(reset):
        raise TypeError(
            f"{type(model).__name__} has buffers on the meta device but no reset_buffers() "
            "method to recompute them; add one, or build the model on a real device"
        )
    for m, n in metas:
        m._buffers[n] = torch.empty_like(m._buffers[n], device=device)
    reset()
