"""The Ray cluster a `train` runs on, chosen and connected: a fresh embedded cluster, a local
cluster that `cluster up` started, or a running cluster at an address.

Never a plain `ray.init()`: it attaches to whatever cluster Ray's temp files name, even a dead
one, and hangs. An embedded cluster starts with `address="local"`; anything else is joined by
its address, after a bounded check that something answers there.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import psutil

from raytrain_app.cluster.capacity import workers_that_fit
from raytrain_app.cluster.dashboard import Dashboard
from raytrain_app.cluster.localnodes import running_dir, running_pids
from raytrain_app.cluster.profiles import ClusterProfile, load_profile
from raytrain_app.config.sections import ScalingConfig
from raytrain_app.console import route_ray_logs
from raytrain_app.errors import UserError, last_line, one_line
from raytrain_app.rayinternals import reload_auth_config, route_raylet_errors, session_logs_dir
from raytrain_app.waiting import poll

CONNECT_TIMEOUT_S = 5
JOIN_TRIES = "5"  # of Ray's GCS connection when joining, a second apart (Ray's own default: 20)


@dataclass(frozen=True)
class ClusterChoice:
    """Where a run goes. `address` None means a fresh embedded cluster."""

    address: Optional[str] = None
    auth_env: Optional[dict] = None  # RAY_AUTH_* for the cluster's token
    current: bool = False  # this process is connected already (a library caller ran ray.init)
    note: Optional[str] = None  # what the user is told about the choice


def choose_cluster(address: Optional[str], workers: int, cpus_per_worker: float,
                   gpus_per_worker: float) -> ClusterChoice:
    """`--address`: HOST:PORT or `auto` joins that cluster, `local` always starts an embedded one.
    Without it, a process already connected to Ray (a library caller's) stays on that cluster; else
    the cluster that $RAY_ADDRESS names is joined, as a plain `ray.init()` would; else a local
    cluster that `cluster up` started is joined when it is idle and its nodes hold the workers;
    else an embedded cluster starts."""
    if address == "local":
        return ClusterChoice()
    if address:
        return ClusterChoice(address)
    if ray_connected():
        return ClusterChoice(current=True)
    named = address_from_environment()
    if named:
        return ClusterChoice(named, note=f"joining the cluster at $RAY_ADDRESS ({named}); --address local starts a "
                                         "fresh one")
    running = running_local_cluster(workers, cpus_per_worker, gpus_per_worker)
    if running:
        return ClusterChoice(f"127.0.0.1:{running.ports()['port']}", running.ray_auth_env(),
                             note=f"using the running local cluster '{running.name}' (--address local starts a "
                                  "fresh one)")
    return ClusterChoice()


def address_from_environment() -> Optional[str]:
    """The GCS address (HOST:PORT) that $RAY_ADDRESS names: a machine's own cluster, where a shell
    on its head (a Ray job's, a SLURM allocation's, a Kubernetes pod's) has it set. A URL there
    names no GCS: `ray job submit` reads a dashboard's (http://), and Ray Client's (ray://) is not
    how raytrain-app joins a cluster."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    return None if address in ("", "auto", "local") or "://" in address else address


def ray_connected() -> bool:
    """Whether this process has joined a Ray cluster already (a library caller's `ray.init()`),
    without loading Ray when it has not."""
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


@contextmanager
def cluster_for(scaling: ScalingConfig, address: Optional[str], log_dir: Optional[str], verbose: bool,
                echo: Callable[[str], None], spare_cpus: float = 0, min_nodes: int = 1,
                node_timeout_s: float = 0, dashboard: bool = False,
                on_node_lost: Optional[Callable[[str], None]] = None) -> Iterator[None]:
    """The cluster for `scaling`'s workers (see `choose_cluster`), said when it is not the obvious
    one, connected for the block: what `train`, `evaluate` and `predict` share. A joined cluster
    whose nodes are still starting (a SLURM allocation's) is given `node_timeout_s` to reach
    `min_nodes`. An embedded cluster gets a `dashboard` for Ray Train's placement-group cleaner
    (what frees a trial's workers when Tune stops it)."""
    choice = choose_cluster(address, scaling.min_workers, scaling.cpus_per_worker, scaling.gpus_per_worker)
    if min_nodes > 1 and not choice.address:
        raise UserError(f"--min-nodes {min_nodes} is for joining a running cluster: name it with --address")
    if choice.note:
        echo(choice.note)
    needed = int(scaling.max_workers * scaling.cpus_per_worker + spare_cpus + 0.999)
    if choice.current:  # the caller's connection, left as it was
        yield
        return
    joined = (embedded_cluster(max(os.cpu_count() or 1, needed), log_dir=log_dir, verbose=verbose,
                               dashboard=dashboard, on_node_lost=on_node_lost, echo=echo) if choice.address is None
              else connected(choice.address, log_dir, verbose, choice.auth_env))
    with joined:
        python_answers_sigterm()
        if min_nodes > 1:  # a joined cluster's (refused above for an embedded one)
            wait_for_nodes(min_nodes, node_timeout_s, echo)
        yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_nodes(count: int, timeout_s: float, echo: Callable[[str], None]) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    said = 0
    while (alive := sum(n["Alive"] for n in ray.nodes())) < count:
        if time.monotonic() > deadline:
            raise UserError(f"only {alive} of {count} nodes joined the Ray cluster within {timeout_s:g}s")
        if alive != said:  # each change said once, while the nodes come up
            echo(f"waiting for nodes: {alive} of {count} joined")
            said = alive
        time.sleep(1)


def running_local_cluster(workers: int, cpus_per_worker: float, gpus_per_worker: float) -> Optional[ClusterProfile]:
    """A local cluster that `cluster up` started, still up, running no Ray job, and whose nodes
    hold `workers` whole workers: `train` joins it rather than start its own."""
    for record in sorted(running_dir().glob("*.json")):
        with suppress(OSError, ValueError, KeyError, UserError):  # stale, unreadable or unreachable: skip it
            profile = load_profile(json.loads(record.read_text())["profile"])
            if running_pids(profile) and _has_room(Dashboard.for_profile(profile), workers, cpus_per_worker,
                                                   gpus_per_worker):
                return profile
    return None


def _has_room(dashboard: Dashboard, workers: int, cpus_per_worker: float, gpus_per_worker: float) -> bool:
    return (not dashboard.busy()
            and workers_that_fit(dashboard.alive_nodes(), cpus_per_worker, gpus_per_worker) >= workers)


@contextmanager
def embedded_cluster(num_cpus: int, num_gpus: Optional[int] = None, log_dir: Optional[str] = None,
                     verbose: bool = False, dashboard: bool = False,
                     on_node_lost: Optional[Callable[[str], None]] = None,
                     echo: Callable[[str], None] = print) -> Iterator[None]:
    """Start a fresh single-node cluster; never attach to one named in Ray's temp files.

    Ray's own logs are copied into `log_dir/ray` when the cluster stops. With a `dashboard` (on a
    free loopback port), Ray's state API answers, and is named to every actor: with no address
    it fails as soon as a second Ray runs on the machine. If the node dies under the run, a
    `NodeWatch` says so and ends the process, after `on_node_lost(message)`.
    """
    import ray

    # Ray Train's preemption watcher (spot instances) and its Prometheus metrics serve long-lived
    # clusters; on a one-machine cluster without a dashboard they only add processes to start-up.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    os.environ.setdefault("RAY_TRAIN_METRICS_ENABLED", "0")
    route_ray_logs(os.path.join(log_dir, "driver.log") if log_dir else None, verbose)
    port = free_port() if dashboard else None
    ray.init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=dashboard,
        **({"dashboard_host": "127.0.0.1", "dashboard_port": port,
            "runtime_env": {"env_vars": {"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}"}}} if dashboard else {}),
        log_to_driver=verbose,
        logging_level=logging.INFO,  # into the handler route_ray_logs installed: a file unless verbose
    )
    if not verbose:
        route_raylet_errors(logging.getLogger("ray").warning)
    session_logs = session_logs_dir()
    global _watch
    try:
        _watch = NodeWatch(session_logs, log_dir, on_node_lost)
        _watch.start()
        yield
    finally:
        if _watch is not None and _watch.is_alive():
            _watch.stop()  # before the node stops on purpose
        _watch = None
        ray.shutdown()
        copy_logs(session_logs, log_dir, lambda line: echo(f"warning: {line}"))


def python_answers_sigterm() -> None:
    """Joining Ray installs its failure signal handler (Abseil's) over Python's: on a SIGTERM, a
    scheduler's stop, it printed a stack dump of this process ("*** SIGTERM received ... PC: @")
    before the command's one line. Python's handler, set again, answers it alone; the cluster's
    own processes keep Ray's, which leaves a crashed worker's stack in its log."""
    handler = signal.getsignal(signal.SIGTERM)
    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def copy_logs(session_logs: str, log_dir: Optional[str], warn: Callable[[str], None] = print) -> None:
    """Ray's session logs into LOG_DIR/ray, where the run keeps them; a copy that fails (a full
    disk) is a warning, never why a command fails."""
    if log_dir and os.path.isdir(session_logs):
        try:
            shutil.copytree(session_logs, os.path.join(log_dir, "ray"), dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("*.sock", "events", "old"))
        except (OSError, shutil.Error) as e:
            cause = e.args[0][0][2] if isinstance(e, shutil.Error) and e.args and e.args[0] else str(e)
            warn(f"Ray's logs were not all copied to {log_dir}/ray: {one_line(str(cause))[:200]}")


# The embedded cluster's watch, while one is up in this process.
_watch: Optional["NodeWatch"] = None
WATCH_INTERVAL_S = 0.1
SEEN_EVERY_S = 1.0


def lost_local_node(wait_s: float) -> None:
    """Where Ray's errors reach the driver: if the embedded cluster's node has died (within
    `wait_s`, the time its death takes to show), end the process as the watch does; else return."""
    if _watch is None or not _watch.is_alive():
        return
    reason = poll(_watch.lost, lambda lost: bool(lost) or not _watch.is_alive(), wait_s, WATCH_INTERVAL_S)
    if reason and _watch.is_alive():
        _watch.fail(reason)


class NodeWatch(threading.Thread):
    """Watches the raylet of the embedded cluster this process started.

    When it dies (killed, out of memory), Ray's core ends the driver within a fraction of a
    second (QuickExit, exit code 1), skipping every `finally`, after an error that reads like an
    interrupt. So the watch, told by a waiting thread when the raylet process ends, and polling
    the GCS's view of the node (which knows of a SIGTERM first), says why in one line, records it
    (`on_lost`), keeps Ray's logs, and exits 1 itself.

    The raylet's children (workers, agents) are orphaned when it dies and end on their own when
    they notice, which a loaded machine showed can take over half a minute: the watch keeps a
    list of this process's descendants, refreshed every `SEEN_EVERY_S`, and kills what is left
    of it before exiting, so that nothing of the node outlives the command.
    """

    def __init__(self, session_logs: str, log_dir: Optional[str], on_lost: Optional[Callable[[str], None]]):
        import ray

        super().__init__(daemon=True, name="raytrain-node-watch")
        self.session_logs, self.log_dir, self.on_lost = session_logs, log_dir, on_lost
        self.node_id = ray.get_runtime_context().get_node_id()
        socket_name = next(n["RayletSocketName"] for n in ray.nodes() if n["NodeID"] == self.node_id)
        self.raylet = next((p for p in psutil.Process().children() if _is_raylet(p, socket_name)), None)
        self._stopped = threading.Event()
        self._failing = threading.Lock()
        self._raylet_gone = threading.Event()
        self._raylet_end: Optional[os.waitid_result] = None  # how it ended, once it has
        self._seen: list[psutil.Process] = []
        self._seen_at = 0.0
        if self.raylet is not None:
            threading.Thread(target=self._await_raylet, daemon=True, name="raytrain-raylet-exit").start()

    def _await_raylet(self) -> None:
        """Block until the raylet ends, and keep how, without reaping it. Ray's own code may reap
        it first (under load it did), after which nobody could tell a SIGKILL from an exit."""
        with suppress(ChildProcessError, OSError):
            self._raylet_end = os.waitid(os.P_PID, self.raylet.pid, os.WEXITED | os.WNOWAIT)
        self._raylet_gone.set()

    def run(self) -> None:
        while not self._stopped.wait(WATCH_INTERVAL_S):
            reason = self.lost()
            if reason:
                self.fail(reason)
            if time.monotonic() - self._seen_at > SEEN_EVERY_S:
                with suppress(psutil.Error):
                    self._seen = psutil.Process().children(recursive=True)
                self._seen_at = time.monotonic()

    def stop(self) -> None:
        self._stopped.set()
        self.join()

    def lost(self) -> Optional[str]:
        """Why the node is gone, or None while it is up."""
        import ray

        if self._raylet_gone.is_set():
            with suppress(ChildProcessError):  # reaped here, unless Ray's code did
                os.waitpid(self.raylet.pid, os.WNOHANG)
            return _ended(self._raylet_end) if self._raylet_end else "raylet exited"
        if self._stopped.is_set():
            return None
        try:
            node = next((n for n in ray.nodes() if n["NodeID"] == self.node_id), None)
        except Exception:  # noqa: BLE001 - the GCS went with the node: the process check will tell
            return None
        if node is not None and not node["Alive"]:
            return f"raylet exited: {node.get('DeathReasonMessage') or 'marked dead'}"
        return None

    def fail(self, reason: str) -> None:
        """Say why, record it, keep the logs, and end the process (exit 1): never returns."""
        with self._failing:
            where = f"; logs in {os.path.join(self.log_dir, 'ray')}" if self.log_dir else ""
            message = f"the local Ray node stopped ({reason}){where}"
            print(f"error: {message}", file=sys.stderr, flush=True)
            with suppress(Exception):  # nothing may keep the process from ending as said
                if self.on_lost:
                    self.on_lost(message)
                copy_logs(self.session_logs, self.log_dir)
            for process in self._seen + psutil.Process().children(recursive=True):
                with suppress(psutil.Error):  # gone already, or its PID reused: psutil checks
                    process.kill()
            sys.stdout.flush()
            os._exit(1)


@contextmanager
def _joining(log_file: Optional[str], verbose: bool) -> Iterator[None]:
    """Ray's wait for a joined cluster's GCS, cut from 20 tries a second apart to `JOIN_TRIES`
    (something answered at the address already: what fails now is the token, or the port's
    owner), with the warning line its C++ client prints at each try kept off the console."""
    ours = "RAY_gcs_server_port_wait_time_s" not in os.environ  # else the user's, kept
    if ours:
        os.environ["RAY_gcs_server_port_wait_time_s"] = JOIN_TRIES
    quiet = not verbose
    if quiet:
        sys.stderr.flush()
        console = os.dup(2)
        with open(log_file or os.devnull, "a") as f:
            os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        if quiet:
            sys.stderr.flush()
            os.dup2(console, 2)
            os.close(console)
        if ours:
            os.environ.pop("RAY_gcs_server_port_wait_time_s", None)


def _not_joined(e: BaseException) -> str:
    """Why ray.init could not join, in words: Ray nests the token's refusal in a traceback's text."""
    text, cause = "", e
    while cause is not None:
        text, cause = text + str(cause), cause.__cause__ or cause.__context__
    if "InvalidAuthToken" in text:
        return ("it asks for its auth token, which this process lacks or has wrong: set RAY_AUTH_MODE=token and "
                "RAY_AUTH_TOKEN_PATH to the token's file")
    return last_line(e)


def _is_raylet(process: psutil.Process, socket_name: str) -> bool:
    try:
        return process.name() == "raylet" and f"--raylet_socket_name={socket_name}" in process.cmdline()
    except psutil.Error:
        return False


def _ended(end: os.waitid_result) -> str:
    if end.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return f"raylet exited: killed by {signal.Signals(end.si_status).name}"
    return f"raylet exited with code {end.si_status}" if end.si_status else "raylet exited"


@contextmanager
def connected(address: str, log_dir: Optional[str] = None, verbose: bool = False,
              auth_env: Optional[dict] = None) -> Iterator[None]:
    """Join a running cluster by its GCS address; `auto` means $RAY_ADDRESS, which Ray Jobs set.

    `auth_env` (RAY_AUTH_MODE and the token's source) goes into this process's environment,
    where Ray reads it when it loads."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "")
        if not address:
            raise UserError("--address auto needs $RAY_ADDRESS (Ray sets it for job entrypoints); name the address")
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as e:  # ray.init would retry for minutes
        raise UserError(f"cannot reach the Ray cluster at {address} (HOST:PORT of its GCS): "
                        f"{e.strerror or e if isinstance(e, OSError) else 'bad address'}") from None
    if auth_env:
        ray_loaded = "ray" in sys.modules
        for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
            os.environ.pop(name, None)
        os.environ.update(auth_env)
        if ray_loaded:  # too late for Ray to see the variables by itself (a library caller imported it)
            reload_auth_config()
    import ray

    log_file = os.path.join(log_dir, "driver.log") if log_dir else None
    route_ray_logs(log_file, verbose)
    try:
        with _joining(log_file, verbose):
            ray.init(address=address, log_to_driver=verbose, logging_level=logging.INFO)
    except (ConnectionError, RuntimeError, ray.exceptions.AuthenticationError) as e:
        raise UserError(f"cannot join the Ray cluster at {address}: {_not_joined(e)}") from None
    if not verbose:
        route_raylet_errors(logging.getLogger("ray").warning)
    try:
        yield
    finally:
        ray.shutdown()
