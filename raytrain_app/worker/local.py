"""A local-mode worker process: what torch's launcher runs as each rank (`python -m
raytrain_app.worker.local ARGS`), as torchrun runs a script. Ray Train's local mode
(`ScalingConfig(num_workers=0)`) reads torchrun's environment, joins the process group and runs
the same `train_loop_per_worker` as a Ray Train worker; see `driver/local.py` for the driver's side.

A fresh interpreter, not a fork or a `multiprocessing` spawn: a spawn re-runs the caller's main
script, which a notebook's or a script's `fit()` would not survive. The worker's arguments come
in a file, cloudpickled as Ray pickles them (a notebook's builder functions travel by value), and
rank 0's console events go back to the driver over one authenticated loopback connection.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from multiprocessing.connection import Client
from typing import Optional

from raytrain_app.worker.loop import WorkerArgs, train_loop_per_worker


class Outbox:
    """Rank 0's end of the driver's event inbox: the `put` a Ray queue has. Opened on first use,
    so only the rank that sends connects."""

    def __init__(self, address: tuple[str, int], authkey: bytes):
        self.address, self.authkey = address, authkey
        self._connection = None

    def put(self, item) -> None:
        if self._connection is None:
            self._connection = Client(self.address, authkey=self.authkey)
        self._connection.send(item)

    put_nowait = put  # a send does not wait for the driver to read it

    def __getstate__(self) -> dict:
        return {"address": self.address, "authkey": self.authkey, "_connection": None}


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


def main(argv: Optional[list[str]] = None) -> None:
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d
    from ray import cloudpickle
    from torch.distributed.elastic.multiprocessing.errors import record

    with open((argv or sys.argv)[1], "rb") as f:
        args = cloudpickle.load(f)
    # Ray Train's local mode joins the group with torch's default timeout (30 min); the job's
    # scaling.timeout_s goes in as this process's default, the one way into its env:// start.
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timedelta(seconds=args.job["scaling"]["timeout_s"])
    record(train)(args)  # an exception's last line reaches the launcher, which names the rank it failed on


if __name__ == "__main__":
    main()
