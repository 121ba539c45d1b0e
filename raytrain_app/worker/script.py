"""A torchrun-style script, unchanged, on every Ray Train worker.

Ray Train starts and places the workers, restarts the group (`failure.max_failures`) and keeps
the checkpoint index; each worker then runs the script as `__main__`, in the launch directory,
with the environment torchrun would give it. Ray Train joins its workers in a process group of
its own, which a script's `init_process_group` would collide with: rank 0 first shares a fresh
rendezvous port through Ray, then that group is torn down and the script builds its own.

Every rank's stdout and stderr go to its `logs/rank-N.log`; rank 0's lines also go to the console.
A heartbeat watches the script's stack and output for the driver's hang watch (see heartbeat.py).
"""

from __future__ import annotations

import io
import logging
import os
import runpy
import socket
import sys
from contextlib import redirect_stderr, redirect_stdout

import ray
import ray.train
import torch.distributed as dist
from ray.train.collective import broadcast_from_rank_zero

from raytrain_app.errors import RankFailed, describe
from raytrain_app.worker.heartbeat import Heartbeat
from raytrain_app.worker.reporter import Reporter
from raytrain_app.worker.script_api import RUN_DIR_ENV


@ray.remote(num_cpus=0)
class RestartCount:
    """How often Ray Train has restarted the worker group: the controller adds, workers read it
    into TORCHELASTIC_RESTART_COUNT."""

    def __init__(self):
        self.count = 0

    def add(self) -> None:
        self.count += 1

    def get(self) -> int:
        return self.count


def run_script_per_worker(args) -> None:
    """The training function of a script run (`args`: loop.WorkerArgs, with `restarts`)."""
    if args.cwd and os.path.isdir(args.cwd):
        os.chdir(args.cwd)
    script = args.job["script"]
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    report = Reporter(args.events, rank, args.log_dir, progress=False)
    env = torchrun_env(ctx, ray.get(args.restarts.get.remote()), args.job)
    env[RUN_DIR_ENV] = args.run_dir
    node = ray.util.get_node_ip_address()
    report.info("rank %d/%d on node %s (%s): %s %s", rank, ctx.get_world_size(),
                ray.get_runtime_context().get_node_id(), node, script["path"], " ".join(script["args"]))
    if dist.is_initialized():
        dist.destroy_process_group()  # Ray Train's group: the script starts its own
    os.environ.update(env)
    _logging_as_in_a_fresh_process()
    sys.argv = [script["path"], *script["args"]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script["path"])))  # as `python script.py` does
    heartbeat = Heartbeat(rank, ray.get_runtime_context().get_node_id(), report.beat, watch_stack=True).start()
    out = RankOutput(report, heartbeat)
    try:
        with redirect_stdout(out), redirect_stderr(out):
            try:
                runpy.run_path(script["path"], run_name="__main__")
            except SystemExit as e:
                if e.code not in (None, 0):
                    raise RankFailed(node, f"{script['path']} exited with status {e.code}") from None
            finally:
                out.finish()
    except RankFailed:
        report.failed()
        raise
    except Exception as e:
        report.failed()
        raise RankFailed(node, describe(e)) from None
    finally:
        heartbeat.stop()
    report.sync()


def torchrun_env(ctx, restarts: int, job: dict) -> dict[str, str]:
    """The variables torchrun sets for each process; MASTER_ADDR:MASTER_PORT is rank 0's node and
    a port free there, shared through Ray (the script's own group does not exist yet)."""
    rank = ctx.get_world_rank()
    master = broadcast_from_rank_zero(_free_address() if rank == 0 else None)
    env = {
        "RANK": rank,
        "LOCAL_RANK": ctx.get_local_rank(),
        "WORLD_SIZE": ctx.get_world_size(),
        "LOCAL_WORLD_SIZE": ctx.get_local_world_size(),
        "GROUP_RANK": ctx.get_node_rank(),
        "NODE_RANK": ctx.get_node_rank(),
        "ROLE_RANK": rank,
        "ROLE_WORLD_SIZE": ctx.get_world_size(),
        "MASTER_ADDR": master[0],
        "MASTER_PORT": master[1],
        "TORCHELASTIC_RESTART_COUNT": restarts,
        "TORCHELASTIC_MAX_RESTARTS": job["failure"]["max_failures"],
        "TORCHELASTIC_RUN_ID": job["name"],
    }
    return {k: str(v) for k, v in env.items()}


def _logging_as_in_a_fresh_process() -> None:
    """Ray Train's worker prints its own lines (one per report) to the console stream, and its
    root logger's handlers would turn a script's logging.basicConfig() into a no-op. The script
    gets Python's defaults, as under torchrun; Ray's lines still go to Ray's log files."""
    ray_train = logging.getLogger("ray.train")
    for handler in [h for h in ray_train.handlers if isinstance(h, logging.StreamHandler)]:
        ray_train.removeHandler(handler)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    # Some Ray modules log under their file's path, straight into the root logger: the script's.
    ray_dir = os.path.dirname(ray.__file__)
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith(ray_dir) and isinstance(logger, logging.Logger):
            logger.propagate = False


def _free_address() -> tuple[str, int]:
    ip = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        s.bind((ip, 0))
        return ip, s.getsockname()[1]


class RankOutput(io.TextIOBase):
    """The script's sys.stdout and sys.stderr, a line at a time to `Reporter.output`; each line
    is progress to the heartbeat."""

    def __init__(self, report: Reporter, heartbeat: Heartbeat):
        self.report, self.heartbeat, self.pending = report, heartbeat, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            self.report.output(line)
        if lines:
            self.heartbeat.progressed()
        return len(text)

    def finish(self) -> None:
        """The last line, when the script ended without a line break."""
        if self.pending:
            self.report.output(self.pending)
            self.pending = ""
