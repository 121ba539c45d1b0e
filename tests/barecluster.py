"""A Ray cluster that has never seen raytrain-app, as users' clusters are: a second virtual
environment with Ray, torch, torchvision and pyarrow only (the versions installed here, from
pip's cache), built once and kept under ~/.cache, and a `ray start --head` from it on loopback,
with token auth, its own ports, and nothing of this checkout on its path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from raytrain_app.cluster.dashboard import reachable
from raytrain_app.cluster.localnodes import stop_processes
from raytrain_app.cluster.session import free_port
from raytrain_app.launch.package import CLUSTER_HAS

CACHE = Path(os.environ.get("RAYTRAIN_TEST_CACHE") or Path.home() / ".cache" / "raytrain-app-tests")


def requirements() -> list[str]:
    """What the cluster's environment gets: raytrain-app's idea of a Ray cluster (CLUSTER_HAS),
    pinned to the versions installed here."""
    return [f"{root}=={metadata.version(root.split('[')[0])}" for root in CLUSTER_HAS]


def bare_venv() -> Path:
    """The environment, built at most once per set of versions (a lock keeps two test processes
    from building it together); checked to hold no raytrain-app."""
    wanted = requirements()
    key = hashlib.sha256(" ".join([sys.version, *wanted]).encode()).hexdigest()[:12]
    venv = CACHE / f"bare-{key}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"bare-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / "ready").exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", *wanted],
                                 capture_output=True, text=True)
            assert pip.returncode == 0, pip.stderr[-3000:]
            (venv / "ready").touch()
        remove_old_raytrain_app(venv)  # left by a test run killed before it could clean up
    found = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.util as u, sys; "
                            "sys.exit(u.find_spec('raytrain_app') is not None)"], cwd="/", env=bare_env(venv))
    assert found.returncode == 0, f"{venv} can import raytrain_app"
    return venv


OLD_VERSION = "0.0.1"


def _old_raytrain_app(venv: Path) -> list[Path]:
    site = next((venv / "lib").glob("python3*/site-packages"))
    return [site / f"raytrain_app-{OLD_VERSION}.dist-info", site / "raytrain_app"]


def remove_old_raytrain_app(venv: Path) -> None:
    for folder in _old_raytrain_app(venv):
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def old_raytrain_app(venv: Path):
    """An old raytrain-app in the cluster's image, as `pip install raytrain-app==0.0.1` leaves it;
    importing it fails, so a job that ran it would fail. Gone when the block ends, and, should the
    test process be killed first, the next time the environment is asked for."""
    info, package = _old_raytrain_app(venv)
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: raytrain-app\nVersion: {OLD_VERSION}\n")
    package.mkdir()
    (package / "__init__.py").write_text(
        f"raise ImportError('the cluster\\'s own raytrain-app {OLD_VERSION} was imported')\n")
    try:
        yield
    finally:
        remove_old_raytrain_app(venv)


def bare_env(venv: Path, **more: str) -> dict:
    """An environment as a node's: the venv's bin first on PATH (a job's `python`), nothing of
    this process's Python, checkout or virtualenv."""
    keep = {name: os.environ[name] for name in ("HOME", "LANG", "TMPDIR", "RAY_worker_niceness") if name in os.environ}
    return {**keep, "PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", **more}


@dataclass
class BareCluster:
    venv: Path
    address: str  # the dashboard: the Jobs API
    token_file: Path
    head: subprocess.Popen

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}

    def stop(self) -> None:
        stop_processes([self.head.pid])


def start(venv: Path, folder: Path, cpus: int = 2) -> BareCluster:
    """A head node from `venv`, in `folder` (its token, logs and temp dir), with free ports."""
    token = folder / "token"
    token.write_text(os.urandom(32).hex() + "\n")
    token.chmod(0o600)
    temp = Path(f"/tmp/rtb-{os.getpid()}-{free_port()}")  # Ray's socket paths must stay short
    dashboard = free_port()
    env = bare_env(venv, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    workers = free_port()
    cmd = [str(venv / "bin" / "ray"), "start", "--head", "--block", "--disable-usage-stats",
           "--num-cpus", str(cpus), "--num-gpus", "0", "--port", str(free_port()), "--temp-dir", str(temp),
           "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
           "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
           "--min-worker-port", str(workers), "--max-worker-port", str(workers + 200)]
    with open(folder / "head.log", "wb") as log:
        head = subprocess.Popen(cmd, env=env, cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    cluster = BareCluster(venv, f"http://127.0.0.1:{dashboard}", token, head)
    deadline = time.monotonic() + 120
    while not reachable(cluster.address, cluster.headers):
        if head.poll() is not None or time.monotonic() > deadline:
            cluster.stop()
            raise RuntimeError(f"the bare cluster did not start: {(folder / 'head.log').read_text()[-2000:]}")
        time.sleep(0.5)
    return cluster
