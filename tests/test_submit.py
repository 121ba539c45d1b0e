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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
import yaml

from raytrain_app.cluster.dashboard import Dashboard
from raytrain_app.cluster.profiles import load_profile, user_runtime_dir
from raytrain_app.cluster.session import ClusterChoice, choose_cluster, free_port, running_local_cluster
from raytrain_app.data.parquet import DIGITS_FILE
from tests import runrecord
from tests.commands import command
from tests.conftest import REPO, TUTORIAL_SCRIPT, epoch_lines, running, short_temp_dir, sweep_table


def cli(*args, timeout=240, env=None):
    return command(args, REPO, env, timeout)


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
    up = cli("cluster", "up", profile_file)
    assert up.returncode == 0, up.stderr
    leaders = [int(pid) for pid in re.findall(r"node \d up \(\w+, pid (\d+)\)", up.stdout)]
    assert len(leaders) == 2 and f"cluster '{profile.name}' is up: 2 nodes" in up.stdout
    yield profile_file, profile

    started = session_processes(leaders)  # gcs, raylets, dashboard, workers, job drivers
    assert len(started) > 10
    # An unrelated process that even calls itself "raylet": `ray stop` would kill it by name.
    decoy = subprocess.Popen(["bash", "-c", "exec -a raylet sleep 600"], start_new_session=True)
    down = cli("cluster", "down", profile_file)
    assert down.returncode == 0 and down.stdout.strip() == f"cluster '{profile.name}' is down (2 nodes stopped)"
    assert running_local_cluster(1, 1, 0) is None  # no longer offered to `train`
    shutil.rmtree(profile.temp_dir, ignore_errors=True)
    assert not [pid for pid in started if running(pid)]  # all of them stopped...
    assert running(decoy.pid)  # ...and only they
    decoy.kill()
    decoy.wait()


def session_processes(leaders: list[int]) -> set[int]:
    """Every process in the sessions these leaders lead, and their descendants."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(stat.parent.name)] = (int(fields[1]), int(fields[3]))
    found = {pid for pid, (_, sid) in table.items() if sid in leaders}
    while more := {pid for pid, (ppid, _) in table.items() if ppid in found} - found:
        found |= more
    return found


def ray_cli_env(profile):
    return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": profile.token()}


def test_cluster_status_shows_both_nodes(two_nodes):
    profile_file, _ = two_nodes
    proc = cli("cluster", "status", profile_file)
    assert proc.returncode == 0, proc.stderr
    assert "2 nodes, 2/2 CPUs free, 0/0 GPUs free" in proc.stdout  # idle
    assert re.search(r"head +1/1 CPUs free", proc.stdout) and re.search(r"worker +1/1 CPUs free", proc.stdout)


def ray_cli(profile, *args):
    """Ray's own `ray job ...` command against the profile's cluster, with its token."""
    verb, *rest = args
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "job", verb,
                           "--address", profile.jobs_address, *rest], capture_output=True, text=True,
                          env=ray_cli_env(profile), timeout=60)
    return proc.returncode, re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)


WHERE_UNPACKED = """
import os
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ray.init()
cwd = ray.remote(num_cpus=0)(lambda: os.getcwd())
nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
unpacked = ray.get([cwd.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
                    for n in nodes])
print(f"{len(nodes)} nodes unpacked into {len(set(unpacked))} folders; the driver's is still", os.getcwd())
"""


def test_each_node_unpacks_a_jobs_working_dir_apart_so_the_driver_keeps_its_folder(two_nodes, tmp_path):
    """Nodes of a local cluster have a Ray temp dir each, as hosts do: when they shared one, the
    second node unpacked a job's working_dir over the first's copy, the folder the job's driver
    runs in, and a sweep's driver then failed reading files (os.getcwd: FileNotFoundError)."""
    _, profile = two_nodes
    (tmp_path / "where.py").write_text(WHERE_UNPACKED)
    code, said = ray_cli(profile, "submit", "--working-dir", str(tmp_path), "--", "python", "where.py")
    assert code == 0, said
    assert re.search(r"^2 nodes unpacked into 2 folders; the driver's is still /\S+/_ray_pkg_", said, re.M), said


# A long job that holds both nodes' CPUs, as a real one does, but sleeps through its steps (leaving
# the CPUs to the commands that watch it), with a checkpoint each epoch for its resume.
PACED = ["--set", "model={name: 'tests.helpers:paced', args: {seconds: 0.05}}", "--set", "checkpoint.every_epochs=1"]


def submit_long_job(profile_file) -> str:
    # The driver-side checks are other tests' subject; skipping them here saves a torch import per job.
    proc = cli("submit", "examples/digits.yaml", "--cluster", profile_file, "--set", "train.epochs=500", "--no-wait",
               "--skip-checks", *PACED)
    assert proc.returncode == 0, proc.stderr
    job_id = re.search(r"submitted (\S+)", proc.stdout).group(1)
    assert re.search(rf"^dashboard: http://127\.0\.0\.1:\d+/#/jobs/{job_id}$", proc.stdout, re.M)
    return job_id


def wait_for_log(job_id, profile_file, pattern) -> None:
    deadline = time.monotonic() + 120
    while not re.search(pattern, logs := cli("logs", job_id, "--cluster", profile_file).stdout, re.MULTILINE):
        assert time.monotonic() < deadline, logs
        time.sleep(2)


def test_status_logs_and_stop_on_a_long_job(two_nodes, tmp_path):
    profile_file, profile = two_nodes
    # A KubeRay RayCluster's dashboard is reached the same way: a kind: kuberay profile naming it.
    kuberay_file = tmp_path / "kuberay.yaml"
    kuberay_file.write_text(yaml.safe_dump({"kind": "kuberay", "address": profile.jobs_address,
                                            "auth": {"token_file": profile.auth.token_file}}))
    job_id = submit_long_job(profile_file)
    wait_for_log(job_id, profile_file, r"epoch +1/500")
    # While it runs, every view of it at once: Ray's own `ray job logs`, status, list, list --json, cluster status.
    with ThreadPoolExecutor(6) as pool:
        ray_logs = pool.submit(ray_cli, profile, "logs", job_id)
        status, listed, as_json, cluster, via_kuberay = pool.map(lambda args: cli(*args).stdout, [
            ("status", job_id, "--cluster", profile_file), ("list", "--cluster", profile_file),
            ("list", "--cluster", profile_file, "--status", "running", "--json"), ("cluster", "status", profile_file),
            ("status", job_id, "--cluster", str(kuberay_file))])
    code, said = ray_logs.result()
    assert code == 0 and re.search(r"epoch +1/500", said)
    assert status.startswith(f"{job_id}: RUNNING") and via_kuberay.startswith(f"{job_id}: RUNNING")
    assert listed.split()[:7] == ["ID", "NAME", "STATUS", "START", "DURATION", "WORKERS", "RUN"]
    assert re.search(rf"{job_id} +digits +RUNNING +\d{{4}}-\d\d-\d\d \d\d:\d\d +\d+m\d\ds +2x1 CPU +\S+/{job_id}",
                     listed)
    [row] = json.loads(as_json)
    assert row["id"] == job_id and row["user"] and len(row["config_sha256"]) == 12
    # the job's workers hold both nodes' CPUs
    assert "2 nodes, 0/2 CPUs free" in cluster and re.search(rf"^{job_id} +digits +RUNNING", cluster, re.M)
    assert running_local_cluster(1, 1, 0) is None  # `train` does not join a cluster that runs a job

    # One writer per run: `submit --resume` of a run that a job still trains is refused here, in one line.
    run_dir = f"{profile.storage}/{job_id}"
    refused = cli("submit", "examples/digits.yaml", "--cluster", profile_file, "--resume", run_dir, "--skip-checks")
    assert refused.returncode == 2 and re.fullmatch(
        rf"error: --resume: run dir {re.escape(run_dir)} is in use by pid \d+ on host \S+ \(train\) since \d\d:\d\d, "
        rf"job {job_id}; stop it first\n", refused.stderr), refused.stderr

    stopped = cli("stop", job_id, "--cluster", profile_file)
    assert stopped.returncode == 0 and stopped.stdout.strip() == f"{job_id}: STOPPED"
    assert "STOPPED" in cli("status", job_id, "--cluster", profile_file).stdout

    # Stopped, the run is continued by a new job from its latest checkpoint, two epochs further:
    # from that checkpoint's position (its checkpoint.json), printing only the epochs after it.
    done = [row["epoch"] for row in runrecord.metrics(run_dir)]
    latest, position = runrecord.latest(run_dir)
    resumed = cli("submit", "examples/digits.yaml", "--cluster", profile_file, "--resume", run_dir, "--skip-checks",
                  "--set", f"train.epochs={done[-1] + 2}", *PACED)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"run directory {run_dir}" in resumed.stdout
    restored, step = re.search(r"resumed from (\S+) at step (\d+):", resumed.stdout).groups()
    assert (os.path.basename(restored), int(step)) == (os.path.basename(latest), position["step"]), resumed.stdout
    printed = [int(re.match(r"epoch +(\d+)/", line).group(1)) for line in epoch_lines(resumed.stdout)]
    assert printed == list(range(position["epoch"] + 1, done[-1] + 3)), resumed.stdout
    epochs = [row["epoch"] for row in runrecord.metrics(run_dir)]
    assert epochs == list(range(1, done[-1] + 3)), epochs
    assert [json.loads(line)["kind"] for line in open(f"{run_dir}/restarts.jsonl")] == ["resume"]
    assert json.loads(open(f"{run_dir}/run.json").read())["status"] == "finished"


def test_train_reuses_the_running_local_cluster_where_hsdp_replicates_across_its_nodes(two_nodes, ray_cluster,
                                                                                       tmp_path):
    _, profile = two_nodes
    run_dir = tmp_path / "run"
    proc = cli("train", "examples/digits.yaml", "--set", "train.epochs=1", "--set", "strategy.name=hsdp",
               "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert f"using the running local cluster '{profile.name}'" in proc.stdout
    # The cluster's two 1-CPU nodes ran one rank each; an embedded cluster would have been one node.
    logs = [(run_dir / "logs" / f"rank-{r}.log").read_text() for r in (0, 1)]
    assert len({re.search(r"on node (\w+)", log).group(1) for log in logs}) == 2
    # HSDP's default mesh: one replica per node, each sharded over its node's one worker.
    assert all("sharded over mesh (2, 1)" in log for log in logs)
    assert len(Dashboard.for_profile(profile).alive_nodes()) == 2  # joined, not stopped

    # A job its 1-CPU nodes cannot hold (3 workers, a 2-CPU worker, a GPU) gets an embedded cluster instead,
    # and so does --address local, always.
    assert running_local_cluster(2, 1, 0).name == profile.name
    # The CLI joined with the token file's path, never the token, in its environment.
    assert profile.ray_auth_env() == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": profile.auth.token_file}
    # A library caller connected to Ray already (as this test process is) stays on its own cluster.
    assert choose_cluster(None, 2, 1, 0) == ClusterChoice(current=True)
    assert choose_cluster("local", 2, 1, 0) == ClusterChoice()  # address None: embedded
    assert choose_cluster("10.0.0.1:6379", 2, 1, 0) == ClusterChoice("10.0.0.1:6379")
    for workers, cpus, gpus in ((3, 1, 0), (1, 2, 0), (1, 1, 1)):
        assert running_local_cluster(workers, cpus, gpus) is None


def test_a_sweep_submitted_to_the_cluster_runs_its_trials_on_both_nodes_and_best_yaml_reproduces(two_nodes, s3,
                                                                                                 tmp_path):
    """`sweep --cluster`: the sweep's driver is a Ray job on the cluster; its two one-worker trials
    run at once, one on each 1-CPU node (a one-worker trial trains in its own actor, which holds
    the worker's CPU), and the sweep's directory is in the profile's storage, here a bucket."""
    _, profile = two_nodes
    profile_file = write_profile(tmp_path / "profile.yaml", local=vars(profile.local),
                                 auth={"token_file": profile.auth.token_file}, storage=f"s3://{s3.bucket}/sweeps",
                                 runtime_env={"env_vars": {name: f"${{{name}}}" for name in s3.env}})
    env = {**os.environ, **s3.env}
    proc = cli("sweep", "examples/digits.yaml", "--param", "optimizer.lr=grid:0.1,0.03", "--samples", "1",
               "--workers", "1", "--set", "train.epochs=1", "--cluster", profile_file, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id, sweep_dir = re.search(r"submitted (\S+) to http\S+ \(a sweep\); run directory (\S+)", proc.stdout).groups()
    assert sweep_dir == f"s3://{s3.bucket}/sweeps/{job_id}"
    assert f"sweep {sweep_dir}: 1 samples of optimizer.lr=grid:0.1,0.03; asha on eval_accuracy (max); " \
           "2 trials at once" in proc.stdout and f"job {job_id} succeeded" in proc.stdout
    rows = sweep_table(proc.stdout)
    assert len(rows) == 2 and {row[-1] for row in rows.values()} == {"finished"}, proc.stdout

    def stored(key: str) -> str:
        return s3.client().get_object(Bucket=s3.bucket, Key=f"sweeps/{job_id}/{key}")["Body"].read().decode()

    nodes = {re.search(r"on node (\w+)", stored(f"{name}/logs/rank-0.log")).group(1) for name in rows}
    assert len(nodes) == 2  # the trials ran side by side, on the cluster's two nodes
    assert json.loads(stored("sweep.json"))["params"] == ["optimizer.lr=grid:0.1,0.03"]
    listed = cli("list", "--cluster", profile_file, env=env).stdout
    assert re.search(rf"^{job_id} +digits \(sweep\) +SUCCEEDED .* {sweep_dir}$", listed, re.M), listed
    # `--resume` sends the same driver with the sweep's directory, and writes nothing into it.
    resumed = cli("sweep", "--resume", sweep_dir, "--cluster", profile_file, "--dry-run", env=env)
    assert resumed.returncode == 0 and re.search(rf"entrypoint +python -m raytrain_app.cli.job_entry sweep --resume "
                                                 rf"{sweep_dir} --address auto$", resumed.stdout, re.M)

    # The best row is the best any trial's metrics.jsonl holds (read from the bucket), best first.
    best_of = {name: max(json.loads(line)["eval_accuracy"] for line in stored(f"{name}/metrics.jsonl").splitlines())
               for name in rows}
    assert [float(row[1]) for row in rows.values()] == pytest.approx(sorted(best_of.values(), reverse=True),
                                                                     abs=5e-5)
    # best.yaml, trained again here (in local mode, as its trial trained: `train` joining a running
    # cluster is test_train_reuses_the_running_local_cluster's), scores what its trial did.
    best_name, best_row = next(iter(rows.items()))
    assert best_of[best_name] == max(best_of.values())
    assert f"best: {best_name}, eval_accuracy {float(best_row[1]):.4f}" in proc.stdout
    (tmp_path / "best.yaml").write_text(stored("best.yaml"))
    again = cli("train", str(tmp_path / "best.yaml"), "--local", "--run-dir", str(tmp_path / "again"))
    assert again.returncode == 0 and "local mode" in again.stdout.splitlines()[0], again.stdout + again.stderr
    assert re.search(rf"best eval_accuracy +{float(best_row[1]) * 100:.2f}% ", again.stdout), (best_row, again.stdout)


def test_the_dashboard_and_jobs_api_listen_on_loopback_only(two_nodes):
    _, profile = two_nodes
    port = profile.local.dashboard_port
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    others = [a for a in re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout) if not a.startswith("127.")]
    if not others:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must check the dashboard from a non-loopback address, and this machine has none")
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    for address in others:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address, port), timeout=5)


def test_the_token_file_is_private_and_the_jobs_api_needs_the_token(two_nodes):
    _, profile = two_nodes
    assert os.stat(os.path.expanduser(profile.auth.token_file)).st_mode & 0o777 == 0o600
    url = f"{profile.jobs_address}/api/jobs/"
    assert requests.get(url, headers=profile.auth_headers(), timeout=10).status_code == 200
    assert requests.get(url, timeout=10).status_code in (401, 403)
    assert requests.get(url, headers={"Authorization": "Bearer " + "0" * 64}, timeout=10).status_code in (401, 403)


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


def test_joining_a_cluster_without_its_token_is_one_line_within_seconds(two_nodes, tmp_path):
    """$RAY_ADDRESS names the cluster, as on its head node, and this shell lacks its token: Ray
    would try 20 times a second apart, a warning line on the console each time, and then name
    only the address."""
    _, profile = two_nodes
    address = f"127.0.0.1:{profile.ports()['port']}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(RAY_ADDRESS=address, RAYTRAIN_RUNNING_DIR=str(tmp_path / "no-local-clusters"))
    start = time.monotonic()
    proc = cli("train", "examples/digits.yaml", "--run-dir", str(tmp_path / "run"), env=env)
    assert proc.returncode == 2 and time.monotonic() - start < 15
    assert f"joining the cluster at $RAY_ADDRESS ({address})" in proc.stdout
    assert proc.stderr == (f"error: cannot join the Ray cluster at {address}: it asks for its auth token, which this "
                           "process lacks or has wrong: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH to the "
                           "token's file\n")
    assert "InvalidAuthToken" in (tmp_path / "run" / "logs" / "driver.log").read_text()  # Ray's own lines, kept


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
    assert f"cannot reach the Ray cluster at http://127.0.0.1:{port}: no answer within 2s" in proc.stderr
    assert time.monotonic() - start < 12
    server.close()
    # Nothing listening: refused at once, and said so (not "within 2s" after a fraction of a second).
    closed = free_port()
    profile = write_profile(tmp_path / "p.yaml", address=f"http://127.0.0.1:{closed}", connect_timeout_s=2,
                            local={}, auth={})
    proc = cli("submit", "examples/digits.yaml", "--cluster", profile)
    assert proc.returncode == 2 and f"at http://127.0.0.1:{closed}: connection refused" in proc.stderr, proc.stderr


@pytest.mark.parametrize("fields, message", [
    ({"colour": "red"}, "colour: unknown key"),
    ({"nodes": 0}, "nodes: must be >= 1"),
    ({"placement": "RANDOM"}, "placement: must be one of PACK, SPREAD"),
    ({"address": "ftp://x"}, "address: must be local or http://HOST:PORT"),
    ({"auth": {"token": "abc"}}, "never put a token in a profile"),
    # Ray's socket paths under it must fit in 107 bytes.
    ({"local": {"temp_dir": "/tmp/" + "x" * 35}}, "local.temp_dir: string should have at most 39 characters"),
    ({"name": "n" * 26, "local": {}}, f"local.temp_dir: the default {user_runtime_dir()}/{'n' * 26} is over 39 "
                                      "characters"),
])
def test_bad_profiles_are_one_line_errors(tmp_path, fields, message):
    proc = cli("submit", "examples/digits.yaml", "--cluster", write_profile(tmp_path / "p.yaml", **fields),
               "--dry-run", timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_dry_run_shows_the_plan_and_masks_secrets(tmp_path):
    profile = write_profile(tmp_path / "p.yaml", nodes=2, gpus_per_node=4,
                            runtime_env={"env_vars": {"WANDB_API_KEY": "hunter2", "MLFLOW_TRACKING_PASSWORD": "pw2",
                                                      "NCCL_DEBUG": "INFO"}})
    # Online W&B needs its key: the profile gives it to the job (this machine has none).
    proc = cli("submit", "examples/digits.yaml", "--cluster", profile, "--dry-run", "--set",
               "tracking.wandb={project: p}", timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "8 = 2 nodes x 4 per node" in out and "1 CPU, 1 GPU" in out and "nccl, bf16" in out
    assert "SPREAD" in out and "train - --address auto" in out and str(tmp_path / "storage") in out
    assert "hunter2" not in out and '"WANDB_API_KEY": "****"' in out and '"NCCL_DEBUG": "INFO"' in out
    assert "pw2" not in out and '"MLFLOW_TRACKING_PASSWORD": "****"' in out
    assert not os.path.exists(tmp_path / "storage")  # nothing submitted, nothing written

    unreachable = cli("submit", "examples/digits.yaml", "--cluster", profile, "--dry-run", "--set",
                      "tracking.mlflow={tracking_uri: 'http://127.0.0.1:9'}", timeout=60)
    assert unreachable.returncode == 2 and unreachable.stderr.strip() == \
        "error: tracking.mlflow.tracking_uri http://127.0.0.1:9 does not answer: ConnectionError"


PROJECT_MODELS = '''
import os

import ray
from torch import nn


def build(input_shape, num_classes, hidden: int = 16):
    # On every node (where Ray is up) this runs in the uploaded copy of the project: what
    # `excludes` names never arrives. `submit` also runs it here first, where the file exists.
    if ray.is_initialized() and os.path.exists("scratch/huge.bin"):
        raise RuntimeError("excluded file was uploaded")
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
'''

PROJECT_DATA = '''
import os

from raytrain_app.data.parquet import parquet


def build(path, eval_fraction, split_seed):
    if os.environ.get("RTPROJ_FAIL"):
        raise RuntimeError("asked to fail on the cluster")
    return parquet(path, eval_fraction, split_seed)
'''


@pytest.fixture
def project(tmp_path, two_nodes):
    """A user's project folder: their own model and data modules, a data file named by a relative
    path, a scratch folder that must not be uploaded, and a profile that ships the folder."""
    from tests.helpers import write_parquet

    _, profile = two_nodes
    root = tmp_path / "project"
    (root / "data").mkdir(parents=True)
    (root / "scratch").mkdir()
    (root / "rtproj_models.py").write_text(PROJECT_MODELS)
    (root / "rtproj_data.py").write_text(PROJECT_DATA)
    write_parquet(root / "data" / "table.parquet", n=120)
    (root / "scratch" / "huge.bin").write_bytes(os.urandom(3 << 20))
    (root / "job.yaml").write_text(yaml.safe_dump({
        "name": "project", "model": {"name": "rtproj_models:build", "args": {"hidden": 8}},
        "data": {"name": "rtproj_data:build", "args": {"path": "data/table.parquet"}},
        "train": {"epochs": 2, "batch_size": 16}}))
    return root, profile


def project_profile(root, profile, **fields):
    return write_profile(root / "profile.yaml", local=vars(profile.local), auth={"token_file": profile.auth.token_file},
                         **fields)


def test_submit_ships_the_users_code_to_both_nodes_with_storage_on_s3(project, s3, tmp_path):
    """The project's model module and its data file (read by the built-in parquet reader) travel
    to both nodes; the run is then evaluated from the project folder, after the job."""
    root, profile = project
    # Credentials reach the job through the profile, named, never written into it.
    profile_file = project_profile(root, profile, storage=f"s3://{s3.bucket}/submitted", runtime_env={
        "working_dir": ".", "excludes": ["scratch/"],
        "env_vars": {name: f"${{{name}}}" for name in s3.env}})
    (root / "shipped.yaml").write_text(yaml.safe_dump({
        "name": "project", "model": {"name": "rtproj_models:build", "args": {"hidden": 8}},
        "data": {"name": "parquet", "args": {"path": "data/table.parquet"}}, "train": {"epochs": 2, "batch_size": 16}}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, **s3.env}
    proc = command(["submit", str(root / "shipped.yaml"), "--cluster", profile_file], elsewhere, env, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    job_id, run_dir = re.search(r"submitted (\S+) to .*run directory (\S+)", proc.stdout).groups()
    assert run_dir == f"s3://{s3.bucket}/submitted/{job_id}" and f"job {job_id} succeeded" in proc.stdout
    assert re.search(rf"best checkpoint +{run_dir}/checkpoint_", proc.stdout)

    rows = [json.loads(line) for line in s3.client().get_object(
        Bucket=s3.bucket, Key=f"submitted/{job_id}/metrics.jsonl")["Body"].read().decode().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2] and rows[-1]["world_size"] == 2
    logs = [s3.client().get_object(Bucket=s3.bucket, Key=f"submitted/{job_id}/logs/rank-{r}.log")["Body"].read()
            .decode() for r in (0, 1)]
    assert len({re.search(r"on node (\w+)", log).group(1) for log in logs}) == 2  # a rank on each node
    assert "epoch 2/2" in proc.stdout  # --follow streamed the job's console, without Ray's job manager's lines
    assert "job_manager.py" not in proc.stdout and "Running entrypoint" not in proc.stdout, proc.stdout
    code, said = ray_cli(profile, "status", job_id)  # Ray's own command sees the same job
    assert code == 0 and f"'{job_id}' succeeded" in said.lower()

    # The run records its data path as written, which means the project folder: made absolute on
    # the cluster, it named the job's copy of the folder, which Ray deletes with its session.
    recorded = yaml.safe_load(s3.client().get_object(Bucket=s3.bucket, Key=f"submitted/{job_id}/config.yaml")["Body"]
                              .read())
    assert recorded["data"]["args"]["path"] == "data/table.parquet"
    scored = command(["evaluate", run_dir, "--local"], root, env)
    best = max(row["eval_accuracy"] for row in rows)
    assert scored.returncode == 0 and re.search(rf"^eval_accuracy +{best:.6f}$", scored.stdout, re.M), scored


def test_a_job_that_fails_on_the_cluster_fails_submit_with_its_one_line_error(project):
    root, profile = project
    profile_file = project_profile(root, profile, runtime_env={
        "working_dir": ".", "excludes": ["scratch/"], "env_vars": {"RTPROJ_FAIL": "1"}})
    proc = cli("submit", str(root / "job.yaml"), "--cluster", profile_file)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    job_id = re.search(r"submitted (\S+)", proc.stdout).group(1)
    assert ("error: data: 'rtproj_data:build' could not be built: RuntimeError: asked to fail on the cluster"
            in proc.stdout.splitlines())
    assert proc.stdout.splitlines()[-1] == f"job {job_id} failed" and "Traceback" not in proc.stdout
    code, said = ray_cli(profile, "status", job_id)
    assert code == 0 and "failed" in said.lower()


def test_submit_warns_when_a_module_would_not_be_shipped(project):
    root, profile = project
    profile_file = project_profile(root, profile)  # no working_dir: rtproj_models stays on this machine
    proc = command(["submit", "job.yaml", "--cluster", profile_file, "--dry-run"], root, timeout=60)
    assert proc.returncode == 0, proc.stderr
    warnings = proc.stderr.splitlines()
    assert len(warnings) == 2  # the model's module and the data's, one line each
    assert warnings[0] == (f"warning: model.name 'rtproj_models:build' imports rtproj_models from {root}, which the "
                           f"job does not upload: set runtime_env.working_dir in {profile_file} to a folder that "
                           f"holds it (or install it on the cluster)")
    shipped = project_profile(root, profile, runtime_env={"working_dir": "."})
    proc = command(["submit", "job.yaml", "--cluster", shipped, "--dry-run"], root, timeout=60)
    assert proc.returncode == 0 and proc.stderr == ""


def test_an_upload_too_large_is_one_line_before_submitting(project):
    root, profile = project
    profile_file = project_profile(root, profile, runtime_env={"working_dir": ".", "max_upload_mb": 1})
    jobs_before = cli("list", "--cluster", profile_file).stdout
    start = time.monotonic()
    proc = command(["submit", "job.yaml", "--cluster", profile_file], root, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (f"error: {profile_file}: runtime_env.working_dir {root} holds 3.0 MiB to upload, over "
                           f"runtime_env.max_upload_mb (1): add large files to runtime_env.excludes or a .rayignore\n")
    assert time.monotonic() - start < 15
    assert cli("list", "--cluster", profile_file).stdout == jobs_before  # nothing was submitted
    # The same folder with the scratch space excluded fits.
    (root / ".rayignore").write_text("scratch/\n")
    proc = command(["submit", "job.yaml", "--cluster", profile_file, "--dry-run"], root, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_a_submitted_script_runs_unchanged_on_both_nodes_as_under_torchrun(two_nodes, torchrun_reference, tmp_path):
    """No working_dir in the profile: the script's own folder travels with the job."""
    profile_file, _ = two_nodes
    reference_lines, reference_checkpoint = torchrun_reference
    checkpoint = tmp_path / "model.pt"  # both nodes share this machine's disk: rank 0 writes it here
    proc = cli("submit", TUTORIAL_SCRIPT, "--cluster", profile_file, "--", "--data", str(DIGITS_FILE),
               "--checkpoint", str(checkpoint))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert epoch_lines(proc.stdout) == reference_lines  # rank 0's lines, streamed by --follow
    run_dir = re.search(r"run directory (\S+)", proc.stdout).group(1)
    logs = [(Path(run_dir) / "logs" / f"rank-{r}.log").read_text() for r in (0, 1)]
    assert len({re.search(r"on node (\w+) ", log).group(1) for log in logs}) == 2  # a rank on each node
    ours, theirs = torch.load(checkpoint), torch.load(reference_checkpoint)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
