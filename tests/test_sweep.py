"""`raytrain-app sweep` on an embedded Ray cluster: four tiny trials of one worker each, one at a
time, under ASHA; Ctrl-C in the middle, `--resume`, and `best.yaml` (test_submit trains one again,
where a sweep runs on the 2-node cluster); and the one-line refusals."""

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import suppress

import psutil
import pytest
import yaml

from raytrain_app.api import job_config
from raytrain_app.driver import sweep as sweeps
from raytrain_app.driver import sweep_plan
from tests.commands import command
from tests.conftest import REPO, sweep_table
from tests.helpers import write_parquet

# One trial at a time, in an order Tune does not fix. ASHA judges epochs 1 and 2 of 3 against the
# median of the trials before. These rates' scores (lr 0.2: second best at epoch 1, worst at epoch
# 2) make it stop one of the first three trials in every order, so the sweep is still running
# when it has: checked over all 24 orders with the scores these trials reach.
LRS = "0.2,0.05,0.03,0.02"
# Without report.png and TensorBoard, which a trial would draw and write as any run does (tested
# there), and which take a trial here about as long as an epoch.
QUIET = ["--set", "tracking.report_png=false", "--set", "tracking.tensorboard=false"]
SWEEP = ["sweep", "examples/digits.yaml", "--param", f"optimizer.lr=grid:{LRS}", "--samples", "1", "--workers", "1",
         "--max-concurrent", "1", "--set", "train.epochs=3", "--set", "train.batch_size=64", *QUIET]


def session_processes(leader: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        with suppress(psutil.Error, OSError):  # a process that ended while listed
            if os.getsid(proc.pid) == leader:
                found.append(proc)
    return found


@pytest.mark.timeout(600)  # a sweep, interrupted, then resumed: 2 minutes alone, over 5 beside the suite on CI
@pytest.mark.usefixtures("ray_cluster")  # the library's sweep runs on it
def test_ctrl_c_stops_every_trial_resume_finishes_and_asha_stops_the_weak(tmp_path):
    sweep_dir = tmp_path / "sweep"
    # A real process in a session of its own, as a terminal runs it: Ctrl-C goes to its whole group.
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", *SWEEP, "--sweep-dir", str(sweep_dir)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # each line as it is said
    said, stopped, cut_at = [], None, None
    for line in proc.stdout:  # until ASHA has cut one of the first three trials (it always does)
        said.append(line)
        if cut := re.match(r"(trial-\d+) stopped early by asha after epoch ([12])$", line):
            stopped, cut_at = cut.group(1), int(cut.group(2))
            break
    order = [m.group(1) for line in said if (m := re.match(r"(trial-\d+) epoch \d+:", line))]
    assert stopped and len(set(order)) <= 3, said  # a trial is left to interrupt
    runs = [name for name, _ in itertools.groupby(order)]
    assert len(runs) == len(set(runs)), said  # --max-concurrent 1: one trial after another
    # Tune ends the stopped trial's actor, which gives back nothing: the sweep gives back its lease
    # once its process is gone, while the sweep goes on (its directory is free for `evaluate`).
    deadline = time.monotonic() + 10
    while (sweep_dir / stopped / "lease.json").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "".join(said)
        time.sleep(0.2)
    # Tune has ended the stopped trial once the next one holds its run directory's lease: Ctrl-C
    # while that one starts (its first epoch is seconds away, and ASHA could cut it there).
    deadline = time.monotonic() + 60
    while not [d for d in sweep_dir.glob("trial-*") if d.name not in order and (d / "lease.json").exists()]:
        assert time.monotonic() < deadline, "".join(said)
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, "".join(said) + out + err
    assert err.strip().splitlines()[-1] == f"interrupted: `raytrain-app sweep --resume {sweep_dir}` continues"
    before = {name: row[-1] for name, row in sweep_table(out).items()}
    assert len(before) == 4 and "stopped early" in before.values() and "interrupted" in before.values(), out
    deadline = time.monotonic() + 15
    while session_processes(proc.pid):  # every trial, worker, raylet and placement group with them
        assert time.monotonic() < deadline, [p.name() for p in session_processes(proc.pid)]
        time.sleep(0.5)
    assert json.load(open(sweep_dir / stopped / "run.json"))["status"] == "stopped early"  # for `runs`, too

    # The resume through the library, on the session's cluster (a sweep's own is tested above).
    said = []
    outcome = sweeps.run(sweep_plan.Sweep.load(str(sweep_dir)), str(sweep_dir), resume=True, echo=said.append)
    resumed = "\n".join(said)
    assert not outcome.interrupted and outcome.best_file, resumed
    # Sent to a cluster, whose job runs in its own working_dir, a relative SWEEP_DIR goes absolute.
    plan = command(["sweep", "--resume", "sweep", "--cluster", os.path.join(REPO, "cluster", "local-2node.yaml"),
                    "--dry-run"], tmp_path)
    entry = rf"^entrypoint +python -m raytrain_app.cli.job_entry sweep --resume {sweep_dir} "
    assert re.search(entry, plan.stdout, re.M), plan.stdout + plan.stderr
    rows = sweep_table(resumed)
    assert sorted(rows) == ["trial-00000", "trial-00001", "trial-00002", "trial-00003"]
    statuses = {name: row[-1] for name, row in rows.items()}
    assert statuses[stopped] == "stopped early" and "finished" in statuses.values(), resumed
    for name, status in statuses.items():  # after the resume ASHA may cut another: its record starts afresh
        epochs = [json.loads(line)["epoch"] for line in open(sweep_dir / name / "metrics.jsonl")]
        assert epochs == list(range(1, len(epochs) + 1))  # a resumed trial went on, and repeated no epoch
        assert status == ("finished" if len(epochs) == 3 else "stopped early")
        assert json.load(open(sweep_dir / name / "run.json"))["status"] == status
    # Tune stops a trial asynchronously: its workers may finish one more epoch before they are killed.
    assert cut_at <= len(open(sweep_dir / stopped / "metrics.jsonl").readlines()) < 3
    # The table is best first, its best is the best any trial's metrics.jsonl holds, and what ASHA
    # cut was weak at its rung: below another trial at that epoch.
    accuracy = {name: [json.loads(line)["eval_accuracy"] for line in open(sweep_dir / name / "metrics.jsonl")]
                for name in rows}
    shown = [float(row[1]) for row in rows.values()]
    assert shown == sorted(shown, reverse=True)
    assert shown[0] == pytest.approx(max(max(a) for a in accuracy.values()), abs=5e-5)  # the table's 4 decimals
    at_cut = {name: a[cut_at - 1] for name, a in accuracy.items() if len(a) >= cut_at and name != stopped}
    assert accuracy[stopped][cut_at - 1] < max(at_cut.values()), (accuracy, stopped, cut_at)
    best_name, best_row = next(iter(rows.items()))
    assert f"best: {best_name}, eval_accuracy {float(best_row[1]):.4f}" in resumed
    best = yaml.safe_load(open(sweep_dir / "best.yaml"))
    assert best["optimizer"]["lr"] == float(rows[best_name][0]) and best["checkpoint"]["metric"] == "eval_accuracy"
    assert best["optimizer"]["lr"] in (0.05, 0.03, 0.02)


def leases(sweep_dir) -> list[str]:
    return sorted(str(path.relative_to(sweep_dir)) for path in sweep_dir.glob("**/lease.json"))


def test_sigterm_stops_a_sweep_as_ctrl_c_does_and_its_trials_give_back_their_leases(tmp_path):
    """A scheduler's stop, SIGTERM to the sweep's driver (`kill`, a pod's end), ends it as Ctrl-C
    does: Tune's stop, Ctrl-C's line and exit code, no process left. Its trial, two workers
    under Ray Train, whose actor Tune kills at the sweep's end, leaves its run directory free:
    `--resume` and `evaluate` are not told it is in use."""
    sweep_dir = tmp_path / "sweep"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", "sweep", "examples/digits.yaml", "--param",
                             "optimizer.lr=grid:0.05", "--samples", "1", "--workers", "2", "--scheduler", "fifo",
                             "--set", "train.epochs=30", *QUIET, "--sweep-dir", str(sweep_dir)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=env)
    said = []
    for line in proc.stdout:
        said.append(line)
        if re.match(r"trial-\d+ epoch 1:", line):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    console = "".join(said) + out + err
    assert proc.returncode == 130, console
    assert err.strip().splitlines()[-1] == f"interrupted: `raytrain-app sweep --resume {sweep_dir}` continues"
    assert "Traceback" not in console and "SIGTERM received" not in console and "*** " not in console, console
    assert [row[-1] for row in sweep_table(out).values()] == ["interrupted"], out
    deadline = time.monotonic() + 15
    while session_processes(proc.pid):
        assert time.monotonic() < deadline, [p.name() for p in session_processes(proc.pid)]
        time.sleep(0.5)
    assert leases(sweep_dir) == []

    # A resumed one whose stop cannot end: its embedded cluster's GCS hangs (SIGSTOP), as when a
    # scheduler's SIGTERM took it down with the driver (Ray's driver would wait a minute on it
    # and abort: exit 134, a crash dump). The driver gives up after STOP_S, with the same line.
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", "sweep", "--resume", str(sweep_dir)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    said = []
    for line in proc.stdout:
        said.append(line)
        if re.match(r"trial-\d+ epoch \d+:", line):
            break
    [gcs] = [p for p in psutil.Process(proc.pid).children() if p.name() == "gcs_server"]
    gcs.suspend()
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(said) + out + err
    assert err == f"interrupted: `raytrain-app sweep --resume {sweep_dir}` continues\n", err
    assert sweeps.STOP_S <= time.monotonic() - signalled < sweeps.STOP_S + 15
    deadline = time.monotonic() + 15
    while session_processes(proc.pid):  # the hung GCS too
        assert time.monotonic() < deadline, [p.name() for p in session_processes(proc.pid)]
        time.sleep(0.5)
    assert leases(sweep_dir) == []


@pytest.mark.timeout(900)  # a minute alone; several under CI's load, beside another module's cluster
def test_a_sweeps_relative_data_paths_mean_the_launch_directory_in_every_trial(tmp_path):
    """A job file naming its Parquet files relative to where the sweep is launched, as `train`
    reads them: a one-worker trial (local mode, in Tune's actor) and a two-worker one (Ray Train)
    read them there, not in Tune's trial folder."""
    (tmp_path / "data").mkdir()
    write_parquet(tmp_path / "data" / "train.parquet", n=400, seed=1)
    write_parquet(tmp_path / "data" / "eval.parquet", n=50, seed=2)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "name": "relative", "model": {"name": "mlp", "args": {"hidden": [16]}},
        "data": {"name": "parquet", "args": {"path": "data/train.parquet", "eval_path": "data/eval.parquet"}},
        "train": {"epochs": 1, "batch_size": 16}, "tracking": {"tensorboard": False, "report_png": False}}))
    proc = command(["sweep", "job.yaml", "--param", "scaling.workers=grid:1,2", "--samples", "1", "--max-concurrent",
                    "1", "--scheduler", "fifo", "--sweep-dir", "sweep"], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = sweep_table(proc.stdout)
    assert sorted(row[0] for row in rows.values()) == ["1", "2"] and {row[-1] for row in rows.values()} == {
        "finished"}, proc.stdout
    for name in rows:
        args = yaml.safe_load(open(tmp_path / "sweep" / name / "config.yaml"))["data"]["args"]
        assert (args["path"], args["eval_path"]) == (str(tmp_path / "data" / "train.parquet"),
                                                     str(tmp_path / "data" / "eval.parquet"))


@pytest.mark.parametrize("args, message", [
    (["--param", "optimizer.lr=lognormal:1:2"], "unknown distribution 'lognormal' (choose from choice, grid, "
                                               "loguniform, randint, uniform)"),
    (["--param", "optimizer.lr=loguniform:0:1"], "loguniform needs LOW:HIGH with LOW < HIGH and LOW > 0"),
    (["--param", "train.batch_size=randint:64:8"], "randint needs LOW:HIGH with LOW < HIGH (integers)"),
    (["--param", "optimizer.lr=choice:"], "choice needs values, e.g. choice:32,64,128"),
    (["--param", "optimizer.lrr=choice:0.1,0.2"], "--param optimizer.lrr=choice:0.1,0.2: optimizer.lrr: unknown key "
                                                 "(did you mean 'optimizer.lr'?)"),
    (["--param", "train.batch_size=choice:big,64"], "train.batch_size: must be an integer, got 'big'"),
    (["--param", "model.args.depth=choice:1,2"], "model.args.depth: unknown argument"),
    (["--param", "optimizer.lr=choice:0.1", "--samples", "0"], "--samples must be >= 1, got 0"),
    (["--param", "optimizer.lr=choice:0.1", "--metric", "eval_f1"],
     "--metric eval_f1 is not a metric of this job "
     "(choose from train_loss, eval_loss, eval_accuracy)"),
    ([], "a sweep needs at least one --param KEY=KIND:ARGS"),
    (["--param", "optimizer.lr=choice:0.1", "--cluster", "cluster/local.yaml", "--address", "local"],
     "--cluster submits the sweep to the profile's cluster, --address (and --min-nodes) run it from here: give one"),
    (["--param", "optimizer.lr=choice:0.1", "--nodes", "2"], "--nodes is for a sweep submitted with --cluster PROFILE"),
    (["--param", "optimizer.lr=choice:0.1", "--workers", "4", "--cluster", "cluster/local.yaml"],
     "a trial's 4 workers do not fit on 1 nodes of 2 workers each (--nodes, --workers)"),
    (["--resume", "sweeps/x"], "give CONFIG to start a sweep, or --resume SWEEP_DIR to continue one (not both)"),
])
def test_a_sweep_it_cannot_run_is_one_line_before_ray_starts(tmp_path, args, message):
    ray_tmp = tmp_path / "ray"
    ray_tmp.mkdir()
    proc = command(["sweep", "examples/digits.yaml", "--sweep-dir", str(tmp_path / "sweep"), *args], REPO,
                   {**os.environ, "RAY_TMPDIR": str(ray_tmp)}, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "sweep").exists() and not os.listdir(ray_tmp)


def test_max_concurrent_defaults_to_the_trials_the_cluster_holds():
    from raytrain_app.config import JobConfig
    from raytrain_app.driver.sweep_plan import trials_that_fit

    cpu = JobConfig.from_dict({"scaling": {"workers": 2, "cpus_per_worker": 2}})
    assert trials_that_fit(cpu, cpus=15, gpus=0) == 3  # 4 CPUs each: a trial's function takes none
    assert trials_that_fit(cpu, cpus=2, gpus=0) == 1  # one, which the worker check then refuses in one line
    gpu = JobConfig.from_dict({"scaling": {"workers": 2, "gpus_per_worker": 1}})
    assert trials_that_fit(gpu, cpus=8, gpus=8) == 4  # GPUs decide, not CPUs


def table_of(stdout: str) -> dict[str, list[str]]:
    """The sweep table's rows by trial: the four settings, best, epochs, status (which may hold spaces)."""
    lines = stdout[stdout.index("TRIAL "):].splitlines()[1:]
    return {line.split()[0]: line.split(None, 7)[1:] for line in lines if line.startswith("trial-")}


PARAMS = ["--param", "optimizer.lr=loguniform:0.01:0.2", "--param", "optimizer.momentum=uniform:0.5:0.9",
          "--param", "model.args.hidden=choice:[16],[32]", "--param", "train.batch_size=randint:30:70"]


@pytest.mark.usefixtures("ray_cluster")  # the library's sweep runs on it
def test_sampled_settings_fifo_and_a_minimised_metric_and_the_same_draws_where_every_trial_fails(tmp_path):
    """Two samples of every distribution, run to the end (fifo), ranked by eval_loss (lower first);
    then the same command, its model made to crash: the same seed draws the same settings, and a
    sweep whose every trial failed exits 1."""
    common = ["sweep", "examples/digits.yaml", *PARAMS, "--samples", "2", "--workers", "1", "--max-concurrent", "1",
              "--scheduler", "fifo", "--metric", "eval_loss", *QUIET, "--set", "train.epochs=1",
              "--set", "model.name=mlp"]
    # Through the library on the session's cluster; then the same sweep's command (its own cluster).
    said = []
    _, config = job_config(os.path.join(REPO, "examples", "digits.yaml"),
                           ["scaling.workers=1", "train.epochs=1", "model.name=mlp", *QUIET[1::2]])
    plan = sweep_plan.plan_for(config, PARAMS[1::2], 2, "fifo", "eval_loss", None, 1)
    sweeps.run(plan, str(tmp_path / "ran"), echo=said.append)
    ran = "\n".join(said)
    rows = table_of(ran)
    assert len(rows) == 2 and {row[-1] for row in rows.values()} == {"finished"}
    # One-worker trials train in local mode (no Ray Train workers): the launcher's logs are there.
    assert all((tmp_path / "ran" / name / "logs" / "local").is_dir() for name in rows), ran
    for name, row in rows.items():
        settings = yaml.safe_load(open(tmp_path / "ran" / name / "config.yaml"))
        lr, momentum = settings["optimizer"]["lr"], settings["optimizer"]["momentum"]
        hidden, batch = settings["model"]["args"]["hidden"], settings["train"]["batch_size"]
        assert 0.01 <= lr <= 0.2 and 0.5 <= momentum <= 0.9 and hidden in ([16], [32]), settings
        assert isinstance(batch, int) and 30 <= batch < 70, settings  # randint: HIGH excluded
        assert float(row[0]) == pytest.approx(lr, rel=1e-3) and int(row[3]) == batch
        loss = json.loads(open(tmp_path / "ran" / name / "metrics.jsonl").readline())["eval_loss"]
        assert float(row[4]) == pytest.approx(loss, abs=5e-5)  # BEST eval_loss: the trial's one epoch
    losses = [float(row[4]) for row in rows.values()]
    assert losses == sorted(losses)  # --mode follows the metric: lower is better, best first
    assert yaml.safe_load(open(tmp_path / "ran" / "best.yaml"))["checkpoint"] == {
        "every_epochs": 4, "every_steps": 0, "keep": 2, "metric": "eval_loss", "mode": "min", "async": False}
    listed = command(["runs", str(tmp_path / "ran"), "--json"], REPO)
    assert sorted((r["name"], r["status"]) for r in json.loads(listed.stdout)) == sorted(
        (name, "finished") for name in rows)

    crash = ["--set", f"model.args={{marker: {tmp_path / 'fault'}, at: 1, fault: crash}}",
             "--set", "model.name=tests.helpers:faulty_mlp"]
    (tmp_path / "fault").touch()
    # --sweep-dir relative, as typed at a prompt (Tune takes only absolute paths).
    failed = command([*common[:-2], *crash, "--sweep-dir", os.path.relpath(tmp_path / "failed", REPO)], REPO,
                     timeout=300)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert (tmp_path / "failed" / "sweep.json").exists()
    again = table_of(failed.stdout)
    assert {name: row[:4] for name, row in again.items()} == {name: row[:4] for name, row in rows.items()}
    assert all(row[-1].startswith("failed") for row in again.values())
    assert failed.stderr.startswith("training failed: every trial failed; trial-") and "injected crash" in failed.stderr


def test_planning_a_sweep_imports_no_tune():
    """A sweep it cannot run is one line before Tune is even imported, and one sent to a cluster
    runs Tune there only: planning, with the job's checks, imports no Ray at all."""
    code = ("import sys\n"
            "from raytrain_app.api import job_config\n"
            "from raytrain_app.driver.sweep_plan import plan_for\n"
            "_, config = job_config('examples/digits.yaml', [])\n"
            "plan_for(config, ['optimizer.lr=loguniform:1e-3:1e-1'], 2, 'asha', None, None, None)\n"
            "print(sorted(name for name in sys.modules if name == 'ray' or name.startswith('ray.')))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "[]\n", proc.stdout + proc.stderr
