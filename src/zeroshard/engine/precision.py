"""Dynamic loss scaling for fp16 (Micikevicius et al. 2018, §3.2).

fp16 flushes gradients below 2^-24 to zero, so the backward pass runs on a loss scaled
by S. A step whose gradients overflowed (inf/NaN on any rank) is skipped and S halves;
after ``growth_interval`` clean steps S doubles. bf16 has fp32's exponent range and
needs none of this.
"""

from __future__ import annotations

__all__ = ["LossScaler"]


class LossScaler:
    def __init__(
        self, init_scale: float, growth_factor: float, backoff_factor: float,
        growth_interval: int, enabled: bool,
    ) -> None:
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_steps": self.clean_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])
