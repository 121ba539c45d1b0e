"""`train.early_stopping`: stop when the watched metric has stopped improving.

Every rank decides alone and all decide alike: the metrics it looks at are all-reduced, so each
rank sees the same numbers at the same epoch and stops there without another collective. What
it has seen is part of the training state (`state_dict`), so a resumed run counts on from where
the checkpoint was, not from zero.
"""

from __future__ import annotations

import math
from typing import Optional

from raytrain_app.config.sections import EarlyStoppingConfig


class EarlyStopping:
    def __init__(self, config: EarlyStoppingConfig):
        self.config = config
        self.best: Optional[float] = None
        self.best_epoch = 0
        self.waited = 0  # epochs since the best

    def update(self, row: dict) -> Optional[str]:
        """After an epoch's metrics: None to go on, or why training stops here."""
        c = self.config
        value = row.get(c.metric)
        if isinstance(value, (int, float)) and math.isfinite(value) and self._improves(value):
            self.best, self.best_epoch, self.waited = float(value), int(row["epoch"]), 0
            return None
        self.waited += 1
        if self.waited < c.patience:
            return None
        best = f"{self.best:.4g} at epoch {self.best_epoch}" if self.best is not None else "none finite"
        beyond = f" by more than {c.min_delta:g}" if c.min_delta else ""
        return (f"{c.metric} did not improve{beyond} for {self.waited} epoch{'s' * (self.waited > 1)} "
                f"(best {best})")

    def _improves(self, value: float) -> bool:
        if self.best is None:
            return True
        gain = value - self.best if self.config.mode == "max" else self.best - value
        return gain > self.config.min_delta

    def state_dict(self) -> dict:
        return {"best": self.best, "best_epoch": self.best_epoch, "waited": self.waited}

    def load_state_dict(self, saved: dict) -> None:
        self.best, self.best_epoch, self.waited = saved["best"], saved["best_epoch"], saved["waited"]
