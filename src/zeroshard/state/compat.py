"""Does a checkpoint fit this model and optimizer? One error listing every mismatch.

Checked before any byte is read, on every rank identically (from the JSON manifest and
the model), so a wrong checkpoint fails at once with names and shapes instead of halfway
through a load with a size error from deep inside DCP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from .layout import ParamEntry
from .manifest import CheckpointError

__all__ = ["check_model", "check_optimizer"]

_SHOW = 12


def _listing(title: str, items: list[str]) -> list[str]:
    if not items:
        return []
    more = f" (+{len(items) - _SHOW} more)" if len(items) > _SHOW else ""
    return [f"  {title} ({len(items)}){more}:", *(f"    {x}" for x in items[:_SHOW])]


def check_model(manifest: dict[str, Any], entries: list[ParamEntry], model: nn.Module,
                path: Path) -> None:
    """Raise listing parameters/buffers missing, unexpected or of another shape."""
    saved = {p["name"]: tuple(p["shape"]) for p in manifest["params"]}
    saved.update({b["name"]: tuple(b["shape"]) for b in manifest["buffers"]})
    ours = {e.name: e.shape for e in entries}
    pnames = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    ours.update({k: tuple(t.shape) for k, t in nn.Module.state_dict(model, keep_vars=True).items()
                 if k not in pnames})
    missing = sorted(set(ours) - set(saved))
    unexpected = sorted(set(saved) - set(ours))
    shapes = sorted(f"{k}: checkpoint {list(saved[k])}, model {list(ours[k])}"
                    for k in set(ours) & set(saved) if saved[k] != ours[k])
    aliases = {p["name"]: sorted(p["aliases"]) for p in manifest["params"]}
    tied = sorted(f"{e.name}: checkpoint ties {aliases[e.name]}, model ties {sorted(e.aliases)}"
                  for e in entries if e.name in aliases and aliases[e.name] != sorted(e.aliases))
    if missing or unexpected or shapes or tied:
        lines = [f"checkpoint {str(path)!r} does not fit {type(model).__name__}:",
                 *_listing("shape differs", shapes),
                 *_listing("in the model but not in the checkpoint", missing),
                 *_listing("in the checkpoint but not in the model", unexpected),
                 *_listing("tied differently", tied),
                 "build the model the checkpoint was saved from (same preset/config), or "
                 "load into a model whose parameter names and shapes match"]
        raise CheckpointError("\n".join(lines))


def _named(parts: list[str] | None) -> str | None:
    """Several optimizers as the user built them: ``(torch.optim.Muon, torch.optim.AdamW)``."""
    return f"({', '.join(parts)})" if parts else None


def check_optimizer(manifest: dict[str, Any], entries: list[ParamEntry], group_of: dict[str, int],
                    inner: torch.optim.Optimizer, path: Path) -> dict[str, Any] | None:
    """The manifest's optimizer section if it fits ``inner`` (None: nothing to load)."""
    info = manifest.get("optimizer")
    if info is None:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was saved without an optimizer; call "
            "load_checkpoint(path, model) without one to load the weights only")
    mine = f"{type(inner).__module__}.{type(inner).__qualname__}"
    parts = [f"{type(p).__module__}.{type(p).__qualname__}"
             for p in getattr(inner, "parts", ())] or None
    saved = _named(info.get("parts")) or info["class"]
    if info["class"] != mine or info.get("parts") != parts:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds the state of {saved}, but the optimizer is "
            f"{_named(parts) or mine}; build the same optimizer (the same classes, in the "
            "same order), or pass optimizer=None to load only the weights")
    if len(info["param_groups"]) != len(inner.param_groups):
        raise CheckpointError(
            f"checkpoint {str(path)!r} has {len(info['param_groups'])} optimizer param groups, "
            f"the optimizer has {len(inner.param_groups)}; build it the same way")
    moved = [(e.name, info["group_of"].get(e.name, 0), group_of.get(e.name, 0))
             for e in entries if e.trainable and "group_of" in info
             and info["group_of"].get(e.name, 0) != group_of.get(e.name, 0)]
    if moved and parts:  # several optimizers: the groups of all of them, in order
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {len(moved)} parameter(s) are stepped by another "
            f"optimizer or group than when saved, e.g. {moved[0][0]!r}; give each optimizer "
            "the same parameters (and groups) as when saving, or pass optimizer=None to "
            "load only the weights")
    if moved:  # hyperparameters load by group position: they would land on other params
        name, was, now = moved[0]
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {len(moved)} parameter(s) are in other optimizer "
            f"param groups than when saved, e.g. {name!r} (group {was} then, {now} now; 0 is "
            "the default group, i the i-th of param_groups=); build param_groups= the same "
            "way, or pass optimizer=None to load only the weights")
    states = info["params"]
    if not states:
        return info
    trainable = {e.name for e in entries if e.trainable}
    # parameters never stepped when saved have no state, as in torch
    lacking = sorted(trainable - set(states) - set(info.get("unstepped", ())))
    frozen_now = sorted(set(states) - trainable)
    if lacking or frozen_now:
        lines = [f"checkpoint {str(path)!r}: optimizer state does not match the trainable "
                 "parameters:",
                 *_listing("trainable now, no optimizer state in the checkpoint", lacking),
                 *_listing("optimizer state in the checkpoint, frozen now", frozen_now),
                 "freeze the same parameters as when saving, or pass optimizer=None to load "
                 "only the weights"]
        raise CheckpointError("\n".join(lines))
    return info

