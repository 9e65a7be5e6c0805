"""torch's DCP state-dict API answered as FSDP2 answers it: DTensor shards, no copies.

[Note: sharded state dicts for torch's DCP API]
``torch.distributed.checkpoint.state_dict.get_model_state_dict`` (and
``get_optimizer_state_dict``, ``get_state_dict``) call ``model.state_dict()`` and
``optimizer.state_dict()``. A script written for DDP calls the same methods on rank 0
and ``torch.save``s the result, so those keep DDP's answer (whole tensors: [Note: model
state dicts], [Note: torch-format optimizer state]) — except when torch's DCP API is the
caller, which is told apart by the calling frame's module
(``torch.distributed.checkpoint.state_dict``; torch is pinned, and
tests/test_dcp_sharded.py fails if that ever stops holding). Then, at stages 1-3:

* each parameter is a ``DTensor`` with ``Shard(0)`` (``(Replicate(), Shard(0))`` on a
  hybrid mesh) whose local tensor is this rank's rows of the fp32 master weights — a
  view, FSDP2's layout (``torch.chunk`` rows: the last ranks may hold fewer or none);
* each per-element optimizer state entry (AdamW's moments) likewise, a view of this
  rank's flat state; scalars (``step``) are copies, as the whole form has them;
* buffers and frozen parameters (stages 1-2) as they are; stage 0 gives DDP's whole
  parameters, views of the weights as DDP's are (nothing is sharded there).

No tensor data moves (the ledger records no collective) and nothing is copied: DCP writes
each rank's 1/N. ``StateDictOptions(full_state_dict=True, cpu_offload=True)`` goes
through torch's own gathering, one tensor at a time, kept on rank 0 only.

Loading accepts both forms (``load_model_state_dict`` / ``load_torch_state_dict``): a
DTensor laid out as ours is copied from its local tensor (skipped where it is our own
view), another one is made whole first. ``dcp.load`` into the views writes the masters
in place, so the compute weights derived from them (16-bit copies, stage 1-2's whole
rows of other ranks) are stale until re-derived: the buckets handed out are watched
(``WeightRefresh.watch``) and re-derived before the next forward if their masters
changed — ``set_state_dict`` after ``dcp.load`` (torch's recipe) is then a copy onto
itself.

Under tensor parallelism (stages 1-3) the placements are the user parameter's on the
whole mesh (the dp placements, then the tp one: [Note: tensor-parallel parameters]), so a
rank's local tensor is its dp rows of its tp piece, FSDP2 + TP's layout
(``_StridedShard`` where both split dim 0).

A whole-parameter optimizer's state (Muon's, Adafactor's: [Note: whole-parameter
updates] in whole.py) lives whole on each parameter's owner, which no DTensor placement
describes. To the default options each rank answers its own parameters' entries as plain
tensors (views: ``dcp.load`` writes them in place) and an empty entry for each parameter
another rank owns (torch's strict ``set_optimizer_state_dict`` wants a key per
parameter): DCP writes every entry once, by its owner, and at any world size each owner
reads its own. To ``full_state_dict=True`` — which would take a plain tensor as whole and
miss the entries held elsewhere — they are gathered from the owners, as before.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch

from .dtensors import dtensor_at_zero

if TYPE_CHECKING:
    from .engine import Engine
    from .flat import FlatBucket

__all__ = ["called_by_dcp_api", "dcp_request", "master_view", "sharded_values",
           "dcp_spec", "local_if_ours", "load_local"]

_DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict"


def called_by_dcp_api(depth: int = 2) -> bool:
    """Is the caller ``depth`` frames up torch's DCP state-dict module?"""
    return dcp_request(depth + 1) is not None


def dcp_request(depth: int = 2) -> str | None:
    """What torch's DCP API asks of the caller ``depth`` frames up: None (it is not the
    DCP API), ``"full"`` (``full_state_dict=True``: it gathers what it gets) or
    ``"sharded"`` (the default options). Read from its ``info`` (``_StateDictInfo``),
    an argument of torch's ``_get_optim_state_dict`` (torch is pinned; the tests fail if
    that changes)."""
    try:
        frame = sys._getframe(depth)
    except ValueError:
        return None
    if frame.f_globals.get("__name__") != _DCP_STATE_DICT:
        return None
    return "full" if getattr(frame.f_locals.get("info"), "full_state_dict", False) else "sharded"


def dcp_spec(s: Any, dtype: torch.dtype | None = None) -> Any:
    """The DTensor spec of slot ``s``'s entries for torch's DCP API (in ``dtype`` if
    given), or None where they are plain tensors (stage 0)."""
    from .dtensors import make_spec

    spec = s.spec
    if spec is None or dtype is None or spec.tensor_meta.dtype == dtype:
        return spec
    return make_spec(spec.mesh, spec.placements, spec.tensor_meta.shape, dtype)


def master_view(b: FlatBucket, i: int) -> torch.Tensor:
    """Slot ``i``'s rows of this rank's master weights (frozen stage-3 buckets: the kept
    compute slice), shaped as its DTensor local: a view."""
    s = b.slots[i]
    if b.world == 1 or not s.spec:  # stage 0: the whole master (inside ``full`` in fp32)
        return b.slot_view((b.master if b.master is not None else b.full).detach(), i)
    if b.master is not None or b.shard16 is not None:
        weights = b.master if b.master is not None else b.shard16
        return b.local(weights.detach(), i)
    n = s.rows_of(b.rank) * s.row  # stages 1-2, fp32: the masters live inside ``full``
    if not n:
        return b.full.detach()[:0].view(s.local_shape(b.rank))
    return b.master_range(s.shard_offset, s.shard_offset + n).view(s.local_shape(b.rank))


def sharded_values(engine: Engine) -> dict[str, torch.Tensor]:
    """Every bucketed parameter, by each of its names, as torch's DCP API gets it: a
    DTensor view of this rank's rows (stage 0: a view of the whole parameter, as DDP's).
    The buckets are watched from now on (``WeightRefresh.watch``)."""
    values: dict[str, torch.Tensor] = {}
    sharded = engine.policy.shard_optimizer
    for b in engine.all_buckets:
        for i, s in enumerate(b.slots):
            view = master_view(b, i)
            values.update(dict.fromkeys(s.names, dtensor_at_zero(view, s.spec)
                                        if sharded else view))
    engine.weights.watch(engine.all_buckets)
    return values


def local_if_ours(t: Any, spec: Any, local_shape: torch.Size) -> torch.Tensor | None:
    """``t``'s local tensor if ``t`` is a DTensor laid out as ``spec`` (the same ranks,
    placements and global shape: this rank's rows of it), else None."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None or spec is None or not isinstance(t, module.DTensor):
        return None
    mesh = t.device_mesh
    if (tuple(t.placements) != tuple(spec.placements) or tuple(t.shape) != tuple(spec.shape)
            or mesh.device_type != spec.mesh.device_type
            or mesh.mesh.tolist() != spec.mesh.mesh.tolist()):
        return None
    local = t.to_local()
    return local if local.shape == local_shape else None


@torch.no_grad()
def load_local(b: FlatBucket, i: int, local: torch.Tensor) -> None:
    """This rank's rows of slot ``i`` -> its masters (the caller re-derives the compute
    weights); nothing to do where ``local`` is our own view (set_state_dict after
    dcp.load into a sharded state dict)."""
    dst = master_view(b, i)
    if dst.numel() and dst.data_ptr() != local.data_ptr():
        dst.copy_(local)
