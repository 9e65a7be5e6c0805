"""Precision recipes: the bytes per parameter of each kind of model state (ZeRO §3.1's
P, G and K) and of activations, which every memory formula reads."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STAGES", "RECIPES", "Recipe", "get_recipe", "check_stage"]

STAGES = (0, 1, 2, 3)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Bytes per parameter of each kind of model state, and of activations."""

    name: str
    """Short name used by the CLI, e.g. "bf16-adamw"."""
    param_bytes: int
    """P: the weights the model computes with (2 for 16-bit)."""
    grad_bytes: int
    """G: gradients as produced and reduced (2 for 16-bit)."""
    optim_bytes: int
    """K: optimizer state (12 = fp32 master + Adam m + v; 8 = Adam m + v, fp32 weights)."""
    act_bytes: int
    """Bytes per stored activation element (2 for 16-bit compute)."""
    master_in_optim: bool = True
    """K holds the fp32 master weights (16-bit recipes). Without mixed precision the
    weights are the master at every stage (stages 1-2 step each rank's chunks of the
    whole weights in place; see [Note: masters inside the weights] in engine/chunks.py);
    with offload that slice's master lives on the host (:func:`host_optimizer_bytes`)."""

    def __post_init__(self) -> None:
        for field in ("param_bytes", "grad_bytes", "optim_bytes", "act_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"Recipe.{field} must be an int >= 0 bytes per element, got {value!r}"
                )

    @property
    def bytes_per_param(self) -> int:
        """P + G + K: 16 for mixed-precision Adam (ZeRO §3.1)."""
        return self.param_bytes + self.grad_bytes + self.optim_bytes


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(name="bf16-adamw", param_bytes=2, grad_bytes=2, optim_bytes=12, act_bytes=2),
        # fp16 costs the same bytes; it adds dynamic loss scaling, not memory.
        Recipe(name="fp16-adamw", param_bytes=2, grad_bytes=2, optim_bytes=12, act_bytes=2),
        Recipe(name="fp32-adamw", param_bytes=4, grad_bytes=4, optim_bytes=8, act_bytes=4,
               master_in_optim=False),
    )
}


def get_recipe(recipe: str | Recipe) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; use one of {', '.join(RECIPES)}")
    return RECIPES[recipe]


def check_stage(stage: int, n: int) -> None:
    """Refuse a stage that is not 0-3 or a data-parallel degree that is not an int >= 1."""
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"data-parallel degree N={n!r} must be an int >= 1")
