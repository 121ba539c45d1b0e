"""A script's own process, as torchrun gives it one: `python -m raytrain_app.worker.script_process
SCRIPT ARGS...`, started and served by its rank's Ray Train worker, or in local mode by the driver
(`worker/script.py`), and ending with that process (`worker/lifeline.py`).

The script runs as `__main__` in this process's main thread, so `signal.signal`, frameworks that
check for the main thread, and checkpoint-on-SIGTERM handlers work as under torchrun. Before it
starts, a heartbeat thread begins beating to the serving process (which passes the beats on to
the driver's hang watch): the script's stack, taken from here, is the one thing outside the
process cannot see. `raytrain_app.script_api` reaches the serving process through the same relay.
"""

from __future__ import annotations

import os
import runpy
import sys

from raytrain_app.worker.heartbeat import Heartbeat
from raytrain_app.worker.lifeline import LIFELINE_ENV, end_with
from raytrain_app.worker.script_api import RUN_DIR_ENV, relay


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
    runpy.run_path(path, run_name="__main__")


def _timeout(value: str):
    return value if value == "auto" else float(value)


if __name__ == "__main__":
    main()
