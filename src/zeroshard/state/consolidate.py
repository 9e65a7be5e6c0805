"""Reading a checkpoint in one process, and ``zeroshard consolidate`` to one safetensors file.

[Note: streaming consolidation]
DeepSpeed's ``zero_to_fp32`` loads every rank's whole optimizer shard to rebuild the
weights, so its host memory grows with the optimizer state (users report > 1 TB at 80B).
Here the weights are stored per parameter (``model.<name>``) apart from the optimizer
state, so consolidation reads one parameter at a time — DCP in a single process
(``no_dist=True``) asks for one key and reads only the stored chunks of that key — and
appends its bytes to the output. The safetensors header (names, dtypes, shapes, byte
offsets) is computed from the manifest before any tensor is read, so the file is written
front to back. Peak host memory: the largest parameter (in the output dtype) plus its
largest stored chunk, on top of the interpreter and torch; never the optimizer state.

Tied weights (``tok_emb.weight`` / ``head.weight``) are written under both names, so
``model.load_state_dict(safetensors.torch.load_file(out))`` works with ``strict=True``;
the metadata entry ``zeroshard.tied`` records which names alias which.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from .layout import model_key, optim_key, quiet
from .manifest import CheckpointError, latest_checkpoint, read_manifest
from .reader import SafeReader, dcp_errors

__all__ = ["CheckpointReader", "ConsolidateReport", "consolidate", "run"]

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
              torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_OUT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class CheckpointReader:
    """Single-process access to a checkpoint, one tensor at a time (no process group).

    ``keys()`` are the model's ``state_dict`` keys; ``tensor(key)`` reads one whole weight
    or buffer, ``optimizer_state(name, key)`` one whole per-element optimizer state.
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool = True) -> None:
        path = Path(path)
        if not (path / "zeroshard.json").is_file() and latest_checkpoint(path) is not None:
            path = latest_checkpoint(path)  # a training run's directory: its latest
        self.path = path
        self.manifest = read_manifest(path)
        self._reader = SafeReader(path, self.manifest, verify=verify)
        self._meta = self._reader.read_metadata()
        self.params = {p["name"]: p for p in self.manifest["params"]}
        self.buffers = {b["name"]: b for b in self.manifest["buffers"]}
        self.alias_of = {a: p["name"] for p in self.manifest["params"] for a in p["aliases"]}

    def keys(self) -> list[str]:
        return list(self.manifest["state_dict_keys"])

    def spec(self, key: str) -> tuple[str, tuple[int, ...], torch.dtype]:
        """(DCP key, shape, stored dtype) of a state_dict key."""
        name = self.alias_of.get(key, key)
        entry = self.params.get(name) or self.buffers.get(name)
        if entry is None:
            raise KeyError(f"{key!r} is not in checkpoint {str(self.path)!r}; keys: "
                           f"{', '.join(self.keys()[:8])}, ...")
        return model_key(name), tuple(entry["shape"]), getattr(torch, entry["dtype"])

    def read(self, dcp_key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        md = self._meta.state_dict_metadata.get(dcp_key)
        if md is None:
            raise CheckpointError(f"{dcp_key!r} is not stored in {str(self.path)!r}")
        target = torch.empty(tuple(md.size), dtype=dtype)
        with quiet(), dcp_errors(f"reading {dcp_key!r} from {str(self.path)!r} failed"):  # also DCP's "assuming the intent is to load in a single process"
            dcp.load({dcp_key: target}, storage_reader=self._reader, no_dist=True)
        return target.view(shape)

    def tensor(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole weight/buffer ``key``, in ``dtype`` (floating only) or as stored."""
        dcp_key, shape, stored = self.spec(key)
        return self.read(dcp_key, shape, dtype if dtype and stored.is_floating_point else stored)

    def optimizer_state(self, name: str, key: str) -> torch.Tensor:
        """The whole optimizer state tensor ``key`` of parameter ``name``: per-element
        state (shaped like the parameter) or a whole-parameter optimizer's (any shape:
        Adafactor's row and column factors)."""
        name = self.alias_of.get(name, name)
        dcp_key = optim_key(name, key)
        md = self._meta.state_dict_metadata.get(dcp_key)
        if md is None:
            raise KeyError(f"no optimizer state {key!r} for {name!r} in {str(self.path)!r}")
        record = ((self.manifest.get("optimizer") or {}).get("params") or {}).get(name, {})
        shape = md.size if record.get("whole") else self.params[name]["shape"]
        return self.read(dcp_key, tuple(shape), md.properties.dtype)


@dataclass(frozen=True)
class ConsolidateReport:
    out: Path
    tensors: int
    bytes: int
    seconds: float
    largest_tensor_bytes: int
    peak_rss_bytes: int  # this process's peak resident set so far (ru_maxrss)


def _header(reader: CheckpointReader, dtype: torch.dtype) -> tuple[bytes, list]:
    plan, offset, header = [], 0, {}
    for key in reader.keys():
        _, shape, stored = reader.spec(key)
        out = dtype if stored.is_floating_point else stored
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=out).element_size()
        header[key] = {"dtype": _ST_DTYPES[out], "shape": list(shape),
                       "data_offsets": [offset, offset + n]}
        plan.append((key, out, n))
        offset += n
    tied = {a: n for a, n in reader.alias_of.items()}
    header["__metadata__"] = {"format": "pt", "zeroshard.tied": json.dumps(tied),
                              "zeroshard.checkpoint": str(reader.path)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8-byte alignment
    return struct.pack("<Q", len(raw)) + raw, plan


def consolidate(checkpoint: str | os.PathLike, out: str | os.PathLike, *,
                dtype: str = "fp32", verify: bool = True) -> ConsolidateReport:
    """Write the checkpoint's full weights to the safetensors file ``out``, streaming.

    Keys are those of the model's ``state_dict()``; floating tensors are cast to
    ``dtype`` (``fp32``, ``bf16`` or ``fp16``). See [Note: streaming consolidation].
    """
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype={dtype!r}; use one of {', '.join(_OUT_DTYPES)}")
    t0 = time.perf_counter()
    reader = CheckpointReader(checkpoint, verify=verify)
    head, plan = _header(reader, _OUT_DTYPES[dtype])
    out = Path(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    total = 0
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            for key, out_dtype, n in plan:
                t = reader.tensor(key, out_dtype).contiguous().reshape(-1)
                f.write(memoryview(t.view(torch.uint8).numpy()))
                total += n
                del t
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return ConsolidateReport(
        out=out, tensors=len(plan), bytes=total, seconds=time.perf_counter() - t0,
        largest_tensor_bytes=max((n for _, _, n in plan), default=0),
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def run(args: argparse.Namespace) -> int:
    from zeroshard.errors import UsageError

    try:
        r = consolidate(args.checkpoint, args.out, dtype=args.dtype, verify=not args.no_verify)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    mib = 2**20
    print(f"wrote {r.out}: {r.tensors} tensors, {r.bytes / mib:.1f} MiB ({args.dtype}) in "
          f"{r.seconds:.1f} s; largest tensor {r.largest_tensor_bytes / mib:.1f} MiB, peak "
          f"RSS {r.peak_rss_bytes / mib:.0f} MiB")
    return 0

