"""Each rank's progress, published cheaply: which step it is at, in which phase, since when.

The loop marks its phases (`at`): an attribute write and a clock read, well under a microsecond
on a step of milliseconds. A daemon thread sends a beat every `BEAT_S` seconds through the
channel the console's events take, from every rank: the phase and how long the rank has been in
it, its recent step times (from which the driver learns how long a step may take), and the loop
thread's Python stack. A rank hung in a forward, a data read or a deadlock keeps beating from
this thread, with the same phase and the same stack; one whose loop holds the GIL stops beating,
which the driver counts the same way. The driver (`driver/hangs.py`) decides what is a hang.

The phases also say where each rank's time went within an epoch (`spent`): its data wait and its
forward, which no collective stretches, show a slow rank for what it is.

A script (`watch_stack`) marks no phases: its progress is its stack's changing between beats
and its output, and its phase is `collective` while its stack is inside torch.distributed,
`backward` inside autograd (where DDP's all-reduce waits), else `script`. A script's one long
call (a big file read, a long C operation) keeps its stack as still as a hang does, so its
floor is five minutes, not one.

A rank still for half its hang timeout also takes torch's flight recorder (on by default, 2,000
collectives, on Gloo as on NCCL): the raw dump goes to RUN_DIR/logs/flight-recorder/rank_N for
torch's tools, and a line per process group rides the beats into the hang's stack file: how many
collectives the rank enqueued and completed, and its newest. A rank hung outside a collective has
completed all it enqueued, one behind the peers waiting for it.
"""

from __future__ import annotations

import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
from collections import deque
from contextlib import suppress
from typing import Callable, Optional, Union

BEAT_S = 2.0
STACK_FRAMES = 30  # innermost frames sent: the top of a deep stack says where it is

# What a phase means to the hang watch: the loop's own work, or what has its own bound (start-up,
# up to a group's first step, which may compile for minutes; a compiled model's last batch of an
# epoch, often shorter, which compiles a graph of its own; evaluation; a checkpoint's write; done).
START, DATA, FORWARD, BACKWARD, OPTIMIZER, AFTER_STEP, COMPILE, EVAL, CHECKPOINT, DONE = (
    "start", "data", "forward", "backward", "optimizer", "after_step", "compile", "eval", "checkpoint", "done")
SCRIPT, IN_COLLECTIVE = "script", "collective"  # a script's, told from its stack
UNWATCHED = frozenset({START, COMPILE, EVAL, CHECKPOINT, DONE})
# Where DDP's gradient all-reduce waits, and the loop's other collectives: a rank here may be
# waiting for another.
COLLECTIVE = frozenset({BACKWARD, AFTER_STEP, IN_COLLECTIVE})
# The least a hang's timeout is, whatever the steps: the loop's, and a script's (see above).
FLOOR_S, SCRIPT_FLOOR_S = 60.0, 300.0
STEPS = 20  # an auto timeout's other bound: times the p99 step
_DISTRIBUTED, _AUTOGRAD = os.path.join("torch", "distributed", ""), os.path.join("torch", "autograd", "")

# Not the user's code: Python's own, installed packages' (torch, Ray), and this package's.
_NOT_USERS = tuple({os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib", "purelib", "platlib")}
                   | {os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")})


class Heartbeat:
    """This rank's phase and step, set by the loop's thread, sent by a thread of its own."""

    def __init__(self, rank: int, node: str, send: Callable[[dict], None], watch_stack: bool = False,
                 timeout: Union[str, float] = "auto", run_dir: Optional[str] = None):
        self.rank, self.node, self.send, self.watch_stack = rank, node, send, watch_stack
        self.timeout, self.run_dir = timeout, run_dir  # failure.hang_timeout_s; where the flight recorder goes
        self._collectives: Optional[tuple[float, list[str]]] = None  # (the stall it was taken in, its lines)
        self.phase, self.since, self.step = (SCRIPT if watch_stack else START), time.monotonic(), 0
        self._last_stack = ""
        self.started = time.time()  # with the pid, which group's process this is (an in-process rank restarts)
        self.count = 0  # optimizer steps this process has finished: none yet is start-up, unwatched
        self.steps: deque[float] = deque(maxlen=256)  # recent optimizer steps' durations
        self.spent: dict[str, float] = {}  # seconds per phase since `reset_spent`
        self.spent_steps = 0  # the optimizer steps those seconds cover
        self._last_step: Optional[float] = None
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytrain-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def at(self, phase: str) -> None:
        """The loop enters `phase`: the one call on its hot path."""
        now = time.monotonic()
        if self.count:  # (a group's first step, warming up, is no rank's typical work)
            self.spent[self.phase] = self.spent.get(self.phase, 0.0) + now - self.since
        self.phase, self.since = phase, now

    def progressed(self) -> None:
        """A script printed a line: it is not hung."""
        self.since = time.monotonic()

    def stepped(self, step: int) -> None:
        """An optimizer step finished (its time counts toward the learned hang timeout)."""
        now = time.monotonic()
        if self._last_step is not None:
            self.steps.append(now - self._last_step)
        self._last_step, self.step = now, step
        self.spent_steps += bool(self.count)  # (not the group's first: see `at`)
        self.count += 1

    def reset_spent(self) -> tuple[dict[str, float], int]:
        """The phases' seconds since the last reset (an epoch's) and the steps they cover; a fresh count."""
        self.at(self.phase)  # the current phase's time so far
        spent, steps, self.spent, self.spent_steps = self.spent, self.spent_steps, {}, 0
        self._last_step = None  # evaluation and the epoch's end are no step's time
        return spent, steps

    def stop(self) -> None:
        """The loop ended, however: a last beat says so, so that the driver stops watching this rank."""
        self.at(DONE)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=BEAT_S)
        self._send()

    def beat(self) -> dict:
        """What the driver gets: this rank's state now."""
        frame = sys._current_frames().get(self._loop_thread)
        frames = traceback.extract_stack(frame)[-STACK_FRAMES:] if frame is not None else []
        stack = "".join(traceback.format_list(frames))
        if self.watch_stack and self.phase != DONE:
            self.phase = (IN_COLLECTIVE if any(_DISTRIBUTED in f.filename for f in frames) else
                          BACKWARD if any(_AUTOGRAD in f.filename for f in frames) else SCRIPT)
            if stack != self._last_stack:
                self.since, self._last_stack = time.monotonic(), stack
        steps = sorted(self.steps)
        p99 = steps[min(len(steps) - 1, int(0.99 * len(steps)))] if steps else None
        phase = self.phase if self.count or self.watch_stack or self.phase == DONE else START
        quiet = time.monotonic() - self.since
        if phase not in UNWATCHED and quiet >= self._timeout_s(p99) / 2 and (
                self._collectives is None or self._collectives[0] != self.since):
            self._collectives = (self.since, self._flight_recorder())
        return {"rank": self.rank, "node": self.node, "host": socket.gethostname(), "pid": os.getpid(),
                "started": self.started, "step": self.step, "phase": phase, "quiet_s": quiet, "p99_step_s": p99,
                "floor_s": self._floor_s(), "stack": stack, "where": users_frame(frames),
                "collectives": self._collectives[1] if self._collectives and self._collectives[0] == self.since else []}

    def _floor_s(self) -> float:
        return SCRIPT_FLOOR_S if self.watch_stack else FLOOR_S

    def _timeout_s(self, p99: Optional[float]) -> float:
        """This rank's view of the hang timeout (the driver's takes the slowest rank's p99, so it is
        never shorter): half of it, the flight recorder is taken, before the driver acts."""
        if self.timeout != "auto":
            return float(self.timeout) or float("inf")
        return max(self._floor_s(), STEPS * (p99 or 0.0))

    def _flight_recorder(self) -> list[str]:
        """torch's record of this rank's collectives: the dump to the run directory, a line per group."""
        import pickle

        import torch.distributed as dist
        from torch._C._distributed_c10d import _dump_fr_trace

        from raytrain_app import storage

        if not dist.is_available() or not dist.is_initialized():
            return []
        try:
            raw = _dump_fr_trace()
            if self.run_dir:
                storage.write_bytes(storage.join(self.run_dir, "logs", "flight-recorder", f"rank_{self.rank}"), raw)
            dump = pickle.loads(raw)
        except Exception as e:  # (a build without it, storage that does not answer): the stacks still go
            return [f"flight recorder: {type(e).__name__}: {e}"]
        newest = {}
        for entry in dump.get("entries", []):
            newest[str(entry["pg_id"])] = entry
        lines = []
        for pg, status in sorted(dump.get("pg_status", {}).items()):
            entry = newest.get(pg)
            last = (f"; newest #{entry['collective_seq_id']} {entry['profiling_name']} {entry['input_sizes']}"
                    if entry else "")
            lines.append(f"process group {pg}: {status['last_enqueued_collective']} collectives enqueued, "
                         f"{status['last_completed_collective']} completed{last}")
        return lines

    def _run(self) -> None:
        while True:  # one beat at once: the driver learns where each rank runs before its first epoch ends
            self._send()
            if self._stop.wait(BEAT_S):
                return

    def _send(self) -> None:
        # A driver gone or a queue full: the next beat tries again (after the last, nobody watches).
        with suppress(Exception):
            self.send(self.beat())


def users_frame(frames: list[traceback.FrameSummary]) -> str:
    """The innermost frame in the user's own code ("model.py:12 in forward"), else the innermost."""
    for frame in reversed(frames):
        if not os.path.abspath(frame.filename).startswith(_NOT_USERS) and not frame.filename.startswith("<"):
            break
    else:
        if not frames:
            return "no stack"
        frame = frames[-1]
    path = os.path.abspath(frame.filename)
    shown = os.path.relpath(path) if path.startswith(os.path.join(os.getcwd(), "")) else path
    return f"{shown}:{frame.lineno} in {frame.name}"
