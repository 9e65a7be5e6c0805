"""Tensor parallelism composed with zeroshard's data parallelism: a model that torch's
``parallelize_module`` made tensor-parallel on the ``tp`` dimension of a mesh, sharded
by zeroshard over the other (data-parallel) dimensions.

[Note: tensor-parallel parameters]
``parallelize_module`` leaves each parameter it parallelised an ``nn.Parameter`` over a
DTensor on the 1-D tp mesh: this rank's local piece (a ``Shard(0)`` block of rows, a
``Shard(1)`` block of columns, or a ``Replicate`` whole) and its placement. zeroshard
shards the *local pieces*:

* at ``shard()`` each such parameter is replaced, in every module holding it, by a plain
  parameter over its local tensor (:func:`localize`), and the engine cuts buckets of
  those as of any model. The ranks of one dp group share a tp coordinate, so their
  local shapes agree: flat buckets, chunks and padding work unchanged, every
  data-parallel collective runs inside the dp dimensions, and every tensor-parallel one
  is torch's own, untouched.
* during forward and backward the modules hold, for each such parameter, its *face*: a
  DTensor leaf over the compute parameter's memory with the tp placement (FSDP2's
  unsharded parameter is the same), so the tp plan's ops see the DTensors they were
  written for. Its gradient arrives on the face, where the engine's hooks take it
  (:meth:`TensorParallel.local_grads`): brought to the face's placement first — a
  ``Partial`` gradient (a sequence-parallel norm's weight) is all-reduced over tp, as
  FSDP2 does before its reduce-scatter (at stage 3 a unit's in one all-reduce, not one
  DTensor ``redistribute`` each) — then its local tensor, which the engine reduces over
  dp only. A leaf, not ``DTensor.from_local`` of the compute parameter in
  each forward: autograd runs a node made before a block's ops only after the whole
  backward, so every gradient arrived late (all held to the end, then reduced twice).
* the user parameter (see [Note: parameters the user sees] in params.py) is a DTensor
  on the whole mesh: zeroshard's dp placements, then the tp placement. Where both split
  dim 0 (a column-wise weight) the dp placement is ``_StridedShard(0, split_factor=tp)``:
  rank (d, t) holds dp chunk d of tp chunk t, as under FSDP2 + TP, so ``full_tensor()``
  is the true parameter and DCP can place it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .dtensors import dtensor

__all__ = ["TpSpec", "TensorParallel", "chunk_range", "localize", "sync_over_tp", "tp_comms",
           "is_tp_mesh"]


def chunk_range(n: int, k: int, parts: int) -> tuple[int, int]:
    """(start, length) of chunk ``k`` of ``n`` items cut in ``parts`` as ``torch.chunk``
    and DTensor's ``Shard`` cut them: chunks of ceil(n / parts), the last ones shorter or
    empty (FlatParam cuts a parameter's rows over dp the same way)."""
    c = -(-n // parts) if n else 0
    start = min(k * c, n)
    return start, max(0, min(c, n - start))


@dataclass(frozen=True)
class TpSpec:
    """A tensor-parallel parameter's place on the tp mesh, and its global shape."""

    mesh: Any  # the 1-D tp DeviceMesh
    placement: Any  # Shard(d) or Replicate()
    shape: torch.Size
    stride: tuple[int, ...]

    @property
    def sharded(self) -> bool:
        return self.placement.is_shard()


def localize(model: nn.Module, tp_mesh: Any, *, frozen: bool) -> dict[nn.Parameter, TpSpec]:
    """Replace every DTensor parameter by a plain parameter over its local piece, in every
    module that holds it (tied ones stay tied); return their specs by the new parameter.
    See [Note: tensor-parallel parameters]. Frozen ones too if ``frozen``
    (stage 3 buckets them); stages 1-2 leave them out of buckets, DTensors as they are."""
    from torch.distributed.tensor import DTensor

    specs: dict[nn.Parameter, TpSpec] = {}
    new_of: dict[DTensor, nn.Parameter] = {}
    for mname, module in model.named_modules():
        for attr, p in list(module._parameters.items()):
            if not isinstance(p, DTensor) or not (frozen or p.requires_grad):
                continue
            name = f"{mname}.{attr}" if mname else attr
            if p not in new_of:
                _check_tp_param(name, p, tp_mesh)
                local = nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
                new_of[p] = local
                specs[local] = TpSpec(p.device_mesh, p.placements[0], p.shape, p.stride())
            module._parameters[attr] = new_of[p]
    return specs


def _check_tp_param(name: str, p: Any, tp_mesh: Any) -> None:
    if p.device_mesh != tp_mesh:
        raise ValueError(
            f"parameter {name!r} is a DTensor on mesh {p.device_mesh} (dims "
            f"{p.device_mesh.mesh_dim_names}), not on the tp dimension of the mesh passed to "
            "shard(): parallelize the model with parallelize_module(model, mesh['tp'], plan) "
            "on that same mesh")
    placement = p.placements[0]
    if not (placement.is_shard() or placement.is_replicate()):
        raise ValueError(
            f"parameter {name!r} has tp placement {placement}; zeroshard shards parameters "
            "placed Shard(d) or Replicate() on the tp mesh (torch's parallel styles give "
            "those)")
    if placement.is_shard():
        n, t = p.shape[placement.dim], tp_mesh.size()
        if not chunk_range(n, t - 1, t)[1]:  # torch.chunk leaves the last tp rank nothing
            raise ValueError(
                f"parameter {name!r}: its dim {placement.dim} of size {n} split over tp={t} "
                f"(chunks of {-(-n // t)}) leaves tp rank {t - 1} no piece; zeroshard needs every tp "
                "rank to hold part of each tp-sharded parameter. Use a tp or a size for which "
                f"ceil({n}/tp) * (tp - 1) < {n} (e.g. a tp dividing {n})")


class TensorParallel:
    """The tp side of an engine: the parameters' tp specs, the mesh the user parameters
    live on, and the faces forward computes with."""

    def __init__(self, mesh: Any, specs: dict[nn.Parameter, TpSpec], tp_comm: Any) -> None:
        self.mesh = mesh  # the whole mesh (dp dims, then "tp")
        self.tp_mesh = mesh["tp"]
        self.size = self.tp_mesh.size()
        self.rank = self.tp_mesh.get_local_rank()
        self.specs = specs  # compute parameter -> TpSpec
        self.comm = tp_comm  # a Comm over the tp group (norms, flags)
        # Checkpoints (state/layout.py) are written and read by the (shard, tp) ranks of
        # one replica together.
        # (Not DeviceMesh._flatten: flattening meshes of the same dimension names twice in a
        # process broke later DTensor collectives.) Every rank creates every replica's group.
        hybrid = len(mesh.mesh_dim_names) == 3
        self.replica = mesh["replicate"].get_local_rank() if hybrid else 0
        for r, sub in enumerate(mesh.mesh if hybrid else [mesh.mesh]):
            ranks = sub.flatten().tolist()
            group = dist.new_group(ranks)
            if r == self.replica:
                self.ckpt_group, self.ckpt_peers = group, ranks
        # Every rank of the mesh: replicas wait on it for replica 0's save.
        self.span_group = dist.new_group(mesh.mesh.flatten().tolist()) if hybrid else None

    def spec(self, param: torch.Tensor) -> TpSpec | None:
        return self.specs.get(param)

    def placements(self, param: torch.Tensor, dp: tuple) -> tuple:
        """The user parameter's placements on the whole mesh."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.placement_types import _StridedShard

        spec = self.spec(param)
        if spec is None:  # not parallelised: the same on every tp rank
            return (*dp, Replicate())
        if spec.placement.is_shard(0):  # dp splits the tp piece's rows again
            dp = tuple(_StridedShard(0, split_factor=self.size) if q.is_shard() else q
                       for q in dp)
        return (*dp, spec.placement)

    def global_shape(self, param: torch.Tensor) -> torch.Size:
        spec = self.spec(param)
        return param.shape if spec is None else spec.shape

    def local_piece(self, param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """This tp rank's piece of a whole tensor shaped like ``param``'s global shape
        (``torch.chunk``, as DTensor's ``Shard`` cuts)."""
        spec = self.spec(param)
        if spec is None or not spec.sharded:
            return whole
        dim = spec.placement.dim
        return whole.narrow(dim, *chunk_range(whole.shape[dim], self.rank, self.size))

    def whole(self, param: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
        """The whole tensor of which ``piece`` is this tp rank's (collective over tp for
        a sharded parameter; every tp rank must call it, in the same order)."""
        from torch.distributed.tensor import DTensor

        spec = self.spec(param)
        if spec is None or not spec.sharded:
            return piece
        dt = DTensor.from_local(piece, spec.mesh, (spec.placement,), run_check=False,
                                shape=spec.shape, stride=spec.stride)
        return dt.full_tensor()

    def counted_once(self, param: torch.Tensor) -> bool:
        """Does this rank count ``param``'s elements in a global sum over tp? Sharded
        pieces on every tp rank; replicated ones on tp rank 0 only."""
        spec = self.spec(param)
        return (spec is not None and spec.sharded) or self.rank == 0

    def make_faces(self, params: list[nn.Parameter]) -> None:
        """One DTensor leaf per tensor-parallel compute parameter, over the same memory
        (see [Note: tensor-parallel parameters]); built once, after the buckets are."""
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        self.faces: dict[nn.Parameter, nn.Parameter] = {}
        for p in params:
            spec = self.specs.get(p)
            if spec is None:
                continue
            dspec = DTensorSpec(spec.mesh, (spec.placement,),
                                tensor_meta=TensorMeta(spec.shape, spec.stride, p.dtype))
            self.faces[p] = nn.Parameter(dtensor(p.detach(), dspec),
                                             requires_grad=p.requires_grad)

    def face(self, param: nn.Parameter) -> nn.Parameter:
        """What the modules hold in forward and backward for a tensor-parallel parameter."""
        return self.faces[param]

    def local_grads(self, leaves: list[torch.Tensor], unit: str) -> list[torch.Tensor | None]:
        """Faces' gradients as their local pieces', other leaves' as they are. A gradient
        whose placement differs from its face's is brought to it first: a
        sequence-parallel norm's ``Partial`` gradient is summed over tp here, as FSDP2
        does before its reduce-scatter, all of ``leaves``' in one all-reduce on the tp
        group (zeroshard's ledger records it); any other change by DTensor's
        ``redistribute``. Every tp rank must call it with the same leaves in the same
        order (stage 3: a unit's; stages 1-2 cut buckets apart on tp ranks, so one leaf
        a call as its gradient arrives)."""
        out: list[torch.Tensor | None] = []
        summed: list[int] = []
        for leaf in leaves:
            g = leaf.grad
            if g is None or not hasattr(g, "_local_tensor"):
                out.append(g)
            elif tuple(g.placements) == tuple(leaf.placements):
                out.append(g._local_tensor)  # not to_local(): an autograd op per parameter
            elif _summed_over_tp(g.placements[0], leaf.placements[0]):
                summed.append(len(out))
                out.append(g._local_tensor)
            else:
                local = g.redistribute(placements=leaf.placements)._local_tensor
                wait = getattr(local, "wait", None)  # an async collective's result
                out.append(wait() if callable(wait) else local)
        if summed:
            parts = [out[i] for i in summed]
            flat = torch.cat([t.reshape(-1) for t in parts])
            # Unchecked (see [Note: divergence] in comm_check.py): its tp peers share this
            # rank's data and dp schedule, and torch's tp collectives on the same group (the
            # plan's, dozens a step, unchecked) pin the order down. Checking these cost 1%
            # of a dp 2 x tp 2 llama-small step (measured interleaved, 1270 vs 1257 ms).
            self.comm.all_reduce(flat, phase="backward", unit=unit, checked=False)
            for i, t, v in zip(summed, parts, flat.split([t.numel() for t in parts])):
                if leaves[i].grad.placements[0].reduce_op == "avg":
                    v.div_(self.size)
                out[i] = v.view_as(t)
        return out


def _summed_over_tp(have: Any, want: Any) -> bool:
    """A ``Partial`` sum (or mean) to be made ``Replicate``: one all-reduce."""
    return (have.is_partial() and want.is_replicate()
            and getattr(have, "reduce_op", None) in ("sum", "avg"))


@torch.no_grad()
def sync_over_tp(model: nn.Module, tp_comm: Any) -> None:
    """Every tp rank starts from tp rank 0's parameters that are not tensor-parallel
    (outside the plan) and buffers, as the dp ranks start from dp rank 0's (buffers.py):
    zeroshard's start-up broadcast runs over the dp dimensions only. Tensor-parallel
    parameters were placed by ``distribute_tensor`` from one rank already."""
    from torch.distributed.tensor import DTensor

    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if isinstance(t, DTensor):
            continue
        data = t.data if t.is_contiguous() else t.data.contiguous()
        tp_comm.broadcast(data, 0, phase="init", unit=f"tp {name}")
        if data is not t.data:
            t.data.copy_(data)


def tp_comms(ledger: Any, mesh: Any, stage: int) -> tuple[Any, Any, Any, Any]:
    """(shard, replicate, dp world, tp) communicators for a mesh with a "tp" dimension:
    ("dp", "tp"), or ("replicate", "shard", "tp") for hybrid sharding."""
    from ..comm import Comm

    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if names not in (("dp", "tp"), ("replicate", "shard", "tp")):
        raise ValueError(
            f"a mesh with a tp dimension must have dims ('dp', 'tp') or ('replicate', "
            f"'shard', 'tp'), got {names}; build it with init_device_mesh(device, (dp, tp), "
            "mesh_dim_names=('dp', 'tp'))")
    if stage == 0:
        raise ValueError(
            "tensor parallelism composes with stages 1, 2 and 3 (stage 0 shards nothing "
            "and keeps a whole replica per rank); pick stage=1, 2 or 3")
    tp = Comm(mesh.get_group("tp"), ledger, label="tp")
    if names == ("dp", "tp"):
        dp = Comm(mesh.get_group("dp"), ledger, label="dp")
        return dp, None, dp, tp
    shard = Comm(mesh.get_group("shard"), ledger, label="shard")
    replicate = Comm(mesh.get_group("replicate"), ledger, label="replicate")
    dp_world = mesh["replicate", "shard"]._flatten("dp_world").get_group()
    return shard, replicate, Comm(dp_world, ledger, label="dp"), tp


def is_tp_mesh(mesh: Any) -> bool:
    return mesh is not None and "tp" in (getattr(mesh, "mesh_dim_names", None) or ())
