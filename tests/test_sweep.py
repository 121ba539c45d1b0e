"""`raytrain-app sweep` on an embedded Ray cluster: four tiny trials of one worker each, two at a
time, under ASHA; Ctrl-C in the middle, `--resume`, and `best.yaml` trained again."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from tests.commands import command
from tests.conftest import REPO

# Two good learning rates, then two that leave the model at chance, one trial at a time (so in
# this order): at ASHA's first rung (epoch 1 of 2) the third falls below the first two's median.
LRS = "0.03,0.02,1e-05,1e-06"
SWEEP = ["sweep", "examples/digits.yaml", "--param", f"optimizer.lr=grid:{LRS}", "--samples", "1", "--workers", "1",
         "--max-concurrent", "1", "--set", "train.epochs=2", "--set", "train.batch_size=64"]


def session_processes(leader: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == leader:
                found.append(proc)
        except (psutil.Error, OSError):
            pass
    return found


def table_rows(stdout: str) -> dict[str, list[str]]:
    lines = stdout[stdout.index("TRIAL "):].splitlines()[1:]
    return {line.split()[0]: line.split(None, 4)[1:] for line in lines if line.startswith("trial-")}


def test_ctrl_c_stops_every_trial_resume_finishes_asha_stops_the_weak_and_best_yaml_reproduces(tmp_path):
    sweep_dir = tmp_path / "sweep"
    # A real process in a session of its own, as a terminal runs it: Ctrl-C goes to its whole group.
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", *SWEEP, "--sweep-dir", str(sweep_dir)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # each line as it is said
    said = []
    for line in proc.stdout:  # until ASHA has cut a trial: two trials ended, the one it cut at epoch 1
        said.append(line)
        if re.match(r"trial-\d+ stopped early by asha after epoch 1$", line):
            break
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, "".join(said) + out + err
    assert err.strip().splitlines()[-1] == f"interrupted: `raytrain-app sweep --resume {sweep_dir}` continues"
    before = table_rows(out)
    assert before["trial-00002"][-1] == "stopped early" and len(before) < 4 or "interrupted" in str(before), out
    deadline = time.monotonic() + 15
    while session_processes(proc.pid):  # every trial, worker, raylet and placement group with them
        assert time.monotonic() < deadline, [p.name() for p in session_processes(proc.pid)]
        time.sleep(0.5)
    stopped = re.match(r"(trial-\d+) stopped", said[-1]).group(1)
    assert json.load(open(sweep_dir / stopped / "run.json"))["status"] == "stopped early"  # for `runs`, too

    resumed = command(["sweep", "--resume", str(sweep_dir)], REPO, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    rows = table_rows(resumed.stdout)
    assert sorted(rows) == ["trial-00000", "trial-00001", "trial-00002", "trial-00003"]
    statuses = {name: row[-1] for name, row in rows.items()}
    assert statuses[stopped] == "stopped early" and "finished" in statuses.values(), resumed.stdout
    for name, status in statuses.items():
        epochs = [json.loads(line)["epoch"] for line in open(sweep_dir / name / "metrics.jsonl")]
        assert epochs == ([1, 2] if status == "finished" else [1])  # resumed trials went on, not over
        assert json.load(open(sweep_dir / name / "run.json"))["status"] == status
    # The table is best first; best.yaml is that trial's config, and training it again gives its score.
    best_name, best_row = next(iter(rows.items()))
    best_value = float(best_row[1])
    assert f"best: {best_name}, eval_accuracy {best_value:.4f}" in resumed.stdout
    best = yaml.safe_load(open(sweep_dir / "best.yaml"))
    assert best["optimizer"]["lr"] in (0.03, 0.02) and best["checkpoint"]["metric"] == "eval_accuracy"
    again = command(["train", str(sweep_dir / "best.yaml"), "--run-dir", str(tmp_path / "again")], REPO, timeout=180)
    assert again.returncode == 0, again.stderr
    assert re.search(rf"best eval_accuracy +{best_value:.4f} ", again.stdout), (best_value, again.stdout)


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
    (["--param", "optimizer.lr=choice:0.1", "--metric", "eval_f1"], "--metric eval_f1 is not a metric of this job "
                                                                    "(choose from train_loss, eval_loss, eval_accuracy)"),
    ([], "a sweep needs at least one --param KEY=KIND:ARGS"),
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
    from raytrain_app.sweep import trials_that_fit

    cpu = JobConfig.from_dict({"scaling": {"workers": 2, "cpus_per_worker": 2}})
    assert trials_that_fit(cpu, cpus=16, gpus=0) == 3  # 4 CPUs of workers and a driver's 0.01 each
    assert trials_that_fit(cpu, cpus=2, gpus=0) == 1  # one, which the worker check then refuses in one line
    gpu = JobConfig.from_dict({"scaling": {"workers": 2, "gpus_per_worker": 1}})
    assert trials_that_fit(gpu, cpus=8, gpus=8) == 4  # GPUs decide, not CPUs
