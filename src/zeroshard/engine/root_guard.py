"""Stage 3: a forward that starts inside the sharded model, refused with the fix.

[Note: forwards outside the sharded model's]
The root unit's weights (embeddings, head, final norm) are put in the modules by the
root's forward. A forward that starts inside the model — ``model.model(x)``,
``model.get_base_model().generate()``, a value head calling the backbone — reaches them
while they are still the sharded DTensors, and torch raises "got mixed torch.Tensor and
DTensor" from inside the embedding, naming neither the call nor the fix (and no
zeroshard frame is on the stack to explain it: ShardedModule.__call__ is not). So each
module holding a root parameter gets a forward pre-hook that raises, naming the module
and the fix, when it is about to compute with the sharded face. Inside the root's
forward, a registered method (gather.register_forward_method) or a backward's
recompute, the modules hold the gathered weights and the hook passes. Not with tensor
parallelism, whose compute parameters are DTensors too. The hook is plain Python that
torch.compile traces (an identity test on the module's parameters): no graph break.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["root_guards"]


def root_guards(root: Any, model: nn.Module) -> list[tuple[nn.Module, Any]]:
    """(module, forward pre-hook) for each module holding a parameter of the stage-3
    ``root`` unit (see [Note: forwards outside the sharded model's])."""
    held: dict[nn.Module, list[tuple[str, nn.Parameter]]] = {}
    for b in root.buckets:
        for s in b.slots:
            for module, attr, _, user in s.homes:
                held.setdefault(module, []).append((attr, user))
    names = {m: n for n, m in model.named_modules()}

    def guard(module: nn.Module, attrs: list[tuple[str, nn.Parameter]]) -> Any:
        def check(mod: nn.Module, args: Any) -> None:
            if any(mod._parameters.get(a) is user for a, user in attrs):
                name = names.get(mod) or type(mod).__name__
                raise RuntimeError(
                    f"{name} ({type(mod).__name__}) ran outside the sharded model's forward, "
                    "where its stage-3 weights are still sharded DTensors (e.g. "
                    "model.get_base_model().generate() or model.model(x) called directly). "
                    "Call the model zeroshard.shard() returned (model.generate(), model(x)), "
                    "or make the entry point a method of that model and register it: "
                    "zeroshard.register_forward_method(model, 'method')")
        return check

    return [(m, guard(m, attrs)) for m, attrs in held.items() if m is not model]

