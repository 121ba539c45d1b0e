"""Ray clusters: the embedded one `train` starts in-process, one `train --address` joins, and the
local or launcher-managed clusters that `cluster up|down|status` manage for a profile.

A local profile's nodes are `ray start --block` processes, each the leader of its own process
group. Their PIDs are recorded in the profile's temp dir, and `down` stops exactly those groups:
never `ray stop`, which kills every Ray process on the machine by name.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Callable, Iterator, Optional

from raytrain_app.console import route_ray_logs
from raytrain_app.dashboard import Dashboard, reachable
from raytrain_app.errors import UserError, last_line
from raytrain_app.profiles import ClusterProfile

NODES_FILE = "raytrain-nodes.json"
START_TIMEOUT_S = 90
CONNECT_TIMEOUT_S = 5
STOP_TIMEOUT_S = 5


@contextmanager
def embedded_cluster(num_cpus: int, num_gpus: Optional[int] = None, log_dir: Optional[str] = None,
                     verbose: bool = False) -> Iterator[None]:
    """Start a fresh single-node cluster; never attach to one named in Ray's temp files.

    `address="local"` is what keeps a stale /tmp/ray/ray_current_cluster from hijacking the run.
    Ray's own logs are copied into `log_dir/ray` when the cluster stops.
    """
    import ray

    # Ray Train's preemption watcher (spot instances) and its Prometheus metrics serve long-lived
    # clusters; on a one-machine cluster without a dashboard they only add processes to start-up.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    os.environ.setdefault("RAY_TRAIN_METRICS_ENABLED", "0")
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


@contextmanager
def connected(address: str, log_dir: Optional[str] = None, verbose: bool = False,
              token: Optional[str] = None) -> Iterator[None]:
    """Join a running cluster by its GCS address; `auto` means $RAY_ADDRESS, which Ray Jobs set."""
    import ray

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
    if token:
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        ray._raylet.Config.initialize("")  # Ray read its auth mode at import: re-read it, as Ray's own token setup does
    route_ray_logs(os.path.join(log_dir, "driver.log") if log_dir else None, verbose)
    try:
        ray.init(address=address, log_to_driver=verbose, logging_level=logging.INFO)
    except (ConnectionError, RuntimeError, ray.exceptions.AuthenticationError) as e:
        raise UserError(f"cannot join the Ray cluster at {address}: {last_line(e)}") from None
    try:
        yield
    finally:
        ray.shutdown()


def running_dir() -> Path:
    """Where `cluster up` records the local clusters it started, one file per profile name holding
    the profile's path, so that `train` can join one instead of starting its own."""
    return Path(os.environ.get("RAYTRAIN_RUNNING_DIR") or f"/tmp/raytrain-{os.getuid()}/running")


def running_local_cluster(workers: int, cpus_per_worker: float, gpus_per_worker: float) -> Optional[ClusterProfile]:
    """A local cluster that `cluster up` started, still up, running no Ray job, and whose nodes
    hold `workers` whole workers: `train` joins it rather than start its own."""
    from raytrain_app.profiles import load_profile

    for record in sorted(running_dir().glob("*.json")):
        with suppress(OSError, ValueError, KeyError, UserError):  # stale, unreadable or unreachable: skip it
            profile = load_profile(json.loads(record.read_text())["profile"])
            if _running_pids(profile) and _has_room(Dashboard.for_profile(profile), workers, cpus_per_worker,
                                                    gpus_per_worker):
                return profile
    return None


def _has_room(dashboard: Dashboard, workers: int, cpus_per_worker: float, gpus_per_worker: float) -> bool:
    fits = [min(n.cpus // cpus_per_worker, n.gpus // gpus_per_worker if gpus_per_worker else workers)
            for n in dashboard.alive_nodes()]
    busy = any(job.status in ("PENDING", "RUNNING") for job in dashboard.jobs().list_jobs())
    return sum(fits) >= workers and not busy


# ---- clusters for profiles ----------------------------------------------------------------


def cluster_up(profile: ClusterProfile, echo: Callable[[str], None]) -> None:
    if profile.launcher:
        _launcher("up", profile)
        return
    if _running_pids(profile):
        raise UserError(f"cluster '{profile.name}' is already up ({profile.jobs_address}); "
                        f"`raytrain-app cluster down {profile.source}` stops it")
    if reachable(profile.jobs_address):
        raise UserError(f"{profile.jobs_address} already answers: another cluster uses local.dashboard_port "
                        f"{profile.local.dashboard_port}; give this profile its own ports")
    env = _node_env(profile)
    temp = Path(profile.temp_dir)
    temp.mkdir(parents=True, exist_ok=True)
    pids: list[int] = []
    try:
        for i in range(profile.nodes):
            pids.append(_start_node(profile, i, env, temp))
            _write_pids(profile, pids)
            _wait_for(profile, nodes=i + 1, pid=pids[-1], log=temp / f"node-{i}.log")
            echo(f"node {i} up ({'head' if i == 0 else 'worker'}, pid {pids[-1]})")
    except BaseException:
        stop_nodes(profile, pids)
        raise
    running = running_dir()
    running.mkdir(parents=True, exist_ok=True)
    (running / f"{profile.name}.json").write_text(json.dumps({"profile": os.path.abspath(profile.source)}))
    echo(f"cluster '{profile.name}' is up: {profile.nodes} nodes, Jobs API at {profile.jobs_address}")


def cluster_down(profile: ClusterProfile, echo: Callable[[str], None]) -> None:
    if profile.launcher:
        _launcher("down", profile)
        return
    pids = _recorded_pids(profile)
    if not pids:
        echo(f"cluster '{profile.name}' is not up")
        return
    stopped = stop_nodes(profile, pids)
    echo(f"cluster '{profile.name}' is down ({stopped} node processes stopped)")


def node_processes(profile: ClusterProfile) -> set[int]:
    """Every live process of the nodes `cluster up` started for this profile."""
    return _node_processes([pid for pid in _recorded_pids(profile) if _alive(pid)])


def stop_nodes(profile: ClusterProfile, pids: list[int]) -> int:
    """SIGTERM every process of our nodes, as `ray stop` would but only ours; SIGKILL what lingers."""
    leaders = [pid for pid in pids if _alive(pid)]
    targets = _node_processes(leaders)
    _signal(targets, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while (targets := _node_processes(leaders) | (targets & _live_pids())) and time.monotonic() < deadline:
        time.sleep(0.2)
    _signal(targets, signal.SIGKILL)
    while _node_processes(leaders) | (targets & _live_pids()):
        time.sleep(0.1)
    (Path(profile.temp_dir) / NODES_FILE).unlink(missing_ok=True)
    (running_dir() / f"{profile.name}.json").unlink(missing_ok=True)
    return len(leaders)


def _start_node(profile: ClusterProfile, i: int, env: dict, temp: Path) -> int:
    lp = profile.local
    workers = lp.worker_port_base + 1000 * i
    cmd = [ray_executable(), "start", "--block", "--disable-usage-stats",
           "--num-cpus", str(profile.cpus_per_node), "--num-gpus", str(profile.gpus_per_node),
           "--min-worker-port", str(workers), "--max-worker-port", str(workers + 999),
           "--dashboard-agent-listen-port", str(lp.agent_port_base + i)]
    if i == 0:
        cmd += ["--head", "--port", str(lp.port), "--temp-dir", str(temp),
                "--dashboard-host", "127.0.0.1", "--dashboard-port", str(lp.dashboard_port),
                "--ray-client-server-port", str(lp.client_port)]
    else:
        cmd += ["--address", f"127.0.0.1:{lp.port}"]
    log = open(temp / f"node-{i}.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    return proc.pid


def _wait_for(profile: ClusterProfile, nodes: int, pid: int, log: Path) -> None:
    dashboard = Dashboard.for_profile(profile)
    dashboard.timeout_s = 2  # poll often while the head starts
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if not _alive(pid):
            lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
            raise UserError(f"a node of '{profile.name}' exited while starting: {lines[-1] if lines else '?'} "
                            f"(log: {log})")
        with suppress(UserError):  # the dashboard may not answer yet
            if len(dashboard.alive_nodes()) >= nodes:
                return
        time.sleep(1)
    raise UserError(f"cluster '{profile.name}' did not reach {nodes} nodes within {START_TIMEOUT_S}s (log: {log})")


def _node_env(profile: ClusterProfile) -> dict:
    """Nodes run with token auth and with this Python first on PATH, so jobs find raytrain_app."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    token = _ensure_token(profile)
    if token:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    else:
        env["RAY_AUTH_MODE"] = "disabled"
    return env


def _ensure_token(profile: ClusterProfile) -> Optional[str]:
    """A local cluster's token file is created (mode 0600) the first time it is needed."""
    path = profile.auth.token_file and Path(os.path.expanduser(profile.auth.token_file))
    if path and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(secrets.token_hex(32) + "\n")
    return profile.token()


def ray_executable() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "ray")
    return beside if os.path.exists(beside) else (shutil.which("ray") or "ray")


def _launcher(verb: str, profile: ClusterProfile) -> None:
    config = profile.path(profile.launcher)
    if not os.path.exists(config):
        raise UserError(f"{profile.source}: launcher file not found: {config}")
    proc = subprocess.run([ray_executable(), verb, config, "-y"])
    if proc.returncode:
        raise UserError(f"`ray {verb} {config}` failed with exit code {proc.returncode}")


def _recorded_pids(profile: ClusterProfile) -> list[int]:
    try:
        return json.loads((Path(profile.temp_dir) / NODES_FILE).read_text())["pids"]
    except (OSError, ValueError, KeyError):
        return []


def _running_pids(profile: ClusterProfile) -> list[int]:
    return [pid for pid in _recorded_pids(profile) if _alive(pid)]


def _write_pids(profile: ClusterProfile, pids: list[int]) -> None:
    (Path(profile.temp_dir) / NODES_FILE).write_text(json.dumps({"pids": pids, "address": profile.jobs_address}))


def _alive(pid: int) -> bool:
    with suppress(ChildProcessError):  # collect it if it is our own exited child
        os.waitpid(pid, os.WNOHANG)
    return pid in _live_pids()


def _live_pids() -> set[int]:
    return set(_process_table())


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id) for every live, non-zombie process."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            table[int(stat.parent.name)] = (int(fields[1]), int(fields[3]))
    return table


def _node_processes(leaders: list[int]) -> set[int]:
    """Each node's processes: its session (gcs, raylet, workers) plus any descendant in a session of
    its own (a job's entrypoint)."""
    table = _process_table()
    found = {pid for pid, (_, sid) in table.items() if sid in leaders} | (set(leaders) & set(table))
    grew = True
    while grew:
        children = {pid for pid, (ppid, _) in table.items() if ppid in found} - found
        found |= children
        grew = bool(children)
    return found


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        with suppress(ProcessLookupError):  # already gone
            os.kill(pid, sig)
