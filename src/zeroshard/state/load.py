"""``load_checkpoint``: each rank asks the checkpoint for exactly the pieces it owns now.

Any world size and any stage can load any checkpoint (see [Note: checkpoint layout]):
the targets handed to DCP are views into this rank's *current* buffers — DTensors over
its slice of each master bucket and of each optimizer state tensor (stages >= 1) or the
whole buffers (stage 0) — so bytes land in place, with no whole-model staging copy.
Version-1 checkpoints (flattened pieces) load through ``layout.read_v1``. Afterwards the
compute weights are re-derived from the masters (cast; stages 1-2 all-gather them, as
after an optimizer step), then scalar optimizer state, hyperparameters, the loss scaler
and RNG states are restored, and the caller's ``extra`` is returned.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ..api import engine_of
from ..engine.chunks import bucket_state, set_bucket_state
from ..engine.engine import Engine
from ..engine.units import UnitState
from ..engine.whole_state import load_whole_state
from . import rng
from .compat import check_model, check_optimizer
from .layout import (
    ParamEntry,
    bucket_view,
    checkpoint_group,
    model_key,
    one_optimizer,
    optim_key,
    param_entries,
    read_v1,
    weights_view,
)
from .manifest import CheckpointError, read_manifest
from .reader import SafeReader, dcp_errors
from .residuals import install_residuals, residual_targets

__all__ = ["load_checkpoint"]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint manifest")
    return dtype


def _prepare_optim(engine: Engine, entries: list[ParamEntry], inner: torch.optim.Optimizer,
                   info: dict[str, Any], path: Path) -> tuple[dict[str, Any], list]:
    """Create/keep each bucket's state tensors; return DCP targets and scalar fix-ups."""
    states = info["params"]
    by_bucket: dict[int, list[ParamEntry]] = {}
    for e in entries:
        if e.trainable:
            by_bucket.setdefault(id(e.bucket), []).append(e)
    targets: dict[str, Any] = {}
    scalars: list[tuple[dict[str, Any], dict[str, Any], torch.Tensor, dict]] = []
    for b in engine.buckets:
        # parameters never stepped have no state (as in torch): their slots get none;
        # a whole-parameter optimizer's are loaded by _prepare_whole
        mine = [e for e in by_bucket.get(id(b), [])
                if e.name in states and not states[e.name].get("whole")]
        if not mine:  # saved before the first step, or none of these ever stepped
            set_bucket_state(inner.state, b, {})
            continue
        per_element = list(dict.fromkeys(k for e in mine for k in states[e.name]["per_element"]))
        old = bucket_state(inner.state, b)
        state = {}
        for k in per_element:
            t = old.get(k)
            ok = isinstance(t, torch.Tensor) and t.shape == (b.shard_numel,)
            state[k] = t if ok else torch.zeros(b.shard_numel, dtype=b.master_dtype,
                                                device=b.master_device)
        # the group of the bucket's chunks the inner optimizer steps (with a mixed
        # whole-parameter optimizer, some of its chunks belong to no inner group)
        group = next(g for g in inner.param_groups
                     if any(p is c for p in g["params"] for c in b.chunks))
        per_slot = {b.slots.index(e.slot): states[e.name]["scalars"] for e in mine}
        scalars.append((state, per_slot, b, group))
        for e in mine:
            for k in states[e.name]["per_element"]:
                targets[optim_key(e.name, k)] = bucket_view(engine, e, state[k])
    return targets, scalars


def _check_whole(info: dict[str, Any], whole: Any, path: Path) -> None:
    """The checkpoint's whole-parameter state fits this optimizer's whole parameters."""
    now = {s.names[0] for s in whole.owner} if whole is not None else set()
    saved = {n for n, rec in info["params"].items() if rec.get("whole")}
    flat = {n for n, rec in info["params"].items() if not rec.get("whole")}
    odd = sorted((saved - now) | (flat & now))
    if odd:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {len(odd)} parameter(s) were stepped whole when "
            f"saved and are not now, or the other way round, e.g. {odd[0]!r}; build the "
            "optimizer as when saving (the same class, groups and whole_params=), or pass "
            "optimizer=None to load only the weights")


def _prepare_whole(whole: Any, info: dict[str, Any], metadata: Any
                   ) -> tuple[dict[str, torch.Tensor], dict[Any, dict[str, Any] | None]]:
    """DCP targets for the state of the parameters this rank owns now (owners are
    re-assigned at each world size), and each one's state, filled once DCP has read."""
    targets: dict[str, torch.Tensor] = {}
    by_param: dict[Any, dict[str, Any] | None] = {}
    for s, t in whole.tensors.items():
        rec = info["params"].get(s.names[0])
        if rec is None or s.names[0] in info.get("unstepped", ()):
            by_param[s.user] = None
            continue
        state: dict[str, Any] = {}
        for k in rec["state_keys"]:
            if k in rec["tensors"]:
                md = metadata.state_dict_metadata[optim_key(s.names[0], k)]
                state[k] = targets[optim_key(s.names[0], k)] = torch.empty(
                    tuple(md.size), dtype=md.properties.dtype, device=t.device)
            else:
                v = rec["scalars"][k]
                state[k] = (torch.tensor(v["value"], dtype=_dtype(v["dtype"])).reshape(
                    v["shape"]) if "dtype" in v else v["value"])
        by_param[s.user] = state
    return targets, by_param


def _set_scalars(inner: torch.optim.Optimizer, fixups: list) -> None:
    """Scalar state from the manifest, per parameter, then every chunk its share
    (engine/chunks.py)."""
    for state, per_slot, b, group in fixups:
        on_device = bool(group.get("capturable") or group.get("fused"))
        dev = b.master_device if on_device else torch.device("cpu")
        scalars: list[dict[str, Any] | None] = [None] * len(b.slots)
        for i, scal in per_slot.items():
            scalars[i] = {k: torch.tensor(v["value"], dtype=_dtype(v["dtype"]), device=dev
                                          ).reshape(v["shape"]) if "dtype" in v else v["value"]
                          for k, v in scal.items()}
        set_bucket_state(inner.state, b, state, scalars)


def _set_groups(inner: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    for group, values in zip(inner.param_groups, saved):
        for k, v in values.items():
            cur = group.get(k)
            if isinstance(cur, torch.Tensor):
                cur.fill_(v)
            elif isinstance(cur, tuple) and isinstance(v, list):
                group[k] = tuple(v)
            else:
                group[k] = v


def _rebuild_extra(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return tensors[value["__tensor__"]]
        return {k: _rebuild_extra(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_rebuild_extra(v, tensors) for v in value]
    return value


def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, *,
                    verify: bool = True) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint`; collective. Returns ``extra``.

    ``model`` (and ``optimizer``, if given) must come from ``zeroshard.shard`` at any world
    size and stage. Weights, optimizer state and hyperparameters, the loss scaler and this
    rank's RNG states are restored in place. ``verify`` checks each file this rank reads
    against its CRC-32 (one extra read; ``False`` checks sizes only). A checkpoint of a
    different model raises :class:`CheckpointError` listing the mismatched names/shapes.
    """
    engine = engine_of(model)
    optimizer = one_optimizer(optimizer)
    path = Path(path)
    manifest = read_manifest(path)
    entries = param_entries(engine)
    check_model(manifest, entries, model, path)
    if any(u.state is not UnitState.SHARDED for u in engine.units):
        raise CheckpointError("load_checkpoint was called while stage-3 units are gathered "
                              "(inside forward/backward); load between steps")
    inner = getattr(optimizer, "optim", optimizer)
    info = (check_optimizer(manifest, entries, engine.group_of, inner, path)
            if inner is not None else None)
    reader = SafeReader(path, manifest, verify=verify)
    metadata = reader.read_metadata()
    sd: dict[str, Any] = {model_key(e.name): weights_view(engine, e) for e in entries}
    pnames = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for k, t in nn.Module.state_dict(model, keep_vars=True).items():
        if k not in pnames:
            sd[model_key(k)] = t.detach()
    fixups: list = []
    whole = getattr(optimizer, "whole", None)
    by_param: dict[Any, Any] = {}
    if info is not None:
        _check_whole(info, whole, path)
        targets, fixups = _prepare_optim(engine, entries, inner, info, path)
        sd.update(targets)
        if whole is not None:
            targets, by_param = _prepare_whole(whole, info, metadata)
            sd.update(targets)
    extra_keys = [k for k in metadata.state_dict_metadata if k.startswith("extra.")]
    rng_keys = [k for k in manifest["rng"]["rows"] if k in metadata.state_dict_metadata]
    loose: dict[str, torch.Tensor] = {}
    for k in extra_keys + rng_keys:
        md = metadata.state_dict_metadata[k]
        loose[k] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    sd.update(loose)
    residuals, res_slices = residual_targets(engine, manifest.get("qg_residuals") or [],
                                             str(path))
    sd.update(residuals)
    missing = sorted(k for k in sd if k not in metadata.state_dict_metadata)
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r}: .metadata lacks {missing[:8]} "
                              "which the manifest promises; the checkpoint is damaged")
    group, rank = checkpoint_group(engine)[:2]
    what = f"loading {str(path)!r} failed"
    if manifest["version"] == 1:  # flattened pieces: each parameter's whole, then its piece
        shapes = {model_key(e.name): e.shape for e in entries}
        shapes.update((optim_key(e.name, k), e.shape) for e in entries if info is not None
                      for k in info["params"].get(e.name, {}).get("per_element", ()))
        with dcp_errors(what):
            read_v1(reader, metadata, {k: sd.pop(k) for k in list(sd) if k in shapes}, shapes)
    with dcp_errors(what):
        dcp.load(sd, storage_reader=reader, process_group=group)
    engine.refresh_weights(phase="state")
    install_residuals(engine, res_slices, str(path))
    if info is not None:
        _set_scalars(inner, fixups)
        if whole is not None:
            load_whole_state(whole, inner, by_param)
            # the same on every rank (whole_state_view): whether anything was stepped
            whole.started = any(rec.get("whole") for rec in info["params"].values())
        _set_groups(inner, info["param_groups"])
        if optimizer is not inner:  # the user's groups, which the next step copies inward
            _set_groups(optimizer, info["param_groups"])
    scaler = manifest.get("loss_scaler") or {}
    if engine.scaler.enabled and scaler.get("enabled"):
        engine.scaler.load_state_dict(scaler)
    rng.restore({k: loose[k] for k in rng_keys}, rank)
    return _rebuild_extra(manifest.get("extra") or {}, loose)
