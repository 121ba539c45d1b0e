"""Jobs on a profile's cluster through the Ray Jobs API: plan, check, submit, follow, manage.

A submitted job runs the same `train` command on the cluster (`train - --address auto`), with
the resolved job config carried in the job's runtime_env. Ray's `ray job status/logs/stop`
see the same submission id.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence, Union

from raytrain_app import storage, tracking
from raytrain_app.cluster.profiles import ClusterProfile, mask
from raytrain_app.config import JobConfig, dump_yaml, updated
from raytrain_app.config.resolve import SHIPPED_FROM_ENV, resolve_auto
from raytrain_app.errors import UserError
from raytrain_app.launch import package
from raytrain_app.launch.shipping import check_upload_size, unshipped_imports
from raytrain_app.launch.versions import SUBMITTED_WITH_ENV, Versions
from raytrain_app.preflight.checks import check_data_and_model, check_script
from raytrain_app.rundir import lease, snapshot

CONFIG_ENV = "RAYTRAIN_JOB_CONFIG"
# A job's command on the cluster (cli/job_entry.py): no `raytrain-app` script is needed there.
JOB_ENTRY = "python -m raytrain_app.cli.job_entry"


@dataclass
class Submission:
    """Everything `submit` will send, shown whole by --dry-run."""

    profile: ClusterProfile
    config: JobConfig  # resolved, with the scaling the cluster shape implies
    submission_id: str
    run_dir: str
    nodes: int  # at least; what must fit before the job is sent
    workers_per_node: int
    runtime_env: dict
    entrypoint: str
    warnings: list[str] = field(default_factory=list)  # said once, before anything is sent
    files: dict[str, str] = field(default_factory=dict)  # written into run_dir just before it is sent
    sweep: str = ""  # what a sweep job sweeps (its trials are `config` with sampled settings)
    max_nodes: Optional[int] = None  # `--nodes MIN:MAX`: as many as the cluster gives, up to this

    @property
    def node_range(self) -> str:
        """"2" or "2-4": the nodes asked for, as SLURM writes a range."""
        return f"{self.nodes}-{self.max_nodes}" if self.max_nodes else str(self.nodes)

    def describe(self) -> list[tuple[str, str]]:
        s = self.config.scaling
        per_worker = f"{s.cpus_per_worker:g} CPU" + (f", {s.gpus_per_worker:g} GPU" if s.gpus_per_worker else "")
        shown_env = {**self.runtime_env, "env_vars": mask(self.runtime_env.get("env_vars", {}))}
        if CONFIG_ENV in shown_env["env_vars"]:
            shown_env["env_vars"][CONFIG_ENV] = f"<resolved job config, {len(shown_env['env_vars'][CONFIG_ENV])} bytes>"
        if "py_modules" in shown_env:
            shown_env["py_modules"] = f"<{len(shown_env['py_modules'])} folders: {package.describe()}>"
        workers = f"{self.node_range} nodes x {self.workers_per_node} per node"
        return [
            ("cluster", f"{self.profile.name} ({self.profile.where})"),
            ("submission id", self.submission_id),
            *([("sweep", self.sweep), ("workers", f"{s.workers} per trial; {workers}")] if self.sweep else
              [("workers", f"{s.min_workers} to {s.max_workers} = {workers}" if s.elastic else
                f"{s.workers} = {workers}")]),
            ("per worker", per_worker),
            ("placement", s.placement),
            ("script", " ".join([self.config.script.path, *self.config.script.args])) if self.config.script else
            ("backend", f"{s.backend}, {self.config.train.precision}"),
            ("storage", self.run_dir),
            ("brings", package.describe()),
            ("runtime_env", json.dumps(shown_env, sort_keys=True)),
            ("entrypoint", self.entrypoint),
        ]


def plan_submission(profile: ClusterProfile, config: JobConfig, nodes: Union[int, str, None] = None,
                    gpus_per_node: Optional[int] = None, cpus_per_node: Optional[int] = None,
                    workers_per_node: Optional[int] = None, name: Optional[str] = None,
                    overrides: Sequence[str] = (), check_builders: bool = True,
                    resume: Optional[str] = None) -> Submission:
    """Turn the cluster shape into workers (one per GPU, or per `scaling.gpus_per_worker` whole GPUs,
    or `workers_per_node` per CPU node), check on this machine what `train` would check on the
    cluster, and say what the job will carry. `nodes` "MIN:MAX" makes the workers a range
    (`scaling.workers: {min, max}`), the cluster's nodes times the workers on each. `resume`
    names a run directory the job continues from its latest checkpoint (`submit --resume`)."""
    if config.scaling.local is True:
        raise UserError("scaling.local: true: a submitted job trains on the cluster's Ray; drop scaling.local "
                        "(submit --smoke runs it here first)")
    nodes, max_nodes = node_range(profile.nodes if nodes is None else nodes)
    gpus = profile.gpus_per_node if gpus_per_node is None else gpus_per_node
    cpus = profile.cpus_per_node if cpus_per_node is None else cpus_per_node
    for flag, value, least in (("--gpus-per-node", gpus, 0), ("--cpus-per-node", cpus, 1)):
        if value < least:
            raise UserError(f"{flag} must be >= {least}, got {value}")
    worker_gpus = gpus_per_worker(config, gpus)
    if gpus and gpus % worker_gpus:
        raise UserError(f"--gpus-per-node {gpus} does not split into workers of scaling.gpus_per_worker "
                        f"{worker_gpus} GPUs")
    if gpus and workers_per_node not in (None, gpus // worker_gpus):
        raise UserError("--workers-per-node is for CPU clusters; with GPUs there is one worker per GPU (or per "
                        "scaling.gpus_per_worker GPUs)")
    per_node = gpus // worker_gpus if gpus else (workers_per_node or 1)
    if per_node < 1 or (not gpus and cpus < per_node):
        raise UserError(f"--workers-per-node {per_node} needs at least that many CPUs per node "
                        f"(--cpus-per-node {cpus})")
    shape = f"{nodes}{f'-{max_nodes}' if max_nodes else ''} nodes x {per_node} workers"
    scaling = {
        "workers": {"min": nodes * per_node, "max": max_nodes * per_node} if max_nodes else nodes * per_node,
        "gpus_per_worker": float(worker_gpus),
        # CPU workers take a node's CPUs in equal parts, so exactly `per_node` fit on each node.
        "cpus_per_worker": config.scaling.cpus_per_worker if gpus else float(cpus // per_node),
        "placement": profile.placement,
        "local": False,  # the job trains on the cluster's Ray, never in local mode
    }
    warnings = [f"--set scaling.{key}={getattr(config.scaling, key)!r} is replaced by the cluster's shape "
                f"({shape}): {key} is {value!r}" for key, value in scaling.items()
                if f"scaling.{key}" in _set_keys(overrides) and getattr(config.scaling, key) != value]
    # The cluster's shape replaced the config's workers and GPUs: the rules that depend on them
    # (nccl needs GPUs, ...) are checked again here, not in a job that would fail on the cluster.
    config = resolve_auto(updated(config, {"name": name or config.name, "scaling": scaling},
                                  f"{name or config.name} on {shape}"))
    working_dir = job_folder(profile)
    if config.script:
        check_script(config.script.path)
        working_dir, path = script_in_working_dir(config.script.path, working_dir, profile.source)
        config = updated(config, {"script": {"path": path}})
    elif check_builders:
        with running_in(working_dir):  # where the job runs: imports and relative paths as there
            check_data_and_model(config)
    submission_id = new_job_id(config.name)
    run_dir = resumable(resume) if resume else storage.join(storage.normalize(profile.storage), submission_id)
    if check_builders and not config.script:  # an MLflow server may answer only inside the cluster's network
        tracking.check(config.tracking, run_dir, profile.connect_timeout_s, {**os.environ, **profile.job_env_vars()},
                       packages=False)
    runtime_env = job_runtime_env(profile, working_dir, {CONFIG_ENV: dump_yaml(config)})
    # A job its scheduler runs again (a retried RayJob, a requeued SLURM job) continues its run.
    entrypoint = (f"printenv {CONFIG_ENV} | {JOB_ENTRY} train - {on_the_cluster(profile)} "
                  f"--run-dir {shlex.quote(run_dir)} {'--resume' if resume else '--resume-if-any'}")
    return Submission(profile, config, submission_id, run_dir, nodes, per_node, runtime_env, entrypoint,
                      warnings + unshipped_imports(config, working_dir, profile.source), max_nodes=max_nodes)


def resumable(run_dir: str) -> str:
    """`submit --resume RUN_DIR`: a run with a checkpoint that no command holds now (the cluster's
    nodes must reach it: the profile's storage, or a bucket), checked here rather than by a job
    that would fail on the cluster."""
    run_dir = storage.normalize(run_dir)
    if storage.is_local(run_dir):
        run_dir = os.path.abspath(run_dir)
    try:
        latest = snapshot.latest(run_dir)
        holder = lease.live_holder(run_dir)
    except Exception as e:  # noqa: BLE001 - an unreachable store or bucket, said in one line
        raise UserError(f"--resume {run_dir}: {storage.explain(e)}") from None
    if latest is None:
        raise UserError(f"--resume: no checkpoint to resume in {run_dir}")
    if holder is not None:
        raise UserError(f"--resume: run dir {run_dir} is in use by {holder.describe()}"
                        + (f", job {holder.job.split(':', 1)[1]}" if holder.job else "") + "; stop it first")
    return run_dir


def node_range(nodes: Union[int, str]) -> tuple[int, Optional[int]]:
    """--nodes N or MIN:MAX: (N, None) or (MIN, MAX)."""
    low, _, high = str(nodes).partition(":")
    try:
        low_n, high_n = int(low), int(high) if high else None
    except ValueError:
        raise UserError(f"--nodes must be a number or a range MIN:MAX, got {nodes!r}") from None
    if low_n < 1:
        raise UserError(f"--nodes must be >= 1, got {low_n}")
    if high_n is not None and high_n <= low_n:
        raise UserError(f"--nodes {nodes}: MIN must be below MAX")
    return low_n, high_n


def gpus_per_worker(config: JobConfig, node_gpus: int) -> int:
    """On nodes with GPUs a worker takes one, or several for a model that spreads itself over them."""
    return max(1, int(config.scaling.gpus_per_worker)) if node_gpus else 0


def job_folder(profile: ClusterProfile) -> Optional[str]:
    """The profile's working_dir: what a Ray job uploads, and where a SLURM job runs."""
    working_dir = profile.path(profile.runtime_env.working_dir) if profile.runtime_env.working_dir else None
    if working_dir and not os.path.isdir(working_dir):
        raise UserError(f"{profile.source}: runtime_env.working_dir {working_dir} is not a directory")
    return working_dir


def job_runtime_env(profile: ClusterProfile, working_dir: Optional[str], env_vars: dict[str, str]) -> dict:
    """The job's runtime_env: raytrain-app and what it needs (`package.py`; a SLURM job finds them
    on its shared filesystem instead), its folder (checked for size: Ray uploads it), the
    profile's pip packages and variables, this machine's versions (checked again where the job
    starts) and `env_vars`."""
    ray_uploads = profile.kind != "slurm"  # SLURM jobs run from a shared filesystem
    uploaded = working_dir and ray_uploads
    if uploaded:
        check_upload_size(working_dir, profile.runtime_env.excludes, profile.runtime_env.max_upload_mb,
                          profile.source)
    excludes = list(dict.fromkeys([*(profile.runtime_env.excludes if working_dir else []), *package.SKIPPED]))
    return {
        **({"working_dir": working_dir} if working_dir else {}),
        **({"py_modules": package.py_modules()} if ray_uploads else {}),
        **({"excludes": excludes} if working_dir or ray_uploads else {}),
        **({"pip": profile.runtime_env.pip} if profile.runtime_env.pip else {}),
        "env_vars": {**profile.job_env_vars(), **env_vars, SUBMITTED_WITH_ENV: Versions.here().to_env(),
                     **({SHIPPED_FROM_ENV: working_dir} if uploaded else {})},
    }


def new_job_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


def on_the_cluster(profile: ClusterProfile) -> str:
    """An entrypoint's flags for the cluster it runs in: the job's own Ray, whose other nodes, in a
    SLURM allocation, are still joining while it starts."""
    flags = "--address auto"
    if profile.kind == "slurm":  # every node of the allocation: a range's is known once it starts
        flags += f" --min-nodes $SLURM_JOB_NUM_NODES --node-timeout {profile.slurm.node_wait_s:g}"
    return flags


def script_in_working_dir(script: str, working_dir: Optional[str], profile_source: str) -> tuple[str, str]:
    """The folder the job uploads and the script's path inside it: the profile's working_dir,
    which must hold the script, or else the script's own folder."""
    script = os.path.abspath(script)
    if not working_dir:
        return os.path.dirname(script), os.path.basename(script)
    inside = os.path.relpath(script, working_dir)
    if inside.startswith(os.pardir + os.sep):
        raise UserError(f"script {script} is outside {profile_source}'s runtime_env.working_dir {working_dir}, "
                        f"which is what the job uploads: move it there, or use a profile without a working_dir")
    return working_dir, inside


def _set_keys(overrides: Sequence[str]) -> set[str]:
    return {expr.partition("=")[0].strip() for expr in overrides}


@contextmanager
def running_in(folder: Optional[str]) -> Iterator[None]:
    """Run the block as the job will run on the cluster: in its uploaded working_dir, with that
    folder first on the import path."""
    if not folder:
        yield
        return
    before = os.getcwd()
    os.chdir(folder)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path.remove(folder)
        os.chdir(before)


def write_files(sub: Submission) -> None:
    for name, text in sub.files.items():
        storage.write_text(storage.join(sub.run_dir, name), text)


