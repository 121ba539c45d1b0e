"""SIGUSR1: the warning a scheduler sends before it takes a run's nodes (SLURM's
`--signal=B:USR1@N` before a time limit or a preemption). The workers answer it with a checkpoint
at the step they are at, and stop (`worker/preemption.py`), when it reaches them through their
`StopFlag`; Python's default for it would kill the driver and leave the run half-recorded.

`kept` holds it from the command's start, so one that arrives while the run is still starting is
passed on as soon as the workers run (`stop_on_usr1`), and one that arrives after they ended
does nothing. Only the main thread can take signals: elsewhere (a sweep's trial) both do nothing.
"""

from __future__ import annotations

import functools
import signal
import threading
from contextlib import contextmanager

_pending = threading.Event()


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
