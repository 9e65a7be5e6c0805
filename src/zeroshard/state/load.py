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
from . import rng
from .compat import check_model, check_optimizer
from .layout import (
    ParamEntry,
    bucket_view,
    checkpoint_group,
    model_key,
    optim_key,
    param_entries,
    read_v1,
    refuse_whole,
    weights_view,
)
from .manifest import CheckpointError, read_manifest
from .reader import SafeReader, dcp_errors

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
        # parameters never stepped have no state (as in torch): their slots get none
        mine = [e for e in by_bucket.get(id(b), []) if e.name in states]
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
        group = next(g for g in inner.param_groups if any(p is b.chunks[0] for p in g["params"]))
        per_slot = {b.slots.index(e.slot): states[e.name]["scalars"] for e in mine}
        scalars.append((state, per_slot, b, group))
        for e in mine:
            for k in states[e.name]["per_element"]:
                targets[optim_key(e.name, k)] = bucket_view(engine, e, state[k])
    return targets, scalars


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
    refuse_whole(optimizer)
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
    if info is not None:
        targets, fixups = _prepare_optim(engine, entries, inner, info, path)
        sd.update(targets)
    extra_keys = [k for k in metadata.state_dict_metadata if k.startswith("extra.")]
    rng_keys = [k for k in manifest["rng"]["rows"] if k in metadata.state_dict_metadata]
    loose: dict[str, torch.Tensor] = {}
    for k in extra_keys + rng_keys:
        md = metadata.state_dict_metadata[k]
        loose[k] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    sd.update(loose)
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
    if info is not None:
        _set_scalars(inner, fixups)
        _set_groups(inner, info["param_groups"])
        if optimizer is not inner:  # the user's groups, which the next step copies inward
            _set_groups(optimizer, info["param_groups"])
    scaler = manifest.get("loss_scaler") or {}
    if engine.scaler.enabled and scaler.get("enabled"):
        engine.scaler.load_state_dict(scaler)
    rng.restore({k: loose[k] for k in rng_keys}, rank)
    return _rebuild_extra(manifest.get("extra") or {}, loose)
