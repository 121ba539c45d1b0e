"""The versions a job depends on, compared between this machine and the cluster, so that a mismatch
is one line before anything is sent rather than a failure on the cluster.

A job brings raytrain-app and its pure-Python dependencies (`package.py`); the rest must be on
the cluster's nodes: the same Ray and Python as here, and what raytrain-app requires of torch,
pyarrow, pydantic and the others. A Jobs API cluster is asked first, by a one-second job that
prints its versions (`probe`); a RayJob's or SLURM job's cluster exists only once the job runs,
so the job checks itself at its start (`job_entry`) against what this machine recorded in it.
A cluster that has raytrain-app installed at another version runs the job's own, and says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shlex
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

from packaging.version import Version

from raytrain_app.cluster.profiles import user_runtime_dir
from raytrain_app.errors import UserError
from raytrain_app.launch.package import PROJECT, not_carried

SUBMITTED_WITH_ENV = "RAYTRAIN_SUBMITTED_WITH"  # this machine's versions, carried by the job
PROBE_MARK = "raytrain-versions: "
PROBE_TIMEOUT_S = 60.0
PROBE_METADATA = {"raytrain.probe": "versions"}

# Run on a node by `python -c`: only the standard library, and Ray's vendored packages (psutil)
# on the path as Ray puts them there, so that they count as the node's.
PROBE = """
import importlib.metadata as m, importlib.util as u, json, os, platform, sys
ray = u.find_spec("ray")
if ray:
    sys.path.append(os.path.join(ray.submodule_search_locations[0], "thirdparty_files"))
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
names = json.loads(sys.argv[1])
print(MARK + json.dumps({"python": platform.python_version(), "packages": {n: version(n) for n in names}}))
"""


@dataclass
class Versions:
    python: str
    packages: dict[str, Optional[str]]  # None: not installed

    @classmethod
    def here(cls) -> "Versions":
        """This process's: what the job was planned with, or what a node runs."""
        return cls(platform.python_version(), {name: _installed(name) for name in compared()})

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, text: str) -> "Versions":
        return cls(**json.loads(text))


def compared() -> list[str]:
    """The distributions whose versions matter: Ray, raytrain-app, and what the job does not bring."""
    return sorted({"ray", PROJECT, *(r.name for r in not_carried())})


def _installed(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check(ours: Versions, theirs: Versions, where: str, here: str = "this machine") -> None:
    """Raise one line per mismatch between `here` (`ours`, where the job was planned) and `where`
    (`theirs`): Python's minor version, Ray's exact one, an unmet requirement of raytrain-app."""
    problems = []
    if _minor(ours.python) != _minor(theirs.python):
        problems.append(f"{where} runs Python {theirs.python} and {here} Python {ours.python}: submit from a "
                        f"Python {_minor(theirs.python)} environment (the job runs the submitting machine's "
                        "raytrain-app code there)")
    ray_here, ray_there = ours.packages.get("ray"), theirs.packages.get("ray")
    if ray_there != ray_here:
        problems.append(f"{where} runs Ray {ray_there} and {here} Ray {ray_here}: use the same Ray on both "
                        f"(pip install 'ray[default,train]=={ray_there}' where the job is submitted)" if ray_there
                        else f"{where} has no Ray installed in the Python its jobs run")
    for requirement in not_carried():
        found = theirs.packages.get(requirement.name)
        if requirement.name.lower() != "ray" and (found is None or Version(found) not in requirement.specifier):
            problems.append(f"{where} has {f'{requirement.name} {found}' if found else f'no {requirement.name}'}, "
                            f"and raytrain-app needs {requirement}: install it in the cluster's image or "
                            "environment (jobs bring only pure-Python packages)")
    if problems:
        raise UserError(*problems)


def other_raytrain_app(ours: Versions, theirs: Versions) -> Optional[str]:
    """The version of raytrain-app `theirs` has installed, when it is not the one `ours` has."""
    installed = theirs.packages.get(PROJECT)
    return installed if installed and installed != ours.packages.get(PROJECT) else None


def _minor(python: str) -> str:
    return ".".join(python.split(".")[:2])


def probe(client, address: str, session: str, timeout_s: float = PROBE_TIMEOUT_S) -> Versions:
    """The cluster's versions, from a job that prints them (through `client`, a Ray
    JobSubmissionClient), asked once per cluster `session` (Ray's session name: a restarted
    cluster is asked again). The job stays in Ray's job list, marked `PROBE_METADATA`, which
    `list` leaves out: Ray's job manager writes a deleted job's record back when it sees its
    supervisor exit."""
    cached = os.path.join(user_runtime_dir(), "versions",
                          hashlib.sha256(f"{address} {session}".encode()).hexdigest()[:16] + ".json")
    with contextlib.suppress(OSError, ValueError, TypeError):
        return Versions(**json.loads(Path(cached).read_text()))
    code = PROBE.replace("MARK", repr(PROBE_MARK))
    job_id = client.submit_job(entrypoint=f"python -c {shlex.quote(code)} {shlex.quote(json.dumps(compared()))}",
                               metadata=PROBE_METADATA)
    deadline = time.monotonic() + timeout_s
    while (status := str(client.get_job_status(job_id).value)) not in ("SUCCEEDED", "FAILED", "STOPPED"):
        if time.monotonic() > deadline:
            client.stop_job(job_id)
            raise UserError(f"the cluster at {address} did not run a one-second version check within "
                            f"{timeout_s:g}s (job {job_id}, {status}): is its head node overloaded?")
        time.sleep(0.1)
    logs = client.get_job_logs(job_id)
    found = [line[len(PROBE_MARK):] for line in logs.splitlines() if line.startswith(PROBE_MARK)]
    if status != "SUCCEEDED" or not found:
        said = [line for line in logs.splitlines() if line.strip()]
        raise UserError(f"the cluster at {address} failed a version check (`python` on its nodes): "
                        f"{said[-1].strip() if said else status}")
    os.makedirs(os.path.dirname(cached), mode=0o700, exist_ok=True)
    Path(cached).write_text(found[-1])
    return Versions(**json.loads(found[-1]))
