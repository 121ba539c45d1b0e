"""The one interface every engine that runs submitted jobs implements (Ray's Jobs API, SLURM,
KubeRay): the CLI picks the profile's backend once (`engines.for_profile`) and never asks which
engine it holds. A new engine is a class with these methods, and a line in `engines.py`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

from raytrain_app.launch.submission import Submission

Echo = Callable[[str], None]


@dataclass
class Submitted:
    job_id: str
    said: list[str]  # where the job went and where its output is, for the user
    warnings: list[str] = field(default_factory=list)  # what the user should know before it runs


class Backend(Protocol):
    success: str  # the engine's name for a job that succeeded

    def check_ready(self) -> None:
        """What this machine needs before it submits (the engine's commands), checked in seconds."""

    def submit(self, sub: Submission) -> Submitted:
        """Check that the cluster can hold and store the job, then hand it over."""

    def follow(self, job_id: str, echo: Echo) -> str:
        """Stream the job's output to `echo` until it ends; its final status."""

    def status(self, job_id: str) -> str:
        """The job's status, with the engine's reason when it gives one."""

    def logs(self, job_id: str) -> str:
        """The job's output so far."""

    def stop(self, job_id: str) -> str:
        """Stop the job and wait until the engine says it ended; its final status."""

    def jobs(self, statuses: Sequence[str] = ()) -> list[dict]:
        """The jobs, oldest first, as `list` shows them (`console.JOB_COLUMNS`), in Ray's states."""

    def describe(self) -> Iterator[str]:
        """`cluster status`'s lines, each as soon as it is known: the nodes with their free and
        total resources, then the running jobs."""

    def render(self, sub: Submission, warn: Echo) -> str:
        """The engine's own job file for `sub` (an sbatch script, a RayJob), for submitting by hand."""
