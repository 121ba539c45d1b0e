"""Local mode (Ray Train's `num_workers=0`, with torch's launcher for more than one worker)
against the same job on the real Ray cluster: bitwise the same weights, a killed worker process
restarted and resumed bitwise, runs that one mode starts and the other resumes, Ctrl-C and a
scheduler's SIGTERM, and what local mode refuses."""

import collections
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress

import pytest
import torch

from raytrain_app.api import fit, job_config
from raytrain_app.config import dump_yaml
from raytrain_app.config.resolve import resolve_auto
from raytrain_app.driver.plan import make_plan
from raytrain_app.driver.trainer import run_training
from raytrain_app.errors import TrainingFailed, UserError
from raytrain_app.worker import checkpoint
from tests.checkpoint_files import check_opens
from tests.commands import command as run_command
from tests.conftest import REPO, running
from tests.helpers import write_parquet
from tests.test_distributed import final_weights, job
from tests.test_reliability import faulty, step_checkpointed
from tests.test_shutdown import descendants
from tests.test_submit import write_profile

NUMBERS = ("epoch", "step", "train_loss", "eval_loss", "eval_accuracy", "eval_samples", "world_size", "lr")


def trained(config, run_dir, local: bool, resume=False, lines=None):
    return run_training(make_plan(config, run_dir=str(run_dir), resume=resume, local=local),
                        echo=(lines if lines is not None else []).append)


def same_run(a, b) -> None:
    """Bitwise the same weights, and the same numbers in every epoch's row."""
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [{k: r[k] for k in NUMBERS} for r in a.metrics] == [{k: r[k] for k in NUMBERS} for r in b.metrics]


@pytest.mark.parametrize("workers", [1, 2])
def test_local_mode_trains_bitwise_what_ray_train_trains(ray_cluster, tmp_path, workers):
    """On Ray because Ray is the reference: the same job, seed and CPU threads under both."""
    config = job(data={"name": "digits"}, scaling={"workers": workers}, checkpoint={"every_steps": 7, "keep": 2})
    local, on_ray = trained(config, tmp_path / "local", True), trained(config, tmp_path / "ray", False)
    same_run(local, on_ray)
    # The same checkpoints kept by the same rule: the best two by the metric and the latest, named alike.
    names = [sorted(p.name for p in (tmp_path / mode).glob("checkpoint_*") if p.is_dir()) for mode in ("local", "ray")]
    kept = [[r["metrics"]["step"] for r in json.loads((tmp_path / mode / "checkpoint_manager_snapshot.json")
                                                      .read_text())["checkpoint_results"]] for mode in ("local", "ray")]
    assert kept[0] == kept[1] and len(names[0]) == len(names[1]) == len(kept[0]) >= 2
    # A local run leaves no thread behind in the driver's process (a notebook runs many).
    assert not [thread for thread in threading.enumerate() if thread.name == "driver-inbox"]


@pytest.mark.slow
def test_a_killed_worker_process_restarts_the_group_and_resumes_bitwise(tmp_path):
    """Local mode's own restart path (a fresh launch from the latest checkpoint): no Ray here."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    straight = trained(step_checkpointed(tmp_path / "never", "kill"), tmp_path / "straight", True)
    marker = tmp_path / "fault"
    marker.touch()
    lines = []
    killed = trained(step_checkpointed(marker, "kill"), tmp_path / "killed", True, lines=lines)
    assert not marker.exists()  # the fault really happened
    [notice] = [line for line in lines if line.startswith("warning:")]
    assert re.fullmatch(r"warning: rank 1 on node \S+ \(pid \d+\): worker process died: killed by SIGKILL; "
                        rf"restarting from {tmp_path}/killed/checkpoint_\S+ \(restart 1 of 1\)", notice), lines
    log = (tmp_path / "killed" / "logs" / "rank-1.log").read_text()
    resumed = re.search(r"resumed from \S+ at step (\d+): epoch (\d+) from batch (\d+)", log)
    assert resumed, log
    step, epoch, batch = map(int, resumed.groups())
    assert epoch == 2 and step == 35 and batch == 12  # the newest step checkpoint before call 40, mid-epoch
    same_run(straight, killed)
    restarts = [json.loads(line) for line in (tmp_path / "killed" / "restarts.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in restarts] == ["restart"] and "killed by SIGKILL" in restarts[0]["reason"]
    # torch's launcher leaves its own signal handlers: this process's (a notebook's Ctrl-C) are back.
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers


def test_a_run_started_in_one_mode_resumes_bitwise_in_the_other(ray_cluster, tmp_path):
    """On Ray because the join is with Ray Train's own index of checkpoints, which each mode keeps
    for the other. One run, three attempts: it crashes in epoch 2 under local mode, `--resume`s
    under Ray and crashes again in epoch 3, then `--resume`s under local mode and finishes."""
    config = faulty(tmp_path / "fault", 35, "crash", checkpoint={"every_steps": 5},
                    train={"epochs": 3, "batch_size": 32})
    straight = trained(config, tmp_path / "straight", True)  # no fault file yet: it never faults
    run_dir = tmp_path / "run"
    (tmp_path / "fault").touch()  # each attempt's rank 1 crashes on its 35th training batch
    with pytest.raises(TrainingFailed, match=r"^rank 1\b.*: RuntimeError: injected crash$"):
        trained(config, run_dir, True)
    with pytest.raises(TrainingFailed, match=r"^rank 1\b.*: RuntimeError: injected crash$"):
        trained(config, run_dir, False, resume=True)
    (tmp_path / "fault").unlink()
    resumed = trained(config, run_dir, True, resume=True)
    # Each resume continued inside an epoch from the other mode's newest checkpoint (23 steps an
    # epoch; the crashes are at steps 35 and about 60): not a fresh start, which would end bitwise
    # the same too.
    logs = (run_dir / "logs" / "rank-0.log").read_text().split("rank 0/2 on node")
    at = [re.search(r"resumed from \S+/checkpoint_\S+ at step (\d+): epoch (\d+) from batch (\d+)", log)
          for log in logs[2:]]
    assert len(at) == 2 and all(at), logs
    (step_ray, epoch_ray, batch_ray), (step_local, epoch_local, batch_local) = (map(int, a.groups()) for a in at)
    assert step_ray in (25, 30) and (epoch_ray, batch_ray) == (2, step_ray - 23), logs
    assert 46 < step_local < step_ray + 35 and (epoch_local, batch_local) == (3, step_local - 46), logs
    same_run(straight, resumed)


@pytest.mark.slow
def test_ctrl_c_and_sigterm_stop_every_worker_process_and_leave_whole_checkpoints(tmp_path):
    for sig in (signal.SIGINT, signal.SIGTERM):  # a terminal's Ctrl-C; a scheduler's stop
        run_dir = tmp_path / sig.name
        proc = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", "train", "examples/digits.yaml", "--local",
                                 "--run-dir", str(run_dir), "--set", "train.epochs=500",
                                 "--set", "checkpoint.every_epochs=1", "--set", "checkpoint.every_steps=3"],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        for line in proc.stdout:
            if re.match(r"epoch +1/500", line):
                break
        started = descendants(proc.pid)
        assert len(started) >= 2  # the two worker processes
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # the terminal signals the whole foreground process group
        else:
            os.kill(proc.pid, sig)  # a scheduler signals the job's process
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        sets = ["train.epochs=500", "checkpoint.every_epochs=1", "checkpoint.every_steps=3", "scaling.local=True"]
        resume = f"raytrain-app train examples/digits.yaml --resume --run-dir {run_dir}" + "".join(
            f" --set {s}" for s in sets)
        assert err.strip().splitlines() == [f"interrupted: `{resume}` continues it"], err  # and no launcher chatter
        # It resumes the run as it was configured, not as the file alone says (12 epochs: over at once).
        _, again = job_config("examples/digits.yaml", shlex.split(resume)[7::2])
        assert dump_yaml(resolve_auto(again)) == (run_dir / "config.yaml").read_text()
        deadline = time.monotonic() + 30
        while [p for p in started if running(p)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in started if running(p)]
        assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"
        assert not list(run_dir.rglob("*.tmp"))
        kept = sorted(d for d in run_dir.glob("checkpoint_*") if d.is_dir())
        assert kept and all(checkpoint.verify(str(d), r) is None for d in kept for r in (0, 1))
        for d in kept:  # and whole as a user opens them, into a LeNet of their own
            check_opens(d, ranks=(0, 1))


def test_a_driver_killed_outright_leaves_no_worker_process_behind(tmp_path):
    """SIGKILL (the OOM killer's) on the driver while rank 1 sleeps in a stalled step and rank 0
    waits for it in the all-reduce: neither would notice (rank 0 waits on a live peer for
    scaling.timeout_s), and each is a session of its own, out of the driver's process group's
    reach. Both end with the driver, and their fork server with them (found left over, 576 MB,
    after a sweep's Ctrl-C had ended a trial whose rank had just finished)."""
    import psutil

    marker = tmp_path / "stall"
    marker.touch()
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", "train", "examples/digits.yaml", "--local",
                             "--run-dir", str(tmp_path / "run"), "--set", "model.name=tests.helpers:faulty_mlp",
                             "--set", f"model.args={{marker: '{marker}', at: 3, rank: 1, fault: stall}}"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    ranks, server = [], None
    try:
        deadline = time.monotonic() + 60
        while marker.exists():  # rank 1 takes it as it stalls
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.2)
        [server] = [p for p in psutil.Process(proc.pid).children() if "forkserver" in " ".join(p.cmdline())]
        ranks = server.children()
        assert len(ranks) == 2 and all(os.getsid(p.pid) == p.pid for p in ranks), ranks
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        _, left = psutil.wait_procs([*ranks, server], timeout=15)
        assert not left, left
    finally:
        for p in [*ranks, *([server] if server else [])]:  # what a failed assertion would leave: ours, by pid
            with suppress(psutil.Error):
                p.kill()
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_sigusr1_checkpoints_mid_epoch_and_stops_and_resume_trains_every_sample_once(tmp_path):
    """SIGUSR1, as SLURM sends it before a time limit (`--signal=B:USR1@N`) to a job that trains
    on its one node in local mode: both worker processes checkpoint at the same step inside the
    epoch and stop (exit 75, status stopped); `--resume` continues from that step, and each
    recorded sample is trained once per epoch over both runs."""
    seen, hold, run_dir = tmp_path / "seen", tmp_path / "hold", tmp_path / "run"
    seen.mkdir()
    hold.touch()  # the first run trains slowly, so that the signal finds it inside an epoch
    epochs, size = 2, 400
    command = [sys.executable, "-m", "raytrain_app.cli", "train", "examples/digits.yaml", "--local",
               "--run-dir", str(run_dir), "--set", f"train.epochs={epochs}", "--set", "checkpoint.every_epochs=100",
               "--set", f"data={{name: 'tests.helpers:index_data', args: {{train_size: {size}, eval_size: 5}}}}",
               "--set", f"model={{name: 'tests.helpers:recorder', args: {{out_dir: '{seen}', per_process: true, "
                        f"hold: '{hold}'}}}}",
               "--set", "train.batch_size=4", "--set", "tracking.report_png=false"]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len((seen / "dropout-0.txt").read_text().splitlines() if (seen / "dropout-0.txt").exists() else []) < 10:
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGUSR1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, out + err
    stopped = re.search(r"stopped on SIGUSR1 at step (\d+) \(epoch (\d+), batch (\d+)\)", err)
    assert stopped, out + err
    step, epoch, batch = map(int, stopped.groups())
    assert (epoch, 0 < batch < size // 8) == (1, True)  # inside the first epoch (50 steps of 2 x 4)
    assert json.loads((run_dir / "run.json").read_text())["status"] == "stopped"
    hold.unlink()
    resumed = subprocess.run([*command, "--resume"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"epoch 1 from batch {batch}" in resumed.stdout + resumed.stderr, resumed.stdout + resumed.stderr
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
    # The first run trained exactly up to its checkpoint, each rank one batch a step.
    starts = sorted(seen.glob("rank-0-*.txt"), key=lambda p: p.stat().st_mtime)
    assert len(starts) == 2 and len(starts[0].read_text().splitlines()) == step
    counts = collections.Counter(int(i) for path in seen.glob("rank-*-*.txt")
                                 for line in path.read_text().splitlines() for i in line.split())
    assert set(counts) == set(range(size)) and set(counts.values()) == {epochs}


def test_what_local_mode_cannot_do_is_one_line_and_auto_picks_ray_for_it(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    write_parquet(tmp_path / "rows.parquet", n=64)
    write_parquet(tmp_path / "eval.parquet", n=16)
    files = {"path": str(tmp_path / "rows.parquet"), "eval_path": str(tmp_path / "eval.parquet")}
    ray_data = job(data={"name": "parquet", "engine": "ray_data", "args": files})
    refusals = {
        "data.engine ray_data needs a Ray cluster": (ray_data, {}),
        "--address and --min-nodes join a Ray cluster": (job(), dict(address="127.0.0.1:1")),
        "gpus_per_worker 0.5: local mode gives each worker one whole GPU or none": (job(), dict(gpus_per_worker=0.5)),
    }
    for reason, (config, given) in refusals.items():
        start = time.monotonic()
        with pytest.raises(UserError) as refused:
            fit(config, local=True, run_dir=str(tmp_path / "never"), **given)
        assert str(refused.value) == f"--local (scaling.local: true): {reason}; drop --local, or what needs Ray"
        assert time.monotonic() - start < 5
    assert not (tmp_path / "never").exists()
    for command, message in ((["sweep", "--param", "optimizer.lr=choice:0.1,0.2"], "a sweep's trials run under Ray "
                              "Tune, on Ray"),
                             (["submit", "--cluster", write_profile(tmp_path / "p.yaml"), "--dry-run"],
                              "a submitted job trains on the cluster's Ray")):
        proc = run_command([command[0], "examples/digits.yaml", *command[1:], "--set", "scaling.local=true"], REPO)
        assert proc.returncode == 2 and proc.stderr.startswith(f"error: scaling.local: true: {message}; drop ") \
            and len(proc.stderr.splitlines()) == 1, proc.stderr

    from raytrain_app.driver.local import choose

    assert choose(job(), None, 1, ray_connected=False)
    assert not choose(job(), "auto", 1, ray_connected=False)
    assert not choose(job(), None, 1, ray_connected=True)  # a notebook's ray.init(): train there
    assert not choose(ray_data, None, 1, ray_connected=False)
    assert not choose(job(scaling={"local": False}), None, 1, ray_connected=False)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # inside a Ray job, or on a cluster's head
    assert not choose(job(), None, 1, ray_connected=False)

    # Where local mode is not chosen for it, $RAY_ADDRESS's cluster is joined, as a plain ray.init() joins it;
    # a URL there names no cluster to train on (a dashboard's for `ray job submit`, Ray Client's).
    from raytrain_app.cluster import session

    monkeypatch.setattr(session, "ray_connected", lambda: False)  # as in a fresh `train`, whatever this process joined
    assert session.choose_cluster(None, 2, 1, 0).address == "127.0.0.1:6379"
    assert session.choose_cluster("local", 2, 1, 0).address is None
    for url in ("http://127.0.0.1:8265", "ray://127.0.0.1:10001"):
        monkeypatch.setenv("RAY_ADDRESS", url)
        assert choose(job(), None, 1, ray_connected=False) and session.choose_cluster(None, 2, 1, 0).address is None


@pytest.mark.slow
def test_smoke_runs_every_path_of_one_short_epoch_and_runs_shows_it(tmp_path):
    """`train --smoke`: a few batches of one epoch, a step checkpoint and the epoch's, evaluation,
    report.png, no tracker; `runs` marks it. `submit --smoke` runs it first, and a smoke run
    that fails sends nothing."""
    digits = f"{REPO}/examples/digits.yaml"
    proc = run_command(["train", digits, "--smoke", "--set", "train.eval_batch_size=64"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    [run_dir] = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("digits-smoke-")
    [row] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert row["epoch"] == 1 and row["step"] == 3  # 3 batches of the 23 an epoch has per worker
    assert row["eval_samples"] == 2 * 2 * 64  # 2 of each worker's 3 eval batches
    index = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    assert [r["metrics"]["step"] for r in index["checkpoint_results"]] == [2, 3]  # mid-epoch at step 2, then the end
    assert (run_dir / "report.png").exists() and not (run_dir / "tensorboard").exists()
    listed = run_command(["runs"], tmp_path)
    assert re.search(rf"^{run_dir.name} .* finished \(smoke\)$", listed.stdout, re.M), listed.stdout

    profile = write_profile(tmp_path / "p.yaml")
    sent = run_command(["submit", digits, "--cluster", profile, "--smoke", "--dry-run"], tmp_path, timeout=120)
    assert sent.returncode == 0, sent.stderr
    tried = re.search(r"^smoke run passed \((\S+)\): submitting$", sent.stdout, re.M)
    assert tried and not tried[1].startswith(str(tmp_path))  # not into the working_dir the job ships
    assert json.loads(open(f"{tried[1]}/metrics.jsonl").readline())["step"] == 3
    assert "train - --address auto" in sent.stdout  # then the plan, as --dry-run shows it
    broken = run_command(["submit", digits, "--cluster", profile, "--smoke", "--dry-run",
                          "--set", "train.batch_size=100000"], tmp_path, timeout=120)
    assert broken.returncode != 0 and "smoke run passed" not in broken.stdout and "entrypoint" not in broken.stdout
