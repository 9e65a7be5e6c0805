"""The checkpoint directory: its JSON manifest, file checksums and the atomic commit.

[Note: atomic checkpoints]
A checkpoint is a directory. It is written under a temporary name ``<path>.tmp-<id>``;
once every rank's files are on disk (fsynced) and rank 0 has written ``zeroshard.json``
— the manifest, listing every file with its size and CRC-32 — rank 0 renames the
directory to ``<path>`` (one ``rename``, atomic on POSIX filesystems) and fsyncs the
parent. So a directory named like a checkpoint is complete by construction; a crash at
any earlier point leaves only a ``*.tmp-*`` directory, which readers ignore and the next
save removes. :func:`latest_checkpoint` picks the newest complete ``step-<n>``.

The manifest is plain JSON (nothing in it is executable): the model's parameter names,
shapes, dtypes and flat layout, the optimizer's class, hyperparameters and scalar state,
the loss scaler, the caller's ``extra`` and the file list. CRC-32 detects accidental
damage (a truncated or bit-flipped shard), not tampering; what protects a loader from a
hostile checkpoint is that nothing in it is unpickled with code execution (see reader.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from .checksum import file_crc32

__all__ = [
    "CheckpointError", "MANIFEST", "FORMAT", "VERSION", "read_manifest", "write_manifest",
    "file_record", "commit", "latest_checkpoint", "step_dir", "remove_stale", "check_name",
    "prune",
]

MANIFEST = "zeroshard.json"
FORMAT = "zeroshard.checkpoint"
# 2: every tensor in its own shape, pieces as DTensors (layout.py); 1: flattened 1-D
# pieces (torch's deprecated sharded tensors), still read (layout.read_v1).
VERSION = 2
READS = (1, 2)
_STEP = re.compile(r"step-(\d+)")
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or does not fit the model."""


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """``<root>/step-<step>``, zero-padded so names sort by step."""
    return Path(root) / f"step-{step:08d}"


def check_name(directory: Path, name: str) -> Path:
    """``directory/name`` if ``name`` is a plain file name inside it, else an error.

    Every file name read from a checkpoint's metadata goes through here, so a crafted
    checkpoint cannot make a loader open ``../../etc/passwd`` or an absolute path.
    """
    if (not isinstance(name, str) or not _SAFE_NAME.fullmatch(name) or name in (".", "..")):
        raise CheckpointError(
            f"checkpoint {str(directory)!r} refers to the file {name!r}, which is not a plain "
            "file name inside the checkpoint directory; refusing to read it (the checkpoint "
            "is damaged or was not written by zeroshard)")
    return directory / name


def file_record(path: Path) -> dict[str, int]:
    """Size and CRC-32 of a file (see [Note: the checksum's speed])."""
    size, crc = file_crc32(path)
    return {"bytes": size, "crc32": crc}


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    path = directory / MANIFEST
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=False)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The validated manifest of a complete checkpoint directory."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint at {str(directory)!r}: not a directory")
    if not path.is_file():
        found = latest_checkpoint(directory)
        hint = (f"; it holds checkpoints, the latest complete one is {str(found)!r}" if found
                else "; a checkpoint whose save was interrupted has no manifest, load an "
                "earlier one")
        raise CheckpointError(f"{str(directory)!r} is not a complete zeroshard checkpoint: "
                              f"{MANIFEST} is missing{hint}")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{str(path)!r} is not valid JSON ({e}); the checkpoint is "
                              "damaged, load an earlier one") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{str(path)!r} is not a zeroshard checkpoint manifest")
    if manifest.get("version") not in READS:
        raise CheckpointError(
            f"{str(path)!r} has format version {manifest.get('version')!r}; this zeroshard "
            f"reads versions {', '.join(map(str, READS))}. Use the zeroshard release that "
            "wrote it")
    for name in manifest.get("files", {}):
        check_name(directory, name)
    return manifest


def verify_file(directory: Path, name: str, record: dict[str, int], *, crc: bool) -> None:
    """Raise a :class:`CheckpointError` naming the file if it is missing, truncated or
    (with ``crc``) its contents changed since it was written."""
    path = check_name(directory, name)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing; the checkpoint is "
                              "incomplete, load an earlier one")
    size = path.stat().st_size
    if size != record["bytes"]:
        how = "truncated" if size < record["bytes"] else "longer than written"
        raise CheckpointError(
            f"checkpoint file {str(path)!r} is {how}: {size} bytes, expected "
            f"{record['bytes']}; the checkpoint is damaged, load an earlier one")
    if crc:
        got = file_record(path)["crc32"]
        if got != record["crc32"]:
            raise CheckpointError(
                f"checkpoint file {str(path)!r} is corrupted: CRC-32 {got:#010x}, expected "
                f"{record['crc32']:#010x}; the checkpoint is damaged, load an earlier one")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems cannot open directories; best effort
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path) -> None:
    """Make ``tmp`` visible as ``final`` in one rename (an existing ``final`` is replaced:
    moved aside first, removed after)."""
    _fsync_dir(tmp)
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{tmp.name.rpartition('-')[2]}")
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_stale(final: Path) -> None:
    """Remove leftovers of interrupted saves of ``final`` (``<final>.tmp-*``, ``.old-*``)."""
    parent = final.parent
    if not parent.is_dir():
        return
    for p in parent.iterdir():
        if p.name.startswith(f"{final.name}.tmp-") or p.name.startswith(f"{final.name}.old-"):
            shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete ``step-<n>`` checkpoint under ``root`` (None if there is none).

    Directories of interrupted saves (``*.tmp-*``) and those without a manifest are
    skipped, so after a crash this is the last checkpoint that finished.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for p in root.iterdir():
        m = _STEP.fullmatch(p.name)
        if m and (p / MANIFEST).is_file() and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), p)
    return best[1] if best else None


def prune(root: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete ``step-<n>`` checkpoints under ``root``,
    and any leftovers of interrupted saves; return what was deleted."""
    root = Path(root)
    if keep < 1:
        raise ValueError(f"keep={keep!r} must be >= 1 (the checkpoint to resume from)")
    steps = sorted((int(m.group(1)), p) for p in root.iterdir()
                   if (m := _STEP.fullmatch(p.name)) and (p / MANIFEST).is_file())
    gone = [p for _, p in steps[:-keep]]
    gone += [p for p in root.iterdir() if p.is_dir() and _STEP.match(p.name)
             and (".tmp-" in p.name or ".old-" in p.name)]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone
