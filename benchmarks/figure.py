"""One benchmark figure: a measured value beside its target."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Figure:
    name: str
    value: float
    unit: str
    target: float
    # "max": the value must not exceed the target (latencies); "min": must reach it (rates).
    direction: Literal["max", "min"]

    @property
    def meets(self) -> bool:
        return self.value <= self.target if self.direction == "max" else self.value >= self.target

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "target": self.target,
            "meets": self.meets,
        }

    def line(self) -> str:
        sign = "<=" if self.direction == "max" else ">="
        verdict = "meets" if self.meets else "MISSES"
        return f"{self.name:34s} {self.value:>14.4g} {self.unit:10s} target {sign} {self.target:g}  {verdict}"
