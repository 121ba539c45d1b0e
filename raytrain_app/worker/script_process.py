"""A script's own process, as torchrun gives it one: `python -m raytrain_app.worker.script_process
SCRIPT ARGS...`, started and served by its rank's Ray Train worker, or in local mode by the driver
(`worker/script.py`), and ending with that process (`worker/lifeline.py`).

The script runs as `__main__` in this process's main thread, so `signal.signal`, frameworks that
check for the main thread, and checkpoint-on-SIGTERM handlers work as under torchrun. Before it
starts, a heartbeat thread begins beating to the serving process (which passes the beats on to
the driver's hang watch): the script's stack, taken from here, is the one thing outside the
process cannot see. `raytrain_app.script_api` reaches the serving process through the same relay.
On Ray, rank 0's process also serves the store the ranks meet at (`rendezvous_store`).
"""

from __future__ import annotations

import os
import runpy
import sys

from raytrain_app.worker.heartbeat import Heartbeat
from raytrain_app.worker.lifeline import LIFELINE_ENV, end_with
from raytrain_app.worker.script_api import RUN_DIR_ENV, STORE_FD_ENV, relay


def main() -> None:
    path, *args = sys.argv[1:]
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(path))  # as `python script.py` has it: the script's folder
    end_with(int(os.environ[LIFELINE_ENV]))
    beats = relay()
    if beats is not None:
        Heartbeat(int(os.environ["RANK"]), os.environ["RAYTRAIN_NODE"], lambda beat: beats.send(("beat", beat)),
                  watch_stack=True, timeout=_timeout(os.environ["RAYTRAIN_HANG_TIMEOUT_S"]),
                  run_dir=os.environ[RUN_DIR_ENV]).start()
    store = rendezvous_store()
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        del store  # closed as the script ends (see rendezvous_store)


def rendezvous_store():
    """On Ray, rank 0's process serves the store the ranks meet at (MASTER_ADDR:MASTER_PORT; with
    TORCHELASTIC_USE_AGENT_STORE every rank's `init_process_group` is its client), on the socket
    its worker listens on before any rank starts (`script_on_ray.rendezvous_socket`). The workers
    load no torch; this process loads it for the script, a moment before the script would. The
    store is closed as the script ends, not in the interpreter's teardown, where one torn down
    with it once aborted a process that had ended well ("terminate called without an active
    exception"). None elsewhere: in local mode the driver serves it."""
    fd = os.environ.pop(STORE_FD_ENV, None)
    if fd is None:
        return None
    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                    is_master=True, wait_for_workers=False, master_listen_fd=int(fd))


def _timeout(value: str):
    return value if value == "auto" else float(value)


if __name__ == "__main__":
    main()
