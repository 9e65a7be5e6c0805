"""``model.state_dict()`` and ``model.load_state_dict()`` of a sharded model: DDP's answer.

[Note: model state dicts]
``state_dict()`` returns the keys, shapes and values the unsharded model's would: every
parameter whole, in its original dtype (fp32 master weights under mixed precision — the
values being trained, which is what a user reloads), buffers as they are.

* Where this rank holds every parameter whole in its original dtype — stage 0, and
  stages 1-2 without mixed precision — the values are copies of the weights on their
  device, one tensor per parameter (tied names share one): no communication, so calling
  it on one rank is fine. Not views, as under DDP: zeroshard's weights are views of flat
  buffers, and tensors sharing one storage are refused by safetensors' ``load_model``
  (Accelerate's ``load_state``); the copy costs the weights' bytes once, transiently.
* Otherwise (stages 1-2 under mixed precision, stage 3) the other ranks' shards are
  read from them ([Note: state dicts served] in shard_server.py: one rank may call it
  alone) or, under NCCL or tensor parallelism, gathered in a collective every rank must
  call (one rank alone: an error on every rank, see [Note: divergence] in comm_check.py).
  Either way buckets come one at a time (a stage-3 bucket is one unit) and each
  parameter is copied to the CPU, so the device never holds more than its shards plus
  one gathered bucket (in the master dtype).

``load_state_dict(full)`` copies each rank's piece of every parameter into its master
weights and compute weights at any stage, from any full state dict (the model's, a
plain model's, a zeroshard one from another stage or world size), with torch's
``strict`` / missing / unexpected-key behaviour; no communication. Every rank loads.
The sharded, communication-free form for checkpoints is ``zeroshard.save_checkpoint``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from .shard_server import WEIGHTS
from .sharded_state import load_local, local_if_ours, sharded_values

if TYPE_CHECKING:
    from .engine import Engine
    from .flat import FlatBucket

__all__ = ["model_state_dict", "load_model_state_dict", "needs_collective"]


def needs_collective(engine: Engine) -> bool:
    """Whether whole original-dtype weights must be gathered (see the Note)."""
    return engine.policy.shard_params or (
        engine.policy.shard_optimizer and engine.faces.swap)  # masters apart: gather them


def check_outside_forward(engine: Engine, what: str) -> None:
    """Refuse ``what`` while stage-3 units are gathered (inside forward, or before its
    backward finished)."""
    busy = [u.name for u in engine.schedule.in_use()]
    if busy:
        raise RuntimeError(
            f"{what} was called while units {busy} are gathered (inside forward or "
            "before backward finished); call it between training steps")


def _extract(b: FlatBucket, gathered: torch.Tensor, i: int, dtype: torch.dtype) -> torch.Tensor:
    """Slot ``i``'s whole parameter out of a gathered-layout tensor, into a new CPU tensor."""
    s = b.slots[i]
    out = torch.empty(s.numel, dtype=dtype, device="cpu")
    g = gathered.view(b.world, b.shard_numel)
    for q in range(b.world):
        lo, hi = s.piece(q)
        if hi > lo:
            out[lo:hi].copy_(g[q, s.shard_offset : s.shard_offset + hi - lo])
    return out.view(s.shape)


@torch.no_grad()
def _values(engine: Engine, keep_vars: bool) -> dict[str, torch.Tensor]:
    """Every bucketed parameter's whole value, by each of its names: read from the peers
    where they serve it ([Note: state dicts served] in shard_server.py), else gathered."""
    if needs_collective(engine) and engine.server is not None:
        with engine.server.session(engine, "model.state_dict()") as fetch:
            return _values_from(engine, keep_vars,
                                lambda b, shard: fetch.gathered(b, shard, WEIGHTS))
    return _values_from(engine, keep_vars, None)


def _values_from(engine: Engine, keep_vars: bool, read: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    gather = needs_collective(engine)
    if gather and read is None:
        engine.world.sync_point("state_dict")
    for b in engine.all_buckets:
        if not gather:
            src = b.master if not engine.policy.shard_optimizer else b.full
            for i, s in enumerate(b.slots):
                user = s.user
                # A copy per parameter, on its device: views of one flat buffer would
                # share its storage, which safetensors' load_model (Accelerate's
                # load_state) refuses ("None is covering the entire storage").
                v = user if keep_vars else b.slot_view(src.detach(), i).clone()
                out.update(dict.fromkeys(s.names, v))
            continue
        shard = (b.master if b.master is not None else b.shard16).detach()
        if read is not None:
            gathered = read(b, shard)
        else:
            gathered = torch.empty(b.padded_numel, dtype=shard.dtype, device=b.device)
            engine.comm.all_gather_into(gathered, shard.to(b.device), phase="state",
                                        unit=b.name)
        for i, s in enumerate(b.slots):
            v = _extract(b, gathered, i, engine.orig_dtype.get(s.names[0], shard.dtype))
            if engine.tp is not None:  # the tp pieces joined: the same slots, in order,
                v = engine.tp.whole(s.param, v)  # on every tp rank
            out.update(dict.fromkeys(s.names, v))
        del gathered
    return out


def model_state_dict(model: nn.Module, engine: Engine, *, destination: Any = None,
                     prefix: str = "", keep_vars: bool = False,
                     sharded: bool = False) -> dict[str, Any]:
    """See [Note: model state dicts]; ``sharded``: torch's DCP API's answer ([Note: sharded
    state dicts for torch's DCP API])."""
    check_outside_forward(engine, "model.state_dict()")
    if sharded:
        values = sharded_values(engine)
    else:
        engine.refresh_handed_out("model.state_dict() after dcp.load")
        values = _values(engine, keep_vars)
    if destination is None:
        destination = OrderedDict()
        destination._metadata = OrderedDict()  # type: ignore[attr-defined]
    before = set(destination)
    nn.Module.state_dict(model, destination=destination, prefix=prefix, keep_vars=True)
    for key in [k for k in destination if k not in before]:
        name = key[len(prefix):]
        if name in values:
            destination[key] = values[name]
        elif name in engine.orig_dtype and not keep_vars:  # a frozen parameter, stages 0-2
            v = destination[key].detach()
            if hasattr(v, "full_tensor"):  # a frozen tp parameter: its whole value
                v = v.full_tensor()
            destination[key] = v.to(engine.orig_dtype[name])
        elif not keep_vars and isinstance(destination[key], torch.Tensor):
            destination[key] = destination[key].detach()
    return destination


def _full(t: Any, key: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"state_dict[{key!r}] is a {type(t).__name__}, not a tensor")
    if hasattr(t, "full_tensor"):  # a DTensor: its whole value (collective)
        t = t.full_tensor()
    return t.detach()


def load_model_state_dict(model: nn.Module, engine: Engine, state_dict: Any,
                          strict: bool = True, assign: bool = False) -> _IncompatibleKeys:
    """See [Note: model state dicts]; a change to the shards ([Note: the state clock])."""
    with engine.loading("load_state_dict"):
        return _load(model, engine, state_dict, strict, assign)


@torch.no_grad()
def _load(model: nn.Module, engine: Engine, state_dict: Any, strict: bool,
          assign: bool) -> _IncompatibleKeys:
    if assign:
        raise NotImplementedError(
            "load_state_dict(assign=True) would replace the sharded parameters; zeroshard "
            "copies values into its buffers: call load_state_dict(state_dict) without assign")
    if not isinstance(state_dict, dict):
        raise TypeError(f"expected a dict of tensors (model.state_dict()), got "
                        f"{type(state_dict).__name__}")
    check_outside_forward(engine, "model.load_state_dict()")
    expected = list(nn.Module.state_dict(model, keep_vars=True))
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in set(expected)]
    errors = []
    slots = [(b, i, s) for b in engine.all_buckets for i, s in enumerate(b.slots)]
    named = [(n, b, i, s) for b, i, s in slots for n in s.names]
    for n, _b, _i, s in named:
        shape = engine.tp.global_shape(s.param) if engine.tp is not None else s.shape
        if n in state_dict and isinstance(state_dict[n], torch.Tensor) and (
                tuple(state_dict[n].shape) != tuple(shape)):
            errors.append(f"size mismatch for {n}: copying a param with shape "
                          f"{tuple(state_dict[n].shape)} from checkpoint, the shape in current "
                          f"model is {tuple(shape)}.")
    if strict:
        if missing:
            errors.insert(0, "Missing key(s) in state_dict: "
                          + ", ".join(f'"{k}"' for k in missing) + ". ")
        if unexpected:
            errors.insert(0, "Unexpected key(s) in state_dict: "
                          + ", ".join(f'"{k}"' for k in unexpected) + ". ")
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__}:\n\t"
                           + "\n\t".join(errors))
    rows: list[FlatBucket] = []  # buckets loaded from DTensor shards laid out as ours
    for b, i, s in slots:
        key = next((n for n in s.names if n in state_dict), None)
        if key is not None:
            local = local_if_ours(state_dict[key], s.spec, s.local_shape(b.rank))
            if local is not None:  # torch's DCP API, sharded: no communication
                load_local(b, i, local)
                if b not in rows:
                    rows.append(b)
                continue
            t = _full(state_dict[key], key)
            if engine.tp is not None:  # this tp rank's piece, then its dp piece
                t = engine.tp.local_piece(s.param, t)
            _load_slot(engine, b, i, t)
    # The compute weights of the rows loaded: every rank's rows at stages 1-2 (a
    # collective: torch's set_state_dict runs on every rank), the 16-bit copy at stage 3.
    trainable = [b for b in engine.buckets if b in rows]
    if trainable:
        engine.refresh_weights(phase="load", buckets=trainable)
    # Resident stage-3 units ([Note: resident units] in stage3.py) hold the old values.
    engine.schedule.drop_stale(engine.all_buckets)
    bucketed = {n for n, *_ in named}
    rest = {k: v for k, v in state_dict.items() if k not in bucketed}
    if engine.tp is not None:  # frozen tp parameters (stages 1-2) stay DTensors
        rest = _tp_frozen(model, rest)
    nn.Module.load_state_dict(model, rest, strict=False)
    return _IncompatibleKeys(missing, unexpected)


def _load_slot(engine: Engine, b: FlatBucket, i: int, t: torch.Tensor) -> None:
    """This rank's piece of a whole value -> the master and the compute weights."""
    s = b.slots[i]
    flat = t.reshape(-1)
    if not engine.policy.shard_optimizer:  # stage 0: whole
        targets = [b.slot_view(b.master.detach(), i), b.slot_view(b.full, i)]
        src = t
    else:
        lo, hi = s.piece(b.rank)
        src = flat[lo:hi]
        piece = slice(s.shard_offset, s.shard_offset + hi - lo)
        targets = [] if b.master is None else [b.master.detach()[piece].view(-1)]
        if engine.policy.shard_params:
            targets.append(b.shard16[piece])
        else:
            targets = [*targets, b.slot_view(b.full, i)]
    done: list[torch.Tensor] = []
    for dst in targets:
        if any(engine._same_memory(dst, d) for d in done):
            continue
        if dst.shape == src.shape:
            dst.copy_(src)
        else:  # the whole compute view at stages 1-2
            dst.copy_(t)
        done.append(dst)


def _tp_frozen(model: nn.Module, rest: dict[str, Any]) -> dict[str, Any]:
    """Whole values of frozen tp parameters copied into their DTensors' local pieces
    (nn.Module's load would copy a whole tensor into a DTensor); the rest as given."""
    from torch.distributed.tensor import distribute_tensor

    params = dict(nn.Module.named_parameters(model, remove_duplicate=False))
    out = {}
    for k, v in rest.items():
        p = params.get(k)
        if p is not None and hasattr(p, "full_tensor") and not hasattr(v, "full_tensor"):
            local = distribute_tensor(_full(v, k).to(p.dtype), p.device_mesh, p.placements,
                                      src_data_rank=None)
            p.detach().to_local().copy_(local.to_local())
            continue
        out[k] = v
    return out
