"""A torchrun-style script's rank on Ray: its Ray Train worker serves it (`worker/script.py`),
reporting through Ray Train, and a Ray actor counts the group's restarts for the script's
TORCHELASTIC_RESTART_COUNT.

The worker only starts and serves the script's process, which makes its own process group: it
needs no torch process group of Ray Train's (`ScriptBackend`), and loads no torch; rank 0's
script process serves the ranks' store (`rendezvous_socket`). A worker that loaded torch and
joined a process group before its script's process did the same cost a run on two cores a few
seconds (benchmarks/README.md).
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import suppress
from typing import Optional

import ray
import ray.train
from ray.train.backend import Backend, BackendConfig
from ray.train.collective import broadcast_from_rank_zero

from raytrain_app.errors import RankFailed
from raytrain_app.worker.preemption import answered
from raytrain_app.worker.reporter import Reporter
from raytrain_app.worker.script import (
    LOOK_S,
    Relay,
    Served,
    script_command,
    script_environment,
    torchrun_env,
)
from raytrain_app.worker.script_api import STORE_FD_ENV

PREEMPTION_MARGIN_S = 30.0  # past a notice's deadline, by which its node should have gone


class ScriptBackend(Backend):
    """Ray Train's backend for a script's workers: no process group (the script makes its own),
    and each worker sees every GPU of its node's workers, as torchrun's processes see them
    (LOCAL_RANK picks one)."""

    share_cuda_visible_devices = True


class ScriptBackendConfig(BackendConfig):
    """What a script's `DataParallelTrainer` is given for its backend: `ScriptBackend`."""

    @property
    def backend_cls(self):
        return ScriptBackend


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


def rendezvous_socket() -> socket.socket:
    """A socket listening on a free port of this node, on which rank 0's script process serves
    the store the ranks meet at (`script_process.rendezvous_store`). It listens before any rank
    starts, so that its port goes to every rank at once, and clients wait in its backlog until
    the store is served."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", 0))


def run_script_per_worker(args) -> None:
    """The training function of a script run on Ray (`args`: args.WorkerArgs): the script's rank, served."""
    if args.cwd and os.path.isdir(args.cwd):
        os.chdir(args.cwd)
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    report = Reporter(args.events, rank, args.log_dir, progress=False)
    # `node`: where the hang watch finds the rank (a Ray node's id); `host`: how a failure names it.
    node, host = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
    restarts = ray.get(args.restarts.get.remote())
    listening = rendezvous_socket() if rank == 0 else None
    master = broadcast_from_rank_zero((host, listening.getsockname()[1]) if listening else None)
    script = args.job["script"]
    report.info("rank %d/%d on node %s (%s): %s %s", rank, ctx.get_world_size(), node, host, script["path"],
                " ".join(script["args"]))
    with Relay() as relay:
        env = {**script_environment(args, relay, node),
               **torchrun_env(rank, ctx.get_local_rank(), ctx.get_world_size(), ctx.get_local_world_size(),
                              ctx.get_node_rank(), master, restarts, args.job)}
        served = RayRank(args, report, relay, node, rank)
        if listening:  # rank 0's script process serves the store on it (script_process.rendezvous_store)
            env[STORE_FD_ENV] = str(listening.fileno())
        try:
            code = served.run(script_command(script), env, pass_fds=(listening.fileno(),) if listening else ())
        finally:
            if listening:
                listening.close()
    report.sync()
    if served.preempted_until is not None:
        # The script checkpointed for a preemption notice and ended; the group has not. It goes on
        # as the built-in loop's would, until Ray Train restarts it from that checkpoint when the
        # node goes; a notice without a deadline, or a node that never went, is a failure.
        time.sleep(max(0.0, served.preempted_until + PREEMPTION_MARGIN_S - time.time()))
        raise RankFailed(host, f"{script['path']} ended on a preemption notice, and its node did not go by the "
                               "deadline: restarting from its checkpoint")
    failure = served.failure(code)
    if failure:
        raise RankFailed(host, failure)


class RayRank(Served):
    """A rank served by its Ray Train worker: reports go to Ray Train, whose controller combines
    the ranks' rows (driver/controller.ScriptReports) and keeps the checkpoints."""

    def __init__(self, args, report: Reporter, relay: Relay, node: str, rank: int):
        super().__init__(args.job["script"], report, relay, node, rank)
        self.stop_flag, self.notices = args.stop_flag, args.notices
        self.preempted_until: Optional[float] = None  # a preemption notice's deadline (Unix seconds; 0: none)
        self.notice = None  # that notice: the checkpoints reported after it answer it
        self._next_look = 0.0

    def _report(self, metrics: dict, checkpoint_dir: Optional[str]) -> None:
        checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        if self.notice is not None:
            # The report's checkpoint answers the notice: the ranks' deaths when the node goes are a
            # preemption, not a failure (driver/controller.RestartNotices).
            metrics = {**metrics, **answered(self.notice)}
        ray.train.report(metrics, checkpoint=checkpoint)

    def _latest(self) -> Optional[str]:
        import pyarrow.fs

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        if isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem):
            return checkpoint.path
        return checkpoint.to_directory()

    def _stop_requested(self, now: bool) -> Optional[str]:
        """A stop request (SIGUSR1 to `train`, `raytrain-app stop`), or Ray Train's notice that this
        group's node is being drained. Looked at every `LOOK_S` (a call to the driver's actor)."""
        if not now and time.monotonic() < self._next_look:
            return None
        self._next_look = time.monotonic() + LOOK_S
        reason = self.stop_flag.get() if self.stop_flag is not None else None
        if reason:
            return reason
        if self.notices:
            from ray.train.v2._internal.execution.context import get_train_context

            with suppress(Exception):  # this worker's own copy of the notice: asking Ray Train is a collective
                info = get_train_context().preemption_context.preemption_info
                if info is not None:
                    self.notice, self.preempted_until = info, (info.deadline_ms or 0) / 1000
                    return "a preemption notice"
        return None
