"""The package's ``zeroshard.shard``: ``stage="auto"`` resolved, then :func:`api.shard`.

``stage="auto"`` traces the model's candidates (timing/auto.py), and a trace runs
``api.shard`` on fake tensors: resolving it inside ``api.shard`` would make the engine's
entry point depend on the planner that depends on it. So the choice is made here, above
both, and ``api.shard`` only ever sees a stage number.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from . import api
from .timing.auto import AUTO_OPTIONS, resolve_auto

__all__ = ["shard"]


@functools.wraps(api.shard)
def shard(model: nn.Module, optimizer: Any = None, *, stage: int | str = 0,
          **options: Any) -> tuple[nn.Module, Any]:
    auto = {k: options.pop(k) for k in AUTO_OPTIONS if k in options}
    if isinstance(stage, str) and stage != "auto":
        raise TypeError(f"stage={stage!r} must be an int 0, 1, 2 or 3, or 'auto' (lower case)")
    if stage != "auto":
        if auto:
            raise TypeError(f"{', '.join(sorted(auto))} go with stage='auto': pass "
                            f"stage='auto' (here stage={stage!r}), or drop them")
        return api.shard(model, optimizer, stage=stage, **options)
    api._require_dist()
    if optimizer is None:
        return api.shard(model, optimizer, stage=0, **options)  # its error names the fix
    chosen, options, choice = resolve_auto(
        model, {**options, **auto}, process_group=options.get("process_group"),
        mixed_precision=options.get("mixed_precision"), hybrid=options.get("hybrid"),
        mesh=options.get("mesh"))
    model, optim = api.shard(model, optimizer, stage=chosen, **options)
    api.engine_of(model).auto_choice = choice
    return model, optim
