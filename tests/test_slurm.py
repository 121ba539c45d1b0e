"""`submit`, `status`, `logs`, `stop` and `list` against a real SLURM (munged, slurmctld and slurmd on
loopback, see slurmcluster.py): each job starts its own Ray inside its allocation.

Without SLURM's packages (or root) the module skips with the reason, except in CI (CI=true),
where that fails: `.ci/run` installs them.
"""

import collections
import json
import os
import re
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from tests import slurmcluster
from tests.commands import command
from tests.conftest import REPO, sweep_table


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = slurmcluster.missing()
    if reason and os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the SLURM tests: {reason}")  # a skip there would hide a broken feature
    if reason:
        pytest.skip(reason)
    cluster, daemons = slurmcluster.start(tmp_path_factory.mktemp("slurm"))
    yield cluster
    slurmcluster.stop(cluster, daemons)


@pytest.fixture(scope="module")
def profile(slurm, tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "slurm.yaml"
    path.write_text(yaml.safe_dump({
        "name": "test-slurm", "kind": "slurm", "nodes": 1, "cpus_per_node": 1,
        "storage": str(path.parent / "runs"),
        # The job's shell finds this Python, with raytrain_app and Ray, as a user's venv activation would.
        "slurm": {"setup": [f"export PATH={os.path.dirname(sys.executable)}:$PATH"], "time_limit": "10:00",
                  "node_wait_s": 120},
    }))
    return str(path)


def cli(slurm, *args, timeout=240):
    return command(args, REPO, slurm.env, timeout)


def submitted_id(stdout: str) -> str:
    return re.search(r"submitted SLURM job (\d+)", stdout).group(1)


def ray_processes_of(job_id: str) -> list[psutil.Process]:
    """Processes of that job's Ray: they all carry its temp dir, /tmp/rt-JOBID, on their command line."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(f"/rt-{job_id}/" in arg or arg.endswith(f"/rt-{job_id}") for arg in proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def test_two_jobs_share_a_node_and_status_logs_stop_and_list_show_slurms_view(slurm, profile):
    """A long training job and a short sweep run at once on the one node (1 CPU each), each with its
    own Ray (ports, temp dir, token); the sweep's trial trains to the end, the long job is stopped.
    The long job's model sleeps through most of each step, leaving the CPUs to the rest."""
    long = cli(slurm, "submit", "examples/digits.yaml", "--cluster", profile, "--name", "long", "--no-wait",
               "--set", "train.epochs=100000", "--set", "model={name: 'tests.helpers:paced'}")
    assert long.returncode == 0, long.stderr
    long_id = submitted_id(long.stdout)
    long_run = re.search(r"run directory (\S+)", long.stdout).group(1)
    assert slurm.run("squeue", "--noheader", "--format=%j", "--jobs", long_id).strip() == os.path.basename(long_run)

    # A sweep whose driver runs in the allocation: its trial and the trial's worker share the job's one CPU.
    short = cli(slurm, "sweep", "examples/digits.yaml", "--param", "optimizer.lr=grid:0.1", "--samples", "1",
                "--workers", "1", "--set", "train.epochs=2", "--cluster", profile)
    assert short.returncode == 0, short.stdout + short.stderr
    short_id = submitted_id(short.stdout)
    [(trial, row)] = sweep_table(short.stdout).items()
    assert row[-2:] == ["2", "finished"] and f"job {short_id} completed" in short.stdout, short.stdout
    assert "Ray runtime started" not in short.stdout  # Ray's own output goes to its own file
    run_dir = re.search(r"run directory (\S+)", short.stdout).group(1)
    assert [line["epoch"] for line in map(yaml.safe_load, open(f"{run_dir}/{trial}/metrics.jsonl"))] == [1, 2]
    script = open(f"{run_dir}/job.sbatch").read()
    assert "#SBATCH --time=10:00" in script and "--requeue" not in script  # a sweep's trials are not stopped
    assert f"sweep --resume {run_dir} --address auto --min-nodes $SLURM_JOB_NUM_NODES" in script
    assert subprocess.run(["bash", "-n", f"{run_dir}/job.sbatch"]).returncode == 0
    assert f"--run-dir {long_run} --resume-if-any" in open(f"{long_run}/job.sbatch").read()

    # The long job's Ray lived beside the short job's: SLURM still runs it, on the same node.
    status = cli(slurm, "status", long_id, "--cluster", profile)
    assert status.returncode == 0 and status.stdout.strip() == f"{long_id}: RUNNING"
    assert slurm.run("squeue", "--noheader", "--format=%T", "--jobs", long_id).strip() == "RUNNING"
    deadline = time.monotonic() + 60
    while not re.search(r"epoch +1/100000 ", logs := cli(slurm, "logs", long_id, "--cluster", profile).stdout):
        assert time.monotonic() < deadline, logs
        time.sleep(2)
    assert re.search(r"raytrain: Ray head at [\d.]+:(\d+)", logs)
    ports = {re.search(r"Ray head at [\d.]+:(\d+)", cli(slurm, "logs", j, "--cluster", profile).stdout).group(1)
             for j in (long_id, short_id)}
    assert len(ports) == 2  # each job's own GCS port
    # Every port a job's Ray is given lies in a block of 200 from its GCS port (client, dashboard,
    # agent, workers): the two blocks do not meet, and the running job listens only in its own.
    low, high = sorted(map(int, ports))
    assert high - low >= 200
    head = int(re.search(r"Ray head at [\d.]+:(\d+)", logs).group(1))  # the running job's
    block = range(head, head + 200)
    fixed = {c.laddr.port for p in ray_processes_of(long_id) for c in p.net_connections("tcp")
             if c.status == psutil.CONN_LISTEN and c.laddr.port in range(low, high + 200)}
    assert fixed and fixed <= set(block), (fixed, block)

    listed = cli(slurm, "list", "--cluster", profile, "--json")
    rows = {row["id"]: row for row in yaml.safe_load(listed.stdout)}
    assert rows[short_id]["status"] == "COMPLETED" and rows[short_id]["run_dir"] == run_dir
    assert rows[long_id]["status"] == "RUNNING" and rows[long_id]["name"].startswith("long-")
    running = cli(slurm, "list", "--cluster", profile, "--status", "running", "--json")
    assert [row["id"] for row in yaml.safe_load(running.stdout)] == [long_id]

    assert ray_processes_of(long_id)
    stop = cli(slurm, "stop", long_id, "--cluster", profile)
    assert stop.returncode == 0 and stop.stdout.strip() == f"{long_id}: CANCELLED", stop.stderr
    assert cli(slurm, "status", long_id, "--cluster", profile).stdout.strip() == f"{long_id}: CANCELLED"
    assert slurm.run("squeue", "--noheader", "--states=all", "--format=%T", "--jobs", long_id).strip() == "CANCELLED"
    deadline = time.monotonic() + 30
    while ray_processes_of(long_id):  # SLURM ends every step of the job, and Ray's processes with them
        assert time.monotonic() < deadline, [p.info["cmdline"][:2] for p in ray_processes_of(long_id)]
        time.sleep(1)
    assert not ray_processes_of(short_id)
    assert not os.path.exists(f"/tmp/rt-{short_id}") and not os.path.exists(f"/tmp/rt-{long_id}")  # temp dirs gone
    # scancel's SIGTERM reached the job's driver too: its output, whole up to SLURM's line on the
    # cancel, has no stack dump from Ray's handler.
    stopped = cli(slurm, "logs", long_id, "--cluster", profile)
    assert stopped.returncode == 0 and stopped.stdout.startswith(logs), stopped
    assert re.search(rf"^\S+: error: \*\*\* JOB {long_id} ON \S+ CANCELLED AT ", stopped.stdout, re.M), stopped.stdout
    assert "SIGTERM received" not in stopped.stdout, stopped.stdout


def test_a_partition_slurm_does_not_know_is_one_line_before_submitting(slurm, profile, tmp_path):
    fields = yaml.safe_load(open(profile))
    fields["slurm"]["partition"] = "gpu-a100"
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(fields))
    proc = cli(slurm, "submit", "examples/digits.yaml", "--cluster", str(tmp_path / "p.yaml"))
    assert proc.returncode == 2
    assert proc.stderr == (f"error: SLURM has no partition 'gpu-a100' ({tmp_path / 'p.yaml'}: slurm.partition; "
                           f"sinfo lists: {slurmcluster.PARTITION}*)\n")


def test_more_gpus_or_cpus_than_the_partitions_nodes_have_is_one_line(slurm, profile):
    gpus = cli(slurm, "submit", "examples/digits.yaml", "--cluster", profile, "--gpus-per-node", "4")
    assert gpus.returncode == 2
    assert gpus.stderr == (f"error: SLURM partition '{slurmcluster.PARTITION}' has at most 0 GPUs per node, and "
                           "the job asks for 4 (--gpus-per-node)\n")
    cpus = cli(slurm, "submit", "examples/digits.yaml", "--cluster", profile, "--cpus-per-node", "64")
    assert cpus.returncode == 2 and "has at most 2 CPUs per node, and the job asks for 64" in cpus.stderr
    nodes = cli(slurm, "submit", "examples/digits.yaml", "--cluster", profile, "--nodes", "5")
    assert nodes.returncode == 2 and nodes.stderr == (f"error: SLURM partition '{slurmcluster.PARTITION}' has 1 "
                                                      "nodes, and the job asks for 5 (--nodes)\n")
    assert not slurm.run("squeue", "--noheader", "--states=PENDING")  # nothing was queued
    status = cli(slurm, "cluster", "status", profile)
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[:2] == [f"SLURM partition '{slurmcluster.PARTITION}': 1 nodes",
                                              f"  node {slurmcluster.NODE:<12} idle    2 CPUs  0 GPUs"]


def test_following_a_job_that_fails_exits_1(slurm, profile):
    """A job whose model exists only in a typo (checks skipped here, as for code only the cluster
    has): SLURM calls it FAILED, and `submit --follow` says so and exits 1."""
    proc = cli(slurm, "submit", "examples/digits.yaml", "--cluster", profile, "--skip-checks",
               "--set", "model.name=nomodule:build")
    job_id = submitted_id(proc.stdout)
    assert proc.returncode == 1 and proc.stdout.rstrip().endswith(f"job {job_id} failed"), proc.stdout + proc.stderr
    assert "error: -: model.name: cannot import 'nomodule'" in proc.stdout  # the job's own line, followed
    assert cli(slurm, "status", job_id, "--cluster", profile).stdout.strip() == f"{job_id}: FAILED (NonZeroExitCode)"


def test_unknown_jobs_and_ids_are_one_line(slurm, profile):
    unknown = cli(slurm, "status", "987654", "--cluster", profile)
    assert (unknown.returncode, unknown.stderr) == (2, "error: SLURM knows no job 987654 (squeue and sacct)\n")
    wrong = cli(slurm, "logs", "digits-1", "--cluster", profile)
    assert wrong.returncode == 2 and "is not a SLURM job id" in wrong.stderr


def test_a_machine_without_slurm_is_told_so(tmp_path):
    """No SLURM here: what a laptop without SLURM's commands sees."""
    (tmp_path / "slurm.yaml").write_text(yaml.safe_dump({"kind": "slurm", "storage": str(tmp_path)}))
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}
    proc = command(["submit", "examples/digits.yaml", "--cluster", str(tmp_path / "slurm.yaml")], REPO, env, 60)
    assert proc.returncode == 2
    assert proc.stderr == ("error: kind: slurm needs SLURM's commands on this machine, and sbatch, squeue, sinfo, "
                           "scancel are not on PATH (run from a login node)\n")


def test_the_rendered_script_for_two_gpu_nodes_asks_slurm_for_them_and_starts_ray_on_both(tmp_path):
    """`slurm render` for the shipped profile at 2 nodes x 4 GPUs: what SLURM and Ray are told."""
    proc = command(["slurm", "render", "examples/digits.yaml", "--cluster", "cluster/slurm.yaml", "--nodes", "2",
                    "--gpus-per-node", "4", "--skip-checks"], REPO, None, 60)
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout
    (tmp_path / "job.sbatch").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0
    sbatch = [line.split(" ", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert sbatch[:4] == ["--job-name=" + re.search(r"--job-name=(\S+)", script).group(1), "--nodes=2",
                          "--ntasks-per-node=1", "--cpus-per-task=32"]
    assert {"--gpus-per-node=4", "--partition=gpu", "--account=my-lab", "--time=24:00:00", "--exclusive",
            "--output=/shared/raytrain/runs/slurm-logs/raytrain-%j.out", "--signal=B:USR1@120",
            "--requeue"} <= set(sbatch)
    assert "module load cuda/12.4\nsource /shared/envs/raytrain/bin/activate\n" in script
    assert "export NCCL_SOCKET_IFNAME=ib0\nexport GLOO_SOCKET_IFNAME=ib0\n" in script
    assert '--node-ip-address="$(ip -o -4 addr show dev ib0' in script and "--num-gpus=4" in script
    assert re.search(r'srun --nodes="\$others" --ntasks="\$others" --exclude="\$head" \\\n    bash -c .ray_node '
                     r'--address=', script)
    config = yaml.safe_load(script.split("<<'RAYTRAIN_JOB_CONFIG'\n")[1].split("\nRAYTRAIN_JOB_CONFIG\n")[0])
    assert (config["scaling"]["workers"], config["scaling"]["backend"]) == (8, "nccl")
    entrypoint = next(line for line in script.splitlines() if line.startswith("printenv RAYTRAIN_JOB_CONFIG"))
    assert entrypoint.startswith("printenv RAYTRAIN_JOB_CONFIG | python -m raytrain_app.cli.job_entry train - "
                                 "--address auto --min-nodes $SLURM_JOB_NUM_NODES --node-timeout 900 ")
    assert entrypoint.endswith(" &")
    # A range of nodes: SLURM starts the job on as many as it has, up to the max; the workers are a
    # range (elastic), and the job waits for every node of the allocation it got.
    ranged = command(["slurm", "render", "examples/digits.yaml", "--cluster", "cluster/slurm.yaml", "--nodes", "2:4",
                      "--gpus-per-node", "4", "--skip-checks", "--set", "scaling.on_resize=scale_lr"], REPO, None, 60)
    assert ranged.returncode == 0, ranged.stderr
    assert "#SBATCH --nodes=2-4\n" in ranged.stdout
    config = yaml.safe_load(ranged.stdout.split("<<'RAYTRAIN_JOB_CONFIG'\n")[1].split("\nRAYTRAIN_JOB_CONFIG\n")[0])
    assert config["scaling"]["workers"] == {"min": 8, "max": 16}


def test_sigusr1_checkpoints_mid_epoch_requeues_the_job_and_its_next_start_trains_every_sample_once(
        slurm, profile, tmp_path):
    """`scancel --signal=USR1 --batch`, as SLURM's `--signal=B:USR1@N` sends it before a time
    limit or a preemption: the driver checkpoints at the loop's next check and stops (exit 75), the
    job requeues itself, and its second start (same id) takes the run's lease back and resumes
    from that step, inside the epoch; its epochs go on, none repeated, and each recorded sample is
    trained once per epoch over both starts."""
    seen, hold = tmp_path / "seen", tmp_path / "hold"
    seen.mkdir()
    hold.touch()  # the first start trains slowly, so that the signal finds it training
    epochs, size = 3, 1000
    job = cli(slurm, "submit", "examples/digits.yaml", "--cluster", profile, "--name", "requeued", "--no-wait",
              "--set", f"train.epochs={epochs}", "--set", "checkpoint.every_epochs=100",
              "--set", f"data={{name: 'tests.helpers:index_data', args: {{train_size: {size}, eval_size: 5}}}}",
              "--set", f"model={{name: 'tests.helpers:recorder', args: {{out_dir: '{seen}', per_process: true, "
                     f"hold: '{hold}'}}}}",
              "--set", "train.batch_size=4")
    assert job.returncode == 0, job.stderr
    job_id = submitted_id(job.stdout)
    run_dir = re.search(r"run directory (\S+)", job.stdout).group(1)
    deadline = time.monotonic() + 120
    while not os.path.exists(f"{run_dir}/metrics.jsonl") or not open(f"{run_dir}/metrics.jsonl").read():
        assert time.monotonic() < deadline, cli(slurm, "logs", job_id, "--cluster", profile).stdout  # epoch 1 done
        time.sleep(0.5)
    slurm.run("scancel", "--signal=USR1", "--batch", job_id)
    while "stopped" not in open(f"{run_dir}/run.json").read():
        assert time.monotonic() < deadline, cli(slurm, "logs", job_id, "--cluster", profile).stdout
        time.sleep(0.5)
    hold.unlink()
    deadline = time.monotonic() + 180
    while (state := slurm.run("squeue", "--noheader", "--states=all", "--format=%T %r", "--jobs", job_id).strip()) \
            != "COMPLETED None":
        assert time.monotonic() < deadline, slurm.run("squeue", "--states=all", "--jobs", job_id)
        if state == "PENDING BeginTime":  # requeued: skip SLURM's usual wait before it may start again
            slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        time.sleep(1)
    rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    assert [row["epoch"] for row in rows] == list(range(1, epochs + 1))
    status = cli(slurm, "status", job_id, "--cluster", profile)
    assert status.returncode == 0 and "COMPLETED, requeued 1x" in status.stdout, status.stdout + status.stderr
    restarts = [json.loads(line) for line in open(f"{run_dir}/restarts.jsonl")]
    assert [r["kind"] for r in restarts] == ["resume"]  # the second start continued the run
    logs = cli(slurm, "logs", job_id, "--cluster", profile).stdout
    stopped = re.search(r"stopped on SIGUSR1 at step (\d+) \(epoch (\d+), batch (\d+)\)", logs)
    assert stopped and "requeueing job" in logs, logs
    step, epoch, batch = map(int, stopped.groups())
    resumed = re.search(r"resumed from \S+ at step (\d+): epoch (\d+) from batch (\d+)", logs)
    assert resumed and tuple(map(int, resumed.groups())) == (step, epoch, batch), logs
    assert epoch >= 2  # past the first epoch; inside one unless the check fell on an epoch's last step
    # One output file holds both starts: the first one's epoch 1 is still there, before the resume.
    first = re.search(rf"^epoch +1/{epochs} ", logs, re.M)
    assert first and first.start() < resumed.start(), logs
    # The first start trained exactly up to its checkpoint (one batch a step), the second the rest.
    starts = sorted(seen.glob("rank-0-*.txt"), key=lambda p: p.stat().st_mtime)
    lines = [path.read_text().splitlines() for path in starts]
    assert len(lines) == 2 and len(lines[0]) == step, (len(lines[0]), step)
    counts = collections.Counter(int(i) for part in lines for line in part for i in line.split())
    assert set(counts) == set(range(size)) and set(counts.values()) == {epochs}, collections.Counter(counts.values())
    assert ray_processes_of(job_id) == []  # neither start left its Ray behind
    assert json.loads(open(f"{run_dir}/run.json").read())["status"] == "finished"
    assert not os.path.exists(f"{run_dir}/lease.json")
