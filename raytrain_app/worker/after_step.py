"""What follows each optimizer step of the loop, and how a worker reports to Ray Train.

After a step: the start-up breakdown at a fresh run's first step, the trackers' step point, a
mid-epoch checkpoint every `checkpoint.every_steps` steps, and the answer to a preemption notice
or a stop request (`preemption.py`): a checkpoint at the step the loop is at.

Asking for a notice is a collective (every rank must ask at the same steps), and asking at every
step would cost more than a small model's step, so the first `MEASURED` steps each ask and time
it, the ranks agree on the largest interval any of them needs for the asking to cost under
`BUDGET` of the step time, and from then on they ask every that many steps (`PreemptionCheck`).

With `checkpoint.async`, checkpoints are written in the background (`Background`): the loop
pauses only while the state is copied to host memory.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Callable, Optional

import ray.train
import torch

from raytrain_app.config import JobConfig
from raytrain_app.console import startup_phases
from raytrain_app.distributed import global_max
from raytrain_app.errors import CheckpointNotWritten, last_line
from raytrain_app.tracking import Trackers
from raytrain_app.worker import checkpoint, preemption
from raytrain_app.worker.compile_cache import CompileCache, give_way
from raytrain_app.worker.heartbeat import CHECKPOINT
from raytrain_app.worker.nonfinite import LossCheck
from raytrain_app.worker.rank import Worker
from raytrain_app.worker.state import TrainState

BUDGET = 0.01  # of the step time, for asking after notices
MEASURED = 8  # steps that ask at every step, timing it
LONGEST = 1000  # steps between asks, at most


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
        self.background = Background(worker) if job.checkpoint.async_ else None  # checkpoint.async's writer

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
            if self.worker.heartbeat:  # its write, or the wait for the one before, has its own bound
                self.worker.heartbeat.at(CHECKPOINT)
            report_to_ray({"epoch": state.epoch, "step": state.step, "batch": state.batch, "mid_epoch": True,
                           c.metric: checkpoint.WORST_SCORE[c.mode], **self.answer()}, state, self.worker,
                          self.about, self.background, urgent=bool(notice))
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

    def close(self) -> None:
        """Called as the loop ends, however it ends: the checkpoint still being written (the run's
        last, most often) is finished before this rank does. Its write error is raised unless the
        loop is already failing with one of its own, which it must not hide."""
        if self.background:
            self.background.close(raise_error=sys.exc_info()[0] is None)


def report_to_ray(metrics: dict, state: TrainState, w: Worker, about: Optional[dict],
                  background: Optional["Background"] = None, urgent: bool = False) -> None:
    """Report to Ray Train, with a checkpoint of `state` (and `about` it) when `about` is given:
    every rank writes its part into a fresh directory; Ray merges them into the run's checkpoint
    (in local mode, `checkpoint.commit` does). A write that fails (a full disk) is said as such,
    with the space left, not as Ray's copy error. With `background` (`checkpoint.async`) the files
    are written while the loop goes on; an `urgent` checkpoint (a notice's, whose node may soon
    go) is waited for all the same."""
    if background:
        background.report(metrics, state, about)
        if urgent:
            background.wait()
        return
    if about is None:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as directory:
        _stage(w, state.step, directory, lambda: checkpoint.save(directory, w.rank, state, about))
        with _unwritten(state.step, w.run_dir):
            if w.local:
                checkpoint.commit(directory, w.run_dir, w.rank, metrics, w.job.checkpoint, w.device)
            else:
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))


class Background:
    """Checkpoints written while the loop trains on (`checkpoint.async`).

    The loop pauses only to take a `checkpoint.Snapshot`: a copy of the state in host memory.
    Serialising, hashing, writing and committing it happen on another thread. In local mode that
    is a thread of this class's, which commits as Ray Train's controller would
    (`checkpoint.commit`); on Ray it is Ray Train's own upload thread
    (`report(checkpoint_upload_mode=ASYNC)`, whose `checkpoint_upload_fn` writes the files before
    uploading them), after which the controller registers the checkpoint.

    Either way a checkpoint becomes the run's latest only once whole and committed, so a process
    killed mid-write leaves the one before as the latest. One checkpoint is in flight at a time:
    the next report waits for it (and reuses its host memory), and so does `close`. A local write
    that failed raises its CheckpointNotWritten at the next of those; on Ray, Ray Train raises it
    at once, in the worker, and ends the group."""

    def __init__(self, w: Worker):
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.w = w
        # Host memory for one copy of the state, pinned for a GPU's copies, reused by every snapshot.
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=w.device.type == "cuda", use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=False))
        # The background's collectives (commit's vote, DCP's save plan) on a Gloo group of their own:
        # on the loop's group, two threads' collectives could meet in a different order on each rank.
        self.group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=w.job.scaling.timeout_s))
                      if dist.is_available() and dist.is_initialized() else None)
        self.staging = tempfile.mkdtemp(prefix="raytrain-checkpoints-")  # each snapshot's files, until committed
        self.in_flight: Optional[Future] = None

    def report(self, metrics: dict, state: TrainState, about: Optional[dict]) -> None:
        """As `report_to_ray`, the files written in the background."""
        # On Ray, reports reach the controller in order: a plain one behind an upload under way
        # would wait for it, unless it goes through Ray Train's upload thread too.
        upload = {} if self.w.local else {"checkpoint_upload_mode": ray.train.CheckpointUploadMode.ASYNC}
        if about is None:
            ray.train.report(metrics, **upload)
            return
        self.wait()  # one in flight: the snapshot reuses its host memory
        snapshot = checkpoint.Snapshot(tempfile.mkdtemp(dir=self.staging), self.w.rank, state, about, self.stager,
                                       self.group)
        done = self.in_flight = Future()
        if self.w.local:
            threading.Thread(target=self._commit, args=(snapshot, metrics, done), name="checkpoint",
                             daemon=True).start()  # never what keeps a failing process alive: `close` joins it
        else:
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(snapshot.directory),
                             checkpoint_upload_fn=lambda staged, name: self._upload(snapshot, done, staged, name),
                             **upload)

    def wait(self) -> None:
        """Until the checkpoint in flight, if any, is committed; raises its write error."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight:
            in_flight.result()

    def close(self, raise_error: bool) -> None:
        """Waits for the checkpoint in flight (raising its write error if `raise_error`), then
        frees the host copy and the staging folder."""
        try:
            self.wait()
        except Exception:
            if raise_error:
                raise
        finally:
            self.stager.close()
            shutil.rmtree(self.staging, ignore_errors=True)

    def _commit(self, snapshot: checkpoint.Snapshot, metrics: dict, done: Future) -> None:
        """Local mode, on the background thread: the files, then what Ray Train's controller does."""
        try:
            _stage(self.w, snapshot.step, snapshot.directory, snapshot.write)
            with _unwritten(snapshot.step, self.w.run_dir):
                checkpoint.commit(snapshot.directory, self.w.run_dir, self.w.rank, metrics, self.w.job.checkpoint,
                                  torch.device("cpu"), self.group)
            done.set_result(None)
        except BaseException as e:  # the loop's next wait raises it
            done.set_exception(e)
        finally:
            shutil.rmtree(snapshot.directory, ignore_errors=True)

    def _upload(self, snapshot: checkpoint.Snapshot, done: Future, staged: ray.train.Checkpoint,
                name: str) -> ray.train.Checkpoint:
        """On Ray, Ray Train's upload thread calls this for the checkpoint directory `name`: the
        files, then the upload Ray Train would make (it deletes the staged files after). A failure
        is raised to Ray Train, which may retry it, or fails the worker with it: the loop waits
        only for a success."""
        _stage(self.w, snapshot.step, snapshot.directory, snapshot.write)
        with _unwritten(snapshot.step, self.w.run_dir):
            persisted = ray.train.get_context().get_storage().persist_current_checkpoint(staged, name)
        done.set_result(None)
        return persisted


def _stage(w: Worker, step: int, directory: str, write: Callable[[], None]) -> None:
    """`write` a checkpoint's files into the staging `directory`; then rank 0's checkpoint wins
    the disk over the compile cache's archive."""
    with _unwritten(step, f"this worker's staging folder {directory}", directory):
        write()
    if w.rank == 0:
        give_way(w.run_dir, directory, w.report.warn)


@contextmanager
def _unwritten(step: int, where: str, path: Optional[str] = None):
    """An OSError (a full disk, a store refusing a write) as CheckpointNotWritten: the step's
    checkpoint, `where` it was going (`path` on disk, the run directory by default), and why."""
    try:
        yield
    except OSError as e:
        raise CheckpointNotWritten(step, where, _write_error(e, path or where)) from None


def _write_error(e: OSError, where: str) -> str:
    """"no space left on device (12 MB free)", or the error's own words."""
    if e.errno is None:
        return last_line(e)
    cause = os.strerror(e.errno).lower()
    if e.errno == errno.ENOSPC and "://" not in where:
        with suppress(OSError):
            cause += f" ({shutil.disk_usage(where).free / 2**20:.0f} MB free)"
    return cause


class PreemptionCheck:
    """Whether a notice or a stop request came, asked after the steps the module's docstring says."""

    def __init__(self, notices: bool, stop_flag, rank: int, device: torch.device,
                 log: Callable[[str], None] = lambda line: None):
        self.notices, self.stop_flag, self.rank, self.device, self.log = notices, stop_flag, rank, device, log
        self.every: Optional[int] = None  # decided after MEASURED asks
        self._costs: list[float] = []
        self._steps: list[float] = []
        self._since: Optional[float] = None  # when the last ask returned
        self._answered: set[int] = set()  # the deadlines of notices already checkpointed
        self._ask = ray.train.get_preemption_info if notices else None  # Ray Train's own question

    def notice(self, step: int):
        """Ray Train's PreemptionInfo or a `Stop` at this step, the first time it is seen; None
        between asks, when there is none, and for one already answered."""
        if not (self.notices or self.stop_flag) or (self.every and step % self.every):
            return None
        start = time.perf_counter()
        info = self._ask() if self._ask else None
        stop = self._stop_requested()
        done = time.perf_counter()
        if self.every is None:
            self._measure(start, done)
        if stop:
            return stop
        key = (info.deadline_ms or 0) if info else None
        if info is None or key in self._answered:
            return None
        self._answered.add(key)
        return info

    def _stop_requested(self) -> Optional[preemption.Stop]:
        """Rank 0 reads the flag, and every rank learns its answer (one all-reduce)."""
        if self.stop_flag is None:
            return None
        reason = self.stop_flag.get() if self.rank == 0 else None
        if not global_max(int(reason is not None), self.device):
            return None
        return preemption.Stop(reason or "a stop request")

    def _measure(self, start: float, done: float) -> None:
        self._costs.append(done - start)
        if self._since is not None:
            self._steps.append(start - self._since)
        self._since = done
        if len(self._costs) < MEASURED:
            return
        step, cost = max(statistics.median(self._steps), 1e-6), statistics.median(self._costs)
        wanted = min(LONGEST, max(1, math.ceil(cost / (BUDGET * step))))
        self.every = int(global_max(wanted, self.device))  # every rank must ask at the same steps
        self.log(f"preemption notices: asked every {self.every} steps ({cost * 1e3:.2f} ms an ask, "
                 f"{step * 1e3:.2f} ms a step here)")
