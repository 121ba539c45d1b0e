"""Notices that the group is about to go, and the work since the last checkpoint with it.

Two kinds, answered alike, with a checkpoint at the step the loop is at (a just-in-time
checkpoint, kept like any other):

- Ray Train's preemption notice: a node of the group is being drained with a deadline (a spot
  reclaim, or Ray's `drain-node`). The run trains on until Ray Train restarts the group from it.
- A stop request: the driver got SIGUSR1, as SLURM sends it before a job's time limit or a
  preemption (`--signal=B:USR1@GRACE`), and sets its `StopFlag` (in local mode, a `StopFile`). The run stops after the
  checkpoint, to be continued by `--resume` (SLURM's requeue).

The loop asks for them after its steps (`after_step.PreemptionCheck`); a script's Ray worker
answers them for its script (`script_on_ray.py`), and loads neither torch nor, until asked, Ray.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

# The report key under which the checkpoint answering a Ray Train notice names the notice's ranks
# and deadline, for the controller's restart accounting (driver/controller.py, RestartNotices).
ANSWERED = "preemption_notice"


class _Flag:
    """StopFlag's state, in a Ray actor (made one when a StopFlag is: this module loads without Ray,
    for local mode's StopFile)."""

    def __init__(self):
        self.reason: Optional[str] = None
        self.hang: Optional[str] = None

    def set(self, reason: str) -> None:
        self.reason = self.reason or reason

    def get(self) -> Optional[str]:
        return self.reason

    def set_hang(self, line: str) -> None:
        self.hang = line

    def take_hang(self) -> Optional[str]:
        hang, self.hang = self.hang, None
        return hang


class StopFlag:
    """Set by the driver on SIGUSR1; rank 0 reads it at the loop's checks. On Ray, an actor that
    `options` place (beside the driver, where no preemption takes it). It also carries the
    driver's hang verdict to Ray Train's controller, which records the restart (`hung`)."""

    def __init__(self, **options):
        import ray

        self.actor = ray.remote(num_cpus=0)(_Flag).options(**options).remote()

    def set(self, reason: str) -> None:
        self.actor.set.remote(reason)  # no wait: the driver may be in a signal handler

    def get(self) -> Optional[str]:
        import ray

        return ray.get(self.actor.get.remote())

    def hung(self, line: str) -> None:
        """The driver's hang watch is about to kill a rank: the restart that follows is a hang's."""
        import ray

        ray.get(self.actor.set_hang.remote(line))

    def take_hang(self) -> Optional[str]:
        """For Ray Train's controller, recording a restart: the hang that caused it, once."""
        import ray

        return ray.get(self.actor.take_hang.remote())

    def close(self) -> None:
        import ray

        ray.kill(self.actor)


class StopFile:
    """Local mode's StopFlag, with no Ray to hold one: a file in a private folder of the driver's,
    which rank 0 (a process of this machine) looks for; a stat costs microseconds."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="raytrain-stop-")
        self.path = os.path.join(self.folder, "stop")

    def set(self, reason: str) -> None:
        if not os.path.exists(self.path):
            with open(self.path, "w") as f:
                f.write(reason)

    def get(self) -> Optional[str]:
        if not os.path.exists(self.path):  # the common answer, without raising FileNotFoundError
            return None
        try:
            with open(self.path) as f:
                return f.read() or "a stop request"
        except FileNotFoundError:
            return None

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass(frozen=True)
class Stop:
    """A stop request, as the loop sees it: the run checkpoints and stops."""

    reason: str  # "SIGUSR1"


class Stopping(Exception):
    """Raised by the loop once a stop request's checkpoint is written: where the run stopped."""

    def __init__(self, where: dict):
        self.where = where
        super().__init__(f"stopping at step {where['step']}")


def describe(notice, step: int, epoch: int, batch: int, epoch_end: bool) -> str:
    """The console's line for a notice answered with a checkpoint."""
    where = f"the end of epoch {epoch + 1}" if epoch_end else f"step {step} (epoch {epoch + 1}, batch {batch})"
    if isinstance(notice, Stop):
        return f"{notice.reason}: a checkpoint at {where}, then the run stops (--resume continues it)"
    nodes = ", ".join(node[:12] for node in notice.preempted_node_ids)
    left = f" in {max(0.0, notice.deadline_ms / 1000 - time.time()):.0f}s" if notice.deadline_ms else ""
    ranks = notice.preempted_ranks
    return (f"preemption notice: node {nodes} ({'ranks' if len(ranks) > 1 else 'rank'} {', '.join(map(str, ranks))}) "
            f"goes away{left}; "
            f"a checkpoint at {where}, which the restart continues from")


def answered(notice) -> dict:
    """What a report says of the Ray Train notice its checkpoint answers (see ANSWERED)."""
    return {ANSWERED: {"ranks": sorted(notice.preempted_ranks), "deadline_ms": notice.deadline_ms}}
