"""Local mode: the same worker loop on this machine with no Ray cluster, through Ray Train's own
local mode (`ScalingConfig(num_workers=0)`).

Why: on one machine a Ray cluster's start-up (eight Python processes before the first step) is
most of a short run's time. In local mode one worker runs in this process, and N workers run as
N processes that torch's elastic launcher (torchrun, as a library) starts and joins in a process
group (see `worker/local.py`); each runs the Ray Train function with `ray.train.get_context()`
and `report()` working, and `worker/checkpoint.commit` does what Ray Train's controller does
with checkpoints.

What it cannot do is decided in `choose`: Ray Data, another node, more than one whole GPU per
worker. A script's ranks are started by this process itself, as torchrun starts them, with no
worker process between (`driver/scripts.py`).

Restarts: after a failure the group starts again from the latest checkpoint, up to
`failure.max_failures` times, each in a fresh launch. torchrun's own `--max-restarts` reuses its
rendezvous store, and with torch 2.14's Gloo the restarted group then dials the old group's
addresses ("connectFullMesh failed ... Connection refused", with plain `torchrun` too).
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import queue
import re
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
from contextlib import contextmanager, suppress
from multiprocessing.connection import Client, Listener
from typing import TYPE_CHECKING, Callable, Optional

from raytrain_app.cluster.session import address_from_environment, running_local_cluster
from raytrain_app.config import JobConfig
from raytrain_app.driver.signals import handlers_kept
from raytrain_app.errors import CheckpointNotWritten, TrainingFailed, UserError, last_line

if TYPE_CHECKING:
    from raytrain_app.worker.args import WorkerArgs
    from raytrain_app.worker.local import Outbox

# The worker's modules (torch, Ray Train) load where they run: this module decides whether a run
# is local, and starts the fork server that loads them, before the driver has loaded them itself.


def cannot(config: JobConfig, address: Optional[str] = None, min_nodes: int = 1) -> list[str]:
    """What in the job needs Ray Train's own workers, in words (none: local mode can run it)."""
    s = config.scaling
    return [reason for given, reason in (
        (config.data.engine == "ray_data", "data.engine ray_data needs a Ray cluster"),
        (bool(address) or min_nodes > 1, "--address and --min-nodes join a Ray cluster"),
        (s.elastic, f"a range of workers ({s.min_workers}:{s.max_workers}) resizes through Ray Train's "
                    "controller"),
        (s.gpus_per_worker not in (0, 1), f"gpus_per_worker {s.gpus_per_worker:g}: local mode gives each worker "
                                          "one whole GPU or none"),
    ) if given]


def choose(config: JobConfig, address: Optional[str], min_nodes: int, ray_connected: bool) -> bool:
    """Whether the run goes through local mode: as `scaling.local` says, and where it says auto,
    whenever nothing Ray brings is asked for and no cluster is there to join ($RAY_ADDRESS's, or
    one that `cluster up` started). Asked for by name, what it cannot do is refused."""
    s = config.scaling
    cannot_here = cannot(config, address, min_nodes)
    if s.local is True and cannot_here:
        raise UserError(f"--local (scaling.local: true): {cannot_here[0]}; drop --local, or what needs Ray")
    if s.local == "auto":  # a cluster this process joined, $RAY_ADDRESS names or `cluster up` started is used
        return not (cannot_here or ray_connected or address_from_environment()
                    or running_local_cluster(s.max_workers, s.cpus_per_worker, s.gpus_per_worker))
    return s.local


def in_this_process(config: JobConfig, trial: bool) -> bool:
    """One worker runs in this process, but not in a sweep's trial: Ray Train refuses its API
    (`get_context`) inside a Tune function, so a trial's one worker is a process of its own. A
    script's ranks are processes of their own (`driver/scripts.py`)."""
    return config.scaling.max_workers == 1 and not trial and not config.script


def fresh_events(here: bool):
    """(the driver's end, the workers' end) of the channel rank 0's console events take: a queue
    for a rank served in this process (the one worker, or a script's ranks), an inbox on loopback
    for worker processes."""
    if here:
        events = queue.Queue()
        return events, events
    inbox = Inbox()
    return inbox, inbox.outbox


class Inbox:
    """The driver's end: what rank 0 sends, read as from a queue (`get` with a timeout)."""

    def __init__(self):
        self._authkey = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=self._authkey)
        self._items: queue.Queue = queue.Queue()
        self._closing = False
        threading.Thread(target=self._receive, name="driver-inbox", daemon=True).start()

    @property
    def outbox(self) -> Outbox:
        from raytrain_app.worker.local import Outbox

        return Outbox(self._listener.address, self._authkey)

    def get(self, timeout: float):
        return self._items.get(timeout=timeout)

    def get_nowait(self):
        return self._items.get_nowait()

    def put_nowait(self, item) -> None:
        """The driver's own item (the listener's wake-up), after what rank 0 sent."""
        self._items.put(item)

    def _receive(self) -> None:
        while True:  # one connection per rank 0 (a restarted group's rank 0 opens another)
            try:
                connection = self._listener.accept()
            except OSError:  # closed
                return
            if self._closing:  # woken by `close`
                connection.close()
                return
            threading.Thread(target=self._drain, args=(connection,), daemon=True).start()

    def _drain(self, connection) -> None:
        with suppress(EOFError, OSError):
            while True:
                self._items.put(connection.recv())

    def close(self) -> None:
        """Closing a listening socket does not wake a thread blocked in its `accept`: a connection does."""
        self._closing = True
        with suppress(OSError):
            Client(self._listener.address, authkey=self._authkey).close()
        self._listener.close()


def run(args: WorkerArgs, config: JobConfig, log_dir: str, latest: Callable[[], Optional[str]],
        on_restart: Callable[[str, str], None], in_process: bool) -> None:
    """Train, restarting the whole group from the latest checkpoint after a failure, up to
    `failure.max_failures` times (`on_restart` hears the cause and the console's line); raises
    TrainingFailed with the last failure after that. Worker
    processes' own output goes to `log_dir`/local/launch-N/attempt_0/RANK/, as Ray's goes to its logs."""
    limit = config.failure.max_failures
    failures = 0
    while True:
        try:
            with worker_environment(config.scaling):
                if config.script:
                    from raytrain_app.driver.scripts import launch

                    launch(args, config, restarts=failures)
                elif in_process:
                    from raytrain_app.worker.local import train

                    train(args)
                else:
                    _launch(args, config.scaling.max_workers, os.path.join(log_dir, "local"), f"launch-{failures + 1}")
            return
        except (KeyboardInterrupt, UserError):
            raise
        except Exception as e:  # noqa: BLE001 - any worker failure is a restart, as under Ray Train
            failures += 1
            why = _reason(e)
            if limit != -1 and failures > limit:
                if isinstance(e, CheckpointNotWritten):  # the worker in this process's: what it could not write
                    raise
                unwritten = _UNWRITTEN.search(why)  # a worker process's, as its last line said it
                if unwritten:
                    raise CheckpointNotWritten(int(unwritten["step"]), unwritten["where"], unwritten["cause"]) from None
                raise TrainingFailed(why) from None
            on_restart(why, f"{why}; restarting from {latest() or 'the start'} "
                            f"(restart {failures} of {'unlimited' if limit == -1 else limit})")


# What the fork server that starts worker processes imports once, so that a launch (and every
# restart's) does not pay it per worker: torch, the dynamo settings DDP's constructor reads (about
# 1 s), and the worker's own modules with Ray Train's. Not the caller's `__main__`, which a
# notebook's or a script's `fit()` would not survive being re-run. Last, `worker/preloaded`, which
# hides all that from the garbage collector (see there).
PRELOAD = ["torch", "torch._dynamo", "raytrain_app.worker.local", "raytrain_app.worker.preloaded"]


def start_fork_server() -> None:
    """Start the worker processes' fork server now, so that it imports what workers need while
    this process checks and plans the run: a launch then forks workers that have it loaded.

    Its output goes to /dev/null, as does a rank's until the launcher sends it to the rank's log
    files. The server is in this process's group, which a terminal's Ctrl-C signals whole: in the
    middle of its imports (it ignores SIGINT only after them) it would print a KeyboardInterrupt's
    traceback, and so would a rank forked but not yet in a session of its own, or one that an
    interrupted launch left half started and that then fails to find the launcher's semaphores.
    This process says it was interrupted, in one line, and stops them."""
    import multiprocessing.forkserver
    from multiprocessing import resource_tracker

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    resource_tracker.ensure_running()  # which the server starts first: its warnings of leaked memory are the user's
    with _output_to(os.devnull):
        multiprocessing.forkserver.ensure_running()
    atexit.unregister(_stop_fork_server)  # (registered once)
    atexit.register(_stop_fork_server, os.getpid())


def _stop_fork_server(owner: int) -> None:
    """At this process's exit (not a fork's of it), its fork server ends too. It would end by
    itself, but only once done with its imports: after a Ctrl-C at start-up, seconds of a process
    loading torch for nothing."""
    from multiprocessing import forkserver

    pid = forkserver._forkserver._forkserver_pid  # (the module's one server: it has no public handle)
    if os.getpid() == owner and pid is not None:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextmanager
def _output_to(path: str):
    """This process's stdout and stderr (the file descriptors, which a process it starts
    inherits) go to `path` meanwhile."""
    sys.stdout.flush()
    sys.stderr.flush()
    kept, target = [os.dup(1), os.dup(2)], os.open(path, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(target, fd)
        yield
    finally:
        for fd, saved in zip((1, 2), kept):
            os.dup2(saved, fd)
            os.close(saved)
        os.close(target)


def _launch(args: WorkerArgs, workers: int, log_dir: str, name: str) -> None:
    """N worker processes through torch's elastic launcher, as `torchrun --standalone` starts
    them, each forked from a server that has their imports done (see `start_fork_server`)."""
    from ray import cloudpickle
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from raytrain_app.worker.local import main

    start_fork_server()  # if it is not up already
    with tempfile.TemporaryDirectory(prefix="raytrain-local-") as scratch, _quiet_launcher():
        # The launcher's files (each rank's output, and the error file it reads back to say why a
        # rank failed) start in scratch space: on a full run directory they could not be written.
        logs = os.path.join(scratch, "logs")
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=workers, run_id=name, rdzv_backend="c10d",
                              rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                              start_method="forkserver", logs_specs=DefaultLogsSpecs(log_dir=logs, redirects=Std.ALL))
        arguments = os.path.join(scratch, "worker-args.pkl")  # private to this user: it holds the inbox's key
        with open(arguments, "wb") as f:
            # This process's pid (each rank ends with it) and its environment now: the fork server
            # has the one of its own start.
            pickle.dump((os.getpid(), dict(os.environ)), f)
            cloudpickle.dump(args, f)
        try:
            with _main_script_hidden(), handlers_kept():  # the launcher sets its own and leaves them
                elastic_launch(config, main)(arguments)
        except SignalException as e:  # the launcher's word for a signal: Ctrl-C, or a scheduler's SIGTERM
            if e.sigval in (signal.SIGINT, signal.SIGTERM):
                raise KeyboardInterrupt from None
            raise
        finally:
            with suppress(OSError):  # kept where they can be; never the run's outcome
                shutil.copytree(logs, log_dir, dirs_exist_ok=True)


# CheckpointNotWritten's words, read back from a worker process's last line.
_UNWRITTEN = re.compile(r"checkpoint at step (?P<step>\d+) could not be written to (?P<where>\S+): (?P<cause>.+)$")


def _reason(e: Exception) -> str:
    """Which rank failed first, where, and its last error line (its peers' broken collectives
    follow from it): from the launcher's report of the worker processes, or the in-process
    worker's own exception."""
    from raytrain_app.driver.scripts import RankEnded

    host = socket.gethostname()
    if isinstance(e, RankEnded):  # a script's rank
        return f"rank {e.rank} on node {host} (pid {e.pid}): {e.what}"
    if not hasattr(e, "failures"):  # not torch's ChildFailedError: the worker in this process
        return f"rank 0 on node {host} (pid {os.getpid()}): {last_line(e)}"
    # The launcher reports the first rank it saw end; a rank that a dead peer's broken collective
    # ended waits a moment first (worker/local.PEER_GRACE_S), so that is the one that died.
    rank, failure = min(e.failures.items())
    message = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
    lines = [line for line in message.strip().splitlines() if line.strip() and "To enable traceback" not in line]
    code = failure.exitcode
    what = (f"worker process died: killed by {signal.Signals(-code).name}" if code < 0 else
            # (a rank's own account, RankFailed, names this node already)
            re.sub(r"^RankFailed: on node \S+: ", "", lines[-1]) if lines else f"worker process died: exit code {code}")
    return f"rank {rank} on node {host} (pid {failure.pid}): {what}"


@contextmanager
def _main_script_hidden():
    """multiprocessing re-runs the caller's main script in each process it starts, where the main
    module names a file or module; a notebook's or a script's `fit()` (no `__main__` guard) would
    not survive that. The workers need nothing from it: their function and arguments are given.
    The launch blocks until training ends, so the main module goes without them that long."""
    main = sys.modules["__main__"]
    spec, path = getattr(main, "__spec__", None), main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__spec__ = spec
        if path is not None:
            main.__file__ = path


@contextmanager
def _quiet_launcher():
    """The launcher's own account of a failure (its log lines, and those of the process group it
    starts the workers in) is said in one line by `_reason`."""
    # Their modules' loggers set levels of their own (WARNING), so a level set here would not reach
    # them: their records stop here instead, at a handler that drops them.
    loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing")]
    dropped, before = logging.NullHandler(), [logger.propagate for logger in loggers]
    for logger in loggers:
        logger.addHandler(dropped)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, propagate in zip(loggers, before):
            logger.removeHandler(dropped)
            logger.propagate = propagate


@contextmanager
def worker_environment(scaling):
    """Each worker computes on as many threads as Ray would give it (its CPUs): the same numbers
    under both, and N workers that do not fight over the cores. Workers given no GPU see none:
    Ray Train's local mode would take a GPU it finds (and NCCL with it). Worker processes get
    this process's import path."""
    import torch

    threads = max(1, int(scaling.cpus_per_worker))
    settings = {"OMP_NUM_THREADS": str(threads), **({"CUDA_VISIBLE_DEVICES": ""} if not scaling.gpus_per_worker
                                                     else {}),
                # Worker processes import what this process can: Ray puts its driver's directory on
                # its workers' path, and Tune runs a trial's function in the trial's own folder.
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    before_env, before = {k: os.environ.get(k) for k in settings}, torch.get_num_threads()
    os.environ.update(settings)  # the worker processes' (the launcher passes these on)
    torch.set_num_threads(threads)  # this process's: the one in-process worker
    try:
        yield
    finally:
        torch.set_num_threads(before)
        for key, value in before_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
