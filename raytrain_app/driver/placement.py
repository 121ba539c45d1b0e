"""How long a run waits for the cluster to place its worker group, and what it says meanwhile.

Ray Train waits without end, and without a word, for a group the cluster cannot place. A
fixed-size run gets `START_TRIES` starts within `failure.placement_timeout_s`: a start that
failed for a passing reason (a node that died while its worker started) gets a second try, and a
group the cluster cannot place then ends the run, naming what is missing.

A range (`scaling.workers: {min, max}`) starts at whatever size fits, in tries of `ELASTIC_TRY_S`
at most: Ray Train sizes a restart from what Ray Data's autoscaling coordinator reserved at its
last refresh (every 20 s), which still counts a node lost a moment ago, and the next try sees the
cluster as it is. Ray Train counts failed starts over the whole run, so a range gets as many as
fit in `failure.placement_timeout_s` (12 by default): a start that cannot succeed (a bad
runtime_env) ends the run, and a resize costs at most one of them. Below `min`, Ray Train waits for room without
a limit or a word: `RoomWatch` ends such a run after `failure.placement_timeout_s`, and says,
for any run, when the cluster holds too few workers and when it has room again.
"""

from __future__ import annotations

import _thread
import math
import signal
import threading
import time
from typing import Callable, Optional

from raytrain_app.cluster.capacity import connected_nodes, describe_capacity, workers_that_fit
from raytrain_app.config import JobConfig
from raytrain_app.console import count
from raytrain_app.rayinternals import draining_nodes

START_TRIES = 2
ELASTIC_TRY_S = 25.0  # past one refresh of the coordinator's view (20 s)
WATCH_INTERVAL_S = 1.0


def start_tries(config: JobConfig) -> int:
    """Ray Train's `controller_failure_limit` + 1."""
    if config.scaling.elastic:
        return max(START_TRIES, math.ceil(config.failure.placement_timeout_s / ELASTIC_TRY_S))
    return START_TRIES


def start_timeout_s(config: JobConfig) -> float:
    """Each start try's wait for its group to be placed."""
    f = config.failure
    return min(ELASTIC_TRY_S, f.placement_timeout_s) if config.scaling.elastic else f.placement_timeout_s / START_TRIES


def fitting_now(config: JobConfig) -> tuple[int, str]:
    """(workers the cluster holds, in all, leaving out nodes being drained; its nodes in words)."""
    s, draining = config.scaling, draining_nodes()
    nodes = [n for n in connected_nodes() if n.node_id not in draining]
    return workers_that_fit(nodes, s.cpus_per_worker, s.gpus_per_worker, s.resources.get("memory", 0)), \
        describe_capacity(nodes)


def unplaced(config: JobConfig, run_dir: Optional[str]) -> str:
    """What the cluster has now, against the group it could not place (after a lost or preempted
    node, say), and how the run continues."""
    s = config.scaling
    fit, nodes = fitting_now(config)
    resume = f"`--resume --run-dir {run_dir}`" if run_dir else "--resume"
    then = (f"{resume} continues from its latest checkpoint" if fit >= s.min_workers else
            f"{resume} continues from its latest checkpoint (with --workers {fit} it fits now)" if fit else
            f"{resume} continues it once the cluster has room")
    wanted = f"the {count(s.min_workers, 'worker')} its range needs" if s.elastic else count(s.workers, "worker")
    return (f"the cluster could not place {wanted} within {config.failure.placement_timeout_s:g}s "
            f"(failure.placement_timeout_s): it holds {fit} now ({nodes}); {then}")


class RoomWatch(threading.Thread):
    """While a run on Ray is on: once the cluster holds fewer workers than it needs (a range's
    `min`; nodes being drained not counted), one line; back, one line. A range below `min` for
    `failure.placement_timeout_s` ends (the main thread is interrupted, and `gave_up` says why);
    a fixed size ends by its start tries."""

    def __init__(self, config: JobConfig, run_dir: str, echo: Callable[[str], None]):
        super().__init__(daemon=True, name="raytrain-room-watch")
        self.config, self.run_dir, self.echo = config, run_dir, echo
        self.gave_up: Optional[str] = None
        self._stopped = threading.Event()

    def run(self) -> None:
        s, timeout = self.config.scaling, self.config.failure.placement_timeout_s
        low, needs = s.min_workers, "the range needs at least" if s.elastic else "the run needs"
        below_since = None
        while not self._stopped.wait(WATCH_INTERVAL_S):
            try:
                fit, nodes = fitting_now(self.config)
            except Exception:  # noqa: BLE001 - the cluster did not answer this time; Ray Train will say if it is gone
                continue
            if fit >= low:
                if below_since is not None:
                    self.echo(f"the cluster holds {count(fit, 'worker')} again ({nodes})")
                below_since = None
            elif below_since is None:
                below_since = time.monotonic()
                self.echo(f"waiting for room: the cluster holds {fit} of the {low} workers {needs} ({nodes}); "
                          f"giving up in {timeout:g}s (failure.placement_timeout_s)")
            elif s.elastic and time.monotonic() - below_since >= timeout:
                self.gave_up = unplaced(self.config, self.run_dir)
                _thread.interrupt_main(signal.SIGINT)  # Ray Train's own handler stops the run
                return

    def stop(self) -> None:
        self._stopped.set()
        self.join()
