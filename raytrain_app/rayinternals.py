"""The few private Ray APIs raytrain-app relies on, each wrapped once, here.

Each stands in for something Ray 2.60 has no public API for. `tests/test_rayinternals.py` checks
that the installed Ray still has every one of them, and names the one that went missing.
"""

from __future__ import annotations

import functools
from typing import Callable

RAYLET = "raylet"


def session_logs_dir() -> str:
    """The running session's log directory (copied into the run directory at the end)."""
    import ray._private.worker

    return ray._private.worker.global_worker.node.get_logs_dir_path()


def reload_auth_config() -> None:
    """Ray reads RAY_AUTH_MODE and the token's source when it loads; `session.connected` sets them
    before that, and calls this only when a library caller had loaded Ray already (Ray's own token
    setup re-reads them the same way)."""
    import ray._raylet

    ray._raylet.Config.initialize("")


def route_raylet_errors(sink: Callable[[str], None]) -> None:
    """Send the errors that raylets push to the driver ("A worker died or was killed ...") to
    `sink` instead of stdout.

    Ray prints them from a background thread of every driver, whatever `log_to_driver` says, as
    a paragraph; raytrain-app says the same in one line of its own and keeps Ray's text in the log.
    """
    import ray._private.worker as worker

    original = getattr(worker.print_to_stdstream, "__wrapped__", worker.print_to_stdstream)

    @functools.wraps(original)
    def print_to_stdstream(data, ignore_prefix: bool):
        if data.get("pid") == RAYLET:
            for line in data.get("lines", []):
                sink(line)
        else:
            original(data, ignore_prefix)

    worker.print_to_stdstream = print_to_stdstream


def put_nowait(queue, item) -> None:
    """Queue an item without waiting for the queue actor's answer (`Queue.put` waits for it)."""
    queue.actor.put_nowait.remote(item)


def placement_timed_out(error: BaseException) -> bool:
    """Ray Train gave up waiting for the cluster to place a (re)started worker group (its
    start-up timeout, which `failure.placement_timeout_s` sets)."""
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

    return isinstance(error, WorkerGroupStartupTimeoutError)


def draining_nodes() -> set[str]:
    """The ids of the connected cluster's nodes being drained (preempted, or scaled down): alive
    still, but taking no new workers."""
    from ray._private.state import state

    return set(state.get_draining_nodes())
