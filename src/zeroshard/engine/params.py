"""The parameters the user sees, and the swap between them and the compute parameters.

[Note: parameters the user sees]
A sharded model must still be a torch model: ``p.shape``, ``p.numel()``,
``clip_grad_norm_(model.parameters())``, ``GradScaler``, optimizers and state dicts
all read the parameters the model's modules hold. Each parameter therefore has two
faces (FSDP2 has the same two: its sharded DTensor and its unsharded tensor):

* the **compute** parameter (``slot.param``): what forward reads and autograd gives
  gradients to — a whole tensor in the compute dtype, a view of the bucket's ``full``
  buffer (at stage 3 only while its unit is gathered);
* the **user** parameter: what the modules hold outside forward/backward, in the
  parameter's original dtype, and whose ``.grad`` after a synchronised backward is this
  parameter's reduced, averaged, unscaled gradient in that dtype:

  ==================================  ======================================  ==========================
  where                               user parameter                          its ``.grad``
  ==================================  ======================================  ==========================
  stage 0                             whole (the master weights)              whole
  stages 1-2, fp32, no offload        whole (the compute parameter itself)    DTensor, ``Shard(0)``
  stages 1-2, mixed prec. or offload  DTensor ``Shard(0)`` of the masters     DTensor, ``Shard(0)``
  stage 3                             DTensor ``Shard(0)`` of the masters     DTensor, ``Shard(0)``
  ==================================  ======================================  ==========================

  The DTensors' local tensors are views of this rank's master slice and of its fp32
  gradient (``master_grad``), so ``clip_grad_norm_`` and ``GradScaler.unscale_``
  scale exactly what the optimizer steps, and their norms and inf checks are global
  (DTensor reduces them over the mesh). Where nothing is sharded and no dtype differs
  (stages 0-2 without mixed precision or offload) the user parameter *is* the compute
  parameter: no swap, and identities survive ``shard()`` as under DDP.

While forward and backward run, the modules hold the compute parameters instead
(``Faces.show``): from the root's forward to the end of backward at stages 0-2 (or to
the end of forward under ``torch.no_grad()``), and per unit from its gather to its
free at stage 3.

[Note: tied parameters]
A parameter held by several modules (GPT-2's token table *is* its output projection)
gets its gradient in one part per use. Autograd sums the parts in the parameter's input
buffer before accumulating: the first use's part (here the output projection's, the
first node of backward) is held there through the whole backward, and the sum is a new
tensor, so at the last use three parameter-sized tensors exist at once (measured: on
gpt2-124m 3 x 147 MiB, the peak of DDP, FSDP2 and every stage). So each home after the
first holds its own compute parameter during forward and backward, an *alias*: another
autograd leaf over the same memory (``alias.data`` is the compute parameter's, set again
whenever the modules are shown the compute parameters). Each leaf's part arrives at its
own gradient hook (``BackwardPass.on_grad`` in backward.py): later parts are added into the one held from this
backward, in place, in arrival order (autograd's own order), so one part lives through
backward, as under torch, and the last use costs one more part, not two plus a sum.
When every leaf has delivered, the sum is added to what earlier backwards left
(accumulation: set aside before the own use accumulates, tied.py), which is
``AccumulateGrad``'s order, earlier + (part + part), so sums round exactly as under
DDP; from there the parameter's gradient takes the untied path of its stage. A home
whose module did not run leaves its slot to the end of backward, as an unused parameter
does. Outside forward and backward every home holds the user parameter again, so
identities and ``model.parameters()`` are as before.
"""

from __future__ import annotations

import torch
from torch import nn

from .dtensors import dtensor, make_spec
from .flat import FlatBucket, FlatParam
from .tensor_parallel import TensorParallel

__all__ = ["Faces"]


def _homes(model: nn.Module, names: tuple[str, ...]) -> list[tuple[nn.Module, str]]:
    """The distinct (module, attribute) pairs that hold a parameter known by ``names``."""
    out: list[tuple[nn.Module, str]] = []
    for name in names:
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        if not any(m is module and a == attr for m, a in out):
            out.append((module, attr))
    return out


def _alias(param: nn.Parameter) -> nn.Parameter:
    """Another autograd leaf over ``param``'s memory (see [Note: tied parameters])."""
    alias = nn.Parameter(torch.empty(0, dtype=param.dtype, device=param.device),
                         requires_grad=param.requires_grad)
    alias.data = param.data
    return alias


class Faces:
    """The user parameters of one engine and where the modules hold them: each
    parameter's ``user``, ``spec``, ``leaves`` and ``homes`` (fields of its
    :class:`FlatParam`, filled in here)."""

    def __init__(self, model: nn.Module, buckets: list[FlatBucket], *, sharded: bool,
                 swap: bool, mesh, placements: tuple, tp: TensorParallel | None = None) -> None:
        self.tp = tp  # see [Note: tensor-parallel parameters] in tensor_parallel.py
        self.sharded = sharded  # user-visible weights/gradients are DTensor shards
        self.swap = swap  # user parameters differ from the compute ones
        self.mesh = mesh
        self.placements = placements
        self.published = False  # user .grad point at the masters' gradients
        self.buckets = buckets
        self.holds_compute = False  # stages 0-2: the modules hold the compute parameters
        # An alias (the leaf a tied parameter's further home holds between a forward with
        # gradients and the end of its backward) -> the user parameter it stands for.
        self.alias_of: dict[nn.Parameter, nn.Parameter] = {}
        self.has_aliases = False  # some parameter has aliases
        for b in buckets:
            for s in b.slots:
                self._build(model, b, s)

    # -- construction -------------------------------------------------------------------
    def _weights(self, b: FlatBucket) -> torch.Tensor:
        """What user parameters view: the masters (original dtype), or for frozen
        stage-3 buckets (no master) the kept compute slice."""
        return (b.master if b.master is not None else b.shard16).detach()

    def _build(self, model: nn.Module, b: FlatBucket, s: FlatParam) -> None:
        homes = _homes(model, s.names)
        if self.tp is not None and self.tp.spec(s.param) is not None:
            s.tp = self.tp.spec(s.param)
            s.leaves = [self.tp.face(s.param)]  # its one leaf is its face
        elif len(homes) > 1 and s.param.requires_grad:
            # One alias per home after the first (see [Note: tied parameters]); a module
            # shared by several parents is one home under several names: its uses sum
            # inside one leaf, as under torch.
            s.leaves = [s.param, *(_alias(s.param) for _ in homes[1:])]
            self.has_aliases = True
        else:
            s.leaves = [s.param]
        if self.sharded:
            placements, shape = self.placements, s.shape
            if self.tp is not None:
                placements = self.tp.placements(s.param, placements)
                shape = self.tp.global_shape(s.param)
            s.spec = make_spec(self.mesh, placements, shape,
                               b.master_dtype if b.requires_grad else b.shard16.dtype)
        if not self.swap:
            user = s.param
        elif not self.sharded:  # stage 0 under mixed precision: the whole master
            weights = self._weights(b)
            user = nn.Parameter(torch.empty(0, dtype=weights.dtype, device=weights.device),
                                requires_grad=s.param.requires_grad)
            user.data = b.slot_view(weights, s.index)
        else:
            user = nn.Parameter(dtensor(b.local(self._weights(b), s.index), s.spec),
                                requires_grad=s.param.requires_grad)
        s.user = user
        self.alias_of.update((a, user) for a in s.leaves[1:])
        leaves = s.leaves
        s.homes = [(module, attr, leaves[k] if len(leaves) > 1 else leaves[0], user)
                   for k, (module, attr) in enumerate(homes)]

    @property
    def swaps(self) -> bool:
        """Do the modules hold other parameters during forward and backward?"""
        return self.swap or self.has_aliases

    # -- the swap -----------------------------------------------------------------------
    def show(self, buckets, compute: bool) -> None:
        """Let the modules hold the compute (or the user) parameters of ``buckets``."""
        if not self.swaps:
            return
        for b in buckets:
            for s in b.slots:
                if len(s.leaves) > 1:
                    if compute:  # aliases follow the compute weights wherever they live
                        for a in s.leaves[1:]:
                            a.data = s.param.data
                    homes = s.homes
                elif self.swap:
                    homes = s.homes
                else:  # only the tied parameters' further homes swap
                    continue
                for k, (module, attr, c, u) in enumerate(homes):
                    if self.swap or k:
                        module._parameters[attr] = c if compute else u

    def hold(self, compute: bool) -> None:
        """Stages 0-2: the modules hold every bucket's compute (or user) parameters, from
        a forward to the end of its backward (or of a forward without gradients)."""
        if self.swaps and self.holds_compute != compute:
            self.show(self.buckets, compute=compute)
            self.holds_compute = compute

    def edits(self, b: FlatBucket) -> int:
        """The sum of the bucket's user parameters' version counters: it changes when
        the user modifies one in place (DTensor ops bump the wrapper's counter, not the
        local tensor's)."""
        return sum(s.user._version for s in b.slots)

    def known(self) -> set[torch.Tensor]:
        """Every tensor a module of the model may hold as one of our parameters."""
        return {t for b in self.buckets for s in b.slots for t in (s.user, s.param, *s.leaves)}

    # -- gradients ----------------------------------------------------------------------
    def publish_grads(self, b: FlatBucket, unused: set[int] = frozenset()) -> None:
        """Point each user parameter's ``.grad`` at its part of ``b.master_grad``; those of
        the slots ``unused`` (no rank produced a gradient) at None, as under DDP."""
        self.published = True
        for i, s in enumerate(b.slots):
            user = s.user
            if i in unused:
                user.grad = None
                if not self.sharded and not self.swap:  # stage 0: the buffer's view
                    s.param.grad = None
                continue
            # Stage 0 without mixed precision: .grad is already the reduced view (unless
            # only other ranks used the parameter).
            if self.sharded or user is not s.param or user.grad is None:
                self.publish_slot(b, i)

    def publish_slot(self, b: FlatBucket, i: int) -> None:
        """Point one user parameter's ``.grad`` at its part of ``b.master_grad`` again."""
        s = b.slots[i]
        if self.sharded:
            s.user.grad = dtensor(b.local(b.master_grad, i), s.spec)
        else:
            s.user.grad = b.slot_view(b.master_grad, i)

    def unpublish(self, buckets) -> None:
        """Where the compute parameters are the user ones (stages 1-2 without mixed
        precision or offload), as a backward reaches its first parameter: drop their
        DTensor ``.grad``, or autograd would add into it (see _drop_published in backward.py).
        The sum lives in the engine's buffers and is published again when that backward
        ends."""
        if self.sharded and not self.swap and self.published:
            for b in buckets:
                for s in b.slots:
                    s.param.grad = None
            self.published = False

    def clear_grads(self, b: FlatBucket) -> None:
        self.published = False
        for s in b.slots:
            for leaf in s.leaves:
                leaf.grad = None
            s.user.grad = None
