"""The embedded Ray cluster that `raytrain-app train` starts in-process and stops at the end."""

from __future__ import annotations

import logging
import os
import shutil
from contextlib import contextmanager
from typing import Iterator, Optional

from raytrain_app.console import route_ray_logs


@contextmanager
def embedded_cluster(num_cpus: int, num_gpus: Optional[int] = None, log_dir: Optional[str] = None,
                     verbose: bool = False) -> Iterator[None]:
    """Start a fresh single-node cluster; never attach to one named in Ray's temp files.

    `address="local"` is what keeps a stale /tmp/ray/ray_current_cluster from hijacking the run.
    Ray's own logs are copied into `log_dir/ray` when the cluster stops.
    """
    import ray

    route_ray_logs(os.path.join(log_dir, "driver.log") if log_dir else None, verbose)
    ray.init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        log_to_driver=verbose,
        logging_level=logging.INFO,  # into the handler route_ray_logs installed: a file unless verbose
    )
    session_logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    try:
        yield
    finally:
        ray.shutdown()
        if log_dir and os.path.isdir(session_logs):
            shutil.copytree(session_logs, os.path.join(log_dir, "ray"), dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("*.sock", "events", "old"))
