"""`submit` and job management against a real 2-node Ray cluster with its dashboard, on loopback.

The test starts the head and a second node with `raytrain-app cluster up` (each `ray start
--block`, the second with `--address`), submits through the Jobs API, and stops exactly those
processes at the end.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import yaml

from raytrain_app.cluster import cluster_down, cluster_up, node_processes, running_local_cluster
from raytrain_app.dashboard import Dashboard
from raytrain_app.profiles import load_profile
from tests.conftest import REPO, running


def cli(*args, timeout=240, env=None):
    return subprocess.run([sys.executable, "-m", "raytrain_app.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)


def short_temp_dir() -> str:
    """Ray's unix socket paths under its temp dir must fit in 107 bytes: pytest's tmp paths are too long."""
    return tempfile.mkdtemp(prefix="rt-", dir="/tmp")


def write_profile(path, **fields):
    base = {"name": "test-2node", "address": "local", "nodes": 2, "cpus_per_node": 1,
            "storage": str(path.parent / "storage"), "placement": "SPREAD",
            "auth": {"token_file": str(path.parent / "token")},
            "local": {"port": 6490, "dashboard_port": 8366, "client_port": 23501, "worker_port_base": 30000,
                      "agent_port_base": 52600, "temp_dir": short_temp_dir()}}
    base.update(fields)
    path.write_text(yaml.safe_dump(base))
    return str(path)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    profile_file = write_profile(tmp_path_factory.mktemp("cluster") / "profile.yaml")
    profile = load_profile(profile_file)
    cluster_up(profile, echo=lambda line: None)
    yield profile_file, profile
    started = node_processes(profile)  # gcs, raylets, dashboard, workers, job drivers
    assert len(started) > 10
    cluster_down(profile, echo=lambda line: None)
    assert running_local_cluster(1, 1, 0) is None  # no longer offered to `train`
    shutil.rmtree(profile.temp_dir, ignore_errors=True)
    assert not [pid for pid in started if running(pid)]  # all of them, and only they, stopped


def ray_cli_env(profile):
    return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": profile.token()}


def test_cluster_status_shows_both_nodes(two_nodes):
    profile_file, _ = two_nodes
    proc = cli("cluster", "status", profile_file)
    assert proc.returncode == 0, proc.stderr
    assert "2 nodes, 2 CPUs, 0 GPUs" in proc.stdout and "head" in proc.stdout and "worker" in proc.stdout


def test_submit_follows_to_success_with_workers_on_both_nodes(two_nodes):
    profile_file, profile = two_nodes
    proc = cli("submit", "examples/digits.yaml", "--cluster", profile_file, "--set", "train.epochs=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id, run_dir = re.search(r"submitted (\S+) to .*run directory (\S+)", proc.stdout).groups()
    assert f"job {job_id} succeeded" in proc.stdout and "epoch 2/2" in proc.stdout

    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["epoch"] for r in rows] == [1, 2] and rows[-1]["world_size"] == 2
    nodes = {re.search(r"on node (\w+)", open(os.path.join(run_dir, "logs", f"rank-{r}.log")).read()).group(1)
             for r in (0, 1)}
    assert len(nodes) == 2  # one machine, one IP: the Ray node ids tell the nodes apart

    ray = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "job", "status", job_id,
                          "--address", profile.jobs_address], capture_output=True, text=True,
                         env=ray_cli_env(profile), timeout=60)
    said = re.sub(r"\x1b\[[0-9;]*m", "", ray.stdout + ray.stderr)
    assert ray.returncode == 0 and f"'{job_id}' succeeded" in said.lower()


def test_status_logs_and_stop_on_a_long_job(two_nodes):
    profile_file, profile = two_nodes
    proc = cli("submit", "examples/digits.yaml", "--cluster", profile_file, "--set", "train.epochs=500",
               "--no-wait")
    assert proc.returncode == 0, proc.stderr
    job_id = re.search(r"submitted (\S+)", proc.stdout).group(1)

    deadline = time.monotonic() + 120
    while not re.search(r"epoch +1/500", logs := cli("logs", job_id, "--cluster", profile_file).stdout):
        assert time.monotonic() < deadline, logs
        time.sleep(2)
    assert cli("status", job_id, "--cluster", profile_file).stdout.startswith(f"{job_id}: RUNNING")
    listed = cli("list", "--cluster", profile_file).stdout
    assert re.search(rf"{job_id}\s+RUNNING", listed)

    stopped = cli("stop", job_id, "--cluster", profile_file)
    assert stopped.returncode == 0 and stopped.stdout.strip() == f"{job_id}: STOPPED"
    assert "STOPPED" in cli("status", job_id, "--cluster", profile_file).stdout


def test_train_reuses_the_running_local_cluster(two_nodes, tmp_path):
    _, profile = two_nodes
    run_dir = tmp_path / "run"
    proc = cli("train", "examples/digits.yaml", "--set", "train.epochs=1", "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert f"using the running local cluster '{profile.name}'" in proc.stdout
    # The cluster's two 1-CPU nodes ran one rank each; an embedded cluster would have been one node.
    nodes = {re.search(r"on node (\w+)", (run_dir / "logs" / f"rank-{r}.log").read_text()).group(1) for r in (0, 1)}
    assert len(nodes) == 2
    assert len(Dashboard.for_profile(profile).alive_nodes()) == 2  # joined, not stopped

    # A job its 1-CPU nodes cannot hold (3 workers, a 2-CPU worker, a GPU) gets an embedded cluster instead.
    assert running_local_cluster(2, 1, 0).name == profile.name
    for workers, cpus, gpus in ((3, 1, 0), (1, 2, 0), (1, 1, 1)):
        assert running_local_cluster(workers, cpus, gpus) is None


def test_more_gpus_than_the_cluster_has_fails_within_seconds(two_nodes):
    profile_file, _ = two_nodes
    start = time.monotonic()
    proc = cli("submit", "examples/digits.yaml", "--cluster", profile_file, "--gpus-per-node", "4")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: not enough GPUs: the job needs 2 nodes with 4 GPUs")
    assert "the cluster has 2 nodes: 0 GPUs/1 CPUs, 0 GPUs/1 CPUs" in proc.stderr
    assert time.monotonic() - start < 15


def test_unwritable_storage_is_reported_before_submitting(two_nodes, tmp_path):
    _, profile = two_nodes
    bad = write_profile(tmp_path / "p.yaml", storage="/proc/raytrain-runs", local=vars(profile.local),
                        auth={"token_file": profile.auth.token_file})
    proc = cli("submit", "examples/digits.yaml", "--cluster", bad)
    assert proc.returncode == 2 and "storage /proc/raytrain-runs/digits-" in proc.stderr
    assert "is not writable" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_unknown_job_is_a_user_error(two_nodes):
    profile_file, _ = two_nodes
    proc = cli("status", "no-such-job", "--cluster", profile_file)
    assert proc.returncode == 2 and "no job 'no-such-job'" in proc.stderr


def test_unreachable_cluster_fails_within_its_timeout(tmp_path):
    # A listener that accepts connections and never answers: the request must time out, not hang.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    held = []
    threading.Thread(target=lambda: held.extend(server.accept() for _ in range(4)), daemon=True).start()
    profile = write_profile(tmp_path / "p.yaml", address=f"http://127.0.0.1:{port}", connect_timeout_s=2,
                            local={}, auth={})
    start = time.monotonic()
    proc = cli("submit", "examples/digits.yaml", "--cluster", profile)
    assert proc.returncode == 2
    assert f"cannot reach the Ray cluster at http://127.0.0.1:{port} within 2s" in proc.stderr
    assert time.monotonic() - start < 12
    server.close()


@pytest.mark.parametrize("fields, message", [
    ({"colour": "red"}, "unknown key 'colour'"),
    ({"nodes": 0}, "nodes must be >= 1"),
    ({"placement": "RANDOM"}, "placement must be one of PACK, SPREAD"),
    ({"address": "ftp://x"}, "address must be local or http://HOST:PORT"),
    ({"auth": {"token": "abc"}}, "never put a token in a profile"),
])
def test_bad_profiles_are_one_line_errors(tmp_path, fields, message):
    proc = cli("submit", "examples/digits.yaml", "--cluster", write_profile(tmp_path / "p.yaml", **fields),
               "--dry-run", timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_dry_run_shows_the_plan_and_masks_secrets(tmp_path):
    profile = write_profile(tmp_path / "p.yaml", nodes=2, gpus_per_node=4,
                            runtime_env={"env_vars": {"WANDB_API_KEY": "hunter2", "NCCL_DEBUG": "INFO"}})
    proc = cli("submit", "examples/digits.yaml", "--cluster", profile, "--dry-run", timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "8 = 2 nodes x 4 per node" in out and "1 CPU, 1 GPU" in out and "nccl, bf16" in out
    assert "SPREAD" in out and "train - --address auto" in out and str(tmp_path / "storage") in out
    assert "hunter2" not in out and '"WANDB_API_KEY": "****"' in out and '"NCCL_DEBUG": "INFO"' in out
    assert not os.path.exists(tmp_path / "storage")  # nothing submitted, nothing written
