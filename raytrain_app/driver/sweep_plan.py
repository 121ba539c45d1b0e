"""A sweep's plan: its trials' job, parameters, metric and scheduler, checked before any trial
starts, and what runs it (here, or as one job on a profile's cluster).

The sweep directory describes itself (`sweep.json`: the job, the parameters, the scheduler), so
`--resume DIR` needs nothing else. Planning imports no Ray Tune: a sweep it cannot run is one
line within a second, and one submitted to a cluster runs Tune there only (`driver/sweep.py`).
"""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from raytrain_app import storage
from raytrain_app.cluster.profiles import ClusterProfile
from raytrain_app.config import JobConfig, nested, updated
from raytrain_app.config.resolve import resolve_auto
from raytrain_app.config.sections import metric_mode
from raytrain_app.driver import local
from raytrain_app.driver.params import Param
from raytrain_app.errors import UserError
from raytrain_app.launch.submission import (
    JOB_ENTRY,
    Submission,
    gpus_per_worker,
    job_folder,
    job_runtime_env,
    new_job_id,
    on_the_cluster,
    running_in,
)
from raytrain_app.preflight.checks import check_data_and_model

SPEC_FILE = "sweep.json"

# A trial's function only waits on its TorchTrainer, so it takes no CPU (else a one-CPU node
# could not hold a trial and its worker); Tune's placement group needs something in its bundle.
TRIAL_DRIVER = {"cpu": 0, "memory": 1}


def trains_in_trial(config: JobConfig) -> bool:
    """A one-worker trial trains in its own Tune actor, through local mode: Ray Train's controller
    and worker actors would cost it seconds of start-up, and a sweep runs many trials. Its
    actor then holds the worker's CPUs (and GPU). A trial of more workers, or of a job that needs
    Ray Train's workers, runs a TorchTrainer as `train` does on a cluster."""
    return config.scaling.workers == 1 and config.scaling.local is not False and not local.cannot(config)


def trial_resources(config: JobConfig) -> dict:
    s = config.scaling
    return {"cpu": s.cpus_per_worker, "gpu": s.gpus_per_worker} if trains_in_trial(config) else TRIAL_DRIVER


@dataclass(frozen=True)
class Sweep:
    """What `sweep.json` holds: everything a resume needs."""

    job: dict  # the job config, resolved, before the trials' settings
    params: list[Param]
    samples: int
    scheduler: str  # asha | fifo
    metric: str
    mode: str  # max | min
    max_concurrent: Optional[int]  # None: what the cluster holds, decided once connected
    seed: int  # Tune's sampler: the same sweep draws the same settings

    @property
    def config(self) -> JobConfig:
        return JobConfig.from_dict(self.job)

    def trial_config(self, settings: dict, source: str = "sweep") -> JobConfig:
        """The job with one trial's settings, ranking its checkpoints by the sweep's metric."""
        changes = nested({"checkpoint.metric": self.metric, "checkpoint.mode": self.mode, **settings})
        return resolve_auto(updated(self.config, changes, source))

    def spec(self) -> str:
        return json.dumps({**asdict(self), "params": [str(p) for p in self.params]}, indent=1) + "\n"

    def save(self, sweep_dir: str) -> None:
        storage.write_text(storage.join(sweep_dir, SPEC_FILE), self.spec())

    def describe(self) -> str:
        return (f"{self.samples} samples of {', '.join(map(str, self.params))}; {self.scheduler} on {self.metric} "
                f"({self.mode})")

    @classmethod
    def load(cls, sweep_dir: str) -> "Sweep":
        path = storage.join(sweep_dir, SPEC_FILE)
        if not storage.exists(path):
            raise UserError(f"--resume: {sweep_dir} holds no sweep (no {SPEC_FILE})")
        spec = json.loads(storage.read_text(path))
        return cls(**{**spec, "params": [Param.parse(p) for p in spec["params"]]})


def plan_sweep(config: JobConfig, param_exprs: Sequence[str], samples: int, scheduler: str,
               metric: Optional[str], mode: Optional[str], max_concurrent: Optional[int], check: bool = True) -> Sweep:
    """Check everything a trial would trip over before any starts: each parameter's distribution
    and key (its first value applied to the job), the metric, and (with `check`) the job's model
    and data, built here."""
    if samples < 1:
        raise UserError(f"--samples must be >= 1, got {samples}")
    if not param_exprs:
        raise UserError("a sweep needs at least one --param KEY=KIND:ARGS")
    if max_concurrent is not None and max_concurrent < 1:
        raise UserError(f"--max-concurrent must be >= 1, got {max_concurrent}")
    if config.script:
        raise UserError("sweep runs job configs; a script's settings are its own arguments")
    if config.scaling.local is True:
        raise UserError("scaling.local: true: a sweep's trials run under Ray Tune, on Ray; drop scaling.local")
    if config.scaling.elastic:
        raise UserError("scaling.workers: a sweep's trials run at a fixed size, not a range: give a number")
    config = resolve_auto(config)
    params = [Param.parse(expr) for expr in param_exprs]
    if len({p.key for p in params}) < len(params):
        raise UserError("--param: a key is given twice")
    metric = metric or config.checkpoint.metric
    reported = config.reported_metrics
    if reported is not None and metric not in reported:
        raise UserError(f"--metric {metric} is not a metric of this job (choose from {', '.join(reported)})")
    if mode is None:
        mode = config.checkpoint.mode if metric == config.checkpoint.metric else metric_mode(metric)
    sweep = Sweep(config.to_dict(), params, samples, scheduler, metric, mode, max_concurrent, config.seed)
    for param in params:  # a key the job does not have, or a value of the wrong type: one line now
        sweep.trial_config({param.key: param.values[0]}, f"--param {param}")
    if check:  # what `train` checks on the driver (builders, their args, labels, shards), for one trial
        first = sweep.trial_config({p.key: p.values[0] for p in params}, "the first trial's config")
        check_data_and_model(first)
    return sweep


def plan_for(config: JobConfig, param_exprs: Sequence[str], samples: int, scheduler: str, metric: Optional[str],
             mode: Optional[str], max_concurrent: Optional[int], profile: Optional[ClusterProfile] = None,
             check: bool = True) -> Sweep:
    """`plan_sweep` for where the sweep will run: here, or on the profile's cluster, its trials
    placed as `submit` places a job and its builders checked in the job's folder, as there."""
    if profile is None:
        return plan_sweep(config, param_exprs, samples, scheduler, metric, mode, max_concurrent, check)
    with running_in(job_folder(profile)):
        return plan_sweep(on_cluster(config, profile), param_exprs, samples, scheduler, metric, mode, max_concurrent,
                          check)


def on_cluster(config: JobConfig, profile: ClusterProfile) -> JobConfig:
    """Trials for a profile's cluster, whose workers take a GPU each (or `scaling.gpus_per_worker`)
    where its nodes have GPUs, as `submit` places them, and are placed as the profile says."""
    gpus = gpus_per_worker(config, profile.gpus_per_node)
    return updated(config, {"scaling": {"gpus_per_worker": float(gpus), "placement": profile.placement}},
                   f"{config.name} on {profile.source}")


def submission(sweep: Sweep, profile: ClusterProfile, sweep_dir: Optional[str], nodes: Optional[int],
               resume: bool) -> Submission:
    """The sweep as one job on the profile's cluster, whose driver runs `sweep --resume SWEEP_DIR`
    there: `sweep.json`, written into SWEEP_DIR (by default in the profile's storage) just before
    the job is sent, is all it reads. A SLURM job asks for `nodes` whole nodes, and its trials
    take turns on them; a Ray cluster must have the profile's nodes."""
    nodes = profile.nodes if nodes is None else nodes
    if nodes < 1:
        raise UserError(f"--nodes must be >= 1, got {nodes}")
    s = sweep.config.scaling
    per_node = (profile.gpus_per_node // int(s.gpus_per_worker) if s.gpus_per_worker
                else int(profile.cpus_per_node // s.cpus_per_worker))
    if per_node < 1:
        raise UserError(f"a node of {profile.source} ({profile.cpus_per_node} CPUs, {profile.gpus_per_node} GPUs) "
                        f"holds no worker of {s.cpus_per_worker:g} CPUs and {s.gpus_per_worker:g} GPUs")
    if s.workers > nodes * per_node:
        raise UserError(f"a trial's {s.workers} workers do not fit on {nodes} nodes of {per_node} workers each "
                        "(--nodes, --workers)")
    job_id = new_job_id(f"{sweep.config.name}-sweep")
    # A local path as the cluster sees it: its jobs run in their working_dir, not here.
    sweep_dir = storage.normalize(sweep_dir or storage.join(storage.normalize(profile.storage), job_id))
    entrypoint = f"{JOB_ENTRY} sweep --resume {shlex.quote(sweep_dir)} {on_the_cluster(profile)}"
    runtime_env = job_runtime_env(profile, job_folder(profile), {})
    return Submission(profile, sweep.config, job_id, sweep_dir, nodes, per_node, runtime_env, entrypoint,
                      files={} if resume else {SPEC_FILE: sweep.spec()}, sweep=sweep.describe())


def trials_that_fit(config: JobConfig, cpus: float, gpus: float) -> int:
    """How many trials the cluster holds at once: its GPUs (or CPUs) over one trial's."""
    from raytrain_app.cluster.capacity import spare_cpus

    s = config.scaling
    if s.gpus_per_worker:
        return max(1, int(gpus // (s.workers * s.gpus_per_worker)))
    return max(1, int(cpus // (s.workers * s.cpus_per_worker + spare_cpus(config))))


def new_sweep_dir(name: str) -> str:
    return os.path.abspath(os.path.join("sweeps", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"))
