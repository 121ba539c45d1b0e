"""Preemption notices: a node of the group is being drained with a deadline (a spot reclaim, or
Ray's `drain-node`), and the work since the last checkpoint would be lost with it.

Ray Train tells every rank through `ray.train.get_preemption_info()`, a collective: every rank
asks at the same steps. Asking at every step would cost more than a small model's step, so the
first `MEASURED` steps each ask and time it, the ranks agree on the largest interval any of them
needs for the asking to cost under `BUDGET` of the step time, and from then on they ask every that
many steps. On a notice every rank takes a checkpoint at the step it is at (a just-in-time
checkpoint, kept like any other), once per notice, and trains on until Ray Train restarts the
group from it.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Optional

import torch

from raytrain_app.distributed import global_max

BUDGET = 0.01  # of the step time
MEASURED = 8  # steps that ask at every step, timing it
LONGEST = 1000  # steps between asks, at most


class PreemptionCheck:
    def __init__(self, enabled: bool, device: torch.device, log: Callable[[str], None] = lambda line: None):
        self.enabled, self.device, self.log = enabled, device, log
        self.every: Optional[int] = None  # decided after MEASURED asks
        self._costs: list[float] = []
        self._steps: list[float] = []
        self._since: Optional[float] = None  # when the last ask returned
        self._answered: set[int] = set()  # the deadlines of notices already checkpointed

    def notice(self, step: int):
        """Ray Train's PreemptionInfo at this step, the first time it is seen; None between asks,
        when there is no notice, and for one already answered."""
        if not self.enabled or (self.every and step % self.every):
            return None
        import ray.train

        start = time.perf_counter()
        info = ray.train.get_preemption_info()
        done = time.perf_counter()
        if self.every is None:
            self._measure(start, done)
        key = (info.deadline_ms or 0) if info else None
        if info is None or key in self._answered:
            return None
        self._answered.add(key)
        return info

    def _measure(self, start: float, done: float) -> None:
        self._costs.append(done - start)
        if self._since is not None:
            self._steps.append(start - self._since)
        self._since = done
        if len(self._costs) < MEASURED:
            return
        step, cost = max(statistics.median(self._steps), 1e-6), statistics.median(self._costs)
        wanted = min(LONGEST, max(1, math.ceil(cost / (BUDGET * step))))
        self.every = int(global_max(wanted, self.device))  # every rank must ask at the same steps
        self.log(f"preemption notices: asked every {self.every} steps ({cost * 1e3:.2f} ms an ask, "
                 f"{step * 1e3:.2f} ms a step here)")


def describe(info, step: int, epoch: int, batch: int, epoch_end: bool) -> str:
    """The console's line for a notice answered with a checkpoint."""
    nodes = ", ".join(node[:12] for node in info.preempted_node_ids)
    left = f" in {max(0.0, info.deadline_ms / 1000 - time.time()):.0f}s" if info.deadline_ms else ""
    where = f"the end of epoch {epoch + 1}" if epoch_end else f"step {step} (epoch {epoch + 1}, batch {batch})"
    ranks = info.preempted_ranks
    return (f"preemption notice: node {nodes} ({'ranks' if len(ranks) > 1 else 'rank'} {', '.join(map(str, ranks))}) "
            f"goes away{left}; "
            f"a checkpoint at {where}, which the restart continues from")
