"""The driver's Ray side: Ray Train's trainer built from the plan and run, the actors the
workers report to, and its failures worded (the callbacks it runs in its controller are in
`controller.py`). Only a run on Ray (or Ray Train's local mode) loads it: a script's ranks in
local mode never load Ray.
"""

from __future__ import annotations

import functools
import os
from contextlib import suppress
from typing import Optional, Sequence

import ray
import ray.train
from ray.train.torch import TorchConfig, TorchTrainer
from ray.train.v2.api.callback import UserCallback
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
from ray.util.queue import Queue
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_app import rundir, storage
from raytrain_app.cluster.session import lost_local_node
from raytrain_app.config import JobConfig
from raytrain_app.config.sections import ScalingConfig
from raytrain_app.data.raydata import read_train
from raytrain_app.driver import placement
from raytrain_app.driver.controller import RestartNotices, ScriptReports
from raytrain_app.driver.signals import handlers_kept
from raytrain_app.errors import (
    CheckpointNotWritten,
    RestartsSpent,
    TrainingFailed,
    UserError,
    describe,
    describe_rank,
    last_line,
    process_died,
    timed_out,
)
from raytrain_app.rayinternals import placement_timed_out
from raytrain_app.worker.args import WorkerArgs
from raytrain_app.worker.loop import train_loop_per_worker
from raytrain_app.worker.preemption import StopFlag
from raytrain_app.worker.script_on_ray import RestartCount, ScriptBackendConfig, run_script_per_worker


def channels(config: JobConfig) -> tuple[Queue, Optional[RestartCount], StopFlag]:
    """The queue rank 0 reports to, a script's restart count and the stop flag: actors beside this
    driver, on no resources (not on a node that a preemption or a resize takes away, and fitting
    inside a Tune trial's placement too). Sets Ray Train's settings for the run first."""
    _ray_train_settings(config)
    here = {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(
        ray.get_runtime_context().get_node_id(), soft=False)}
    return (Queue(actor_options=here), RestartCount.options(**here).remote() if config.script else None,
            StopFlag(**here))


def this_node() -> str:
    return ray.get_runtime_context().get_node_id()


def fit(args: WorkerArgs, config: JobConfig, run_dir: str, listener,
                history: rundir.MetricsLog, callbacks: Sequence[UserCallback], flag: StopFlag) -> Optional[str]:
    """Ray Train runs the loop on the cluster's workers; returns the final checkpoint's URI. The
    listener and the actors the workers report to end with it, however it ends. `flag` carries
    the hang watch's verdicts to Ray Train's controller (and, but for a script, stop requests)."""
    try:
        result = _fit(_trainer(args, config, run_dir, history, callbacks, flag), config, run_dir,
                      placement.RoomWatch(config, run_dir, listener.echo))
    finally:
        listener.stop()
        ray.kill(args.events.actor)
        if args.restarts is not None:
            ray.kill(args.restarts)
    return storage.checkpoint_uri(run_dir, result.checkpoint) if result.checkpoint else None


def _trainer(args: WorkerArgs, config: JobConfig, run_dir: str, history: rundir.MetricsLog,
             callbacks: Sequence[UserCallback], flag: StopFlag) -> DataParallelTrainer:
    callbacks = [RestartNotices(args.events, run_dir, config.failure, args.restarts, flag), *callbacks]
    if config.script:
        callbacks.append(ScriptReports(args.events, run_dir))
    return ray_trainer(
        functools.partial(run_script_per_worker if config.script else train_loop_per_worker, args), config.scaling,
        datasets={"train": read_train(config.data)} if config.data.engine == "ray_data" else None,
        script=bool(config.script),
        run_config=ray.train.RunConfig(
            name=os.path.basename(run_dir),
            storage_path=os.path.dirname(run_dir),
            failure_config=failure_config(config),
            callbacks=callbacks,
            checkpoint_config=ray.train.CheckpointConfig(  # a script's checkpoints: the newest are kept
                num_to_keep=config.checkpoint.keep,
                checkpoint_score_attribute=None if config.script else config.checkpoint.metric,
                checkpoint_score_order="max" if config.script else config.checkpoint.mode,
            ),
        ),
    )

def _fit(trainer: DataParallelTrainer, config: JobConfig, run_dir: str, watch: placement.RoomWatch):
    watch.start()
    try:
        with handlers_kept():  # Ray Train's SIGINT handler stops this run, and no later one
            return trainer.fit()
    except BaseException as e:
        if watch.gave_up:
            raise TrainingFailed(watch.gave_up) from None
        # A lost embedded node reaches here looking like an interrupt or a failed controller: if
        # that is what happened, the node watch says so and ends the process (see NodeWatch).
        lost_local_node(wait_s=0.5 if isinstance(e, ray.exceptions.RayActorError) else 0)
        if isinstance(e, ray.train.TrainingFailedError):
            raise explain_failure(e, config, run_dir) from None
        if isinstance(e, ray.exceptions.RayActorError) and e.actor_init_failed:  # Ray Train's controller refused
            raise TrainingFailed(f"Ray Train could not start the run: {last_line(e)}") from None
        if isinstance(e, (SystemExit, ray.exceptions.RayActorError)):
            # Ray Train's own SIGINT handler aborts the run and raises SystemExit (or, in older
            # versions, kills its controller). An interrupted run is not a successful one.
            raise KeyboardInterrupt from None
        raise
    finally:
        watch.stop()

def failure_config(config: JobConfig) -> ray.train.FailureConfig:
    """Ray Train's retry budgets: worker failures, preemptions apart from them, and starts (see
    `placement.py`; each try's timeout is set in `_ray_train_settings`). Ray Train counts a node
    stopped before its drain's deadline as a plain failure: its `max_failures` is both budgets
    together, which `RestartNotices` keeps apart."""
    failure = config.failure
    both = -1 if -1 in (failure.max_failures, failure.max_preemption_failures) else \
        failure.max_failures + failure.max_preemption_failures
    return ray.train.FailureConfig(max_failures=both,
                                   max_preemption_failures=failure.max_preemption_failures,
                                   preemption_grace_s=failure.preemption_grace_s,
                                   relax_collectives_on_preemption=failure.preemption_grace_s > 0,
                                   controller_failure_limit=placement.start_tries(config) - 1)

# A poll interval the user set, which wins over ours.
_USER_POLL_INTERVAL = os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")


def _ray_train_settings(config: JobConfig) -> None:
    """Settings Ray Train reads only from the driver's environment when a run starts (and passes on
    to its controller and workers)."""
    # One timeout for both layers: torch's process group (TorchConfig) and Ray Train's own
    # collectives such as the barrier inside ray.train.report, which has none by default.
    os.environ["RAY_TRAIN_COLLECTIVE_TIMEOUT_S"] = str(config.scaling.timeout_s)
    # How long Ray Train waits for a (re)started group's workers to be placed, each try.
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(placement.start_timeout_s(config))
    # Workers stay where Ray started them, in a job's uploaded working_dir (or move to the launch
    # directory, see WorkerArgs.cwd), instead of Ray Train's per-run scratch directory.
    os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = "0"
    # Ray Train's controller polls its workers every 2 s by default, and a worker's report (every
    # epoch, every step checkpoint) waits until the controller has taken the one before: each
    # costs up to a poll interval, as do the start and the finish. Polling a few workers often is
    # cheap; a large group is polled at about 100 workers a second in all.
    poll_s = min(0.5, max(0.1, 0.01 * config.scaling.max_workers))
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = _USER_POLL_INTERVAL or str(poll_s)
    # Ray Train sends what workers print to its own log as well as to stdout: the console's lines
    # come from the events channel instead (a script's output, read from its process, among them).
    os.environ["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
    # Preemption notices (worker/preemption.py), from a watcher in Ray Train's controller: on for
    # a cluster joined or submitted to, whatever its nodes' own environment says; the embedded
    # one-machine cluster has turned it off already (cluster/session.py).
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "1")


def shipped_working_dir() -> bool:
    """Inside a Ray job that uploaded a working_dir, every worker already runs in its own copy of it."""
    return bool(ray.get_runtime_context().runtime_env.get("working_dir"))

def ray_trainer(loop, scaling: ScalingConfig, run_config: ray.train.RunConfig,
               datasets: Optional[dict] = None, script: bool = False) -> DataParallelTrainer:
    """Ray Train's trainer running `loop` on `scaling`'s workers: training's, evaluation's and a
    script's, so all place their workers alike. The built-in loop's workers join a torch process
    group (TorchTrainer); a script's workers join none, since the script makes its own."""
    scaling_config = ray.train.ScalingConfig(
        num_workers=(scaling.min_workers, scaling.max_workers) if scaling.elastic else scaling.workers,
        elastic_resize_monitor_interval_s=scaling.resize_interval_s, use_gpu=scaling.gpus_per_worker > 0,
        resources_per_worker=scaling.resources, placement_strategy=scaling.placement)
    if script:
        return DataParallelTrainer(loop, backend_config=ScriptBackendConfig(), scaling_config=scaling_config,
                                   run_config=run_config)
    return TorchTrainer(loop, scaling_config=scaling_config, datasets=datasets, run_config=run_config,
                        torch_config=TorchConfig(backend=scaling.backend, timeout_s=scaling.timeout_s))


def explain_failure(error: ray.train.TrainingFailedError, config: JobConfig,
                    run_dir: Optional[str] = None) -> Exception:
    """One clause per failed rank: where it ran and its last error line, not Ray's nested tracebacks."""
    spent = getattr(error, "controller_failure", None)  # RestartNotices ended the run: the failures that did
    if isinstance(spent, RestartsSpent) and spent.hang:
        return TrainingFailed(spent.hang)
    failures = (spent.worker_failures if isinstance(spent, RestartsSpent) else getattr(error, "worker_failures", None)
                or {})
    if failures and all(isinstance(e, UserError) for e in failures.values()):
        return UserError(last_line(next(iter(failures.values()))))
    unwritten = [e for e in failures.values() if isinstance(e, CheckpointNotWritten)]
    if unwritten and run_dir:
        return TrainingFailed(rundir.unwritten(unwritten[0], run_dir))
    if not failures:
        cause = getattr(error, "controller_failure", error)
        with suppress(Exception):  # what the cluster holds, if it still answers; else Ray's words
            if placement_timed_out(cause):
                return TrainingFailed(placement.unplaced(config, run_dir))
        return TrainingFailed(describe(cause))
    # A rank whose process died is the cause; its peers' Gloo/NCCL connection errors follow from it.
    ranked = sorted(failures.items(), key=lambda item: (not process_died(item[1]), item[0]))
    clauses = [describe_rank(rank, e) for rank, e in ranked]
    waiting = sorted(rank for rank, e in failures.items() if timed_out(e))
    if waiting:
        stalled = sorted(set(range(config.scaling.max_workers)) - set(failures))
        clauses.insert(0, f"a collective timed out after {config.scaling.timeout_s}s (scaling.timeout_s): "
                          f"rank(s) {', '.join(map(str, waiting))} were waiting; "
                          f"rank(s) {', '.join(map(str, stalled)) or 'unknown'} stalled")
    return TrainingFailed("; ".join(clauses))
