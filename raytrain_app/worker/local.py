"""A local-mode worker process: what torch's launcher runs as each rank (`main`), as torchrun
runs a script. Ray Train's local mode (`ScalingConfig(num_workers=0)`) reads torchrun's
environment, joins the process group and runs the same `train_loop_per_worker` as a Ray Train
worker; see `driver/local.py` for the driver's side.

The process is forked from a server that imported torch, not from the driver (whose threads a
fork would copy mid-flight) and not a spawn (which re-runs the caller's main script, which a
notebook's or a script's `fit()` would not survive). So what the driver's environment says is set
here again. The worker's arguments come in a file, cloudpickled as Ray pickles them (a notebook's
builder functions travel by value), and rank 0's console events go back to the driver over one
authenticated loopback connection.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import threading
import time
from contextlib import suppress
from multiprocessing.connection import Client
from typing import Optional

from raytrain_app.errors import peer_gone
from raytrain_app.worker.args import WorkerArgs
from raytrain_app.worker.lifeline import end_with
from raytrain_app.worker.loop import train_loop_per_worker


class Outbox:
    """A rank's end of the driver's event inbox: the `put` a Ray queue has. Opened on first use;
    the loop's thread and the heartbeat's send on it, one at a time."""

    def __init__(self, address: tuple[str, int], authkey: bytes):
        self.address, self.authkey = address, authkey
        self._connection = None
        self._sending = threading.Lock()

    def put(self, item) -> None:
        with self._sending:
            if self._connection is None:
                self._connection = Client(self.address, authkey=self.authkey)
            self._connection.send(item)

    put_nowait = put  # a send does not wait for the driver to read it

    def __getstate__(self) -> dict:
        return {"address": self.address, "authkey": self.authkey}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["address"], state["authkey"])


def train(args: WorkerArgs) -> None:
    """Run the loop as Ray Train's local mode runs it: in this process, joined to the group that
    torchrun's environment (set by the launcher) names, if it names one."""
    in_local_mode(functools.partial(train_loop_per_worker, args), os.path.basename(args.run_dir.rstrip("/")))


def in_local_mode(function, name: Optional[str] = None) -> None:
    """`function` through Ray Train's local mode (`num_workers=0`): training's and `evaluate --local`'s."""
    import ray.train
    from ray.train.torch import TorchTrainer

    # Local mode's own lines (that it runs locally, every reported metric) say what the console says.
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    TorchTrainer(function, scaling_config=ray.train.ScalingConfig(num_workers=0),
                 run_config=ray.train.RunConfig(name=name)).fit()


# How long a rank whose collective a dead peer broke waits before it ends.
PEER_GRACE_S = 2.0

# What torch's launcher sets for each rank, which a driver running under torchrun itself has too.
_LAUNCHER_VARIABLES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                       "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                       "TORCH_NCCL_ASYNC_ERROR_HANDLING"}


def main(arguments: str) -> None:
    """One rank, from the arguments file the driver wrote; the launcher records an exception's
    last line, and names the rank it failed on."""
    from datetime import timedelta

    import torch
    import torch.distributed.distributed_c10d as c10d

    # A session of its own, as torchrun starts each worker: a terminal's Ctrl-C reaches the
    # driver, whose launcher stops the workers, not each worker mid-step.
    with suppress(OSError):  # already a session's leader
        os.setsid()
    with open(arguments, "rb") as f:
        # The driver's pid and its environment at this launch (the fork server has the one of its
        # own start; multiprocessing brings the driver's import path and directory), with this
        # rank's variables that the launcher set.
        driver, environment = pickle.load(f)
        end_with(driver)  # (its fork server ends by itself: each process it forks holds the pipe that stops it)
        launcher = {k: v for k, v in os.environ.items() if k in _LAUNCHER_VARIABLES or k.startswith("TORCHELASTIC_")}
        os.environ.clear()
        os.environ.update({**environment, **launcher})
        from ray import cloudpickle

        args = cloudpickle.load(f)
    # The launcher passes on the driver's OMP_NUM_THREADS (see driver/local.worker_environment),
    # which torch, loaded before it was set, reads only now.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # Ray Train's local mode joins the group with torch's default timeout (30 min); the job's
    # scaling.timeout_s goes in as this process's default, the one way into its env:// start.
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timedelta(seconds=args.job["scaling"]["timeout_s"])
    try:
        train(args)
    except Exception as e:
        if peer_gone(e):  # the launcher names the first rank it sees end: let that be the one that died
            time.sleep(PEER_GRACE_S)
        raise

