"""A process that ends with the one that started it, however that one ends.

A local-mode worker process, or a script's process, runs in a session of its own (out of reach
of its starter's process group, as torchrun starts each worker), so a starter killed outright
(SIGKILL, the OOM killer, Tune ending a sweep's trial, Ray killing a worker) would leave it
behind. Nothing else would end it: a rank that sleeps in a stalled step, waits in a collective
on a live peer (up to scaling.timeout_s), or has finished and waits to be read never notices.
Linux's pidfd says when its starter is gone, unpolled.
"""

from __future__ import annotations

import os
import select
import signal
import threading
from contextlib import suppress

# The starter's pid, for a process started with it in its environment (worker/script_process.py).
LIFELINE_ENV = "RAYTRAIN_LIFELINE_PID"


def end_with(pid: int) -> None:
    """SIGKILL for this process when process `pid` ends."""
    if not hasattr(os, "pidfd_open"):  # (not Linux)
        return

    def watch() -> None:
        with suppress(ProcessLookupError):  # (gone already)
            select.select([os.pidfd_open(pid)], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()
