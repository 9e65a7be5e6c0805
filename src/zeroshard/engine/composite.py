"""Several torch optimizers over one sharded model, stepped as one inner optimizer.

[Note: several optimizers]
Muon is used beside AdamW: Muon for the hidden matrices, AdamW for embeddings, heads,
norms and biases, as two optimizers (``zeroshard.shard(model, (muon, adamw))``). The
engine has one inner optimizer (engine/optimizer.py); here it is a
:class:`CompositeOptimizer` whose groups are the parts' groups in order — so the
machinery for one optimizer with mixed groups (whole-parameter groups owned by ranks,
elementwise groups on flat chunks; see [Note: whole-parameter updates] in whole.py)
serves unchanged — and whose ``step`` steps the parts named in ``active``. Each part's
state stays in that part (``RoutedState`` sends each tensor's entry to the part holding
it). The user holds one :class:`~zeroshard.engine.optimizer.OptimizerPart` per optimizer
they passed: its ``step`` steps its part, its ``zero_grad`` clears its parameters'
gradients (as torch's does), its ``state_dict`` is torch's for its groups alone.

At most one part may step whole parameters and at most one elementwise: two elementwise
optimizers in one bucket would share its flat state buffers (chunks.flatten_state) with
different keys; one optimizer with several param groups does that instead.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import torch

__all__ = ["CompositeOptimizer", "RoutedState"]


class RoutedState(MutableMapping):
    """``optimizer.state`` over several optimizers: each tensor's entry lives in the
    part whose groups hold it; entries for tensors no part holds (chunks of parameters
    stepped whole, or of none) are kept aside, as one optimizer's defaultdict would."""

    def __init__(self, parts: list[torch.optim.Optimizer]) -> None:
        self.parts = parts
        self.aside: dict[Any, Any] = {}
        self._owner: dict[Any, dict[Any, Any]] | None = None

    def _home(self, key: Any) -> dict[Any, Any]:
        if self._owner is None:  # the groups are fixed once built
            self._owner = {p: part.state for part in self.parts
                           for g in part.param_groups for p in g["params"]}
        return self._owner.get(key, self.aside)

    def __getitem__(self, key: Any) -> Any:
        home = self._home(key)
        if home is self.aside and key not in home:
            raise KeyError(key)
        return home[key]  # a part's defaultdict creates the entry, as torch's does

    def __setitem__(self, key: Any, value: Any) -> None:
        self._home(key)[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._home(key)[key]

    def __contains__(self, key: object) -> bool:
        return key in self._home(key)

    def __iter__(self) -> Iterator[Any]:
        for part in self.parts:
            yield from part.state
        yield from self.aside

    def __len__(self) -> int:
        return sum(len(part.state) for part in self.parts) + len(self.aside)


class CompositeOptimizer:
    """The inner optimizer over several parts (see [Note: several optimizers]): their
    groups in order, their states routed, ``step`` over the ``active`` parts (all when
    None)."""

    def __init__(self, parts: list[torch.optim.Optimizer]) -> None:
        self.parts = parts
        self.state = RoutedState(parts)
        self.defaults: dict[str, Any] = {}
        self.active: list[int] | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for part in self.parts for g in part.param_groups]

    def group_ranges(self) -> list[range]:
        """Each part's indices into ``param_groups``."""
        out, start = [], 0
        for part in self.parts:
            out.append(range(start, start + len(part.param_groups)))
            start += len(part.param_groups)
        return out

    def step(self, closure: Any = None) -> None:
        for i, part in enumerate(self.parts):
            if self.active is None or i in self.active:
                part.step()
