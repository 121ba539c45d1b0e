"""Local mode for a script: its ranks started by this process, as torchrun starts them.

Each rank is `python -m raytrain_app.worker.script_process SCRIPT ARGS` with torchrun's
environment, and the ranks meet at a store this process hosts, as torchrun's agent hosts it
(`TORCHELASTIC_USE_AGENT_STORE`). This process serves every rank as a Ray Train worker serves its
own (`worker/script.Served`): output, heartbeats, `script_api.report` and `latest_checkpoint`,
stops. No worker process stands between the command and the script's processes, and none has to
import torch and Ray first: a script starts about as soon as under torchrun.

The ranks' reports are joined as one row a round, each rank's k-th report waiting for every
rank's k-th, as a collective would; a round's checkpoint is every rank's files in one new
directory of the run (`worker/checkpoint.commit_files`).

A rank that fails ends the launch: the others are killed, as torchrun kills them, and
`driver/local.run` starts the group again from the latest checkpoint. SIGTERM or SIGINT to this
process (a scheduler's stop, Ctrl-C) becomes `script.stop_signal` to every rank, with
`script.stop_grace_s` to checkpoint; a second Ctrl-C kills them at once.
"""

from __future__ import annotations

import signal
import socket
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from typing import Optional

from torch.distributed import TCPStore

from raytrain_app import storage
from raytrain_app.config import JobConfig
from raytrain_app.errors import peer_gone
from raytrain_app.rundir import snapshot
from raytrain_app.worker.checkpoint import commit_files
from raytrain_app.worker.reporter import Reporter
from raytrain_app.worker.script import (
    LOOK_S,
    POLL_S,
    Relay,
    Served,
    combined,
    script_command,
    script_environment,
    torchrun_env,
)


class RankEnded(Exception):
    """The first rank of a launch to fail: which, its process, and how (`Served.failure`)."""

    def __init__(self, rank: int, pid: int, what: str):
        self.rank, self.pid, self.what = rank, pid, what
        super().__init__(what)


def launch(args, config: JobConfig, restarts: int) -> None:
    """One launch of the script's `scaling.max_workers` ranks, served until every rank ended;
    raises RankEnded for the first that failed, KeyboardInterrupt after a stop signal."""
    workers = config.scaling.max_workers
    store = TCPStore("127.0.0.1", 0, workers, is_master=True, wait_for_workers=False)  # (held to the end)
    node = args.node or socket.gethostname()
    reporters = [Reporter(args.events, rank, args.log_dir, progress=False) for rank in range(workers)]
    keep = config.checkpoint.model_copy(update={"metric": "time", "mode": "max"})  # the newest are kept
    reports = Reports(workers, args.run_dir, keep, reporters[0])
    stops = Stops(args.stop_flag)
    ranks = []
    with ExitStack() as stack:
        relays = [stack.enter_context(Relay()) for _ in range(workers)]  # each rank's, open while the launch lasts
        for rank in range(workers):
            env = {**script_environment(args, relays[rank], node),
                   **torchrun_env(rank, rank, workers, workers, 0, ("127.0.0.1", store.port), restarts, args.job)}
            ranks.append(LocalRank(args.job["script"], reporters[rank], relays[rank], node, rank, reports, stops,
                                   args.run_dir, env))
        with stops.on_signals():
            threads = [threading.Thread(target=r.serve, name=f"script-rank-{r.rank}", daemon=True) for r in ranks]
            for thread in threads:
                thread.start()
            try:
                while any(thread.is_alive() for thread in threads):
                    if stops.killing or any(r.failed for r in ranks):  # the group ends with its first failure
                        abandon(ranks, reports)
                    for thread in threads:
                        thread.join(timeout=POLL_S)
            finally:
                abandon(ranks, reports)  # (after an error here, or a KeyboardInterrupt: no rank outlives its launch)
                for thread in threads:
                    thread.join()
    for reporter in reporters:
        reporter.sync()
    if stops.signalled:
        raise KeyboardInterrupt
    failed = [r for r in ranks if r.failed]
    if failed:
        # The culprit: the first to end, but a rank whose collective a dead peer broke is an effect.
        first = min(failed, key=lambda r: (peer_gone(Exception(r.failed)), r.ended))
        raise RankEnded(first.rank, first.pid, first.failed)


def abandon(ranks: list["LocalRank"], reports: "Reports") -> None:
    reports.abandon()
    for rank in ranks:
        rank.abandoned.set()


class LocalRank(Served):
    """One rank's script process, served from this process."""

    def __init__(self, script: dict, report: Reporter, relay: Relay, node: str, rank: int, reports: "Reports",
                 stops: "Stops", run_dir: str, env: dict):
        super().__init__(script, report, relay, node, rank)
        self.reports, self.stops, self.run_dir, self.env = reports, stops, run_dir, env
        self.failed: Optional[str] = None  # how it failed, if it did
        self.ended = float("inf")  # when its process ended (the first to fail is the culprit)
        self.pid = 0

    def serve(self) -> None:
        self.report.info("rank %d/%s on node %s: %s %s", self.rank, self.env["WORLD_SIZE"], self.node,
                         self.script["path"], " ".join(self.script["args"]))
        def started(process) -> None:
            self.pid = process.pid
            self.stops.started(self)

        code = self.run(script_command(self.script), self.env, started=started)
        killed_here = self.abandoned.is_set() and code == -signal.SIGKILL  # (a peer failed first)
        self.ended = time.monotonic()
        self.failed = None if killed_here else self.failure(code)

    def _report(self, metrics: dict, checkpoint_dir: Optional[str]) -> None:
        self.reports.report(self.rank, metrics, checkpoint_dir)

    def _latest(self) -> Optional[str]:
        latest = snapshot.latest(self.run_dir)
        if latest is None or storage.is_local(latest):
            return latest
        local = tempfile.mkdtemp(prefix="raytrain-checkpoint-")
        storage.download(latest, local)
        return local

    def _stop_requested(self, now: bool) -> Optional[str]:
        return self.stops.reason()

    def _signal(self, process, reason: str) -> float:
        return self.stops.signal_all(reason)


class Reports:
    """The ranks' `script_api.report` calls, joined a round at a time (see the module's docstring)."""

    def __init__(self, workers: int, run_dir: str, keep, rank0: Reporter):
        self.workers, self.run_dir, self.keep, self.rank0 = workers, run_dir, keep, rank0
        self._changed = threading.Condition()
        self._rounds: dict[int, dict[int, tuple[dict, Optional[str]]]] = {}
        self._errors: dict[int, dict[int, OSError]] = {}  # a joined round's: the ranks whose files were not written
        self._made = [0] * workers
        self._abandoned = False

    def report(self, rank: int, metrics: dict, checkpoint_dir: Optional[str]) -> None:
        """Rank `rank`'s next report; returns once its round is joined (its checkpoint written)."""
        with self._changed:
            k = self._made[rank]
            self._made[rank] += 1
            entries = self._rounds.setdefault(k, {})
            entries[rank] = (metrics, checkpoint_dir)
            if len(entries) == self.workers:
                self._errors[k] = self._join(self._rounds.pop(k))
                self._changed.notify_all()
            while k not in self._errors:
                if self._abandoned:
                    raise RuntimeError("another rank of the group ended")
                self._changed.wait()
            error = self._errors[k].get(rank)
        if error is not None:
            raise error

    def abandon(self) -> None:
        """The launch is ending: ranks waiting for a round get an error instead."""
        with self._changed:
            self._abandoned = True
            self._changed.notify_all()

    def _join(self, entries: dict[int, tuple[dict, Optional[str]]]) -> dict[int, OSError]:
        row = combined([entries[rank][0] for rank in sorted(entries)])
        staged = {rank: path for rank, (_, path) in entries.items() if path is not None}
        errors = commit_files(staged, self.run_dir, row, self.keep) if staged else {}
        if staged and not errors:
            row["checkpoint"] = snapshot.latest(self.run_dir)
        self.rank0.script_report(row)
        return errors


class Stops:
    """Why the ranks should stop: a stop request (`stop_flag`: SIGUSR1, `raytrain-app stop`), or
    SIGTERM or SIGINT to this process while the launch runs. A second SIGINT kills the ranks."""

    def __init__(self, stop_flag):
        self.stop_flag = stop_flag
        self.signalled: Optional[str] = None
        self.killing = False
        self._next_look, self._flagged = 0.0, None
        self._lock = threading.Lock()
        self._unsignalled: list[LocalRank] = []  # started ranks not sent the stop signal yet
        self._sent: Optional[float] = None  # when it was first sent

    def started(self, rank: LocalRank) -> None:
        with self._lock:
            self._unsignalled.append(rank)

    def signal_all(self, reason: str) -> float:
        """`script.stop_signal` to every rank's process at once, as torchrun's agent passes a
        signal on, whichever rank's thread saw the reason first; when it was first sent. A rank
        signalled after its peers would often get it as it exits, its peers having told it to stop
        (in the script's own collective), when Python has given its handlers up: it died of it."""
        with self._lock:
            for rank in self._unsignalled:
                rank.send_stop(rank.pid, reason)
            self._unsignalled.clear()
            self._sent = self._sent or time.monotonic()
            return self._sent

    def reason(self) -> Optional[str]:
        if self.signalled:
            return self.signalled
        if self._flagged is None and self.stop_flag is not None and time.monotonic() >= self._next_look:
            self._next_look = time.monotonic() + LOOK_S
            self._flagged = self.stop_flag.get()
        return self._flagged

    @contextmanager
    def on_signals(self):
        if threading.current_thread() is not threading.main_thread():  # (a sweep's trial: the trial's own)
            yield
            return

        def stop(signum, frame):
            if self.signalled:
                self.killing = True
            self.signalled = signal.Signals(signum).name

        before = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)
