"""Jobs on a Ray cluster through its Jobs API (kind: ray, and a KubeRay RayCluster's dashboard):
check, submit, follow and manage them. Ray's `ray job status/logs/stop` see the same submission
ids, and the job's metadata carries what `list` shows."""

from __future__ import annotations

import asyncio
import functools
import getpass
import hashlib
import re
import time
from typing import Iterator, Sequence

from raytrain_app import storage
from raytrain_app.cluster.capacity import check_shape_fits, describe_nodes
from raytrain_app.cluster.dashboard import Dashboard
from raytrain_app.cluster.profiles import ClusterProfile
from raytrain_app.config import dump_yaml
from raytrain_app.console import jobs_table
from raytrain_app.errors import UserError, last_line
from raytrain_app.launch import versions
from raytrain_app.launch.backend import Echo, Submitted
from raytrain_app.launch.package import PROJECT
from raytrain_app.launch.submission import Submission, write_files
from raytrain_app.launch.versions import Versions
from raytrain_app.waiting import poll

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
# What Ray's job manager writes at the head of a job's log, before the entrypoint's own output
# ("... INFO job_manager.py:581 -- Runtime env is setting up.", "Running entrypoint for job ..."):
# Ray's chatter, left in the job's logs (`logs`), not streamed to a followed job's console.
RAY_JOB_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+[A-Z]+ job_manager\.py:\d+ -- "
                          r"|Running entrypoint for job ")


class RayJobs:
    success = "SUCCEEDED"

    def __init__(self, profile: ClusterProfile):
        self.profile = profile

    @functools.cached_property
    def dashboard(self) -> Dashboard:
        """Made when first asked (it needs the profile's token; rendering a RayJob does not)."""
        return Dashboard.for_profile(self.profile)

    def check_ready(self) -> None:
        """Nothing to check here: the cluster itself is asked when the job is submitted."""

    def submit(self, sub: Submission) -> Submitted:
        """The cluster answers, holds the job's shape and can be written to (else one line naming
        what was asked and what exists, rather than a job queued forever); then the job, with the
        metadata `list` shows."""
        self.dashboard.check()
        where = f"the cluster at {self.dashboard.address}"
        ours, theirs = Versions.here(), versions.probe(self.dashboard.jobs(), self.dashboard.address,
                                                       self.dashboard.session())
        versions.check(ours, theirs, where)
        installed = versions.other_raytrain_app(ours, theirs)
        notes = [f"{where} has raytrain-app {installed} installed; the job brings raytrain-app "
                 f"{ours.packages[PROJECT]} from this machine and runs it instead"] if installed else []
        check_shape_fits(self.dashboard.alive_nodes(), sub.nodes, sub.workers_per_node, sub.config)
        storage.check_writable(sub.run_dir)
        write_files(sub)
        try:
            job_id = self.dashboard.jobs().submit_job(entrypoint=sub.entrypoint, submission_id=sub.submission_id,
                                                      runtime_env=sub.runtime_env, metadata=_metadata(sub))
        except (ValueError, RuntimeError) as e:  # Ray refuses the runtime_env, or the cluster refuses the job
            raise UserError(f"cannot submit to {self.dashboard.address}: {last_line(e)}") from None
        what = "a sweep" if sub.sweep else sub.config.scaling.describe_workers()
        return Submitted(job_id, [f"submitted {job_id} to {self.profile.jobs_address} ({what}); run directory "
                                  f"{sub.run_dir}", f"dashboard: {self.profile.jobs_address}/#/jobs/{job_id}"], notes)

    def follow(self, job_id: str, echo: Echo) -> str:
        self._info(job_id)
        client = self.dashboard.jobs()

        async def tail() -> None:
            pending = ""  # a line not yet ended: whether it is Ray's is known at its end
            async for chunk in client.tail_job_logs(job_id):
                *lines, pending = (pending + chunk).split("\n")
                shown = "".join(f"{line}\n" for line in lines if not RAY_JOB_LINE.match(line))
                if shown:
                    echo(shown)
            if pending and not RAY_JOB_LINE.match(pending):
                echo(pending)

        asyncio.run(tail())
        return self._wait(job_id, timeout_s=30)

    def status(self, job_id: str) -> str:
        info = self._info(job_id)
        return f"{info.status.value}" + (f" ({info.message})" if info.message else "")

    def logs(self, job_id: str) -> str:
        self._info(job_id)
        return self.dashboard.jobs().get_job_logs(job_id)

    def stop(self, job_id: str, timeout_s: float = 60) -> str:
        # Ray marks a job stopped while it is still PENDING (its runtime env being set up) and may then
        # start its entrypoint all the same (ray-project/ray#58353): stop it once it runs.
        if str(self._info(job_id).status.value) == "PENDING":
            self._wait(job_id, timeout_s, until=TERMINAL | {"RUNNING"})
        self.dashboard.jobs().stop_job(job_id)
        return self._wait(job_id, timeout_s)

    def jobs(self, statuses: Sequence[str] = ()) -> list[dict]:
        wanted = {s.upper() for s in statuses}
        found = sorted((j for j in self.dashboard.jobs().list_jobs() if (not wanted or str(j.status.value) in wanted)
                        and not versions.PROBE_METADATA.items() <= (j.metadata or {}).items()),
                       key=lambda j: j.start_time or 0)
        return [_row(j) for j in found]

    def describe(self) -> Iterator[str]:
        nodes = self.dashboard.alive_nodes()
        yield from describe_nodes(f"cluster '{self.profile.name}' at {self.profile.jobs_address}", nodes,
                                  self.dashboard.free())
        running = self.jobs(("PENDING", "RUNNING"))
        yield f"running jobs: {len(running)}"
        if running:
            yield jobs_table(running)

    def render(self, sub: Submission, warn: Echo) -> str:
        raise UserError(f"{self.profile.source} is a profile of kind: {self.profile.kind}, whose jobs go to the "
                        "Jobs API: `submit --dry-run` shows one")

    def _wait(self, job_id: str, timeout_s: float, until: set[str] = TERMINAL) -> str:
        """The job's status once it is one of `until`, or the last one seen when the time is up."""
        client = self.dashboard.jobs()
        return poll(lambda: str(client.get_job_status(job_id).value), lambda status: status in until, timeout_s,
                    interval_s=0.5)

    def _info(self, job_id: str):
        try:
            return self.dashboard.jobs().get_job_info(job_id)
        except RuntimeError as e:
            if "404" in str(e) or "does not exist" in str(e):
                raise UserError(f"no job '{job_id}' on {self.dashboard.address}") from None
            raise


def _metadata(sub: Submission) -> dict[str, str]:
    """What `list` shows of a job, attached to it at submission (Ray keeps it with the job)."""
    s = sub.config.scaling
    shape = f"{sub.node_range}x{sub.workers_per_node} {'GPU' if s.gpus_per_worker else 'CPU'}"
    name = f"{sub.config.name} (sweep)" if sub.sweep else sub.config.name
    return {"raytrain.name": name, "raytrain.run_dir": sub.run_dir, "raytrain.workers": shape,
            "raytrain.config_sha256": hashlib.sha256(dump_yaml(sub.config).encode()).hexdigest()[:12],
            "raytrain.user": getpass.getuser()}


def _row(job) -> dict:
    """A job as `list` shows it; jobs not submitted by raytrain-app show their entrypoint."""
    meta = job.metadata or {}
    start, end = (t / 1000 if t else None for t in (job.start_time, job.end_time))
    return {"id": job.submission_id or job.job_id, "name": meta.get("raytrain.name", job.entrypoint[:30]),
            "status": str(job.status.value), "start": start,
            "duration_s": ((end or time.time()) - start) if start else None,
            "workers": meta.get("raytrain.workers", "-"), "run_dir": meta.get("raytrain.run_dir", "-"),
            "user": meta.get("raytrain.user"), "config_sha256": meta.get("raytrain.config_sha256")}
