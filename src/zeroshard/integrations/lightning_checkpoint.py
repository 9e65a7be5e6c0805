"""A zeroshard Lightning checkpoint as Lightning's one-file ``.ckpt``, in one call.

    from zeroshard.integrations.lightning_checkpoint import to_lightning_checkpoint
    to_lightning_checkpoint("ckpt/step-step=3.ckpt", "step3.ckpt")   # the directory -> one file
    LitModel.load_from_checkpoint("step3.ckpt")                        # inference
    Trainer(strategy="ddp").fit(model, ckpt_path="step3.ckpt")         # resume under DDP

or ``zeroshard consolidate ckpt/step-step=3.ckpt step3.ckpt --lightning``.

The zeroshard strategies save a directory (each rank's shards, ``zeroshard.save_checkpoint``,
plus ``lightning.pt``: the loops', callbacks' and schedulers' state). Lightning's own
readers — ``LightningModule.load_from_checkpoint``, the DDP strategy's ``ckpt_path=`` —
read one ``torch.save`` file holding the whole ``state_dict`` and the optimizer's state
in torch's format. This writes that file in one process (no process group), reading one
tensor at a time (``CheckpointReader``); it holds the whole model and optimizer state in
host memory once, as the ``.ckpt`` it writes does.

[Note: torch-format optimizer state from a checkpoint]
torch numbers an optimizer's parameters in the order its groups list them, and keeps the
state per number. The manifest records, per group, the names of its parameters in that
order (``group_params``; the model's order within each group for checkpoints written
before it was recorded), the hyperparameters, and per parameter its scalar state
(``step``) and its per-element state, stored whole under ``optim.<name>.<key>``. A
parameter that was never stepped has no entry, as in torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["to_lightning_checkpoint", "load_from_checkpoint", "lightning_checkpoint_dict",
           "whole_state_dict", "LIGHTNING_STATE"]

#: Inside a zeroshard Lightning checkpoint directory: everything but weights and
#: optimizer state, as Lightning's checkpoint dict (written by rank 0).
LIGHTNING_STATE = "lightning.pt"


def whole_state_dict(reader: Any) -> dict[str, torch.Tensor]:
    """The model's whole ``state_dict`` from a ``CheckpointReader``, one tensor at a time."""
    return {k: reader.tensor(k) for k in reader.keys()}


def _group_names(manifest: dict[str, Any], optim: dict[str, Any]) -> list[list[str]]:
    """Each group's parameter names in the optimizer's order (see the Note)."""
    if optim.get("group_params") is not None:
        return [list(g) for g in optim["group_params"]]
    groups: list[list[str]] = [[] for _ in optim["param_groups"]]
    for p in manifest["params"]:
        g = optim["group_of"].get(p["name"])
        if g is not None and g >= 0:
            groups[g].append(p["name"])
    return groups


def _scalar(entry: dict[str, Any]) -> Any:
    if "dtype" in entry:
        return torch.tensor(entry["value"], dtype=getattr(torch, entry["dtype"])).reshape(
            entry["shape"])
    return entry["value"]


def optimizer_state_dict(reader: Any) -> dict[str, Any] | None:
    """The checkpoint's optimizer state in torch's format (None if it holds none)."""
    optim = reader.manifest.get("optimizer")
    if optim is None:
        return None
    names = _group_names(reader.manifest, optim)
    state: dict[int, dict[str, Any]] = {}
    groups, index = [], 0
    for hyper, group in zip(optim["param_groups"], names):
        ids = []
        for name in group:
            info = optim["params"].get(name)
            if info is not None and name not in optim.get("unstepped", []):
                entry = {k: _scalar(v) for k, v in info["scalars"].items()}
                for k in [*info["per_element"], *info.get("tensors", ())]:
                    entry[k] = reader.optimizer_state(name, k)
                # torch's key order (a whole-parameter optimizer's record keeps it)
                order = info.get("state_keys", list(entry))
                state[index] = {k: entry[k] for k in order if k in entry} | entry
            ids.append(index)
            index += 1
        groups.append({**hyper, "params": ids})
    return {"state": state, "param_groups": groups}


def _per_optimizer(osd: dict[str, Any] | None, manifest: dict[str, Any]) -> list[dict]:
    """Lightning's ``optimizer_states``: one torch-format dict per optimizer (several:
    the saved state split by each one's groups, see engine/composite.py)."""
    if osd is None:
        return []
    counts = (manifest.get("optimizer") or {}).get("part_groups")
    if not counts:
        return [osd]
    from ..engine.optimizer import part_state_dict

    starts = [sum(counts[:k]) for k in range(len(counts))]
    return [part_state_dict(osd, range(a, a + n)) for a, n in zip(starts, counts)]


def lightning_checkpoint_dict(checkpoint: str | os.PathLike, *, optimizer: bool = True
                              ) -> dict[str, Any]:
    """The dict Lightning's one-file ``.ckpt`` holds, for the zeroshard Lightning checkpoint
    directory ``checkpoint`` (see :func:`to_lightning_checkpoint`)."""
    from ..state.consolidate import CheckpointReader
    from ..state.manifest import CheckpointError

    path = Path(checkpoint)
    if not (path / LIGHTNING_STATE).is_file():
        raise CheckpointError(
            f"{str(path)!r} is not a checkpoint of the zeroshard Lightning strategies (no "
            f"{LIGHTNING_STATE}); for a zeroshard.save_checkpoint directory use "
            "zeroshard.consolidate (weights as safetensors)")
    reader = CheckpointReader(path)
    ckpt = torch.load(path / LIGHTNING_STATE, weights_only=False)
    ckpt["state_dict"] = whole_state_dict(reader)
    osd = optimizer_state_dict(reader) if optimizer else None
    ckpt["optimizer_states"] = _per_optimizer(osd, reader.manifest)
    if not optimizer:
        ckpt.pop("lr_schedulers", None)
    return ckpt


def load_from_checkpoint(cls: type, checkpoint_path: str | os.PathLike | Any,
                         map_location: Any = None, hparams_file: Any = None,
                         strict: bool | None = None, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint`` (a ``LightningModule`` class) for the path a zeroshard
    strategy reports — ``trainer.checkpoint_callback.best_model_path`` / ``last_model_path``
    name a *directory* (each rank's shards), which Lightning's reader, a classmethod that
    never sees the strategy, cannot open (``IsADirectoryError``). The directory's weights
    are read whole in this one process (one tensor at a time; no process group, no
    optimizer state) into the one-file form Lightning reads, handed to it in memory; the
    arguments are Lightning's. A plain ``.ckpt`` file goes straight to Lightning."""
    import io

    if not (isinstance(checkpoint_path, (str, os.PathLike)) and Path(checkpoint_path).is_dir()):
        return cls.load_from_checkpoint(checkpoint_path, map_location=map_location,
                                        hparams_file=hparams_file, strict=strict, **kwargs)
    buffer = io.BytesIO()
    torch.save(lightning_checkpoint_dict(checkpoint_path, optimizer=False), buffer)
    buffer.seek(0)
    return cls.load_from_checkpoint(buffer, map_location=map_location,
                                    hparams_file=hparams_file, strict=strict, **kwargs)


def to_lightning_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, *,
                            optimizer: bool = True) -> Path:
    """Write the zeroshard Lightning checkpoint directory ``checkpoint`` as Lightning's
    one-file ``.ckpt`` at ``out``: whole weights in their saved dtypes (fp32 masters of
    trained parameters), the optimizer state in torch's format (unless ``optimizer=False``:
    a smaller file for inference), and the rest of Lightning's state as saved."""

    ckpt = lightning_checkpoint_dict(checkpoint, optimizer=optimizer)
    out = Path(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    try:
        torch.save(ckpt, tmp)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out
