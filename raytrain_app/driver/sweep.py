"""Hyper-parameter sweeps with Ray Tune: trials of one job with sampled settings.

Each trial's function trains as `train` does (`make_plan`, `run_training`), in a run directory
of its own under the sweep's, and hands rank 0's epoch reports to Tune with Ray's
`TuneReportCallback` (Ray's pattern for Train V2: the trial function runs the TorchTrainer). A
one-worker trial trains in local mode instead, its worker a process of the trial's own, and the
same callback hears its epochs (`trains_in_trial`). A trial is therefore an ordinary run:
metrics.jsonl, checkpoints, report.png, `runs` and `report` read it. Tune samples the settings,
runs as many trials at once as the cluster holds, and with ASHA stops the weak ones after their
first epochs.

The sweep's plan (`driver/sweep_plan.py`) is saved in its directory, so `--resume DIR` needs
nothing else. Tune restarts unfinished trials, and each continues from its run directory's
latest checkpoint. A trial runs where the sweep's driver runs (its launch directory, or a job's
working_dir), as `train`'s workers do: relative data paths mean the same files in every trial.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import psutil
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search.basic_variant import BasicVariantGenerator

from raytrain_app import rundir, storage
from raytrain_app.console import columns
from raytrain_app.driver.plan import make_plan
from raytrain_app.driver.signals import term_as_interrupt
from raytrain_app.driver.sweep_plan import Sweep, trains_in_trial, trial_resources, trials_that_fit
from raytrain_app.errors import TrainingFailed, last_line
from raytrain_app.rundir.lease import Lease, give_back_abandoned

BEST_FILE = "best.yaml"
STOP_S = 20.0  # after a SIGTERM, the sweep's own stop; within SLURM's 30 s before its SIGKILL
FREE_S = 5.0  # how long the sweep's end waits for the processes of the trials Tune killed to end


@dataclass
class Trial:
    name: str  # its run directory's name under the sweep's
    settings: dict
    best: Optional[float]  # the sweep's metric at the trial's best epoch
    best_epoch: Optional[int]
    epochs_done: int
    status: str  # finished, stopped early, failed, interrupted


def launch(sweep: Sweep, sweep_dir: str, resume: bool, address: Optional[str], verbose: bool,
           echo: Callable[[str], None], min_nodes: int = 1, node_timeout_s: float = 0) -> tuple[list[Trial], bool]:
    """Run (or resume) the sweep on a cluster chosen as `train` chooses one; returns the trials,
    best first, and whether the sweep was interrupted (Ctrl-C, or a scheduler's SIGTERM: Tune
    saves its state and stops every trial; `--resume` continues). An embedded cluster gets room
    for as many trials as this machine's CPUs (or GPUs) hold; a joined one `node_timeout_s` to reach
    `min_nodes` (a SLURM allocation's nodes join while the sweep's job starts). The sweep directory's
    lease is held throughout, as `train` holds a run's."""
    if not verbose:  # Tune's own tables off: the console gets one line per trial epoch instead
        os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    held = Lease.acquire(sweep_dir, "sweep", lambda line: echo(f"warning: {line}"))
    try:
        return _launch(sweep, sweep_dir, resume, address, verbose, echo, min_nodes, node_timeout_s, held)
    finally:
        held.release()


def _launch(sweep: Sweep, sweep_dir: str, resume: bool, address: Optional[str], verbose: bool,
            echo: Callable[[str], None], min_nodes: int, node_timeout_s: float,
            held: Lease) -> tuple[list[Trial], bool]:
    from raytrain_app.cluster.capacity import check_workers_fit, connected_nodes, spare_cpus
    from raytrain_app.cluster.session import cluster_for

    config, s = sweep.config, sweep.config.scaling
    if not resume:
        sweep.save(sweep_dir)
    # Trials that fit this machine: an embedded cluster's size.
    here = sweep.max_concurrent or trials_that_fit(config, os.cpu_count() or 1, _local_gpus())
    trial_cpus = s.workers * s.cpus_per_worker + spare_cpus(config)
    room = here * trial_cpus - s.workers * s.cpus_per_worker  # beyond one trial's workers, which cluster_for counts
    log_dir = os.path.join(sweep_dir, "logs") if storage.is_local(sweep_dir) else None
    with cluster_for(s, address, log_dir, verbose, echo, room, min_nodes, node_timeout_s, dashboard=True), \
            term_as_interrupt(STOP_S, functools.partial(_give_up, sweep_dir, held)):  # once Ray set its own
        nodes = connected_nodes()
        check_workers_fit(nodes, config)  # one trial fits, or one line now
        alive = [n for n in nodes if n.alive]
        return run_sweep(sweep, sweep_dir, resume, echo, sum(n.cpus for n in alive), sum(n.gpus for n in alive),
                         verbose)


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def run_sweep(sweep: Sweep, sweep_dir: str, resume: bool, echo: Callable[[str], None], cpus: float,
              gpus: float, verbose: bool = False) -> tuple[list[Trial], bool]:
    """Run (or resume) the sweep on the cluster this process is connected to, which has `cpus` and
    `gpus`."""
    # Trials stay where Ray starts them (`_trial` moves them here), not in Tune's trial folders.
    os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = "0"
    trainable = tune.with_resources(tune.with_parameters(_trial, sweep=sweep, sweep_dir=sweep_dir,
                                                         launched_in=os.getcwd()),
                                    lambda settings: trial_resources(sweep.trial_config(settings)))
    parent, name = os.path.dirname(sweep_dir.rstrip("/")), os.path.basename(sweep_dir.rstrip("/"))
    run_config = tune.RunConfig(storage_path=parent, name=name, verbose=1 if verbose else 0,
                                callbacks=[_Progress(sweep, echo), _GiveBack(sweep_dir)])
    if resume and tune.Tuner.can_restore(sweep_dir):  # else it was stopped before Tune began: begin
        tuner = tune.Tuner.restore(sweep_dir, trainable=trainable, resume_errored=True)
    else:
        concurrent = sweep.max_concurrent or trials_that_fit(sweep.config, cpus, gpus)
        echo(f"sweep {sweep_dir}: {sweep.describe()}; {concurrent} trials at once")
        epochs = max([sweep.config.train.epochs, *(p.most for p in sweep.params if p.key == "train.epochs")])
        scheduler = (ASHAScheduler(time_attr="epoch", metric=sweep.metric, mode=sweep.mode, max_t=epochs,
                                   grace_period=1, reduction_factor=2, stop_last_trials=False)
                     if sweep.scheduler == "asha" else FIFOScheduler())
        tuner = tune.Tuner(
            trainable, param_space={p.key: p.space() for p in sweep.params},
            # The limit goes to the sampler: Tune ignores max_concurrent_trials beside a sampler given.
            # A stopped trial's actor ends, and with it a trial that trains in it (not reused).
            tune_config=tune.TuneConfig(num_samples=sweep.samples, scheduler=scheduler, reuse_actors=False,
                                        trial_dirname_creator=_trial_dirname, trial_name_creator=_trial_dirname,
                                        search_alg=BasicVariantGenerator(random_state=sweep.seed,
                                                                         max_concurrent=concurrent)),
            run_config=run_config)
    results = tuner.fit()
    errors = {os.path.basename(r.path.rstrip("/")): last_line(r.error) for r in results if r.error}
    analysis = tune.ExperimentAnalysis(sweep_dir)  # results.experiment_path drops a URI's scheme
    _give_back_leases([storage.join(sweep_dir, _trial_name(t)) for t in analysis.trials])
    # Interrupted trials stay RUNNING or PENDING in the saved state, which a resume picks up.
    interrupted = any(t.status in ("RUNNING", "PENDING", "PAUSED") for t in analysis.trials)
    trials = [_summary(sweep, sweep_dir, t, interrupted, errors) for t in analysis.trials]
    trials.sort(key=lambda t: (t.best is None, -(t.best or 0) if sweep.mode == "max" else (t.best or 0)))
    return trials, interrupted


@dataclass
class Outcome:
    trials: list[Trial]  # best first
    best_file: Optional[str]  # best.yaml, once a trial has a score
    interrupted: bool  # Ctrl-C: `sweep --resume` continues


def run(sweep: Sweep, sweep_dir: str, resume: bool = False, address: Optional[str] = None, verbose: bool = False,
        echo: Callable[[str], None] = print, min_nodes: int = 1, node_timeout_s: float = 600) -> Outcome:
    """Run (or resume) a sweep from this process, as `raytrain-app sweep` does: its trials' epochs,
    then the table of trials and the best one said to `echo`, and `best.yaml` written."""
    sweep_dir = storage.normalize(sweep_dir)  # Tune takes an absolute path or a URI, not `--sweep-dir sweeps/x`
    trials, interrupted = launch(sweep, sweep_dir, resume, address, verbose, echo, min_nodes, node_timeout_s)
    echo(table(sweep, trials))
    best = write_best(sweep, sweep_dir, trials)
    if best:
        echo(f"best: {trials[0].name}, {sweep.metric} {trials[0].best:.4f}; its config: {best}")
    return Outcome(trials, best, interrupted)


def write_best(sweep: Sweep, sweep_dir: str, trials: list[Trial]) -> Optional[str]:
    """`best.yaml`: the winning trial's resolved config, which `train` reproduces. A sweep whose
    every trial failed has none, and failed."""
    scored = [t for t in trials if t.best is not None]
    failed = [t for t in trials if t.status.startswith("failed")]
    if failed and len(failed) == len(trials):
        raise TrainingFailed(f"every trial failed; {failed[0].name}: {failed[0].status.removeprefix('failed: ')}")
    if not scored:
        return None
    path = storage.join(sweep_dir, BEST_FILE)
    storage.write_text(path, f"# best of {sweep_dir}: {scored[0].name}, {sweep.metric} {scored[0].best:.6g} "
                             f"at epoch {scored[0].best_epoch}\n"
                       + storage.read_text(storage.join(sweep_dir, scored[0].name, "config.yaml")))
    return path


def table(sweep: Sweep, trials: list[Trial]) -> str:
    header = ("TRIAL", *(p.key for p in sweep.params), f"BEST {sweep.metric}", "EPOCHS", "STATUS")
    return columns(header, [(t.name, *(_cell(t.settings.get(p.key)) for p in sweep.params),
                             "-" if t.best is None else f"{t.best:.4f}", str(t.epochs_done), t.status) for t in trials])


def _cell(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _trial(settings: dict, sweep: Sweep, sweep_dir: str, launched_in: str) -> None:
    """One trial, inside Tune: the job with these settings, trained as `train` trains it, in the
    directory the sweep was launched from (where its job's relative paths point), unless the
    trial runs in a copy of a job's working_dir already."""
    from raytrain_app.driver.on_ray import shipped_working_dir
    from raytrain_app.driver.trainer import run_training

    if not shipped_working_dir() and os.path.isdir(launched_in):
        os.chdir(launched_in)
    run_dir = storage.join(sweep_dir, os.path.basename(tune.get_context().get_trial_dir()))
    config = sweep.trial_config(settings)
    run_training(make_plan(config, run_dir=run_dir, resume="if_any", sweep_trial=True, local=trains_in_trial(config)),
                 callbacks=[_EpochReports(config.train.epochs)])


def _give_back_leases(run_dirs: list[str]) -> None:
    """The leases of the trials Tune killed at the sweep's end (those still running: an
    interrupted sweep's), once their processes are gone, waiting up to `FREE_S` for them; a trial
    that runs its `finally` gives back its own."""
    deadline = time.monotonic() + FREE_S
    while True:
        run_dirs = [run_dir for run_dir in run_dirs if not give_back_abandoned(run_dir)]
        if not run_dirs or time.monotonic() > deadline:
            return
        time.sleep(0.2)


def how_to_continue(sweep_dir: str) -> str:
    return f"`raytrain-app sweep --resume {sweep_dir}` continues"


def _give_up(sweep_dir: str, held: Lease) -> None:
    """A SIGTERM's stop that did not end (its cluster went down with it): the line Ctrl-C ends
    with, the processes this one started (an embedded cluster's) stopped, the leases of the sweep
    and of its trials given back, and exit code 130. The sweep's state is as Tune saved it last,
    which `--resume` continues."""
    from raytrain_app.cluster.localnodes import stop_processes

    print(f"interrupted: {how_to_continue(sweep_dir)}", file=sys.stderr, flush=True)
    stop_processes([child.pid for child in psutil.Process().children()])
    _give_back_leases([storage.join(sweep_dir, name) for name in storage.subdirectories(sweep_dir)
                       if name.startswith("trial-")])
    held.release()
    os._exit(130)


def _trial_dirname(trial) -> str:
    return "trial-" + trial.trial_id.rsplit("_", 1)[-1]


def _trial_name(trial) -> str:
    """Its run directory's name under the sweep's."""
    return os.path.basename(trial.path.rstrip("/")) if trial.path else _trial_dirname(trial)


def _summary(sweep: Sweep, sweep_dir: str, trial, interrupted: bool, errors: dict[str, str]) -> Trial:
    name = _trial_name(trial)
    run_dir = storage.join(sweep_dir, name)
    rows = rundir.read_metrics(run_dir)
    best = rundir.best_row(rows, sweep.metric, sweep.mode)
    done = max((row["epoch"] for row in rows if "epoch" in row), default=0)
    planned = sweep.trial_config(trial.config).train.epochs
    if trial.status == "ERROR":
        status = f"failed: {errors.get(name, 'see its logs')}"
    elif done >= planned:
        status = "finished"
    elif interrupted and trial.status != "TERMINATED":
        status = "interrupted"
    else:  # Tune ended it before its last epoch: ASHA's rung cut it, or its own train.early_stopping
        status = "stopped early"
        if rundir.read_record(run_dir).get("status") != status:  # the trial's own reason stands
            rundir.record_status(run_dir, status, f"{sweep.scheduler} stopped it after epoch {done}")
    return Trial(name, dict(trial.config), best[sweep.metric] if best else None, best["epoch"] if best else None,
                 done, status)


class _Progress(tune.Callback):
    """One console line per trial epoch and per failed trial, instead of Tune's status tables."""

    def __init__(self, sweep: Sweep, echo: Callable[[str], None]):
        self.sweep, self.echo = sweep, echo

    def on_trial_result(self, iteration, trials, trial, result, **info):
        value = result.get(self.sweep.metric)
        shown = f"{value:.4f}" if isinstance(value, (int, float)) and math.isfinite(value) else value
        epoch = result.get("epoch", result.get("final_epoch"))
        self.echo(f"{_trial_dirname(trial)} epoch {epoch}: {self.sweep.metric} {shown} "
                  f"({', '.join(f'{k}={_cell(v)}' for k, v in trial.config.items())})")
        if result.get("done") and "epoch" in result:  # the scheduler's decision, before its last epoch
            self.echo(f"{_trial_dirname(trial)} stopped early by {self.sweep.scheduler} after epoch {epoch}")

    def on_trial_error(self, iteration, trials, trial, **info):
        self.echo(f"{_trial_dirname(trial)} failed: its log is in {trial.path}")


class _GiveBack(tune.Callback):
    """The lease of each trial Tune ended, given back once the trial's process is gone. Tune ends a
    trial it stops (ASHA's cut) by ending its actor, which skips the trial's own release: its run
    directory would stay "in use" to `evaluate` and `--resume` (on this host until a command
    took the lease over; elsewhere for a minute). A trial that ends by itself gives back its own."""

    def __init__(self, sweep_dir: str):
        self.sweep_dir = sweep_dir
        self.ended: set[str] = set()  # run directories whose lease may still be held
        self.looked = 0.0

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.ended.add(storage.join(self.sweep_dir, _trial_name(trial)))

    on_trial_error = on_trial_complete

    def on_step_end(self, iteration, trials, **info):
        if self.ended and time.monotonic() - self.looked >= 1:  # a read of each lease, at most once a second
            self.looked = time.monotonic()
            self.ended = {run_dir for run_dir in self.ended if not give_back_abandoned(run_dir)}


class _EpochReports(TuneReportCallback):
    """Ray's TuneReportCallback for epoch-end reports only: a mid-epoch checkpoint's report holds a
    placeholder score, which ASHA would take for the trial's. The last epoch's report reaches
    Tune as `final_epoch`, which ASHA does not judge: stopping a trial that has trained in full
    would only kill it before it writes how it ended."""

    def __init__(self, epochs: int):
        super().__init__()
        self.epochs = epochs

    def after_report(self, run_context, metrics, checkpoint):
        if metrics[0].get("mid_epoch"):
            return
        if metrics[0].get("epoch", 0) >= self.epochs:
            metrics = [{**metrics[0], "final_epoch": metrics[0]["epoch"]}]
            del metrics[0]["epoch"]
        super().after_report(run_context, metrics, checkpoint)
