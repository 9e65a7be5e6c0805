"""Stage-3 units chosen by size, for a model without an ``nn.ModuleList`` of layers.

[Note: units by size]
The default units are the modules of the model's first ``nn.ModuleList`` (a
transformer's layers). A model without one — an autoencoder of two ``nn.Sequential``s,
a CNN of stages — gets units as FSDP's size-based auto-wrap policy would choose them:
walking the modules children first, a module whose parameters not yet in a unit number
at least ``1 / SHARE`` of the model's becomes a unit — unless it is a container of
repeated blocks (two or more children of one class holding most of its parameters:
timm's ViT keeps its blocks in an ``nn.Sequential``, torchvision's ResNet its
``layerN``), which becomes a unit per block instead: taken whole, timm's ViT ``blocks``
was one unit of 97% of the model, gathered whole on every rank. Then every subtree left holding
parameters outside any unit (a child of the root, or of a module containing units) is
a unit too: the root unit stays gathered from the first forward to the end of the last
backward, so parameters left to it would be whole on every rank all step, and with one
unit prefetched beside the one computing, two big units plus a root holding the rest
would be the whole model. Parameters a module holds directly beside its units' stay
with the root; an ``nn.MultiheadAttention`` is never split (``LEAVES``). The choice is logged (rank 0) with each unit's name and size; pass
``units=`` to choose others.
"""

from __future__ import annotations

import logging

from torch import nn

__all__ = ["LEAVES", "SHARE", "BLOCKS_SHARE", "units_by_size", "repeated_blocks", "units_hint"]

#: Modules whose forward reads their children's parameters directly (not by calling
#: them), so a child may not be a unit of its own: nn.MultiheadAttention reads
#: ``out_proj.weight`` (FSDP1's ``FORCE_LEAF_MODULES``). See [Note: reads outside a unit].
LEAVES: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)

#: A unit holds at least this fraction of the model's parameters (before the leftovers).
SHARE = 8
#: A module chosen by size whose children are two or more blocks of one class holding
#: at least this share of its parameters is split into a unit per block.
BLOCKS_SHARE = 0.5

_log = logging.getLogger("zeroshard")


def _own(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters(recurse=False))


def units_by_size(model: nn.Module, rank: int = 0) -> list[nn.Module]:
    """The units of [Note: units by size], in model order (empty if the model has fewer
    than two parameter-holding modules besides the root)."""
    total = sum(p.numel() for p in model.parameters())
    threshold = max(1, total // SHARE)
    chosen: set[nn.Module] = set()

    def walk(m: nn.Module) -> tuple[int, bool]:
        """Children first: the parameters left over, and whether a unit is inside (a
        module holding a unit is never one itself: units do not overlap)."""
        if isinstance(m, LEAVES):  # read as a whole: never split into units
            left, inside = sum(p.numel() for p in m.parameters()), False
        else:
            below = [walk(c) for c in m.children()]
            left = _own(m) + sum(n for n, _ in below)
            inside = any(u for _, u in below)
        if m is not model and not inside and left >= threshold:
            kids = repeated_blocks(m)
            if kids:  # a container of blocks (timm's ViT ``blocks``): a unit per block
                chosen.update(kids)
                blocks.update(dict.fromkeys(kids, m))
            else:
                chosen.add(m)
            return 0, True
        return left, inside

    blocks: dict[nn.Module, nn.Module] = {}  # a block chosen -> its container
    walk(model)

    def holds_unit(m: nn.Module) -> bool:
        return any(s in chosen for s in m.modules())

    def leftovers(m: nn.Module) -> None:  # unit-free subtrees beside units become units
        for c in m.children():
            if c in chosen:
                continue
            if holds_unit(c):
                leftovers(c)
            elif any(True for _ in c.parameters()):
                chosen.add(c)

    by_size = set(chosen)
    leftovers(model)
    names = {m: n for n, m in model.named_modules()}
    units = [m for m in model.modules() if m in chosen]
    if len(units) < 2:
        return []
    if rank == 0:
        _log.warning(
            "stage 3: %s has no nn.ModuleList of layers; units chosen by size (at "
            "least 1/%d of the %s parameters each, then each subtree left beside them, "
            "marked 'left'; 'block of X': one of X's repeated blocks): %s. Pass units= to "
            "choose others", type(model).__name__,
            SHARE, f"{total:,}",
            ", ".join(f"{names[u]} ({sum(p.numel() for p in u.parameters()):,}"
                      f"{_why(u, by_size, blocks, names)})" for u in units))
    return units


def repeated_blocks(m: nn.Module) -> list[nn.Module]:
    """``m``'s children if two or more of them, all of one class, hold at least
    ``BLOCKS_SHARE`` of its parameters (an ``nn.Sequential`` of transformer blocks,
    torchvision's ``layerN``); else []. Never inside a module read as a whole (LEAVES)."""
    if isinstance(m, LEAVES):
        return []
    kids = [c for c in m.children() if any(True for _ in c.parameters())]
    if len(kids) < 2 or len({type(c) for c in kids}) != 1:
        return []
    total = sum(p.numel() for p in m.parameters())
    held = sum(p.numel() for c in kids for p in c.parameters())
    return kids if held >= BLOCKS_SHARE * total else []


def _why(u: nn.Module, by_size: set[nn.Module], blocks: dict[nn.Module, nn.Module],
         names: dict[nn.Module, str]) -> str:
    if u in blocks:
        return f", block of {names[blocks[u]]}"
    return "" if u in by_size else ", left"


def units_hint(model: nn.Module) -> str:
    """``units=`` spelled for ``model``: the children of its first module with two or
    more parameter-holding children (``list(model.encoder)``), else a predicate."""
    for name, m in model.named_modules():
        kids = [c for c in m.children() if any(True for _ in c.parameters())]
        if len(kids) >= 2 and not isinstance(m, LEAVES):
            where = f"model.get_submodule({name!r})" if name else "model"
            return f"units=list({where}.children())"
    return "units=lambda m: isinstance(m, MyBlock)"
