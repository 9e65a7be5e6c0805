"""Gradient parts of a tied parameter: summed as they arrive, one part alive at a time.

The mechanism is [Note: tied parameters] in params.py (each home after the first holds an
alias leaf); this file is its backward half. Each leaf's part reaches the gradient hook
(``BackwardPass.on_grad`` in backward.py), which hands it here: parts of one backward are summed on
one leaf, in arrival order, and once every leaf delivered the sum is added to what
earlier backwards left, in ``AccumulateGrad``'s order (earlier + (part + part)).
"""

from __future__ import annotations

import torch
from torch import nn

from .flat import FlatBucket, FlatParam

__all__ = ["TiedGrads"]


class TiedGrads:
    """The trainable parameters with several leaves, and what earlier backwards left on
    them."""

    def __init__(self, buckets: list[FlatBucket]) -> None:
        self.slots = [s for b in buckets for s in b.slots if len(s.leaves) > 1]
        self.earlier: dict[FlatParam, torch.Tensor] = {}  # see before_own_part

    @staticmethod
    def merge_parts(s: FlatParam, p: nn.Parameter) -> nn.Parameter:
        """Add ``p``'s gradient part into the part another leaf of the same parameter
        holds from this backward (``s.arrived``: those heard from), in place (autograd
        gave that tensor to ``.grad``: it is ours alone), and return the leaf holding the
        sum: one part alive, not two. Parts add up in arrival order, as in autograd's
        input buffer."""
        held = next((t for k, t in enumerate(s.leaves) if t is not p and k in s.arrived
                     and t.grad is not None), None)
        if held is None:
            return p
        held.grad.add_(p.grad)
        p.grad = None
        return held

    def settle(self, s: FlatParam, held: nn.Parameter) -> nn.Parameter:
        """This backward's parts are summed on ``held``: the parameter's ``.grad``
        becomes what earlier backwards left plus that sum, added in autograd's order
        (earlier + (part + part), as ``AccumulateGrad`` adds the summed input), so
        accumulation rounds exactly as under DDP. What earlier backwards left is still
        on its own leaf's ``.grad`` if its own use did not deliver, else set aside
        (before_own_part)."""
        own = s.leaves[0]
        total, held.grad = held.grad, None
        earlier = self.earlier.pop(s, None) if 0 in s.arrived else own.grad
        if earlier is not None:
            total = earlier.add_(total)
        own.grad = total
        return own

    def before_own_part(self, s: FlatParam, grads: tuple) -> None:
        """Before autograd accumulates the parameter's own use's part: set aside what
        earlier backwards left on its ``.grad``, so this backward's parts are summed
        apart first (see settle). Not for a late part, which accumulates as usual."""
        own = s.leaves[0]
        if own.grad is not None and 0 not in s.arrived and len(s.arrived) < len(s.leaves):
            self.earlier[s] = own.grad
            own.grad = None

    @staticmethod
    def move_part(p: nn.Parameter, own: nn.Parameter) -> nn.Parameter:
        """A part arriving after every use delivered (reentrant checkpointing): onto the
        parameter's own ``.grad``, where autograd would have accumulated it."""
        if p is not own:
            if own.grad is None:
                own.grad = p.grad
            else:
                own.grad.add_(p.grad)
            p.grad = None
        return own

    def settle_unfinished(self) -> None:
        """End of backward: a tied parameter some use of which delivered nothing (its
        module did not run) still gets this backward's parts, or its earlier gradient
        back."""
        for s in self.slots:
            if len(s.arrived) == len(s.leaves):
                continue
            held = next((t for k, t in enumerate(s.leaves)
                         if k in s.arrived and t.grad is not None), None)
            if held is not None:
                self.settle(s, held)

    def held_grads(self) -> list[torch.Tensor]:
        """Parts held until the parameter's other uses deliver (for the memory tracker)."""
        return [t.grad for s in self.slots for t in s.leaves if t.grad is not None]
