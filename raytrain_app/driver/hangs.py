"""Hangs: a rank that stops making progress without dying, found from every rank's heartbeat
(`worker/heartbeat.py`), named, its stacks kept, and its group restarted.

A rank hung in its forward, a data read or a deadlock leaves its peers waiting in the next
collective until `scaling.timeout_s` (ten minutes by default), and then the verdict names a
waiting rank. Here the driver sees every rank's phase and how long it has been in it: when the
rank that stopped first has been still for `failure.hang_timeout_s` (auto: the larger of a
floor, a minute for the loop and five for a script, and `STEPS` times the run's p99 step) in a
phase the loop owns, that rank is the
culprit (one outside a collective before one inside, then the one stopped longest). Every
rank's stack goes to RUN_DIR/logs/hang-STEP.txt, one line names the culprit, and the culprit's
process is killed: the group then restarts from the latest checkpoint as after any failure,
counted against `failure.max_failures`, and recorded as a `hang`.

Phases with bounds of their own are never a hang: start-up to a group's first step (which may
compile), a compile, evaluation and checkpoints (the collective timeout still bounds them).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from typing import Callable, Optional, Union

from raytrain_app import storage
from raytrain_app.rundir import stacks
from raytrain_app.worker.heartbeat import COLLECTIVE, STEPS, UNWATCHED

LOOK_EVERY_S = 1.0
REQUESTS_EVERY_S = 2.0  # how often the run directory is looked at for `raytrain-app stack`


@dataclass
class Seen:
    beat: dict
    at: float  # when it came (this process's monotonic clock)

    def still_s(self, now: float) -> float:
        """How long the rank has been in its phase: as it said then, and since."""
        return self.beat["quiet_s"] + now - self.at


class HangWatch(threading.Thread):
    """The driver's view of every rank's progress. Fed by the event listener (`beat`), emptied
    when a group ends (`reset`); `kill(beat, line)` ends a culprit's process, `said(line)` tells the user."""

    def __init__(self, timeout: Union[str, float], run_dir: str, kill: Callable[[dict, str], None],
                 said: Callable[[str], None]):
        super().__init__(daemon=True, name="raytrain-hang-watch")
        self.timeout, self.run_dir, self.kill, self.said = timeout, run_dir, kill, said
        self.verdict: Optional[str] = None  # the last hang's one line, for the restart that follows
        self._ranks: dict[int, Seen] = {}
        self._ended: set[tuple] = set()  # processes of groups that are gone: their late beats are ignored
        self._lock = threading.Lock()
        self._closing = threading.Event()

    def beat(self, beat: dict) -> None:
        with self._lock:
            if (beat["pid"], beat["started"]) not in self._ended:
                self._ranks[beat["rank"]] = Seen(beat, time.monotonic())

    def reset(self) -> None:
        """The group ended (a failure, a restart, a resize): its ranks are no longer watched."""
        with self._lock:
            self._ended |= {(s.beat["pid"], s.beat["started"]) for s in self._ranks.values()}
            self._ranks = {}

    def take_verdict(self) -> Optional[str]:
        """The hang that ended the group, once: what its restart is recorded as."""
        verdict, self.verdict = self.verdict, None
        return verdict

    def nodes(self) -> dict[int, str]:
        """Each rank's host, as its latest beat says."""
        with self._lock:
            return {rank: seen.beat["host"] for rank, seen in self._ranks.items()}

    def timeout_s(self) -> Optional[float]:
        """The timeout now; None when off. Learned from the ranks' p99 steps when auto."""
        if self.timeout != "auto":
            return float(self.timeout) or None
        beats = [s.beat for s in self._ranks.values()]
        return max(max((b["floor_s"] for b in beats), default=0.0),
                   STEPS * max((b["p99_step_s"] or 0.0 for b in beats), default=0.0))

    def stop(self) -> None:
        self._closing.set()

    def run(self) -> None:
        asked_at = 0.0
        while not self._closing.wait(LOOK_EVERY_S):
            hang = self.check(time.monotonic())
            if hang:
                self._act(*hang)
            if time.monotonic() - asked_at >= REQUESTS_EVERY_S:
                asked_at = time.monotonic()
                with suppress(OSError):  # storage that does not answer now: the next look tries again
                    stacks.answer_if_asked(self.run_dir, lambda: self.stacks(time.monotonic()))

    def check(self, now: float) -> Optional[tuple[Seen, list[Seen]]]:
        """(the culprit, every rank) when a hang is declared, else None."""
        timeout = self.timeout_s()
        with self._lock:
            ranks = list(self._ranks.values())
        if timeout is None or not ranks:
            return None
        first = max(ranks, key=lambda s: s.still_s(now))
        if first.beat["phase"] in UNWATCHED or first.still_s(now) < timeout:
            return None  # the rank that stopped first is in a phase with its own bound, or not long enough
        # Every rank still for half the timeout waits on the same hang: a slower rank reaches the
        # collective its peers wait in later, by up to a step (seconds, on a loaded machine).
        stuck = [s for s in ranks if s.still_s(now) >= timeout / 2 and s.beat["phase"] not in UNWATCHED]
        culprit = min(stuck, key=lambda s: (s.beat["phase"] in COLLECTIVE, -s.still_s(now)))
        return culprit, ranks

    def _act(self, culprit: Seen, ranks: list[Seen]) -> None:
        now = time.monotonic()
        b = culprit.beat
        # A script's steps are its own: its file is named by the time instead.
        path = storage.join(self.run_dir, "logs", f"hang-{b['step'] or time.strftime('%Y%m%d-%H%M%S')}.txt")
        at = f" at step {b['step']}" if b["step"] else ""
        line = (f"hang: rank {b['rank']} on node {b['host']} (pid {b['pid']}) made no progress for "
                f"{culprit.still_s(now):.0f}s in {b['phase']}{at} ({b['where']})")
        self.reset()  # this group is done: the next beats are its restart's
        recorded = ("\ntorch's flight recorder of each rank that took it (the collectives lines below): "
                    f"{storage.join(self.run_dir, 'logs', 'flight-recorder', '')}\n"
                    if any(s.beat.get("collectives") for s in ranks) else "")
        try:
            storage.write_text(path, f"{line}\n{recorded}\n{self._stacks(ranks, now)}")
            line += f"; every rank's stack in {path}"
        except OSError as e:
            line += f"; the stacks could not be written to {path}: {e.strerror or e}"
        self.verdict = line
        self.said(line)
        self.kill(b, line)

    def stacks(self, now: float) -> str:
        """Every rank's latest stack, for `raytrain-app stack`."""
        with self._lock:
            ranks = list(self._ranks.values())
        return self._stacks(ranks, now) if ranks else "no rank has reported yet (the group is starting)\n"

    @staticmethod
    def _stacks(ranks: list[Seen], now: float) -> str:
        parts = []
        for seen in sorted(ranks, key=lambda s: s.beat["rank"]):
            b = seen.beat
            parts.append(f"rank {b['rank']} on node {b['host']} (pid {b['pid']}): step {b['step']}, {b['phase']} "
                         f"for {seen.still_s(now):.1f}s, stack as of {now - seen.at:.1f}s ago\n"
                         + "".join(f"  {line}\n" for line in b.get("collectives", [])) + b["stack"])
        return "\n".join(parts)


def who(verdict: str) -> str:
    """A verdict's culprit ("hang: rank 1 on node X (pid N)"), for the restart's line after it."""
    return verdict.split(" made no progress", 1)[0]


def kill_local(beat: dict) -> None:
    """A local-mode rank, a process of this machine: its launcher then restarts the group."""
    _kill(beat["pid"])


def kill_on_ray(beat: dict) -> None:
    """A Ray Train worker, on whichever node it runs: a task there ends it, and Ray Train restarts
    the group as after any worker's death."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    on_its_node = NodeAffinitySchedulingStrategy(beat["node"], soft=False)
    ray.remote(num_cpus=0, max_retries=0)(_kill).options(scheduling_strategy=on_its_node).remote(beat["pid"])


def _kill(pid: int) -> None:
    with suppress(ProcessLookupError):  # it ended meanwhile
        os.kill(pid, signal.SIGKILL)
