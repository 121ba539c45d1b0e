"""A sweep's parameters: `--param KEY=KIND:ARGS`, checked in one line each, and the Tune
distribution each stands for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raytrain_app.config.files import loads
from raytrain_app.errors import UserError

BOUNDED = {"loguniform", "uniform", "randint"}
LISTED = {"choice", "grid"}


@dataclass(frozen=True)
class Param:
    """`--param KEY=KIND:ARGS`: loguniform:LOW:HIGH, uniform:LOW:HIGH, randint:LOW:HIGH (HIGH
    excluded), choice:A,B,C (sampled) or grid:A,B,C (every value, times --samples)."""

    key: str
    kind: str
    values: tuple

    @classmethod
    def parse(cls, expr: str) -> "Param":
        key, eq, spec = expr.partition("=")
        kind, _, rest = spec.partition(":")
        if not eq or not key.strip():
            raise UserError(f"--param {expr}: expected KEY=KIND:ARGS, e.g. optimizer.lr=loguniform:1e-4:1e-1")
        if kind not in BOUNDED | LISTED:
            raise UserError(f"--param {expr}: unknown distribution '{kind}' (choose from "
                            f"{', '.join(sorted(BOUNDED | LISTED))})")
        if kind in LISTED:
            values = tuple(loads(v) for v in rest.split(",")) if rest else ()  # YAML 1.2: 1e-5 is a number
            if not values:
                raise UserError(f"--param {expr}: {kind} needs values, e.g. {kind}:32,64,128")
            return cls(key.strip(), kind, values)
        bounds = rest.split(":")
        number = int if kind == "randint" else float
        try:
            low, high = (number(b) for b in bounds) if len(bounds) == 2 else (None, None)
        except ValueError:
            low = high = None
        if low is None or not low < high or (kind == "loguniform" and low <= 0):
            raise UserError(f"--param {expr}: {kind} needs LOW:HIGH with LOW < HIGH"
                            + (" and LOW > 0" if kind == "loguniform" else "")
                            + (" (integers)" if kind == "randint" else ""))
        return cls(key.strip(), kind, (low, high))

    def space(self):
        """Tune's search space: imported here, as only the sweep's run needs Tune (its planning
        does not)."""
        from ray import tune

        if self.kind in LISTED:
            return (tune.choice if self.kind == "choice" else tune.grid_search)(list(self.values))
        return getattr(tune, self.kind)(*self.values)

    @property
    def most(self) -> Any:
        """The largest value it can take (ASHA's last rung when the epochs are swept)."""
        return max(self.values) - (1 if self.kind == "randint" else 0)

    def __str__(self) -> str:
        return f"{self.key}={self.kind}:{(',' if self.kind in LISTED else ':').join(map(str, self.values))}"
