"""``save_checkpoint``: every rank writes what it owns, rank 0 commits (see manifest.py).

What goes where (see [Note: checkpoint layout] in layout.py):

========================  ==============================================================
DCP tensors               ``model.<name>`` fp32 master weights, DTensors of the
                          parameter's shape, sharded by owner; ``optim.<name>.<key>``
                          per-element optimizer state, the same pieces;
                          ``model.<buffer>`` buffers and frozen parameters kept whole
                          (written once); ``rng.*`` one row per rank;
                          ``extra.<path>`` tensors found in ``extra``
``zeroshard.json``        names, shapes, dtypes, flat layout; optimizer class,
                          hyperparameters and scalar state (AdamW's ``step``) per
                          parameter; loss scaler; JSON part of ``extra``; file list
========================  ==============================================================
"""

from __future__ import annotations

import functools
import json
import os
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from .._version import __version__
from ..api import engine_of
from ..engine.chunks import bucket_state, slot_scalars
from ..engine.dtensors import dtensor_at_zero
from ..engine.engine import Engine
from . import rng
from .async_save import AsyncCheckpoint, stage, start, wait_pending, writer_group
from .crc_writer import ChecksummingWriter
from .layout import (
    ParamEntry,
    bucket_view,
    checkpoint_group,
    model_key,
    one_optimizer,
    optim_key,
    param_entries,
    rng_table,
    weights_view,
)
from .manifest import (
    FORMAT,
    VERSION,
    CheckpointError,
    commit,
    file_record,
    remove_stale,
    write_manifest,
)
from .reader import dcp_errors
from .residuals import collect_residuals

__all__ = ["save_checkpoint"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _per_element(state: dict[str, Any], numel: int) -> list[str]:
    return [k for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape == (numel,)]


def _scalars(state: dict[str, Any], numel: int, owner: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if k in _per_element(state, numel):
            continue
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            out[k] = {"value": v.item(), "dtype": _dtype_name(v.dtype), "shape": list(v.shape)}
        elif isinstance(v, (bool, int, float)):
            out[k] = {"value": v}
        else:
            raise CheckpointError(
                f"optimizer state {k!r} of {owner!r} is a {type(v).__name__} of shape "
                f"{getattr(v, 'shape', '?')}: neither per-element nor a scalar, so it cannot "
                "be resharded. zeroshard checkpoints elementwise optimizers (AdamW, Adam, SGD, ...)")
    return out


def _jsonable(value: Any, where: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` with tensors moved into ``tensors`` (as ``{"__tensor__": key}``)."""
    if isinstance(value, torch.Tensor):
        key = f"extra.{where}"
        tensors[key] = value.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise TypeError(f"extra{where and '.' + where}: key {k!r} is not a str; "
                                "checkpoint extra must be a JSON-like dict with str keys")
        return {k: _jsonable(v, f"{where}.{k}" if where else k, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, f"{where}.{i}", tensors) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"extra.{where} is a {type(value).__name__}; checkpoint extra holds JSON "
                    "values (dict, list, str, int, float, bool, None) and tensors only")


def _groups_json(optim: torch.optim.Optimizer) -> list[dict[str, Any]]:
    groups = []
    for g in optim.param_groups:
        out: dict[str, Any] = {}
        for k, v in g.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if v is None or isinstance(v, (bool, int, float, str)):
                out[k] = v
            elif isinstance(v, (tuple, list)) and all(
                    x is None or isinstance(x, (int, float)) for x in v):  # Adafactor's eps
                out[k] = list(v)
        groups.append(out)
    return groups


def _group_params(engine: Engine, optim: torch.optim.Optimizer) -> list[list[str]] | None:
    """Names of each group's parameters, in the group's order (None if ``optim`` does not
    hold the model's parameters, e.g. the inner optimizer over zeroshard's chunks)."""
    first: dict[int, str] = {}
    for name, p in engine.user_params_by_name().items():
        first.setdefault(id(p), name)
    try:
        return [[first[id(p)] for p in g["params"]] for g in optim.param_groups]
    except KeyError:
        return None


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optim", optimizer)


def _collect(engine: Engine, model: nn.Module, optim: torch.optim.Optimizer | None,
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(DCP state dict of what this rank writes, the layout part of the manifest)."""
    sd: dict[str, Any] = {}
    params, optim_params, unstepped = [], {}, []
    inner = _inner(optim) if optim is not None else None
    whole = getattr(optim, "whole", None) if optim is not None else None
    whole_slots = set(whole.owner) if whole is not None else set()
    for e in param_entries(engine):
        info: dict[str, Any] = {"name": e.name, "aliases": list(e.aliases), "shape": list(e.shape),
                                "trainable": e.trainable, "offset": e.offset,
                                "bucket": e.bucket.name if e.bucket is not None else None}
        sd[model_key(e.name)], info["dtype"] = _weights(engine, e)
        params.append(info)
        if inner is None or not e.trainable or e.slot in whole_slots:
            continue  # (a whole-parameter optimizer's parameters: _whole_state, below)
        numel = e.bucket.shard_numel
        state = bucket_state(inner.state, e.bucket)
        own = slot_scalars(inner.state, e.bucket, e.bucket.slots.index(e.slot))
        if not state or own is None:  # never stepped: no state, as in torch
            unstepped.append(e.name)
            continue
        keys = _per_element(state, numel)
        optim_params[e.name] = {"state_keys": [*own, *keys], "per_element": keys,
                                "scalars": _scalars(own, numel, e.name)}
        for k in keys:
            sd[optim_key(e.name, k)] = bucket_view(engine, e, state[k])
    if whole is not None:
        records, tensors = _whole_state(engine, whole, inner)
        sd.update(tensors)
        for e in param_entries(engine):
            if e.slot in whole_slots:
                if e.name in records:
                    optim_params[e.name] = records[e.name]
                else:
                    unstepped.append(e.name)
    pnames = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    buffers = []
    # Buffers may differ across ranks (BatchNorm without SyncBatchNorm, between two
    # broadcasts): the checkpoint holds rank 0's, which a DDP user saves. Written by every
    # rank, DCP kept whichever copy its deduplication picked (rank 1's, seen).
    _, ckpt_rank, _, _, writes = checkpoint_group(engine)
    for key, t in nn.Module.state_dict(model, keep_vars=True).items():
        if key not in pnames:
            if ckpt_rank == 0 and writes:
                sd[model_key(key)] = t.detach()
            buffers.append({"name": key, "shape": list(t.shape), "dtype": _dtype_name(t.dtype)})
    layout = {
        "params": params, "buffers": buffers,
        "state_dict_keys": list(nn.Module.state_dict(model, keep_vars=True).keys()),
        "buckets": [{"name": b.name, "numel": b.numel, "padded_numel": b.padded_numel,
                     "shard_numel": b.shard_numel, "trainable": b.requires_grad}
                    for b in engine.all_buckets],
        "optimizer": None if inner is None else {
            "class": f"{type(inner).__module__}.{type(inner).__qualname__}",
            # several optimizers (engine/composite.py): each one's class, in order
            **({"parts": [f"{type(p).__module__}.{type(p).__qualname__}"
                          for p in inner.parts],
                "part_groups": [len(p.param_groups) for p in inner.parts]}
               if hasattr(inner, "parts") else {}),
            # the hyperparameters the user's groups hold now (an LR scheduler sets those;
            # the inner optimizer's catch up at the next step)
            "param_groups": _groups_json(optim), "params": optim_params,
            # each group's parameters in the optimizer's order: torch's numbering
            # (integrations/lightning_checkpoint.py writes torch's format from it)
            "group_params": _group_params(engine, optim),
            # trainable, but never stepped when saved (no gradient yet): no state, as in
            # torch (empty when nothing was stepped at all: "params" is empty then)
            "unstepped": unstepped if optim_params else [],
            # which group each trainable parameter is in (param_groups=; 0: the default)
            "group_of": {e.name: engine.group_of.get(e.name, 0)
                         for e in param_entries(engine) if e.trainable}},
    }
    return sd, layout


def _whole_state(engine: Engine, whole: Any, inner: torch.optim.Optimizer
                 ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A whole-parameter optimizer's state (see [Note: whole-parameter updates]): each
    owner writes its parameters' state tensors whole, as plain tensors under
    ``optim.<name>.<key>`` (DCP keeps the one copy, so a load at another world size reads
    them whatever rank now owns them); every rank learns every parameter's record (keys
    and scalars) for the manifest: one small all-gather per save."""
    records: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for s, t in whole.tensors.items():
        st = inner.state.get(t)
        if not st:  # never stepped, as in torch
            continue
        name = s.names[0]
        big = [k for k, v in st.items() if isinstance(v, torch.Tensor) and v.numel() > 1]
        records[name] = {"whole": True, "state_keys": list(st), "per_element": [],
                         "tensors": big, "scalars": _scalars(
                             {k: v for k, v in st.items() if k not in big}, -1, name)}
        tensors.update((optim_key(name, k), st[k].detach()) for k in big)
    group, _, size, _, _ = checkpoint_group(engine)
    if size > 1:
        parts: list[Any] = [None] * size
        dist.all_gather_object(parts, records, group=group)
        for part in parts:
            records.update(part)
    return records, tensors


def _weights(engine: Engine, e: ParamEntry) -> tuple[Any, str]:
    """What DCP writes for a parameter's weights, and its dtype name."""
    t = weights_view(engine, e)
    return t, _dtype_name(t.dtype)


def _rng_tables(engine: Engine) -> tuple[dict[str, Any], dict[str, list]]:
    """Each generator state as a ``[world, L]`` table whose row r is rank r's (rng.py);
    r is the rank in the checkpoint group (layout.checkpoint_group)."""
    states = rng.capture()
    return ({k: rng_table(engine, v) for k, v in states.items()}, rng.row_lengths(states))


def _agree_tmp(path: Path, engine: Engine) -> Path:
    group, rank, size, peers, _ = checkpoint_group(engine)
    name = [None]
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(path)
        name[0] = f"{path.name}.tmp-{uuid.uuid4().hex[:12]}"
        (path.parent / name[0]).mkdir()
    if size > 1:
        dist.broadcast_object_list(name, src=peers[0], group=group)
    return path.parent / str(name[0])


def save_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    extra: dict[str, Any] | None = None, *, async_save: bool = False,
                    pin_memory: bool | None = None, process_group: Any = None,
                    keep_staging: bool = True) -> Path | AsyncCheckpoint:
    """Save a sharded checkpoint to the directory ``path``; collective (every rank calls).

    Each rank writes only what it owns: its pieces of the fp32 master weights and of the
    per-element optimizer state (DTensors, as FSDP2's), its RNG states; buffers and frozen parameters are
    written once. ``extra`` is a JSON-like dict (tensors allowed) that must be the same on
    every rank — typically ``{"step": step, "data": loader.state_dict()}`` — and is what
    :func:`load_checkpoint` returns. The checkpoint appears at ``path`` only once complete
    (see [Note: atomic checkpoints]); an existing ``path`` is replaced. Returns ``path``.

    ``async_save=True`` returns once this rank's share is copied to host memory (pinned
    on CUDA unless ``pin_memory=False``) and writes it on a thread, on a process group of
    its own (``process_group``: yours, never the default one); training may go on. It
    returns an :class:`~zeroshard.state.async_save.AsyncCheckpoint`: ``wait()`` gives the
    path once committed (or raises the write's error), ``done()`` polls. See [Note:
    asynchronous checkpoints]. A later save waits for the one in flight. The host copy
    is kept for the next asynchronous save of this model, which copies into it (~10x
    faster than into new memory); ``keep_staging=False`` frees it after the write ([Note:
    the staging copy is kept]).
    """
    engine = engine_of(model)
    optimizer = one_optimizer(optimizer)
    path = Path(path)
    wait_pending(engine)  # one save in flight at a time
    t0 = time.perf_counter()
    extra_tensors: dict[str, torch.Tensor] = {}
    extra_json = _jsonable(dict(extra or {}), "", extra_tensors)
    writes = checkpoint_group(engine)[4]
    if async_save:
        group, span = writer_group(engine, process_group)  # first: refusals before anything
        _check_same_extra(engine, extra_json, extra_tensors)
        write: Any = _nothing
        if writes:
            sd, layout, tmp = _prepare(path, engine, model, optimizer, extra_tensors)
            staged = stage(engine, sd, pin_memory, keep_staging)
            del sd
            write = functools.partial(_write, path, engine, staged, layout, tmp, extra_json,
                                      t0, group)
        return start(engine, path, functools.partial(
            _replica_0_writes, path, write, None if span is None else (span, torch.device("cpu"))))
    _check_same_extra(engine, extra_json, extra_tensors)

    def write_now() -> None:
        sd, layout, tmp = _prepare(path, engine, model, optimizer, extra_tensors)
        sd = {k: _own_storage(v) for k, v in sd.items()}
        _write(path, engine, sd, layout, tmp, extra_json, t0)

    span = None if engine.replicate is None else (_model_group(engine), engine.device)
    _replica_0_writes(path, write_now if writes else _nothing, span)
    return path


def _nothing() -> None:
    """What a replica other than replica 0 writes (hybrid sharding): nothing."""


def _replica_0_writes(path: Path, write: Any, span: tuple[Any, torch.device] | None) -> Path:
    """Run ``write`` (nothing on the replicas that do not write); with replicas (hybrid
    sharding: replica 0 writes the pieces all of them hold) every rank then learns how
    replica 0's write went, by one all-reduce of a failure flag on ``span`` (group,
    device), and raises if it failed."""
    failed: BaseException | None = None
    try:
        write()
    except BaseException as exc:  # noqa: BLE001 - re-raised below, on every rank
        failed = exc
    if span is not None:
        flag = torch.tensor([float(failed is not None)], device=span[1])
        dist.all_reduce(flag, group=span[0])
        if failed is None and flag.item() > 0:
            raise CheckpointError(f"saving {str(path)!r} failed on replica 0 (its ranks raised "
                                  "the cause); nothing was committed")
    if failed is not None:
        raise failed
    return path


def _digest(extra_json: Any, tensors: dict[str, torch.Tensor]) -> int:
    crc = zlib.crc32(json.dumps(extra_json, sort_keys=True).encode())
    for k in sorted(tensors):
        t = tensors[k]
        crc = zlib.crc32(f"{k}:{t.dtype}:{tuple(t.shape)}".encode(), crc)
        crc = zlib.crc32(t.reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc


def _check_same_extra(engine: Engine, extra_json: Any, tensors: dict[str, torch.Tensor]) -> None:
    """``extra`` is written once (rank 0's) and every rank gets it back: one that differs
    across ranks would come back as rank 0's everywhere, silently. Checked before anything
    is written (one small all-gather of a CRC per save), on every rank alike."""
    group = _model_group(engine)
    size = dist.get_world_size(group)
    if size == 1:
        return
    digests: list[Any] = [None] * size
    dist.all_gather_object(digests, _digest(extra_json, tensors), group=group)
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    if odd:
        raise CheckpointError(
            f"save_checkpoint: extra differs across ranks (rank(s) {odd} hold another value "
            "than rank 0); it is written once and every rank would load rank 0's. Pass what "
            "is the same everywhere (step, the data loader's global state), and keep "
            "per-rank values out of extra (RNG states are saved per rank already)")


def _model_group(engine: Engine):
    """The group of every rank of the model: with hybrid sharding its replicas too, under
    tensor parallelism its (shard, tp) ranks (None: the default group, which
    ``engine.world`` often is)."""
    tp = engine.tp
    if tp is None:
        return engine.world.group
    return tp.span_group if tp.span_group is not None else tp.ckpt_group



def _prepare(path: Path, engine: Engine, model: nn.Module,
             optimizer: torch.optim.Optimizer | None, extra_tensors: dict[str, torch.Tensor]
             ) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """The collective part of a save, on the training thread: what this rank writes (views
    of its buffers), the manifest's layout, and the temporary directory."""
    sd, layout = _collect(engine, model, optimizer)
    residuals, layout["qg_residuals"] = collect_residuals(engine)  # collective
    sd.update(residuals)
    rng_sd, rng_rows = _rng_tables(engine)
    sd.update(rng_sd)
    sd.update(extra_tensors)
    layout["rng"] = {"world_size": checkpoint_group(engine)[2], "rows": rng_rows}
    return sd, layout, _agree_tmp(path, engine)


def _own_storage(t: Any) -> Any:
    """``t`` (or a DTensor's piece) as an alias whose storage is exactly its bytes: a slice
    of its buffer's storage, which keeps the buffer alive. DCP's writer clones a tensor
    whose storage is larger (torch.save would write the whole storage), and ours are
    views into flat buffers: a copy of every piece, one at a time, for nothing."""
    local = t.to_local() if hasattr(t, "to_local") else t
    if not isinstance(local, torch.Tensor) or not local.is_contiguous() or (
            local.untyped_storage().size() == local.nbytes) or local.device.type != "cpu":
        return t
    lo = local.storage_offset() * local.element_size()
    alias = torch.empty(0, dtype=local.dtype).set_(
        local.untyped_storage()[lo:lo + local.nbytes], 0, local.shape, local.stride())
    return dtensor_at_zero(alias, t._spec) if local is not t else alias


def _write(path: Path, engine: Engine, sd: dict[str, Any], layout: dict[str, Any],
           tmp: Path, extra_json: Any, t0: float, group: Any = None) -> None:
    """One replica's ranks write ``sd`` into ``tmp`` together and rank 0 of them commits
    it as ``path``. Every collective runs on ``group`` (default: the checkpoint group):
    an asynchronous save passes its own (async_save.py)."""
    ckpt_group, rank, size, _, _ = checkpoint_group(engine)
    group = ckpt_group if group is None else group
    what = (f"saving {str(path)!r} failed, nothing was committed (the previous "
            "checkpoints are intact)")
    writer = ChecksummingWriter(tmp, sync_files=True)
    with dcp_errors(what):
        dcp.save(sd, storage_writer=writer, process_group=group)
    # each file's size and CRC as written ([Note: checksums while writing]), or read back
    mine = {p.name: writer.records.get(p.name) or file_record(p) for p in tmp.iterdir()
            if p.name.startswith(f"__{rank}_")}
    gathered: list[Any] = [mine]
    if size > 1:
        gathered = [None] * size
        dist.all_gather_object(gathered, mine, group=group)
    if rank == 0:
        files: dict[str, dict[str, int]] = {}
        for part in gathered:
            files.update(part)
        for p in sorted(tmp.iterdir()):
            if p.name not in files and p.is_file():
                files[p.name] = writer.records.get(p.name) or file_record(p)
        manifest = {
            "format": FORMAT, "version": VERSION, "zeroshard": __version__,
            "torch": torch.__version__, "world_size": size,
            "stage": engine.policy.stage, "mixed_precision": engine.config.mixed_precision,
            **({"tp": engine.tp.size} if engine.tp is not None else {}),
            **layout, "loss_scaler": {"enabled": engine.scaler.enabled,
                                      **engine.scaler.state_dict()},
            "extra": extra_json, "write_seconds": round(time.perf_counter() - t0, 3),
            "files": files,
        }
        write_manifest(tmp, manifest)
        commit(tmp, path)
    if size > 1:  # every writer returns once the checkpoint is committed
        dist.barrier(group=group)
