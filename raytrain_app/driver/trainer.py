"""Plan -> a run: the run directory's record kept, the workers started (by Ray Train on a cluster,
`on_ray.py`, or here in local mode, `local.py`), and what they report collected.

The driver listens on a queue for rank 0's events (per-epoch metrics, in-epoch progress) and for
every rank's heartbeats while the workers run, prints them, and keeps `metrics.jsonl` in the run
directory up to date. Ray loads only where the run uses it: a script's ranks in local mode start
without it, about as soon as under torchrun.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from contextlib import suppress
from typing import TYPE_CHECKING, Optional, Sequence

from raytrain_app import rundir, storage, tracking
from raytrain_app.cluster.capacity import check_workers_fit, connected_nodes
from raytrain_app.config import JobConfig, dump_yaml
from raytrain_app.console import Progress, epoch_line, startup_line, startup_phases
from raytrain_app.driver import local
from raytrain_app.driver.hangs import HangWatch, kill_local, kill_on_ray, who
from raytrain_app.driver.plan import RunPlan
from raytrain_app.driver.result import Result
from raytrain_app.driver.signals import stop_on_usr1
from raytrain_app.errors import CheckpointNotWritten, Stopped, TrainingFailed, UserError, last_line
from raytrain_app.rundir import snapshot
from raytrain_app.worker.args import WorkerArgs
from raytrain_app.worker.preemption import StopFile

if TYPE_CHECKING:
    from ray.train.v2.api.callback import UserCallback
    from ray.util.queue import Queue


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

    on_ray = None
    if plan.local:
        in_process = local.in_this_process(config, plan.trial)
        events, sent_to = local.fresh_events(in_process or bool(config.script))
        restarts, stop_flag = None, StopFile()
    else:
        from raytrain_app.driver import on_ray

        events, restarts, stop_flag = on_ray.channels(config)
        sent_to = events
    if plan.local and plan.trial:  # a sweep's trial, inside Ray Tune: Ray is loaded
        from raytrain_app.driver.on_ray import this_node
    marks = {**(marks or {}), "fit": time.time()}
    args = WorkerArgs(job=config.to_python(), run_dir=plan.run_dir, events=sent_to, progress=progress,
                      log_dir=storage.join(plan.run_dir, "logs"),
                      cwd=None if on_ray and on_ray.shipped_working_dir() else os.getcwd(),
                      restarts=restarts, marks=marks, local=plan.local,
                      node=this_node() if plan.local and plan.trial else None,
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
                    final = on_ray.fit(args, config, plan.run_dir, listener, history, callbacks, stop_flag)
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
        raise TrainingFailed(rundir.unwritten(e, run_dir)) from None
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


def _picture(run_dir: str, echo) -> Optional[str]:
    """RUN_DIR/report.png, the run's curves; a run without matplotlib (a cluster's image, often)
    says how to get them, there or later on any machine that has it."""
    from raytrain_app.rundir import plots

    try:
        return plots.write([run_dir], storage.join(run_dir, "report.png"))
    except UserError as e:
        echo(f"warning: no report.png: {e}, or draw it later where matplotlib is: raytrain-app report {run_dir}")
        return None


class EventListener(threading.Thread):
    """Drains rank 0's events, and every rank's heartbeat for the `hangs` watch, while fit()
    blocks the main thread."""

    def __init__(self, events: "Queue | local.Inbox", log: rundir.MetricsLog, progress: Progress, epochs: int, echo,
                 marks: dict, run_dir: str, callbacks: Sequence[UserCallback] = (), hangs: Optional[HangWatch] = None):
        super().__init__(daemon=True)
        self.events, self.log, self.progress, self.epochs, self.echo = events, log, progress, epochs, echo
        self.marks, self.run_dir, self.callbacks, self.hangs = marks, run_dir, callbacks, hangs
        self.world_size: Optional[int] = None  # the group's, as its rank 0 last said
        self.nonfinite: Optional[dict] = None  # where the workers stopped at a non-finite loss
        self.stopped_early: Optional[str] = None  # why train.early_stopping ended the run
        self.stopped: Optional[dict] = None  # where the workers stopped on a stop request
        self._stop_event = threading.Event()
        # What a get or put on a Ray queue raises once its actor is gone (local mode has no Ray).
        self._gone = (sys.modules["ray"].exceptions.RayError,) if "ray" in sys.modules else ()

    def run(self) -> None:
        # A Ray queue's get is a call to its actor: a long wait keeps an idle run's driver and
        # queue near silent (at 0.2 s they took 4% of a core), and `stop` wakes it at once.
        while not self._stop_event.is_set():
            with suppress(queue.Empty, *self._gone):  # nothing queued within 2 s
                self._handle(*self.events.get(timeout=2))

    def stop(self) -> None:
        """Stop listening, then handle what is still queued (the last epoch's event may be)."""
        self._stop_event.set()
        with suppress(queue.Full, *self._gone):  # a queue that is gone: the get ends on its own
            self.events.put_nowait(("wake", None))  # after whatever rank 0 sent, which the listener handles first
        self.join()
        with suppress(queue.Empty, *self._gone):  # drained
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


def _stopped_message(where: dict, run_dir: str) -> str:
    return (f"stopped on {where['reason']} at step {where['step']} (epoch {where['epoch']}, batch {where['batch']}), "
            f"after a checkpoint there; `--resume --run-dir {run_dir}` continues it")


def _nonfinite_message(where: dict, latest) -> str:
    then = ("the latest checkpoint is the last good one: lower optimizer.lr and --resume" if latest else
            "no checkpoint was saved before it: lower optimizer.lr and start again")
    return (f"the training loss was not finite at epoch {where['epoch']}, step {where['step']} "
            f"(lr {where['lr']:.3g}); {then} (train.stop_on_nonfinite: false trains on regardless)")


