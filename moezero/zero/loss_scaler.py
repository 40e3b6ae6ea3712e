"""Dynamic loss scaling for fp16 (Micikevicius et al. 2018, as in Megatron and DeepSpeed)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DynamicLossScaler:
    """Megatron's DynamicGradScaler: an overflow uses up one of `hysteresis` tolerated overflows, and once they
    are used up every overflow halves the scale; `growth_interval` clean steps in a row double it and tolerate
    `hysteresis` overflows again."""

    scale: float = 2.0**16
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    backoff_factor: float = 0.5
    growth_factor: float = 2.0

    def __post_init__(self):
        self._clean_steps = 0
        self._hysteresis_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:  # not tolerated again until the scale grows (Megatron's)
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._clean_steps += 1
        if self._clean_steps == self.growth_interval:
            self._clean_steps = 0
            self.scale *= self.growth_factor
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self._clean_steps = state["clean_steps"]
        self._hysteresis_left = state["hysteresis_left"]
