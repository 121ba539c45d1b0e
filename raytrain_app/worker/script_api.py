"""What a script may call: `report` and `latest_checkpoint`, both optional.

A script run by `raytrain-app train SCRIPT.py` finds `RAYTRAIN_RUN_DIR` in its environment; the
same script under plain `torchrun` does not, and there these calls do nothing (`report`) and find
nothing (`latest_checkpoint`), so one script serves both launchers.

The script runs in a process of its own (`worker/script_process.py`); both calls are requests to
its rank's worker over an authenticated local socket (`relay`), which does the reporting.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

RUN_DIR_ENV = "RAYTRAIN_RUN_DIR"
RELAY_ENV = "RAYTRAIN_RELAY"  # the worker's socket, and its key (hex), for this process alone
STORE_FD_ENV = "RAYTRAIN_STORE_FD"  # rank 0's, on Ray: the socket to serve the ranks' store on

_requests = None
_lock = threading.Lock()


def report(metrics: dict, checkpoint_dir: Optional[str] = None) -> None:
    """Record `metrics` as one row of the run's metrics.jsonl, and `checkpoint_dir`'s files as a
    checkpoint of the run (copied into the run directory, which keeps its index).

    Every rank calls it at the same point, as it would an all-reduce: the call returns once all
    of them have. Numbers are averaged over the ranks that report them (all-reduce exact sums yourself
    where a mean of ranks is not what you want, as the tutorials' accuracy does); other values
    are rank 0's. Ranks without a checkpoint to save pass None.
    """
    if RUN_DIR_ENV in os.environ:
        _ask("report", dict(metrics), os.path.abspath(checkpoint_dir) if checkpoint_dir else None)


def latest_checkpoint() -> Optional[str]:
    """The directory of the run's newest checkpoint, to resume from after a restart
    (`--max-failures`) or `--resume`; None in a fresh run. Remote checkpoints are downloaded."""
    return _ask("latest_checkpoint") if RUN_DIR_ENV in os.environ else None


def relay():
    """A new connection to this rank's worker; None outside `raytrain-app train`."""
    from multiprocessing.connection import Client

    if RELAY_ENV not in os.environ:
        return None
    address, key = os.environ[RELAY_ENV].rsplit(" ", 1)
    return Client(address, family="AF_UNIX", authkey=bytes.fromhex(key))


def _ask(*request):
    """The worker's answer to `request`; its error, raised here, where the script called."""
    global _requests
    with _lock:
        if _requests is None:
            _requests = relay()
        _requests.send(request)
        ok, answer = _requests.recv()
    if not ok:
        raise RuntimeError(answer)
    return answer
