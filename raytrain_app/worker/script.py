"""A torchrun-style script, unchanged, one process per rank, as torchrun runs it.

On Ray, each rank's Ray Train worker starts the script as a child process
(`worker/script_process.py`) with the environment torchrun would give it, and serves it until it
ends (`Served`, as `script_on_ray.RayRank`; in local mode the driver starts and serves every rank
itself, `driver/scripts.py`, and Ray is never imported):

- the script has its process's main thread, its own signal handlers and its own process group,
  whose ranks meet at a fresh store, as torchrun's agent hosts it: in local mode this process
  hosts it; on Ray, rank 0's script process, on a socket its worker opened (the worker's group,
  Ray Train's, is not the script's);
- its stdout and stderr, as file descriptors (a C++ warning, a native crash's message), go line
  by line to the rank's `logs/rank-N.log`, rank 0's also to the console, in order;
- its `script_api.report` and `latest_checkpoint` calls come over a local socket and are done
  here, through Ray Train (or, in local mode, as its controller would, `checkpoint.commit`);
- its heartbeats (its stack) go on to the driver's hang watch, a printed line counting as progress;
- a stop (SIGUSR1 to `train`, a drain's preemption notice, a stop of the run; in local mode also
  SIGTERM or SIGINT to `train`) becomes
  `script.stop_signal` to the script, which gets `script.stop_grace_s` to write its checkpoint
  before it is killed;
- its exit status, and its last line of output, are its rank's failure;
- it ends with the process serving it (`worker/lifeline.py`), however that ends.
"""

from __future__ import annotations

import abc
import collections
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import suppress
from multiprocessing.connection import Listener
from typing import Callable, Optional

from raytrain_app.worker.heartbeat import DONE
from raytrain_app.worker.lifeline import LIFELINE_ENV
from raytrain_app.worker.reporter import Reporter
from raytrain_app.worker.script_api import RELAY_ENV, RUN_DIR_ENV

TAIL = 20  # lines of output kept to say why a rank failed
POLL_S = 0.2  # how often the worker looks at the script
LOOK_S = 1.0  # and at stop requests (on Ray, a call to the driver's StopFlag actor)

def script_command(script: dict) -> list[str]:
    return [sys.executable, "-m", "raytrain_app.worker.script_process", script["path"], *script["args"]]


def script_environment(args, relay: "Relay", node: str) -> dict[str, str]:
    """A script process's variables, but for torchrun's: the serving process's own (not the
    launcher variables of a run under torchrun itself: the script's group is its own), the way
    back to it, and its import path."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    return {**inherited, RUN_DIR_ENV: args.run_dir, RELAY_ENV: relay.env, "RAYTRAIN_NODE": node,
            LIFELINE_ENV: str(os.getpid()),
            "RAYTRAIN_HANG_TIMEOUT_S": str(args.job["failure"]["hang_timeout_s"]),
            # The serving process's import path (Ray's working_dir and py_modules among it), so that
            # the script process finds this package and what the script imports as the worker would.
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            "PYTHONUNBUFFERED": "1"}  # each line as printed, in order with the native layer's


def torchrun_env(rank: int, local_rank: int, world_size: int, local_world_size: int, node_rank: int,
                 master: tuple[str, int], restarts: int, job: dict) -> dict[str, str]:
    """The variables torchrun sets for each process."""
    env = {
        "RANK": rank,
        "LOCAL_RANK": local_rank,
        "WORLD_SIZE": world_size,
        "LOCAL_WORLD_SIZE": local_world_size,
        "GROUP_RANK": node_rank,
        "NODE_RANK": node_rank,
        "ROLE_RANK": rank,
        "ROLE_WORLD_SIZE": world_size,
        "MASTER_ADDR": master[0],
        "MASTER_PORT": master[1],
        "TORCHELASTIC_USE_AGENT_STORE": True,  # MASTER_ADDR:MASTER_PORT is a store every rank is a client of
        "TORCHELASTIC_RESTART_COUNT": restarts,
        "TORCHELASTIC_MAX_RESTARTS": job["failure"]["max_failures"],
        "TORCHELASTIC_RUN_ID": job["name"],
    }
    return {k: str(v) for k, v in env.items()}


class Relay:
    """The worker's end of the script's requests and heartbeats: a Unix socket in a private
    folder, with a key only the script's environment holds."""

    def __init__(self):
        self._folder = tempfile.mkdtemp(prefix="raytrain-script-")
        self._key = os.urandom(32)
        self._listener = Listener(os.path.join(self._folder, "relay"), family="AF_UNIX", authkey=self._key)
        self._address = self._listener.address
        self.env = f"{self._address} {self._key.hex()}"
        self.requests: queue.Queue = queue.Queue()  # (connection, request), answered by the worker's thread
        self.beats: queue.Queue = queue.Queue()

    def __enter__(self) -> "Relay":
        threading.Thread(target=self._accept, name="script-relay", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._listener.close()
        with suppress(OSError):
            os.unlink(self._address)
            os.rmdir(self._folder)

    def _accept(self) -> None:
        while True:  # one connection for the heartbeat, one for requests
            try:
                connection = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection) -> None:
        with suppress(EOFError, OSError):
            while True:
                message = connection.recv()
                if message[0] == "beat":
                    self.beats.put(message[1])
                else:
                    self.requests.put((connection, message))


class Served(abc.ABC):
    """One script process, served until it ends (see the module's docstring). What a report, a
    `latest_checkpoint` call and a stop request are is the serving process's: `RayRank` here,
    `driver/scripts.LocalRank` in local mode."""

    def __init__(self, script: dict, report: Reporter, relay: Relay, node: str, rank: int):
        self.script, self.report, self.relay, self.node, self.rank = script, report, relay, node, rank
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL)
        self.last_output = time.monotonic()
        self.last_beat: Optional[dict] = None
        self.stopped = False  # asked to stop: however it then ended, the run stops
        self.abandoned = threading.Event()  # set by the server: its group is ending, the script is killed

    def run(self, command: list[str], env: dict, started: Optional[Callable[[subprocess.Popen], None]] = None,
            pass_fds: tuple[int, ...] = ()) -> int:
        """The script's exit status; `started` is called with its process, as it starts."""
        # A session of its own: the whole of it (its DataLoader workers too) is stopped at once.
        process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True, pass_fds=pass_fds)
        reading = threading.Thread(target=self._read, args=(process.stdout,), name="script-output", daemon=True)
        reading.start()
        stopping: Optional[float] = None  # when the stop signal was sent
        try:
            if started:
                started(process)
            while True:
                self._pass_beats()
                if self.abandoned.is_set() and process.poll() is None:
                    _kill_session(process.pid, signal.SIGKILL)
                try:
                    connection, request = self.relay.requests.get(timeout=POLL_S)
                except queue.Empty:
                    if process.poll() is not None:
                        # A stop this rank had not looked for yet (a notice) may be what ended it.
                        if stopping is None and self._stop_requested(now=True):
                            stopping = time.monotonic()
                        break
                else:
                    self._answer(connection, request)
                    continue
                if stopping is None:
                    reason = self._stop_requested(now=False)
                    if reason:
                        stopping = self._signal(process, reason)
                elif time.monotonic() - stopping > self.script["stop_grace_s"] and process.poll() is None:
                    self.report.say(f"the script did not exit within script.stop_grace_s "
                                    f"({self.script['stop_grace_s']:g}s): killed")
                    _kill_session(process.pid, signal.SIGKILL)
        finally:
            if process.poll() is None:  # the server itself is ending (its group failed): the script with it
                _kill_session(process.pid, signal.SIGKILL)
            process.wait()
            reading.join(timeout=5)
            self._pass_beats()
            if self.last_beat:  # the hang watch stops watching this rank
                self.report.beat({**self.last_beat, "phase": DONE, "quiet_s": 0.0})
        if stopping is not None:
            self.stopped = True
            code = process.returncode
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"with status {code}"
            self.report.say(f"the script exited {time.monotonic() - stopping:.1f}s after the stop signal, {how}")
        return process.returncode

    def failure(self, code: int) -> Optional[str]:
        """The rank's failure, in a line, from its exit status and its last line of output; None for
        a script that succeeded, or that was asked to stop (it ends as it may: the run stops)."""
        if not code or self.stopped:
            return None
        what = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        last = next((line for line in reversed(self.tail) if line.strip()), "")
        last = re.sub(r"^\[rank\d+\]:\s*", "", last.strip())  # torch's prefix on an exception's lines
        return f"{self.script['path']} {what}" + (f": {last}" if last else "")

    @abc.abstractmethod
    def _report(self, metrics: dict, checkpoint_dir: Optional[str]) -> None:
        """A `script_api.report` call: its row, and its checkpoint folder if it gave one."""

    @abc.abstractmethod
    def _latest(self) -> Optional[str]:
        """A `script_api.latest_checkpoint` call: the newest checkpoint's local folder, or None."""

    @abc.abstractmethod
    def _stop_requested(self, now: bool) -> Optional[str]:
        """Why the script should stop, if it should (`now`: look, even if looked a moment ago)."""

    def _read(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            self.report.output(line)
            self.tail.append(line)
            self.last_output = time.monotonic()

    def _pass_beats(self) -> None:
        """The script's beats, to the driver: from this node, and quiet only since its last line."""
        while True:
            try:
                beat = self.relay.beats.get_nowait()
            except queue.Empty:
                return
            beat = {**beat, "node": self.node, "quiet_s": min(beat["quiet_s"], time.monotonic() - self.last_output)}
            self.last_beat = beat
            self.report.beat(beat)

    def _answer(self, connection, request) -> None:
        kind, *rest = request
        try:
            answer = self._report(*rest) if kind == "report" else self._latest()
            reply = (True, answer)
        except Exception as e:  # said to the script, where it called: its own error to handle
            reply = (False, f"{type(e).__name__}: {e}")
        with suppress(OSError):
            connection.send(reply)

    def _signal(self, process: subprocess.Popen, reason: str) -> float:
        """Stop the script (`send_stop`); when it was asked to."""
        self.send_stop(process.pid, reason)
        return time.monotonic()

    def send_stop(self, pid: int, reason: str) -> None:
        name = self.script["stop_signal"]
        self.report.say(f"{reason}: {name} to the script (rank {self.rank}, pid {pid}), which has "
                        f"{self.script['stop_grace_s']:g}s (script.stop_grace_s) to checkpoint and exit")
        with suppress(ProcessLookupError):
            os.kill(pid, getattr(signal, name))


def combined(metrics: list[dict]) -> dict:
    """One row of every rank's report: numbers averaged over the ranks that reported them (one
    value everywhere, such as an epoch, stays as it is), others rank 0's; and the time."""
    row = {}
    for key in dict.fromkeys(k for m in metrics for k in m):
        values = [m[key] for m in metrics if key in m]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        mixed = len(numbers) != len(values) or len(set(numbers)) == 1
        row[key] = values[0] if mixed else sum(numbers) / len(numbers)
    row["time"] = time.time()  # for report.png's time axis, as the loop's epoch rows have
    return row


def _kill_session(pid: int, sig: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
