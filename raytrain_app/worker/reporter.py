"""What a worker tells the user: its own log file, and from rank 0 the events the driver prints.

Every rank writes `logs/rank-N.log` in the run directory. On object storage a worker cannot
append to a remote file, so it writes a local copy and uploads it after every report and when it
fails; a restarted worker first takes the uploaded log back, so a run keeps one log per rank.

Rank 0 alone sends console events through a Ray queue that the driver drains (in local mode, a
queue or a loopback connection): start-up marks,
notices, progress within an epoch, epoch metrics, a stop at a non-finite loss, or the lines a
script prints. Every rank sends its heartbeat's beats the same way (see `heartbeat.py`).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import Callable, Optional

from raytrain_app import storage
from raytrain_app.rayinternals import put_nowait

PROGRESS_INTERVAL_S = 0.5


class Reporter:
    def __init__(self, events, rank: int, log_dir: str, progress: bool):
        self.events, self.rank, self.progress_on = events, rank, progress and rank == 0
        self.remote_log = None if storage.is_local(log_dir) else storage.join(log_dir, f"rank-{rank}.log")
        local_dir = log_dir if self.remote_log is None else tempfile.mkdtemp(prefix="raytrain-log-")
        os.makedirs(local_dir, exist_ok=True)
        self.local_log = os.path.join(local_dir, f"rank-{rank}.log")
        if self.remote_log and storage.exists(self.remote_log):  # a restarted worker continues the log
            with open(self.local_log, "wb") as f:
                f.write(storage.read_bytes(self.remote_log))
        self.log = logging.getLogger(f"raytrain_app.rank{rank}")
        self.log.setLevel(logging.INFO)
        self.log.propagate = False
        for old in list(self.log.handlers):  # a worker process may be reused by a restarted run
            self.log.removeHandler(old)
            old.close()
        self.file = logging.FileHandler(self.local_log)
        self.file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self.log.addHandler(self.file)

    def info(self, message: str, *args) -> None:
        """A line for the log only."""
        self.log.info(message, *args)

    def say(self, message: str) -> None:
        """A line for the log and, from rank 0, for the console."""
        self.log.info(message)
        self._send("info", message)

    def warn(self, message: str) -> None:
        """A warning for the log and, from rank 0, for the console."""
        self.log.warning(message)
        self._send("notice", message)

    def output(self, line: str) -> None:
        """A line a script printed: into the log as it is and, from rank 0, to the console in
        order, without waiting for the driver."""
        self.file.stream.write(line + "\n")
        self.file.flush()
        if self.rank == 0:
            self._send_nowait(("output", line))

    def group(self, world_size: int, step: str) -> None:
        """The group's size and what a step is at it, once per (re)start: the driver says a resize."""
        self.log.info("%d workers, %s", world_size, step)
        self._send("group", {"world_size": world_size, "step": step})

    def beat(self, beat: dict) -> None:
        """This rank's progress, from its heartbeat's thread, never waiting for the driver."""
        self._send_nowait(("beat", beat))

    def script_report(self, row: dict) -> None:
        """A script's report, its ranks' values combined (local mode; on Ray the controller sends it)."""
        self._send("report", row)

    def startup(self, marks: dict) -> None:
        self._send("startup", marks)

    def epoch(self, metrics: dict) -> None:
        self.log.info("epoch %d %s", metrics["epoch"], metrics)
        self._send("epoch", metrics)

    def restored(self, rows: list[dict]) -> None:
        """The resumed checkpoint's epoch rows: the driver adds those metrics.jsonl lacks."""
        self._send("restored", rows)

    def nonfinite(self, where: dict) -> None:
        self.log.error("stopped: the training loss was not finite at %s", where)
        self._send("nonfinite", where)

    def stopped_early(self, where: dict) -> None:
        self.log.info("stopping early after epoch %d: %s", where["epoch"], where["reason"])
        self._send("stopped_early", where)

    def stopped(self, where: dict) -> None:
        self.log.info("stopped on request (%s) at step %d", where["reason"], where["step"])
        self._send("stopped", where)

    def failed(self) -> None:
        """Called from an exception handler: the traceback goes to the log, and the log to storage."""
        self.log.exception("rank %d failed", self.rank)
        self.sync()

    def sync(self) -> None:
        """Copy the log to object storage (no-op for local run directories)."""
        if self.remote_log:
            for handler in self.log.handlers:
                handler.flush()
            storage.upload(self.local_log, self.remote_log)

    def progress(self, epoch: int, total: int) -> Optional[Callable[[int], None]]:
        """rank 0's per-batch callback for epoch `epoch` (0-based) of `total` batches, at most one
        event per PROGRESS_INTERVAL_S and never waiting for the queue; None elsewhere."""
        if not self.progress_on:
            return None
        last = 0.0

        def report(done: int) -> None:
            nonlocal last
            now = time.monotonic()
            if now - last >= PROGRESS_INTERVAL_S or done == total:
                last = now
                self._send_nowait(("progress", (epoch + 1, done, total)))

        return report

    def _send(self, kind: str, payload) -> None:
        if self.rank == 0:
            self.events.put((kind, payload))

    def _send_nowait(self, item) -> None:
        if hasattr(self.events, "actor"):  # a Ray queue, whose own put_nowait waits for the actor's answer
            put_nowait(self.events, item)
        else:
            self.events.put_nowait(item)
