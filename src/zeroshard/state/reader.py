"""Reading a checkpoint's DCP files without running code from them, and with errors that
name the damaged file.

[Note: what loading trusts]
DCP stores tensors with ``torch.save`` and reads them with ``torch.load(weights_only=True)``
(no code execution). Its index, ``.metadata``, is a plain ``pickle``, and ``pickle.load``
can call any importable function. :class:`SafeReader` therefore reads ``.metadata`` with
an unpickler that can construct only DCP's metadata dataclasses, ``torch.Size``, dtypes and
paths (:data:`_ALLOWED`), after checking the file's size and CRC-32 against the JSON
manifest. It then checks every file name the metadata refers to (plain names inside the
checkpoint directory: no ``..``, no absolute paths) and every byte range (inside the
file). Before reading, each file this rank's load plan touches is checked against the
manifest (size, and CRC-32 unless ``verify=False``), so a truncated or bit-flipped shard
is reported by name instead of surfacing as a garbled tensor or a zip error.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .manifest import CheckpointError, check_name, verify_file

__all__ = ["SafeReader", "dcp_errors"]

_METADATA = ".metadata"
_DCP_META = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, set[str]] = {
    _DCP_META: {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def load_metadata(directory: Path, manifest: dict[str, Any]) -> Metadata:
    """Verify and safely unpickle ``.metadata``; check every file name and range in it."""
    files = manifest.get("files", {})
    if _METADATA not in files:
        raise CheckpointError(f"{str(directory)!r}: the manifest lists no {_METADATA}")
    verify_file(directory, _METADATA, files[_METADATA], crc=True)
    path = directory / _METADATA
    try:
        metadata = _RestrictedUnpickler(io.BytesIO(path.read_bytes())).load()
    except Exception as e:
        raise CheckpointError(f"checkpoint file {str(path)!r} cannot be read safely: {e}; "
                              "the checkpoint is damaged or not written by zeroshard") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"checkpoint file {str(path)!r} holds no DCP metadata")
    for index, info in metadata.storage_data.items():
        name = getattr(info, "relative_path", None)
        check_name(directory, name)
        record = files.get(name)
        if record is None:
            raise CheckpointError(f"{str(path)!r} refers to {name!r}, which the manifest "
                                  "does not list; the checkpoint is inconsistent")
        off, length = getattr(info, "offset", -1), getattr(info, "length", -1)
        if not (isinstance(off, int) and isinstance(length, int) and off >= 0 and length >= 0
                and off + length <= record["bytes"]):
            raise CheckpointError(f"{str(path)!r}: {index.fqn!r} lies outside {name!r} "
                                  f"(offset {off}, length {length}, file {record['bytes']} B)")
    return metadata


class SafeReader(FileSystemReader):
    """A DCP ``FileSystemReader`` with the checks of [Note: what loading trusts]."""

    def __init__(self, directory: str | Path, manifest: dict[str, Any], *,
                 verify: bool = True) -> None:
        super().__init__(directory)
        self.directory = Path(directory)
        self.manifest = manifest
        self.verify = verify
        self._metadata: Metadata | None = None
        self._verified: set[str] = set()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = load_metadata(self.directory, self.manifest)
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan, planner):  # type: ignore[override]
        names = sorted({self.storage_data[item.storage_index].relative_path
                        for item in plan.items})
        files = self.manifest["files"]
        for name in names:
            if name not in self._verified:
                verify_file(self.directory, name, files[name], crc=self.verify)
                self._verified.add(name)
        try:
            return super().read_data(plan, planner)
        except CheckpointError:
            raise
        except Exception as e:
            which = ", ".join(repr(str(self.directory / n)) for n in names)
            raise CheckpointError(f"reading checkpoint file(s) {which} failed: "
                                  f"{type(e).__name__}: {e}") from e


@contextmanager
def dcp_errors(what: str) -> Iterator[None]:
    """Turn DCP's ``CheckpointException`` (a ``BaseException`` bundling every rank's
    failure) into a :class:`CheckpointError`: ours unchanged (it names the file), others
    prefixed with ``what`` and the rank that failed first."""
    try:
        yield
    except CheckpointException as e:
        failures = sorted(e.failures.items())
        for _, (exc, _) in failures:
            if isinstance(exc, CheckpointError):
                raise CheckpointError(str(exc)) from None
        rank, (exc, _) = failures[0] if failures else (-1, (e, None))
        raise CheckpointError(f"{what}: rank {rank}: {type(exc).__name__}: {exc}") from e
