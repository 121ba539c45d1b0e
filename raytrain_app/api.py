"""The library's entry points: `fit` trains a job the way `raytrain-app train` does, and
`load_model` gives back a trained model for inference.

config -> plan (auto choices, run directory, checks on this machine) -> a Ray cluster (embedded,
joined, or at an address) -> Ray Train -> the result. The CLI is a thin layer over this.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from raytrain_app.config import SMOKE, JobConfig, flag_overrides, load_config, with_overrides
from raytrain_app.driver import signals
from raytrain_app.errors import Interrupted, UserError


@signals.kept
def fit(config: Union[str, Path, dict, JobConfig], *, overrides: Optional[Sequence[str]] = None,
        workers: Union[int, str, None] = None, gpus_per_worker: Optional[float] = None, run_dir: Optional[str] = None,
        address: Optional[str] = None, resume: Union[bool, str] = False, verbose: bool = False, progress: bool = False,
        echo: Callable[[str], None] = print, started: Optional[float] = None, script_args: Sequence[str] = (),
        min_nodes: int = 1, node_timeout_s: float = 600, local: Optional[bool] = None, smoke: bool = False):
    """Train `config` (a YAML path, "-" for standard input, a dict, or a JobConfig) and return the
    run's `Result` (run_dir, metrics per epoch, best and final checkpoint, wall time).

    A path ending in `.py` is a torchrun-style script instead, run unchanged on every worker with
    `script_args` as its arguments (see `worker/script.py`); `overrides` then set its name, scaling,
    failure and checkpoint.keep.

    In a dict or JobConfig, `model.name` and `data.name` may be the builder functions themselves
    (a notebook's, say). `overrides` are `--set` expressions; `workers` (a number, or "MIN:MAX")
    and `gpus_per_worker` set the scaling; `resume` True continues a run (see `make_plan` for
    "if_any"); `address` picks the cluster as `--address` does, and a process already connected
    to Ray (`ray.init()` done) trains there,
    and a cluster at `address` gets `node_timeout_s` to reach `min_nodes` nodes; `echo` receives
    the console lines. `local` True runs through Ray Train's local mode with no Ray cluster, False
    on Ray, None as `scaling.local` says (see `driver/local.py`). `smoke` runs a few batches of one
    epoch through every path, as NAME-smoke (see `config.SMOKE`). Raises UserError (ConfigError)
    for anything the user can fix, TrainingFailed when training started and did not finish.
    """
    marks = {"start": started or time.time()}
    users_sets = [*(overrides or ()), *flag_overrides(workers=workers, gpus_per_worker=gpus_per_worker, local=local)]
    source, job = job_config(config, [*(SMOKE if smoke else ()), *users_sets], script_args)
    if smoke:
        if job.script:
            raise UserError("--smoke runs raytrain-app's own training loop, not a script: run the script with "
                            "its own short settings")
        job = job.model_copy(update={"name": f"{job.name}-smoke"})
    # torch and Ray load only now: a config error is reported in a fraction of a second, and
    # Ray reads its auth settings when it loads, after the cluster choice has set them.
    from raytrain_app.cluster.session import ray_connected
    from raytrain_app.driver import local as local_mode

    locally = local_mode.choose(job, address, min_nodes, ray_connected=ray_connected())
    # The worker processes' fork server loads their imports beside this process: from the start
    # where this process has yet to load torch itself (a command), else once the checks passed
    # (a notebook's fit(), with nothing to overlap: a refused job then starts nothing).
    fork_server = locally and job.scaling.max_workers > 1 and not job.script  # (a script's ranks: driver/scripts.py)
    if fork_server and "torch" not in sys.modules:
        local_mode.start_fork_server()  # (a child process: it ends with this one, also on a refusal)
    from raytrain_app.driver.plan import make_plan

    plan = make_plan(job, run_dir=run_dir, resume=resume, source=source, warn=lambda line: echo(f"warning: {line}"),
                     local=locally)
    if fork_server:
        local_mode.start_fork_server()  # if it is not up already
    try:
        result = _run(plan, address, verbose, progress, echo, marks, min_nodes, node_timeout_s)
    except KeyboardInterrupt:
        raise Interrupted(_how_to_continue(config, plan, users_sets, smoke, script_args)) from None
    finally:
        plan.upload_logs(lambda line: echo(f"warning: {line}"))
        plan.lease.release()
    result.wall_s = time.time() - marks["start"]  # the command's, its cluster's stop included
    return result


def _run(plan, address, verbose, progress, echo, marks, min_nodes, node_timeout_s):
    """The planned run on its cluster."""
    # torch loads before Ray connects (a job's checks have loaded it already; a script's have
    # not): loaded after Ray inside a Ray job, libtorch fails with "oneMKL FATAL ERROR".
    import torch  # noqa: F401

    from raytrain_app.cluster.capacity import spare_cpus
    from raytrain_app.cluster.session import cluster_for
    marks["planned"] = time.time()
    s = plan.config.scaling
    what = plan.config.script.path if plan.config.script else f"{s.backend}, {plan.config.train.precision}"
    where = "local mode (no Ray cluster; --ray for one)" if plan.local else "on Ray"
    echo(f"run {plan.run_dir}: {s.describe_workers()}, {what}, {where}")
    for warning in plan.warnings:
        echo(f"warning: {warning}")
    if plan.local:
        from raytrain_app.driver.trainer import run_training

        marks["cluster"] = marks["planned"]
        return run_training(plan, progress=progress, echo=echo, marks=marks)

    def lost(message: str) -> None:  # the embedded node died under the run, which ends this process
        from raytrain_app.rundir import record_status

        record_status(plan.run_dir, "failed", message)
        plan.lease.release()

    with cluster_for(s, address, plan.log_dir, verbose, echo, spare_cpus(plan.config), min_nodes, node_timeout_s,
                     on_node_lost=lost):
        from raytrain_app.driver.trainer import run_training

        marks["cluster"] = time.time()
        return run_training(plan, progress=progress, echo=echo, marks=marks)


def _how_to_continue(config, plan, sets: Sequence[str], smoke: bool, script_args: Sequence[str]) -> str:
    """What continues an interrupted run: the command, where it has a checkpoint to resume. A
    resume trains the config it is given, so the command repeats the run's `--set`s and flags:
    without them, `train.epochs=500` would resume as the file's 12, and end at once."""
    from raytrain_app import rundir, storage

    if not storage.exists(storage.join(plan.run_dir, rundir.SNAPSHOT)):
        return "no checkpoint was written: start it again"
    what = str(config) if isinstance(config, (str, Path)) else "CONFIG"
    options = "".join(f" --set {shlex.quote(expression)}" for expression in sets) + (" --smoke" if smoke else "")
    args = f" -- {' '.join(script_args)}" if script_args else ""
    return f"`raytrain-app train {what} --resume --run-dir {plan.run_dir}{options}{args}` continues it"


def job_config(config: Union[str, Path, dict, JobConfig], overrides: Sequence[str] = (),
               script_args: Sequence[str] = ()) -> tuple[str, JobConfig]:
    """Where the config came from (for error messages), and the config: read from YAML, taken
    from plain data, or made for a `.py` script and its arguments."""
    if isinstance(config, (str, Path)) and str(config).endswith(".py"):
        script = {"path": str(config), "args": list(script_args)}
        return str(config), with_overrides({"name": Path(config).stem, "script": script}, overrides, str(config))
    if script_args:
        raise UserError(f"arguments after the config ({' '.join(script_args)}) are for a script: SCRIPT.py -- ARGS")
    if isinstance(config, (str, Path)):
        return str(config), load_config(config, overrides)
    raw = config.to_python() if isinstance(config, JobConfig) else config
    return "<config>", with_overrides(raw, overrides)


