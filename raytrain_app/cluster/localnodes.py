"""`cluster up|down` for a profile: local Ray nodes started and stopped by PID, or Ray's launcher.

A local profile's nodes are `ray start --block` processes, each the leader of its own session.
Their PIDs (with their start times, so a reused PID is never taken for ours) are recorded in the
profile's temp dir, and `down` stops exactly those sessions and their descendants: never
`ray stop`, which kills every Ray process on the machine by name. Processes are found and
stopped through psutil, so this works wherever psutil does (Linux, macOS).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import Callable

import psutil

from raytrain_app.cluster.dashboard import Dashboard
from raytrain_app.cluster.profiles import PORTS, PORTS_FILE, ClusterProfile, user_runtime_dir
from raytrain_app.console import count
from raytrain_app.errors import UserError
from raytrain_app.waiting import poll

NODES_FILE = "raytrain-nodes.json"
PORT_RANGE = (10000, 32000)  # where free ports are chosen: below the kernel's ephemeral range (32768+)
START_TIMEOUT_S = 90
STOP_TIMEOUT_S = 5


def running_dir() -> Path:
    """Where `cluster up` records the local clusters it started, one file per profile name holding
    the profile's path, so that `train` can join one instead of starting its own."""
    return Path(os.environ.get("RAYTRAIN_RUNNING_DIR") or os.path.join(user_runtime_dir(), "running"))


def cluster_up(profile: ClusterProfile, echo: Callable[[str], None]) -> None:
    _check_startable(profile, "up")
    if profile.launcher:
        _launcher("up", profile)
        return
    temp = Path(profile.temp_dir)
    _own_folder(temp)
    if running_pids(profile):
        raise UserError(f"cluster '{profile.name}' is already up ({profile.jobs_address}); "
                        f"`raytrain-app cluster down {profile.source}` stops it")
    ports = _choose_ports(profile)
    (temp / PORTS_FILE).write_text(json.dumps(ports))
    env = _node_env(profile)
    nodes: list[psutil.Process] = []
    try:
        for i in range(profile.nodes):
            nodes.append(_start_node(profile, i, env, temp, ports))
            _record(profile, nodes)
            _wait_for(profile, nodes=i + 1, node=nodes[-1], log=node_log(profile, i))
            echo(f"node {i} up ({'head' if i == 0 else 'worker'}, pid {nodes[-1].pid})")
    except BaseException:
        stop_nodes(profile, [n.pid for n in nodes])
        raise
    running = running_dir()
    running.mkdir(parents=True, exist_ok=True)
    (running / f"{profile.name}.json").write_text(json.dumps({"profile": os.path.abspath(profile.source)}))
    echo(f"cluster '{profile.name}' is up: {count(profile.nodes, 'node')}, Jobs API at {profile.jobs_address}")


def cluster_down(profile: ClusterProfile, echo: Callable[[str], None]) -> None:
    _check_startable(profile, "down")
    if profile.launcher:
        _launcher("down", profile)
        return
    leaders = running_pids(profile)
    if not leaders:
        echo(f"cluster '{profile.name}' is not up")
        _forget(profile)
        return
    stopped = stop_nodes(profile, leaders)
    echo(f"cluster '{profile.name}' is down ({count(stopped, 'node')} stopped)")


def add_node(profile: ClusterProfile, index: int) -> psutil.Process:
    """Node `index` joining the running local cluster, as a cloud adds one under a run (the tests
    and benchmarks grow a cluster with it); not recorded, so its caller stops it."""
    temp = Path(profile.temp_dir)
    return _start_node(profile, index, _node_env(profile), temp, json.loads((temp / PORTS_FILE).read_text()))


def node_log(profile: ClusterProfile, index: int) -> Path:
    """Where node `index` of a local cluster writes its `ray start --block` output."""
    return Path(profile.temp_dir) / f"node-{index}.log"


def last_line(log: Path) -> str:
    """A node log's last line: why a node that exited did ("" for a log with nothing in it)."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _check_startable(profile: ClusterProfile, verb: str) -> None:
    """Only local nodes and Ray's launcher are ours to start and stop."""
    owner = {"slurm": "SLURM allocates nodes per job, and each job starts and stops its own Ray",
             "kuberay": "KubeRay's operator runs its clusters (`raytrain-app k8s render` writes a RayJob that "
                        "brings one)"}.get(profile.kind)
    if not owner and not profile.is_local and not profile.launcher:
        owner = f"it names a running cluster ({profile.jobs_address}) and no launcher: file"
    if owner:
        raise UserError(f"cluster {verb}: nothing to {'start' if verb == 'up' else 'stop'} for {profile.source}: "
                        f"{owner}")


def running_pids(profile: ClusterProfile) -> list[int]:
    """The recorded node leaders that are still the processes `cluster up` started."""
    return [n.pid for n in _recorded(profile)]


def stop_nodes(profile: ClusterProfile, leaders: list[int]) -> int:
    """Stop these nodes (`stop_processes`) and forget the cluster. Returns how many node leaders
    there were."""
    stop_processes(leaders)
    _forget(profile)
    return len(leaders)


def stop_processes(leaders: list[int]) -> None:
    """SIGTERM every process of these nodes, as `ray stop` would but only ours; SIGKILL what lingers
    (also a node `add_node` started)."""
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while True:
        fresh = [p for p in node_processes(leaders) if p.pid not in seen]  # new workers may still appear
        for proc in fresh:
            seen[proc.pid] = proc
            with suppress(psutil.Error):
                proc.terminate()
        _, alive = psutil.wait_procs(list(seen.values()), timeout=0.2)
        if not alive and not fresh:
            break
        if time.monotonic() > deadline:
            for proc in alive:
                with suppress(psutil.Error):
                    proc.kill()
            psutil.wait_procs(alive, timeout=STOP_TIMEOUT_S)
            if not node_processes(leaders):
                break


def node_processes(leaders: list[int]) -> list[psutil.Process]:
    """Each node's processes: its session (gcs, raylet, workers, even those whose parent died) plus
    every descendant, also one in a session of its own (a job's entrypoint)."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter():
        with suppress(psutil.Error, OSError):
            if proc.pid in leaders or os.getsid(proc.pid) in leaders:
                found[proc.pid] = proc
    for proc in list(found.values()):
        with suppress(psutil.Error):
            for child in proc.children(recursive=True):
                found.setdefault(child.pid, child)
    return [p for p in found.values() if _alive(p)]


def ray_executable() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "ray")
    return beside if os.path.exists(beside) else (shutil.which("ray") or "ray")


def _own_folder(temp: Path) -> None:
    """The cluster's temp dir, this user's alone (0700): Ray's sockets, logs and the node records
    are in it. One that another user owns is refused, not shared."""
    for folder in (temp.parent, temp) if temp.parent.name.startswith("raytrain") else (temp,):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        owner = folder.stat().st_uid
        if owner != os.getuid():
            raise UserError(f"{folder} belongs to another user (uid {owner}): set local.temp_dir to a folder of "
                            "your own, or leave it out")


def _choose_ports(profile: ClusterProfile) -> dict[str, int]:
    """The profile's ports, checked free; the others chosen free. A port in use (another user's
    cluster, another program) is one line now, not a node that dies while starting."""
    ports, taken = {}, set()
    for name in PORTS:
        width = (1000 * profile.nodes if name == "worker_port_base"
                 else profile.nodes if name == "agent_port_base" else 1)
        given = getattr(profile.local, name)
        if given is not None:
            busy = next((p for p in range(given, given + width) if not _free(p)), None)
            if busy is not None:
                low, high = _ephemeral_ports()
                why = (f"ports {low}-{high} are the kernel's for outgoing connections, which take any of them at "
                       f"any time): choose ports below {low}, or" if given + width > low and given <= high else
                       "another user's cluster, or another program):")
                raise UserError(f"{profile.source}: local.{name} {given}: port {busy} is in use ({why} leave local's "
                                "ports out to have free ones chosen")
        else:
            given = _free_block(width, taken)
        ports[name] = given
        taken.update(range(given, given + width))
    return ports


def _free(port: int) -> bool:
    """Nothing listens on `port`, on any address (Ray's servers bind all of them)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is no user
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel gives outgoing connections their local ports from."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):  # not Linux: its default
        return 32768, 60999


def _free_block(width: int, taken: set[int]) -> int:
    """The first of `width` free ports in a row, below the kernel's ephemeral ports."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(PORT_RANGE[0], PORT_RANGE[1] - width)
        block = range(base, base + width)
        if not taken.intersection(block) and all(_free(p) for p in block):
            return base
    raise UserError(f"no {width} free ports in a row between {PORT_RANGE[0]} and {PORT_RANGE[1]}")


def _start_node(profile: ClusterProfile, i: int, env: dict, temp: Path, ports: dict[str, int]) -> psutil.Process:
    """Node `i` of a local cluster. Each node has a Ray temp dir of its own, as on separate hosts:
    nodes sharing one would share its `runtime_resources`, where a node that has not yet unpacked
    a job's working_dir unpacks it again over another node's copy, deleting the directory the
    job's driver runs in (Ray's working_dir plugin overwrites)."""
    workers = ports["worker_port_base"] + 1000 * i
    cmd = [ray_executable(), "start", "--block", "--disable-usage-stats",
           "--num-cpus", str(profile.cpus_per_node), "--num-gpus", str(profile.gpus_per_node),
           "--min-worker-port", str(workers), "--max-worker-port", str(workers + 999),
           "--dashboard-agent-listen-port", str(ports["agent_port_base"] + i)]
    if i == 0:
        cmd += ["--head", "--port", str(ports["port"]), "--temp-dir", str(temp),
                "--dashboard-host", "127.0.0.1", "--dashboard-port", str(ports["dashboard_port"]),
                "--ray-client-server-port", str(ports["client_port"])]
    else:
        cmd += ["--address", f"127.0.0.1:{ports['port']}", "--temp-dir", str(temp / str(i))]
    with open(node_log(profile, i), "wb") as log:
        return psutil.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def _wait_for(profile: ClusterProfile, nodes: int, node: psutil.Process, log: Path) -> None:
    dashboard = Dashboard.for_profile(profile)
    dashboard.timeout_s = 2  # poll often while the head starts

    def joined() -> int:
        if not _alive(node):
            raise UserError(f"a node of '{profile.name}' exited while starting: {last_line(log) or '?'} (log: {log})")
        with suppress(UserError):  # the dashboard may not answer yet
            return len(dashboard.alive_nodes())
        return 0

    if poll(joined, lambda count: count >= nodes, START_TIMEOUT_S) >= nodes:
        return
    raise UserError(f"cluster '{profile.name}' did not reach {nodes} nodes within {START_TIMEOUT_S}s (log: {log})")


def _node_env(profile: ClusterProfile) -> dict:
    """Nodes run with token auth and with this Python first on PATH: a job's `python` is the one
    the nodes run Ray with, as on a cluster's image (raytrain-app comes with the job either way)."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):  # this shell's own Ray token is not the cluster's
        env.pop(name, None)
    _ensure_token_file(profile)
    env.update({"RAY_AUTH_MODE": "disabled", **profile.ray_auth_env()})
    return env


def _ensure_token_file(profile: ClusterProfile) -> None:
    """A local cluster's token file is created (mode 0600) the first time it is needed."""
    path = profile.auth.token_file and Path(os.path.expanduser(profile.auth.token_file))
    if path and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(secrets.token_hex(32) + "\n")


def _launcher(verb: str, profile: ClusterProfile) -> None:
    config = profile.path(profile.launcher)
    if not os.path.exists(config):
        raise UserError(f"{profile.source}: launcher file not found: {config}")
    proc = subprocess.run([ray_executable(), verb, config, "-y"])
    if proc.returncode:
        raise UserError(f"`ray {verb} {config}` failed with exit code {proc.returncode}")


def _record(profile: ClusterProfile, nodes: list[psutil.Process]) -> None:
    (Path(profile.temp_dir) / NODES_FILE).write_text(json.dumps(
        {"nodes": [{"pid": n.pid, "started": n.create_time()} for n in nodes], "address": profile.jobs_address}))


def _recorded(profile: ClusterProfile) -> list[psutil.Process]:
    try:
        records = json.loads((Path(profile.temp_dir) / NODES_FILE).read_text())["nodes"]
    except (OSError, ValueError, KeyError):
        return []
    ours = []
    for record in records:
        with suppress(psutil.Error, KeyError, TypeError):
            proc = psutil.Process(record["pid"])
            if proc.create_time() == record["started"] and _alive(proc):  # not a reused PID
                ours.append(proc)
    return ours


def _forget(profile: ClusterProfile) -> None:
    (Path(profile.temp_dir) / NODES_FILE).unlink(missing_ok=True)
    (Path(profile.temp_dir) / PORTS_FILE).unlink(missing_ok=True)
    (running_dir() / f"{profile.name}.json").unlink(missing_ok=True)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
