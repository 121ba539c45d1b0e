"""Plan -> Ray Train: build the TorchTrainer, run it, and collect what the workers report.

The driver listens on a Ray queue for rank 0's events (per-epoch metrics, in-epoch progress)
while `fit()` runs, prints them, and keeps `metrics.jsonl` in the run directory up to date.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import sys
import threading
import time
from contextlib import suppress
from typing import Optional, Sequence

import ray
import ray.train
from ray.train.torch import TorchConfig, TorchTrainer
from ray.train.v2.api.callback import UserCallback
from ray.util.queue import Queue
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_app import rundir, storage, tracking
from raytrain_app.cluster.capacity import check_workers_fit, connected_nodes
from raytrain_app.cluster.session import lost_local_node
from raytrain_app.config import JobConfig, dump_yaml
from raytrain_app.config.sections import FailureConfig, ScalingConfig
from raytrain_app.console import Progress, epoch_line, startup_line, startup_phases
from raytrain_app.data.raydata import read_train
from raytrain_app.driver import local, placement
from raytrain_app.driver.hangs import HangWatch, kill_local, kill_on_ray, who
from raytrain_app.driver.plan import RunPlan
from raytrain_app.driver.result import Result
from raytrain_app.driver.signals import handlers_kept, stop_on_usr1
from raytrain_app.errors import (
    CheckpointNotWritten,
    RestartsSpent,
    Stopped,
    TrainingFailed,
    UserError,
    describe,
    describe_rank,
    last_line,
    process_died,
    timed_out,
)
from raytrain_app.rayinternals import placement_timed_out
from raytrain_app.rundir import snapshot
from raytrain_app.worker import preemption
from raytrain_app.worker.loop import WorkerArgs, train_loop_per_worker
from raytrain_app.worker.preemption import StopFile, StopFlag
from raytrain_app.worker.script import RestartCount, combined, run_script_per_worker


def run_training(plan: RunPlan, progress: bool = False, echo=print, marks: Optional[dict] = None,
                 callbacks: Sequence[UserCallback] = ()) -> Result:
    """Run the plan on the Ray cluster this process is connected to.

    `marks` are the caller's wall-clock start-up marks ("start", "planned", "cluster"); with the
    workers' own they become the start-up breakdown printed at the first step and kept in
    `startup.json`. `callbacks` see every report too (a sweep's trial hands them to Tune). The
    plan's lease on the run directory is given back when the run ends, however it ends.
    """
    try:
        return _run_training(plan, progress, echo, marks, callbacks)
    finally:
        if plan.lease:
            plan.lease.release()


def _run_training(plan: RunPlan, progress: bool, echo, marks: Optional[dict], callbacks: Sequence[UserCallback]):
    config = plan.config
    if not plan.local:
        check_workers_fit(connected_nodes(), config)
    gone = snapshot.drop_missing(plan.run_dir)  # what an earlier run's stopped controller left, as the lease is held
    if gone:
        echo(f"warning: the run's checkpoint index named {', '.join(gone)}, which {'is' if len(gone) == 1 else 'are'} "
             f"gone (a run stopped while it pruned checkpoints): taken out of the index")
    rundir.remove_partial(plan.run_dir)  # what an earlier run's failed write left, now that we hold the lease
    storage.write_text(storage.join(plan.run_dir, "config.yaml"), dump_yaml(config))
    history = rundir.MetricsLog(storage.join(plan.run_dir, rundir.METRICS), resume=plan.resume)
    if plan.resume:
        rundir.record_restart(plan.run_dir, "resume", "--resume")
    rundir.record_status(plan.run_dir, "running", launch={
        "engine": "local" if plan.local else "ray", "workers": config.scaling.describe_workers(),
        **({"script": config.script.path, "args": config.script.args} if config.script else {})})

    if plan.local:
        in_process = local.in_this_process(config, plan.trial)
        events, sent_to = local.fresh_events(in_process or bool(config.script))
        restarts, stop_flag = None, StopFile()
    else:
        _ray_train_settings(config)
        # Beside this driver, on no resources: not on a node that a preemption or a resize takes
        # away, and fitting inside a Tune trial's placement too.
        here = {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False)}
        events = sent_to = Queue(actor_options=here)
        restarts = RestartCount.options(**here).remote() if config.script else None
        stop_flag = StopFlag(**here)
    marks = {**(marks or {}), "fit": time.time()}
    args = WorkerArgs(job=config.to_python(), run_dir=plan.run_dir, events=sent_to, progress=progress,
                      log_dir=storage.join(plan.run_dir, "logs"),
                      cwd=None if not plan.local and shipped_working_dir() else os.getcwd(),
                      restarts=restarts, marks=marks, local=plan.local,
                      node=ray.get_runtime_context().get_node_id() if plan.local and plan.trial else None,
                      # Decided here, once for every rank (asking is a collective). Ray Train's notices
                      # come from its preemption watcher, which a one-machine cluster runs without
                      # (cluster/session.py); local mode has no Ray cluster at all.
                      notices=not plan.local and os.environ.get("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "1") != "0",
                      stop_flag=stop_flag)
    hangs = HangWatch(config.failure.hang_timeout_s, plan.run_dir,
                      _hang_killer(plan.local, plan.local and in_process, stop_flag, plan.run_dir),
                      lambda line: echo(f"warning: {line}"))
    # In local mode no Ray Train controller calls `callbacks`: the listener hands them each epoch's report.
    listener = EventListener(events, history, Progress(progress), config.train.epochs, echo, marks, plan.run_dir,
                             callbacks if plan.local else (), hangs)
    listener.start()
    hangs.start()
    try:
        try:
            with stop_on_usr1(args.stop_flag, echo):
                if plan.local:
                    final = _fit_locally(args, config, plan.run_dir, plan.log_dir, listener, echo, in_process)
                else:
                    final = _fit_on_ray(args, config, plan.run_dir, listener, history, callbacks, stop_flag)
            # A script asked to stop has ended (it checkpointed, if it handles its stop signal).
            script_stopped = config.script and stop_flag.get()
        finally:
            hangs.stop()
            if stop_flag is not None:
                stop_flag.close()  # its actor, or its folder: however the run ended
        if listener.nonfinite:  # the workers agreed to stop early: the run did not finish
            raise TrainingFailed(_nonfinite_message(listener.nonfinite, final))
        if listener.stopped:
            raise Stopped(_stopped_message(listener.stopped, plan.run_dir))
        if script_stopped:
            raise Stopped(f"stopped on {script_stopped}; the script's latest checkpoint: {final or 'none'}; "
                          f"`--resume --run-dir {plan.run_dir}` continues it")
    except BaseException as e:
        ended = "interrupted" if isinstance(e, KeyboardInterrupt) else "stopped" if isinstance(e, Stopped) else \
            "failed"
        with suppress(Exception):  # neither may hide why the run ended
            rundir.remove_partial(plan.run_dir)  # first: on a full disk, that frees the space to say so
            rundir.record_status(plan.run_dir, ended, last_line(e))
            tracking.finish(config.tracking, plan.run_dir, "FAILED" if ended == "failed" else "KILLED")
        raise
    best, best_metrics = rundir.best(plan.run_dir, rows=history.rows())
    best_uri = best.path if best else None
    tracking.finish(config.tracking, plan.run_dir, "FINISHED", best_uri, best_metrics)
    rundir.record_status(plan.run_dir, *(("stopped early", listener.stopped_early) if listener.stopped_early else
                                  ("finished",)))
    return Result(
        # (a script that reported nothing has nothing to draw)
        report=_picture(plan.run_dir, echo) if config.tracking.report_png and (history.rows() or not config.script)
        else None,
        config=config,
        run_dir=plan.run_dir,
        metrics=history.rows(),
        best_checkpoint=best_uri,
        best_metrics=best_metrics,
        final_checkpoint=final,
        stopped_early=listener.stopped_early,
        wall_s=time.time() - marks.get("start", marks["fit"]),  # the caller's start: the command's time
    )


def _fit_on_ray(args: WorkerArgs, config: JobConfig, run_dir: str, listener: "EventListener",
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
             callbacks: Sequence[UserCallback], flag: StopFlag) -> TorchTrainer:
    callbacks = [RestartNotices(args.events, run_dir, config.failure, args.restarts, flag), *callbacks]
    if config.script:
        callbacks.append(ScriptReports(args.events, run_dir))
    return torch_trainer(
        functools.partial(run_script_per_worker if config.script else train_loop_per_worker, args), config.scaling,
        datasets={"train": read_train(config.data)} if config.data.engine == "ray_data" else None,
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


def _fit_locally(args: WorkerArgs, config: JobConfig, run_dir: str, log_dir: str, listener: "EventListener",
                 echo, in_process: bool) -> Optional[str]:
    """Ray Train's local mode runs the loop here (see `local.py`); returns the final checkpoint's URI."""
    def restarting(why: str, line: str) -> None:
        listener.hangs.reset()
        hang = listener.hangs.take_verdict()  # the rank the watch killed: what the launcher saw die
        echo(f"warning: {line.replace(why, who(hang), 1) if hang else line}")
        rundir.record_restart(run_dir, "hang" if hang else "restart", hang or why)

    try:
        local.run(args, config, log_dir, lambda: snapshot.latest(run_dir), restarting, in_process)
    except CheckpointNotWritten as e:
        raise TrainingFailed(_unwritten(e, run_dir)) from None
    except TrainingFailed:
        hang = listener.hangs.take_verdict()  # the last restart's budget was spent on it
        if hang:
            raise TrainingFailed(hang) from None
        raise
    finally:
        listener.stop()
        if isinstance(listener.events, local.Inbox):
            listener.events.close()
    return snapshot.latest(run_dir)


def _fit(trainer: TorchTrainer, config: JobConfig, run_dir: str, watch: placement.RoomWatch):
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


def _hang_killer(local_mode: bool, in_process: bool, stop_flag, run_dir: str):
    """How the hang watch ends a hung rank: a local process by its pid, a Ray Train worker by a
    task on its node (after telling Ray Train's controller, through the stop flag's actor, that
    the restart is a hang's). The one worker of a one-worker local run is this process itself:
    the run ends, as it says, and `--resume` continues it."""
    if in_process:
        def end_here(beat: dict, line: str) -> None:
            message = "the one worker runs in this process, which cannot restart it: `--resume` continues the run"
            print(f"error: {message}", file=sys.stderr, flush=True)
            with suppress(Exception):
                rundir.record_status(run_dir, "failed", message)
            os._exit(1)

        return end_here
    if local_mode:
        return lambda beat, line: kill_local(beat)

    def kill(beat: dict, line: str) -> None:
        if stop_flag is not None:
            with suppress(Exception):  # a verdict that cannot be told is a plain restart
                stop_flag.hung(line)
        kill_on_ray(beat)

    return kill


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


def _picture(run_dir: str, echo) -> Optional[str]:
    """RUN_DIR/report.png, the run's curves; a run without matplotlib (a cluster's image, often)
    says how to get them, there or later on any machine that has it."""
    from raytrain_app.rundir import plots

    try:
        return plots.write([run_dir], storage.join(run_dir, "report.png"))
    except UserError as e:
        echo(f"warning: no report.png: {e}, or draw it later where matplotlib is: raytrain-app report {run_dir}")
        return None


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


class EventListener(threading.Thread):
    """Drains rank 0's events, and every rank's heartbeat for the `hangs` watch, while fit()
    blocks the main thread."""

    def __init__(self, events: Queue, log: rundir.MetricsLog, progress: Progress, epochs: int, echo, marks: dict,
                 run_dir: str, callbacks: Sequence[UserCallback] = (), hangs: Optional[HangWatch] = None):
        super().__init__(daemon=True)
        self.events, self.log, self.progress, self.epochs, self.echo = events, log, progress, epochs, echo
        self.marks, self.run_dir, self.callbacks, self.hangs = marks, run_dir, callbacks, hangs
        self.world_size: Optional[int] = None  # the group's, as its rank 0 last said
        self.nonfinite: Optional[dict] = None  # where the workers stopped at a non-finite loss
        self.stopped_early: Optional[str] = None  # why train.early_stopping ended the run
        self.stopped: Optional[dict] = None  # where the workers stopped on a stop request
        self._stop_event = threading.Event()

    def run(self) -> None:
        # A Ray queue's get is a call to its actor: a long wait keeps an idle run's driver and
        # queue near silent (at 0.2 s they took 4% of a core), and `stop` wakes it at once.
        while not self._stop_event.is_set():
            with suppress(queue.Empty, ray.exceptions.RayError):  # nothing queued within 2 s
                self._handle(*self.events.get(timeout=2))

    def stop(self) -> None:
        """Stop listening, then handle what is still queued (the last epoch's event may be)."""
        self._stop_event.set()
        with suppress(queue.Full, ray.exceptions.RayError):  # a queue that is gone: the get ends on its own
            self.events.put_nowait(("wake", None))  # after whatever rank 0 sent, which the listener handles first
        self.join()
        with suppress(queue.Empty, ray.exceptions.RayError):  # drained
            while True:
                self._handle(*self.events.get_nowait())
        self.progress.close()

    def _handle(self, kind: str, payload) -> None:
        if kind == "wake":  # from `stop`
            return
        if kind == "beat":
            if self.hangs:
                self.hangs.beat(payload)
            return
        if kind == "ended":  # Ray Train's controller saw the group fail: its ranks' beats stop meaning anything
            if self.hangs:
                self.hangs.reset()
            return
        if kind == "progress":
            self.progress.update(*payload)
            return
        if kind == "nonfinite":
            self.nonfinite = payload
            return
        if kind == "output":  # a script's line, as it printed it
            self.echo(payload)
            return
        if kind == "report":  # a script's report, numbered on from the run's rows (--resume continues them)
            self.log.add({"report": len(self.log.rows()) + 1, **payload})
            return
        if kind == "restored":  # a resume's checkpoint: epochs whose rows an earlier driver did not write
            self.log.fill(payload)
            return
        self.progress.close()
        if kind == "startup":
            phases = startup_phases({**self.marks, **payload})
            storage.write_text(storage.join(self.run_dir, "startup.json"), json.dumps(phases, indent=1) + "\n")
            self.echo(startup_line(phases))
        elif kind == "group":  # a (re)started group: an elastic run's resize is one line and a record
            was, self.world_size = self.world_size, payload["world_size"]
            if was and was != self.world_size:
                what = f"{'grew' if self.world_size > was else 'shrank'} {was} -> {self.world_size} workers"
                self.echo(f"resized: {what}; {payload['step']}")
                rundir.record_restart(self.run_dir, "resize", what)
        elif kind == "notice":
            self.echo(f"warning: {payload}")
        elif kind == "info":
            self.echo(payload)
        elif kind == "epoch":
            self.log.add(payload)
            self.echo(epoch_line(payload, self.epochs, self.hangs.nodes() if self.hangs else None))
            for callback in self.callbacks:
                callback.after_report(None, [payload], None)
        elif kind == "stopped":
            self.stopped = payload
        elif kind == "stopped_early":
            self.stopped_early = f"stopped early after epoch {payload['epoch']}: {payload['reason']}"
            self.echo(self.stopped_early)


class RestartNotices(UserCallback):
    """In Ray Train's controller: one console line when a worker fails and the group restarts, and
    the count of failures against `failure.max_failures` apart from preemptions.

    Ray's own account of a dead worker is a paragraph printed by the driver (kept in driver.log);
    this says which rank failed, where, why, and which checkpoint the restart continues from.

    Ray Train charges a preemption to `max_preemption_failures` only when the node went after its
    drain's deadline (Ray then marks its workers' deaths `preempted`, or stops the group itself);
    a node stopped before it (a cloud that reclaims early, a pod's shorter grace) kills the
    workers in what Ray Train counts as a plain failure. Its policy is not ours to set, so Ray
    Train gets both budgets as one (`failure_config`) and this keeps them apart: ranks that died
    within a notice the workers answered (`preemption.ANSWERED`, in the report of the checkpoint
    they wrote for it) count as a preemption, others as a failure. A budget spent ends the run
    from here (`RestartsSpent`, which Ray Train raises as a controller error: `explain_failure`
    words it as it words Ray Train's own).
    """

    def __init__(self, events: Queue, run_dir: str, failure: FailureConfig, restarts=None, stop_flag=None):
        self.events, self.run_dir, self.stop_flag = events, run_dir, stop_flag
        self.budgets = {"restart": failure.max_failures, "preemption": failure.max_preemption_failures}
        self.grace_ms = failure.preemption_grace_s * 1000
        self.restarts = restarts  # a script run's RestartCount
        self.spent = {"restart": 0, "preemption": 0}
        self.latest: Optional[str] = None
        self.answered: Optional[dict] = None  # the latest notice the workers answered: its ranks and deadline

    def after_report(self, run_context, metrics, checkpoint) -> None:
        if checkpoint is not None:
            self.latest = storage.checkpoint_uri(self.run_dir, checkpoint)
        self.answered = metrics[0].get(preemption.ANSWERED) or self.answered

    def after_exception(self, run_context, worker_exceptions: dict) -> None:
        self.events.put(("ended", None))
        # A rank whose process died is the cause; the others' broken collectives are the effect.
        died = [r for r, e in worker_exceptions.items() if process_died(e)]
        rank = min(died or worker_exceptions)
        what = describe_rank(rank, worker_exceptions[rank])
        hang = self.stop_flag.take_hang() if self.stop_flag is not None else None
        then = f"restarting from {self.latest or 'the start'}"
        if hang:  # the driver's hang watch killed the rank (and said why): a failure, said as the hang it was
            what = who(hang)
        if any(_preempted_by_ray(e) for e in worker_exceptions.values()):  # Ray Train counts it itself
            kind, said = "preemption", f"its node was preempted: {then}"
        else:
            kind = "preemption" if self._drained(died) else "restart"
            self.answered = None  # the next group's notices are its own
            self.spent[kind] += 1
            budget = self.budgets[kind]
            if budget != -1 and self.spent[kind] > budget:
                raise RestartsSpent(worker_exceptions, hang)
            drained = "its node was being drained (a preemption); " if kind == "preemption" else ""
            said = f"{drained}{then} ({kind} {self.spent[kind]} of {'unlimited' if budget == -1 else budget})"
        if self.restarts is not None:
            self.restarts.add.remote()
        self.events.put(("notice", f"{what}; {said}"))
        rundir.record_restart(self.run_dir, "hang" if hang and kind == "restart" else kind, hang or what)

    def _drained(self, died: list[int]) -> bool:
        """The ranks died within the notice the workers answered: before its deadline (and grace),
        which Ray Train would have waited out, on the nodes it named."""
        notice = self.answered
        if not (notice and died and set(died) <= set(notice["ranks"])):
            return False
        return not notice["deadline_ms"] or time.time() * 1000 <= notice["deadline_ms"] + self.grace_ms


def _preempted_by_ray(e: BaseException) -> bool:
    """Ray marked the worker's death a preemption (its node went at its drain's deadline), as
    Ray Train's policy reads it: a health check's failure wrapping a `RayActorError.preempted`."""
    return bool(getattr(getattr(e, "health_check_failure", e), "preempted", False))


class ScriptReports(UserCallback):
    """In Ray Train's controller: each `raytrain_app.report` of a script, all ranks' values
    combined (`script.combined`), to the driver's metrics.jsonl."""

    def __init__(self, events: Queue, run_dir: str):
        self.events, self.run_dir = events, run_dir

    def after_report(self, run_context, metrics, checkpoint) -> None:
        row = combined(metrics)
        row.pop(preemption.ANSWERED, None)  # the restart accounting's (RestartNotices), not the script's
        if checkpoint is not None:
            row["checkpoint"] = storage.checkpoint_uri(self.run_dir, checkpoint)
        self.events.put(("report", row))


def _unwritten(e: CheckpointNotWritten, run_dir: str) -> str:
    """A full disk: what was not written, and what is safe."""
    rundir.remove_partial(run_dir)
    good = rundir.kept(run_dir)
    then = (f"the last good checkpoint is step {good[-1].step}: free space and --resume" if good else
            "no checkpoint was written before it: free space and start again")
    return f"{e}; {then}"


def _stopped_message(where: dict, run_dir: str) -> str:
    return (f"stopped on {where['reason']} at step {where['step']} (epoch {where['epoch']}, batch {where['batch']}), "
            f"after a checkpoint there; `--resume --run-dir {run_dir}` continues it")


def _nonfinite_message(where: dict, latest) -> str:
    then = ("the latest checkpoint is the last good one: lower optimizer.lr and --resume" if latest else
            "no checkpoint was saved before it: lower optimizer.lr and start again")
    return (f"the training loss was not finite at epoch {where['epoch']}, step {where['step']} "
            f"(lr {where['lr']:.3g}); {then} (train.stop_on_nonfinite: false trains on regardless)")


def torch_trainer(loop, scaling: ScalingConfig, run_config: ray.train.RunConfig,
                  datasets: Optional[dict] = None) -> TorchTrainer:
    """Ray Train's trainer running `loop` on `scaling`'s workers: training's and evaluation's, so
    both place their workers alike (resources, placement, backend)."""
    return TorchTrainer(
        loop,
        scaling_config=ray.train.ScalingConfig(
            num_workers=(scaling.min_workers, scaling.max_workers) if scaling.elastic else scaling.workers,
            elastic_resize_monitor_interval_s=scaling.resize_interval_s, use_gpu=scaling.gpus_per_worker > 0,
            resources_per_worker=scaling.resources, placement_strategy=scaling.placement),
        torch_config=TorchConfig(backend=scaling.backend, timeout_s=scaling.timeout_s),
        datasets=datasets, run_config=run_config)


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
        return TrainingFailed(_unwritten(unwritten[0], run_dir))
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
