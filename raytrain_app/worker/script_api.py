"""What a script may call: `report` and `latest_checkpoint`, both optional.

A script run by `raytrain-app train SCRIPT.py` finds `RAYTRAIN_RUN_DIR` in its environment; the
same script under plain `torchrun` does not, and there these calls do nothing (`report`) and find
nothing (`latest_checkpoint`), so one script serves both launchers.
"""

from __future__ import annotations

import os
from typing import Optional

RUN_DIR_ENV = "RAYTRAIN_RUN_DIR"


def report(metrics: dict, checkpoint_dir: Optional[str] = None) -> None:
    """Record `metrics` as one row of the run's metrics.jsonl, and `checkpoint_dir`'s files as a
    checkpoint of the run (Ray Train copies them into the run directory and keeps its index).

    Every rank calls it at the same point, as it would an all-reduce: Ray Train waits for all of
    them. Numbers are averaged over the ranks that report them (all-reduce exact sums yourself
    where a mean of ranks is not what you want, as the tutorials' accuracy does); other values
    are rank 0's. Ranks without a checkpoint to save pass None.
    """
    if RUN_DIR_ENV not in os.environ:
        return
    import ray.train

    checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
    ray.train.report(metrics, checkpoint=checkpoint)


def latest_checkpoint() -> Optional[str]:
    """The directory of the run's newest checkpoint, to resume from after a restart
    (`--max-failures`) or `--resume`; None in a fresh run. Remote checkpoints are downloaded."""
    if RUN_DIR_ENV not in os.environ:
        return None
    import pyarrow.fs
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    if isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem):
        return checkpoint.path
    return checkpoint.to_directory()
