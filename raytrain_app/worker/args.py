"""What the driver hands every worker, of the built-in loop or of a script: one object, which
crosses the Ray boundary (or, in local mode, a process's), and loads without Ray."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class WorkerArgs:
    """What the driver hands every worker."""

    job: dict  # the resolved job config as plain data; each worker validates it again
    run_dir: str  # a local path or URI: where checkpoints and metrics live
    events: Any  # a ray.util.queue.Queue that the driver's console reads
    progress: bool  # rank 0 reports its position within epochs (the driver shows a bar)
    log_dir: str  # RUN_DIR/logs, a local path or URI: where rank-N.log goes
    cwd: Optional[str]  # the launch directory, when workers should run there (not with a working_dir)
    restarts: Any = None  # a script run's restarts so far on Ray: a script_on_ray.RestartCount actor
    marks: Optional[dict] = None  # the driver's start-up marks (wall clock), for the trackers' breakdown
    local: bool = False  # Ray Train's local mode: no controller keeps checkpoints, the loop does (driver/local.py)
    node: Optional[str] = None  # the Ray node a local-mode worker runs on, inside a sweep's trial
    notices: bool = False  # ask Ray Train for preemption notices (its watcher runs on this cluster)
    stop_flag: Any = None  # a preemption.StopFlag, which the driver sets on SIGUSR1
