"""This rank's part in a run: what the loop (and what follows each of its steps) needs besides
the job's own settings, decided when the worker starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import ray.train
import torch

from raytrain_app.config import JobConfig
from raytrain_app.rundir import snapshot
from raytrain_app.worker.heartbeat import Heartbeat
from raytrain_app.worker.reporter import Reporter


@dataclass(frozen=True)
class Worker:
    """This worker's part in the run: what the loop needs besides the job's own settings."""

    job: JobConfig
    run_dir: str
    rank: int
    world_size: int
    node: str  # Ray's node id (local mode: the host's name), for the mesh's host grouping
    device: torch.device
    report: Reporter  # this rank's log, and the events the driver's console shows
    marks: dict  # start-up times so far (wall clock), for the first step's breakdown
    local: bool = False  # see args.WorkerArgs.local
    notices: bool = False  # see args.WorkerArgs.notices
    stop_flag: Any = None  # see args.WorkerArgs.stop_flag
    heartbeat: Optional[Heartbeat] = None  # this rank's progress, which the driver watches for hangs

    def latest_checkpoint(self) -> Optional[ray.train.Checkpoint]:
        """Where training continues from: what Ray Train hands a (re)started group, or in local
        mode the newest checkpoint of the run's own index (a restarted launch starts afresh)."""
        if not self.local:
            return ray.train.get_checkpoint()
        latest = snapshot.latest(self.run_dir)
        return ray.train.Checkpoint(latest) if latest else None
