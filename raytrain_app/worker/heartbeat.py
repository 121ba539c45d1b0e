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
from typing import Callable, Optional

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
_DISTRIBUTED, _AUTOGRAD = os.path.join("torch", "distributed", ""), os.path.join("torch", "autograd", "")

# Not the user's code: Python's own, installed packages' (torch, Ray), and this package's.
_NOT_USERS = tuple({os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib", "purelib", "platlib")}
                   | {os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")})


class Heartbeat:
    """This rank's phase and step, set by the loop's thread, sent by a thread of its own."""

    def __init__(self, rank: int, node: str, send: Callable[[dict], None], watch_stack: bool = False):
        self.rank, self.node, self.send, self.watch_stack = rank, node, send, watch_stack
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
        phase = self.phase if self.count or self.watch_stack or self.phase == DONE else START
        return {"rank": self.rank, "node": self.node, "host": socket.gethostname(), "pid": os.getpid(),
                "started": self.started, "step": self.step, "phase": phase, "quiet_s": time.monotonic() - self.since,
                "p99_step_s": steps[min(len(steps) - 1, int(0.99 * len(steps)))] if steps else None,
                "floor_s": SCRIPT_FLOOR_S if self.watch_stack else FLOOR_S,
                "stack": stack, "where": users_frame(frames)}

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
