"""Optimizer state in torch's format: what ``torch.optim.AdamW`` over the unsharded model
would hold, built from (and loaded into) this rank's flat, sharded state.

[Note: torch-format optimizer state]
``ShardedOptimizer.state_dict()`` returns ``{"state": {i: {key: value}}, "param_groups":
[...]}`` exactly as torch's optimizer over the same groups would: parameters numbered in
group order, per-element state whole and shaped like its parameter (fp32, on the CPU),
scalar state (AdamW's ``step``) per parameter. At stages >= 1 each bucket's state is read
from the other ranks ([Note: state dicts served] in shard_server.py; a collective under
NCCL, tensor parallelism or a whole-parameter optimizer), one bucket and one key at a
time, and moved to the CPU parameter by parameter. ``load_state_dict`` takes the same format — from zeroshard at
any stage and world size, or from a plain torch optimizer — and keeps only this rank's
chunk of each parameter: no communication.

Scalars are per chunk in the engine and a chunk never spans two parameters
(engine/chunks.py), so each parameter keeps its own (AdamW's ``step`` lags where torch
skipped the parameter for want of a gradient), and a parameter torch never stepped has
no entry, here as in torch.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from .chunks import bucket_state, set_bucket_state, slot_scalars
from .sharded_state import dcp_spec, local_if_ours
from .sources import full_of
from .whole import WholeUpdates
from .whole_state import load_whole_state, whole_state_dict, whole_state_local

if TYPE_CHECKING:
    from .engine import Engine
    from .flat import FlatBucket

__all__ = ["torch_state_dict", "load_torch_state_dict", "state_view"]


def _numbering(groups: list[dict[str, Any]]
               ) -> tuple[list[dict[str, Any]], dict[torch.Tensor, int]]:
    index: dict[torch.Tensor, int] = {}
    packed = []
    for g in groups:
        p = {k: v for k, v in g.items() if k != "params"}
        p["params"] = [index.setdefault(q, len(index)) for q in g["params"]]
        packed.append(p)
    return packed, index


def _per_element(state: dict[str, Any], b: FlatBucket) -> list[str]:
    return [k for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape == (b.shard_numel,)]


@torch.no_grad()
def torch_state_dict(engine: Engine, inner: torch.optim.Optimizer,
                     groups: list[dict[str, Any]], whole: WholeUpdates | None = None,
                     sharded: bool = False, served: int | None = None,
                     whole_local: bool = False) -> dict[str, Any]:
    """See [Note: torch-format optimizer state]; a whole-parameter optimizer's entries
    come from their owners (whole_state.py). ``sharded``: per-element entries are DTensor
    views of this rank's state, nothing gathered ([Note: sharded state dicts for torch's
    DCP API]); with ``whole_local`` the whole-parameter entries too are this rank's own
    (views; empty for the parameters others own). ``served``: the optimizer's kind at its
    server — the peers' state is read from them, not gathered ([Note: state dicts served]
    in shard_server.py)."""
    if served is None:
        return _torch_state_dict(engine, inner, groups, whole, sharded, None, whole_local)
    with engine.server.session(engine, "optimizer.state_dict()") as fetch:
        return _torch_state_dict(
            engine, inner, groups, whole, sharded,
            lambda b, local, key: fetch.gathered(b, local, served, key), whole_local)


def _torch_state_dict(engine: Engine, inner: torch.optim.Optimizer,
                      groups: list[dict[str, Any]], whole: WholeUpdates | None,
                      sharded: bool, read: Any, whole_local: bool = False) -> dict[str, Any]:
    packed, index = _numbering(groups)
    state: dict[int, dict[str, Any]] = {}
    for b in engine.buckets:
        bstate = bucket_state(inner.state, b)
        if not bstate:
            continue
        keys = _per_element(bstate, b)
        if sharded:
            _sharded_entries(engine, inner, b, bstate, keys, index, state)
            continue
        gathered = {k: (bstate[k].detach() if not engine.policy.shard_optimizer
                        else engine.gather_shard(b, bstate[k].detach(), phase="state")
                        if read is None else full_of(b, read(b, bstate[k], k)))
                    for k in keys}
        for i, s in enumerate(b.slots):
            scalars = slot_scalars(inner.state, b, i)
            if s.user not in index or engine.group_of.get(s.names[0], 0) < 0 or (
                    scalars is None):  # never stepped: torch has no entry either
                continue
            entry: dict[str, Any] = {}
            for k, v in scalars.items():  # torch's key order: scalars (step) first
                entry[k] = v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
            for k in keys:
                v = b.slot_view(gathered[k], i)
                if engine.tp is not None:  # tp pieces joined, slot by slot on every rank
                    v = engine.tp.whole(s.param, v)
                entry[k] = v.to("cpu", copy=True)
            state[index[s.user]] = entry
        del gathered
    if whole is not None and sharded and whole_local:  # this rank's own, as they are
        state.update(whole_state_local(whole, inner, index))
    elif whole is not None:  # the whole-parameter groups' entries, from their owners
        state.update(whole_state_dict(whole, inner, index, engine.device))
    return {"state": dict(sorted(state.items())), "param_groups": packed}


def _sharded_entries(engine: Engine, inner: torch.optim.Optimizer, b: FlatBucket,
                     bstate: dict[str, Any], keys: list[str], index: dict[torch.Tensor, int],
                     state: dict[int, dict[str, Any]]) -> None:
    """This bucket's entries as DTensor views of this rank's flat state (stage 0: whole
    views, as torch's optimizer holds them; no copy, no collective); scalars copied, as the
    whole form has them."""
    from .dtensors import dtensor_at_zero

    for i, s in enumerate(b.slots):
        scalars = slot_scalars(inner.state, b, i)
        if s.user not in index or engine.group_of.get(s.names[0], 0) < 0 or scalars is None:
            continue
        entry: dict[str, Any] = {k: v.detach().clone() if torch.is_tensor(v) else v
                                 for k, v in scalars.items()}
        for k in keys:
            # stage 0: the whole state, as torch's
            local = (b.local(bstate[k].detach(), i) if engine.policy.shard_optimizer
                     else b.slot_view(bstate[k].detach(), i))
            spec = dcp_spec(s, local.dtype)
            entry[k] = dtensor_at_zero(local, spec) if spec is not None else local
        state[index[s.user]] = entry


def _check_groups(saved: list[dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    if len(saved) != len(groups):
        raise ValueError(f"loaded optimizer state has {len(saved)} parameter group(s), this "
                         f"optimizer has {len(groups)}; build it with the same groups")
    for i, (s, g) in enumerate(zip(saved, groups)):
        if len(s["params"]) != len(g["params"]):
            raise ValueError(f"param_groups[{i}] of the loaded state holds "
                             f"{len(s['params'])} parameters, this optimizer's "
                             f"{len(g['params'])}; build it over the same parameters in the "
                             "same order")


@torch.no_grad()
def load_torch_state_dict(engine: Engine, inner: torch.optim.Optimizer,
                          groups: list[dict[str, Any]], sd: dict[str, Any],
                          whole: WholeUpdates | None = None) -> None:
    """Load a torch-format state dict (see [Note: torch-format optimizer state])."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError(
            "optimizer.load_state_dict() takes torch's format, a dict with 'state' and "
            f"'param_groups' (what optimizer.state_dict() returns); got keys "
            f"{sorted(sd) if isinstance(sd, dict) else type(sd).__name__}")
    saved = sd["param_groups"]
    _check_groups(saved, groups)
    by_param: dict[torch.Tensor, Any] = {}
    for s, g in zip(saved, groups):
        for idx, p in zip(s["params"], g["params"]):
            by_param[p] = sd["state"].get(idx)
        for k, v in s.items():
            if k != "params":
                g[k] = copy.deepcopy(v)
    held_whole = set(whole.owner) if whole is not None else set()
    for b in engine.buckets:  # the whole-parameter groups' state: on its owners, below
        _load_bucket(engine, inner, b, by_param, held_whole)
    if whole is not None:
        load_whole_state(whole, inner, by_param)


def _is_per_element(k: str, v: Any, shape: torch.Size) -> bool:
    """Shaped like its parameter (AdamW's moments) rather than a scalar (its ``step``;
    a 0-dim parameter's moments are told apart from its step by name, as torch's
    optimizers all call it ``step``)."""
    return torch.is_tensor(v) and tuple(v.shape) == tuple(shape) and not (
        v.dim() == 0 and k == "step")


def _load_bucket(engine: Engine, inner: torch.optim.Optimizer, b: FlatBucket,
                 by_param: dict[torch.Tensor, Any], held_whole: set) -> None:
    values: dict[str, Any] = {}
    scalars: list[dict[str, Any] | None] = []
    group = _inner_group(inner, b)
    on_device = bool(group and (group.get("capturable") or group.get("fused")))
    for s in b.slots:
        st = by_param.get(s.user) if s not in held_whole else None
        if not st:  # never stepped: no state, as in torch
            scalars.append(None)
            continue
        own: dict[str, Any] = {}
        shape = engine.tp.global_shape(s.param) if engine.tp is not None else s.shape
        for k, v in st.items():
            if not _is_per_element(k, v, shape):
                if torch.is_tensor(v):  # a scalar: each chunk its own copy
                    dev = b.master_device if on_device else torch.device("cpu")
                    v = v.detach().clone().to(dev)
                own[k] = v
                continue
            if k not in values:
                values[k] = torch.zeros(b.shard_numel, dtype=b.master_dtype,
                                        device=b.master_device)
            lo, hi = s.piece(b.rank)
            dst = values[k][s.shard_offset : s.shard_offset + hi - lo]
            local = local_if_ours(v, s.spec, s.local_shape(b.rank))
            if local is not None:  # a shard laid out as ours (torch's DCP API, sharded)
                dst.copy_(local.reshape(-1))
                continue
            if hasattr(v, "full_tensor"):  # another DTensor layout: whole first
                v = v.full_tensor()
            if engine.tp is not None:  # this tp rank's piece first
                v = engine.tp.local_piece(s.param, v)
            dst.copy_(v.detach().reshape(-1)[lo:hi])
        scalars.append(own)
    if all(x is None for x in scalars):
        set_bucket_state(inner.state, b, {})
        return
    set_bucket_state(inner.state, b, values, scalars)


def _inner_group(inner: torch.optim.Optimizer, b: FlatBucket) -> dict[str, Any] | None:
    chunks = set(b.chunks)
    return next((g for g in inner.param_groups if any(p in chunks for p in g["params"])), None)


def state_view(engine: Engine, inner: torch.optim.Optimizer) -> dict[Any, dict[str, Any]]:
    """``optimizer.state`` as torch keys it — by parameter — for this rank's shard:
    per-element state as views shaped like the parameter's local piece (DTensors at
    stages >= 1, whole tensors at stage 0), scalars as they are. Read-only in spirit:
    writes into the views change the state; assigning new entries does nothing."""
    from .dtensors import dtensor

    out: dict[Any, dict[str, Any]] = {}
    for b in engine.buckets:
        bstate = bucket_state(inner.state, b)
        if not bstate:
            continue
        keys = _per_element(bstate, b)
        for i, s in enumerate(b.slots):
            scalars = slot_scalars(inner.state, b, i)
            if engine.group_of.get(s.names[0], 0) < 0 or scalars is None:
                continue
            entry: dict[str, Any] = dict(scalars)
            for k in keys:
                v = bstate[k]
                if engine.policy.shard_optimizer:
                    local = b.local(v.detach(), i)
                    spec = s.spec
                    entry[k] = dtensor(local, spec) if local.dtype == spec.tensor_meta.dtype \
                        else local
                else:
                    entry[k] = b.slot_view(v.detach(), i)
            out[s.user] = entry
    return out
