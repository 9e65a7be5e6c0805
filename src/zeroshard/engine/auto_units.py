"""Stage-3 units chosen by size, for a model without an ``nn.ModuleList`` of layers.

[Note: units by size]
The default units are the modules of the model's first ``nn.ModuleList`` (a
transformer's layers). A model without one — an autoencoder of two ``nn.Sequential``s,
a CNN of stages — gets units as FSDP's size-based auto-wrap policy would choose them:
walking the modules children first, a module whose parameters not yet in a unit number
at least ``1 / SHARE`` of the model's becomes a unit. Then every subtree left holding
parameters outside any unit (a child of the root, or of a module containing units) is
a unit too: the root unit stays gathered from the first forward to the end of the last
backward, so parameters left to it would be whole on every rank all step, and with one
unit prefetched beside the one computing, two big units plus a root holding the rest
would be the whole model. Parameters a module holds directly beside its units' stay
with the root. The choice is logged (rank 0) with each unit's name and size; pass
``units=`` to choose others.
"""

from __future__ import annotations

import logging

from torch import nn

__all__ = ["SHARE", "units_by_size"]

#: A unit holds at least this fraction of the model's parameters (before the leftovers).
SHARE = 8

_log = logging.getLogger("zeroshard")


def _own(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters(recurse=False))


def units_by_size(model: nn.Module, rank: int = 0) -> list[nn.Module]:
    """The units of [Note: units by size], in model order (empty if the model has fewer
    than two parameter-holding modules besides the root)."""
    total = sum(p.numel() for p in model.parameters())
    threshold = max(1, total // SHARE)
    chosen: set[int] = set()

    def walk(m: nn.Module) -> int:  # children first; returns the parameters left over
        left = _own(m) + sum(walk(c) for c in m.children())
        if m is not model and left >= threshold:
            chosen.add(id(m))
            return 0
        return left

    walk(model)

    def holds_unit(m: nn.Module) -> bool:
        return any(id(s) in chosen for s in m.modules())

    def leftovers(m: nn.Module) -> None:  # unit-free subtrees beside units become units
        for c in m.children():
            if id(c) in chosen:
                continue
            if holds_unit(c):
                leftovers(c)
            elif any(True for _ in c.parameters()):
                chosen.add(id(c))

    leftovers(model)
    names = {id(m): n for n, m in model.named_modules()}
    units = [m for m in model.modules() if id(m) in chosen]
    if len(units) < 2:
        return []
    if rank == 0:
        _log.warning(
            "stage 3: %s has no nn.ModuleList of layers; units chosen by size (each at "
            "least 1/%d of the %s parameters, then what was left beside them): %s. Pass "
            "units= to choose others", type(model).__name__, SHARE, f"{total:,}",
            ", ".join(f"{names[id(u)]} ({sum(p.numel() for p in u.parameters()):,})"
                      for u in units))
    return units
