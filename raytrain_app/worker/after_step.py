"""What follows each optimizer step of the loop, and how a worker reports to Ray Train.

After a step: the start-up breakdown at a fresh run's first step, the trackers' step point, a
mid-epoch checkpoint every `checkpoint.every_steps` steps, and the answer to a preemption notice
or a stop request (`preemption.py`): a checkpoint at the step the loop is at.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from contextlib import suppress
from typing import Optional

import ray.train

from raytrain_app.config import JobConfig
from raytrain_app.console import startup_phases
from raytrain_app.errors import CheckpointNotWritten, last_line
from raytrain_app.tracking import Trackers
from raytrain_app.worker import checkpoint, preemption
from raytrain_app.worker.compile_cache import CompileCache, give_way
from raytrain_app.worker.nonfinite import LossCheck
from raytrain_app.worker.preemption import PreemptionCheck
from raytrain_app.worker.rank import Worker
from raytrain_app.worker.state import TrainState


class AfterStep:
    """What follows an optimizer step: rank 0 tells the driver and the trackers where start-up went
    (at a fresh run's first step), the trackers get their step-level point, and every
    `checkpoint.every_steps` steps, or at a preemption notice, a mid-epoch checkpoint records the
    position within the epoch. After this process's first step, what it compiled goes into the
    run's compile cache."""

    def __init__(self, job: JobConfig, about: dict, worker: Worker, loss_check: LossCheck, trackers: Trackers,
                 marks: dict, compile_cache: Optional[CompileCache]):
        self.job, self.about, self.worker = job, about, worker
        self.loss_check, self.report = loss_check, worker.report
        self.trackers, self.marks, self.compile_cache = trackers, marks, compile_cache
        self.preemption = PreemptionCheck(worker.notices, worker.stop_flag, worker.rank, worker.device,
                                          worker.report.log.info)
        self.save_at_epoch_end = False  # a notice came at the epoch's last step
        self.answering: dict = {}  # the Ray Train notice the next checkpoint answers (preemption.answered)
        self.first = True  # this group's first step: benchmarks/preemption.py times a resize to it
        self.stop_after_epoch: Optional[dict] = None  # where a stop request came, at the epoch's last step

    def __call__(self, state: TrainState, last_in_epoch: bool) -> None:
        if state.step == 1:
            marks = {**self.marks, "first_step": time.time()}
            self.report.startup(marks)
            self.trackers.startup(startup_phases(marks))
        if self.first:
            self.report.info("first step of this group: step %d", state.step)
            self.first = False
        if self.compile_cache:
            self.compile_cache.after_step()  # archiving is not the first step's time
        self.trackers.step(state)
        every = self.job.checkpoint.every_steps
        notice = self.preemption.notice(state.step)
        if notice:
            self.report.warn(preemption.describe(notice, state.step, state.epoch, state.batch, last_in_epoch))
            self.save_at_epoch_end = last_in_epoch  # the epoch's own checkpoint follows at once
            self.answering = {} if isinstance(notice, preemption.Stop) else preemption.answered(notice)
        if (notice or every and state.step % every == 0) and not last_in_epoch:
            self.loss_check.settle()  # never checkpoint weights that a non-finite loss has poisoned
            self.trackers.sync()  # the curves up to here first: a restart from this checkpoint keeps them
            # Never "best" by its score: a mid-epoch checkpoint is kept only while it is the latest.
            c = self.job.checkpoint
            report_to_ray({"epoch": state.epoch, "step": state.step, "batch": state.batch, "mid_epoch": True,
                           c.metric: checkpoint.WORST_SCORE[c.mode], **self.answer()}, state, self.worker,
                          self.about)
        if notice and not last_in_epoch:  # (at an epoch's end, the epoch's own checkpoint follows)
            self.report.info("notice answered: the checkpoint at step %d is written", state.step)
        if isinstance(notice, preemption.Stop):
            where = {"epoch": state.epoch + 1, "step": state.step, "batch": state.batch, "reason": notice.reason}
            if not last_in_epoch:
                raise preemption.Stopping(where)
            self.stop_after_epoch = {**where, "epoch": state.epoch + 2, "batch": 0}  # the next epoch's start

    def answer(self) -> dict:
        """For the report of the checkpoint that answers a Ray Train notice: the notice, once."""
        answering, self.answering = self.answering, {}
        return answering


def report_to_ray(metrics: dict, state: TrainState, w: Worker, about: Optional[dict]) -> None:
    """Report to Ray Train, with a checkpoint of `state` (and `about` it) when `about` is given:
    every rank writes its part into a fresh directory; Ray merges them into the run's checkpoint
    (in local mode, `checkpoint.commit` does). A write that fails (a full disk) is said as such,
    with the space left, not as Ray's copy error."""
    if about is None:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as directory:
        try:
            checkpoint.save(directory, w.rank, state, about)
        except OSError as e:
            raise CheckpointNotWritten(state.step, f"this worker's staging folder {directory}",
                                       _write_error(e, directory)) from None
        if w.rank == 0:  # the checkpoint wins the disk over the compile cache's archive
            give_way(w.run_dir, directory, w.report.warn)
        try:
            if w.local:
                checkpoint.commit(directory, w.run_dir, w.rank, metrics, w.job.checkpoint, w.device)
            else:
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))
        except OSError as e:
            raise CheckpointNotWritten(state.step, w.run_dir, _write_error(e, w.run_dir)) from None


def _write_error(e: OSError, where: str) -> str:
    """"no space left on device (12 MB free)", or the error's own words."""
    if e.errno is None:
        return last_line(e)
    cause = os.strerror(e.errno).lower()
    if e.errno == errno.ENOSPC and "://" not in where:
        with suppress(OSError):
            cause += f" ({shutil.disk_usage(where).free / 2**20:.0f} MB free)"
    return cause
