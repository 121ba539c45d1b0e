"""SIGUSR1: the warning a scheduler sends before it takes a run's nodes (SLURM's
`--signal=B:USR1@N` before a time limit or a preemption). The workers answer it with a checkpoint
at the step they are at, and stop (`worker/preemption.py`), when it reaches them through their
`StopFlag`; Python's default for it would kill the driver and leave the run half-recorded.

`kept` holds it from the command's start, so one that arrives while the run is still starting is
passed on as soon as the workers run (`stop_on_usr1`), and one that arrives after they ended
does nothing. Only the main thread can take signals: elsewhere (a sweep's trial) both do nothing.

A sweep's driver takes SIGTERM, a scheduler's stop, as Ctrl-C (`term_as_interrupt`).

SIGINT (Ctrl-C) raises a KeyboardInterrupt, as Python's own handler does, but never in the middle
of an import (`after_imports`).
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from contextlib import contextmanager
from typing import Callable

_pending = threading.Event()

# How soon a SIGINT that came in the middle of an import is taken again.
RETRY_S = 0.05


def kept(function):
    """Run `function` with SIGUSR1 held for the workers (see above)."""
    @functools.wraps(function)
    def holding(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return function(*args, **kwargs)
        _pending.clear()
        before = signal.signal(signal.SIGUSR1, lambda signum, frame: _pending.set())
        try:
            return function(*args, **kwargs)
        finally:
            signal.signal(signal.SIGUSR1, before)
    return holding


@contextmanager
def stop_on_usr1(stop_flag, echo):
    """While the workers run: SIGUSR1, also one that came before, sets their `stop_flag`."""
    if stop_flag is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def asked(signum=None, frame=None):
        stop_flag.set("SIGUSR1")
        echo("SIGUSR1: the run checkpoints at its next check and stops")

    before = signal.signal(signal.SIGUSR1, asked)
    if _pending.is_set():
        asked()
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, before)


@contextmanager
def handlers_kept():
    """This process's handlers of the stop signals, back as they were after the block. torch's
    elastic launcher (local mode) and Ray Train's `fit` each set their own and leave them: after
    a run, a notebook's Ctrl-C would meet the launcher's, or Ray Train's handler for a controller
    that is gone."""
    signals = [getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, name)]
    before = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in before.items():
                if handler is not None:
                    signal.signal(sig, handler)


@contextmanager
def term_as_interrupt(give_up_s: float, give_up: Callable[[], None]):
    """SIGTERM during the block (a scheduler's stop: `scancel`, a pod's end, `timeout`, `kill`)
    does what Ctrl-C does: Ray Tune's SIGINT handler stops every trial and saves the sweep's
    state, which `sweep --resume` continues. Ray's own SIGTERM handler exits at once (code 15),
    its trials killed with the cluster, and says nothing. Where the stop has not ended the
    process `give_up_s` after the signal, `give_up` runs in a thread of its own and must end it:
    a scheduler signals every process of its job, an embedded cluster's too, and Ray's driver
    then waits on its dead GCS for a minute before it aborts with a crash dump (exit 134)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    deadline = threading.Timer(give_up_s, give_up)
    deadline.daemon = True

    def stop(signum, frame):
        if deadline.ident is None:  # the first: armed until the process ends, the cluster's stop included
            deadline.start()
        signal.raise_signal(signal.SIGINT)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def after_imports(handler: Callable) -> Callable:
    """`handler` as a SIGINT handler that waits for the imports under way to end: the signal comes
    again every RETRY_S until it finds none. A KeyboardInterrupt raised in the middle of an import
    was lost, or left a module half made: torch's C++ start swallows it while it imports NumPy
    (the Ctrl-C did nothing, and NumPy could not be imported after), matplotlib half imported ended
    in a fatal error as the interpreter exited, and in a dataclass's methods, which are compiled
    from a string, it made CPython exit by SIGINT (not 130) after it had been handled."""
    def waiting(signum, frame) -> None:
        if _importing(frame):
            again = threading.Timer(RETRY_S, os.kill, (os.getpid(), signum))
            again.daemon = True
            again.start()
            return
        handler(signum, frame)
    return waiting


def _importing(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


KEYBOARD_INTERRUPT = after_imports(signal.default_int_handler)
