"""Config -> plan: everything decided and checked on the driver before Ray starts.

The plan resolves "auto" choices (precision, backend), picks the run directory, and runs the
cheap checks that would otherwise fail minutes later inside a worker: the data loads, the model
accepts it, the labels fit the model, each worker's shard holds a batch; or a script compiles.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

from raytrain_app import storage, tracking
from raytrain_app.config import JobConfig
from raytrain_app.config.resolve import absolute_paths, resolve_auto
from raytrain_app.errors import ConfigError, UserError
from raytrain_app.preflight.checks import check_data_and_model, check_resumable, check_script
from raytrain_app.rundir import SNAPSHOT
from raytrain_app.rundir.lease import Lease


@dataclass(frozen=True)
class RunPlan:
    config: JobConfig  # resolved: no "auto" left but the strategy's units and replicas, which workers decide
    run_dir: str  # absolute local path or URI
    resume: bool
    warnings: tuple[str, ...] = ()  # what the user should hear before the run starts
    lease: Optional[Lease] = None  # the run directory's, held from the plan to the end of the run
    local: bool = False  # through Ray Train's local mode, with no Ray cluster (driver/local.py)
    trial: bool = False  # a sweep's trial, inside Ray Tune

    @property
    def log_dir(self) -> str:
        """Where this process writes the driver's and Ray's logs: RUN_DIR/logs, or for a run
        directory on object storage a local folder uploaded there at the end (`upload_logs`)."""
        if storage.is_local(self.run_dir):
            return os.path.join(self.run_dir, "logs")
        return os.path.join(tempfile.gettempdir(), f"raytrain-{os.getuid()}", "logs", os.path.basename(self.run_dir))

    def upload_logs(self, warn: Callable[[str], None]) -> None:
        """The driver's logs into the run directory on object storage; failing to is a warning."""
        if not storage.is_local(self.run_dir) and os.path.isdir(self.log_dir):
            try:
                storage.upload(self.log_dir, storage.join(self.run_dir, "logs"))
            except Exception as e:  # noqa: BLE001 - pyarrow's and the store's errors alike: never the run's outcome
                warn(f"the driver's logs were not uploaded to {self.run_dir}/logs: {storage.explain(e)}")


def make_plan(config: JobConfig, run_dir: Optional[str] = None, resume: Union[bool, str] = False,
              source: str = "config", warn: Callable[[str], None] = print, sweep_trial: bool = False,
              local: bool = False) -> RunPlan:
    """`resume` "if_any" continues `run_dir` when it holds a checkpoint and starts it otherwise: the
    entrypoint of a job that its scheduler may run again (a retried RayJob, a requeued SLURM job).

    The plan holds the run directory's lease (`plan.lease`): its caller releases it when the run
    ends. `warn` hears of a lease taken over from a holder that is gone."""
    config = resolve_auto(config)
    if resume == "if_any" and not run_dir:
        raise UserError("--resume-if-any needs --run-dir: the run it may continue")
    run_dir = storage.normalize(run_dir or _latest_or_new_run_dir(config.name, resume))
    # Before anything else looks at the directory: a second writer is refused here, in one line.
    held = Lease.acquire(run_dir, "sweep trial" if sweep_trial else "train", warn)
    try:
        storage.check_writable(run_dir)  # a full or read-only volume, now, not at the first checkpoint
        return _checked(config, run_dir, resume, source, held, local, sweep_trial)
    except BaseException:
        held.release()
        raise


def _checked(config: JobConfig, run_dir: str, resume: Union[bool, str], source: str, held: Lease,
             local: bool, trial: bool) -> RunPlan:
    """The plan's checks, with the run directory's lease held; nothing in it changes until they pass."""
    # Ray Train writes its index after every checkpoint: something to resume, and no fresh start here.
    has_checkpoint = storage.exists(storage.join(run_dir, SNAPSHOT))
    if_any = resume == "if_any"
    if if_any:
        resume = has_checkpoint
    if resume and not has_checkpoint:
        raise UserError(f"--resume: no checkpoint to resume in {run_dir}")
    if not resume and has_checkpoint:
        raise UserError(f"{run_dir} already holds a run: pass --resume to continue it, or choose another --run-dir")
    warnings = []
    try:
        if config.script:
            check_script(config.script.path)
        else:
            model = check_data_and_model(config)
            if resume:
                warnings += check_resumable(config, run_dir, model, if_any)
    except ConfigError as e:
        raise ConfigError(*[f"{source}: {line}" for line in e.lines]) from None
    if not config.script:
        tracking.check(config.tracking, run_dir)
        config = absolute_paths(config)
    if config.strategy.sharded and config.scaling.max_workers == 1:
        warnings.append(f"strategy {config.strategy.name} on one worker has nothing to shard over: training it "
                        "unsharded")
    return RunPlan(config, run_dir, bool(resume), tuple(warnings), held, local, trial)


def _latest_or_new_run_dir(name: str, resume: bool) -> str:
    if not resume:
        return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    previous = sorted(d for d in os.listdir("runs") if d.startswith(f"{name}-")) if os.path.isdir("runs") else []
    if not previous:
        raise UserError(f"--resume: no earlier run of '{name}' under runs/; name one with --run-dir")
    return os.path.join("runs", previous[-1])
