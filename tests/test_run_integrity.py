"""One writer per run directory, and nothing lost on a full disk or a wrong resume.

Real processes on one run directory (the lease), a real S3-compatible server (its conditional
writes), a real tmpfs that fills up at a checkpoint, and LR curves read off the scheduler.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import raytrain_app
from raytrain_app import rundir
from raytrain_app.config import load_config
from raytrain_app.config.sections import ScheduleConfig
from raytrain_app.driver.plan import make_plan
from raytrain_app.errors import UserError
from raytrain_app.rundir import lease, snapshot
from raytrain_app.rundir.lease import Holder, Lease
from raytrain_app.worker.optim import build_schedule, extend_schedule
from tests.commands import command
from tests.conftest import REPO, short_temp_dir

DIGITS = f"{REPO}/examples/digits.yaml"
QUIET = {"echo": lambda line: None, "local": True}  # the loop is under test, not Ray


def files_of(run_dir: Path) -> dict[str, str]:
    """Every file of a run directory and its SHA-256: what a refused command must not change."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_second_train_on_a_run_dir_in_use_is_refused_and_the_first_run_is_untouched(tmp_path):
    """Refused while the first run starts (held in its checks, which build its data with the lease
    held: tests/held.py) and while it trains; the refused commands start and write nothing."""
    run_dir, hold = tmp_path / "run", tmp_path / "hold"
    hold.touch()
    first: dict = {}
    training = threading.Thread(target=lambda: first.update(result=raytrain_app.fit(
        DIGITS, run_dir=str(run_dir), overrides=["train.epochs=30", "checkpoint.every_epochs=1",
                                                 "data.name=tests.held:digits", f"data.args={{hold: '{hold}'}}"],
        **QUIET)))
    training.start()
    refused = []
    try:
        deadline = time.monotonic() + 60
        while not Path(f"{hold}.waiting").exists():
            assert time.monotonic() < deadline and training.is_alive(), "the first run never reached its checks"
            time.sleep(0.05)
        refused.append(command(["train", DIGITS, "--run-dir", str(run_dir)], tmp_path))  # during start-up
        # The first run was still starting: its checks not passed, nothing of it in the directory but its
        # lease (and, were it renewed just then, the lease's next version, staged under a name of its own).
        assert [name for name in os.listdir(run_dir) if not name.startswith(lease.LEASE)] == []
        assert training.is_alive()
    finally:
        hold.unlink()
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text():
        assert time.monotonic() < deadline and training.is_alive(), "the first run trained no epoch"
        time.sleep(0.1)
    refused.append(command(["train", DIGITS, "--run-dir", str(run_dir)], tmp_path))  # once it trains
    assert training.is_alive(), "the first run ended before the second command was tried"
    training.join(timeout=240)
    holder = f"pid {os.getpid()} on host {socket.gethostname()} (train) since "
    for proc in refused:
        assert proc.returncode == 2 and proc.stdout == "", proc  # not a line of a run of its own
        [line] = proc.stderr.splitlines()
        assert line.startswith(f"error: run dir {run_dir} is in use by {holder}"), line
        assert line.endswith("if that process is gone, --resume takes over after 60 s"), line
    result = first["result"]
    assert [row["epoch"] for row in result.metrics] == list(range(1, 31))  # no epoch rewritten, none lost
    assert json.loads((run_dir / "run.json").read_text())["pid"] == os.getpid()
    assert (run_dir / "logs" / "rank-0.log").read_text().count("rank 0/2 on node") == 1  # no other workers started
    assert not (run_dir / lease.LEASE).exists()  # given back at the end
    assert not (run_dir / "restarts.jsonl").exists()  # nobody resumed it


def test_epochs_a_killed_driver_did_not_record_come_back_from_the_checkpoint_on_resume(tmp_path):
    """The driver writes metrics.jsonl as each epoch's row reaches it, after the epoch's checkpoint:
    one killed in between (SIGKILL, the OOM killer) left checkpoints of epochs that the file
    lacked, and the resumed run a gap in its history (seen by hand: epochs 1, 2, 5, 6). Here the
    file has lost its last two rows, as then; the resume restores them from its checkpoint."""
    run_dir = tmp_path / "run"
    sets = ["checkpoint.every_epochs=1", "scaling.workers=1"]
    raytrain_app.fit(DIGITS, run_dir=str(run_dir), overrides=[*sets, "train.epochs=3"], **QUIET)
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text(rows[0] + "\n")
    resumed = raytrain_app.fit(DIGITS, run_dir=str(run_dir), overrides=[*sets, "train.epochs=4"], resume=True,
                               **QUIET)
    again = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert again[:3] == rows and json.loads(again[3])["epoch"] == 4
    assert [row["epoch"] for row in resumed.metrics] == [1, 2, 3, 4]
    # As many epochs as it has done, or fewer: one line before anything starts, not a run that ends
    # at once with exit 0, "4 of 4 epochs" (or "4 of 2").
    latest = rundir.kept(str(run_dir))[-1].name
    before = files_of(run_dir)
    proc = command(["train", DIGITS, "--run-dir", str(run_dir), "--resume", "--local",
                    *sum((["--set", s] for s in [*sets, "train.epochs=4"]), [])], tmp_path)
    assert proc.returncode == 2, proc
    assert proc.stderr == (f"error: --resume: the run has trained 4 epochs ({latest}) and train.epochs is 4: nothing "
                           "left to train; --set train.epochs=N with N above 4 trains on\n"), proc.stderr
    assert files_of(run_dir) == before
    # Epochs trained past its latest checkpoint (a run stopped between checkpoints) are named too.
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**json.loads(again[3]), "epoch": 5}) + "\n")
    with pytest.raises(UserError) as fewer:
        make_plan(load_config(DIGITS, [*sets, "train.epochs=2"]), run_dir=str(run_dir), resume=True)
    assert str(fewer.value) == (f"--resume: the run has trained 5 epochs ({latest}, its latest checkpoint at epoch 4) "
                                "and train.epochs is 2: nothing left to train; --set train.epochs=N with N above 4 "
                                "trains on")
    # A job that may run again (--resume-if-any) and finds its run finished ends at once, its work done.
    make_plan(load_config(DIGITS, [*sets, "train.epochs=4"]), run_dir=str(run_dir), resume="if_any").lease.release()


def test_a_stale_lease_is_taken_over_and_a_requeued_job_takes_its_own(tmp_path, monkeypatch):
    path = str(tmp_path / lease.LEASE)
    now = time.time()
    elsewhere = Holder("t1", "gpu-node-7", 4242, "train", None, now - 600, now - 5)
    lease._create(path, elsewhere)
    with pytest.raises(UserError, match=r"in use by pid 4242 on host gpu-node-7 \(train\) since .*; if that "
                                        r"process is gone, --resume takes over after 60 s$"):
        Lease.acquire(str(tmp_path), "train", print)
    # evaluate (which writes evaluations/) is told its own way back, not train's --resume.
    with pytest.raises(UserError, match=r"\(train\) since .*; if that process is gone, `evaluate` again takes over "
                                        r"after 60 s$"):
        Lease.acquire(str(tmp_path), "evaluate", print)
    stale = Holder(**{**elsewhere.__dict__, "heartbeat": now - lease.STALE_S - 1})
    lease._renew(path, stale, None)
    said = []
    held = Lease.acquire(str(tmp_path), "train", said.append)
    assert said and said[0].startswith(f"took over the lease of {tmp_path} from pid 4242 on host gpu-node-7")
    assert said[0].endswith("no heartbeat for 61 s")
    held.release()
    assert not os.path.exists(path)

    # A SLURM requeue runs the same job id on another node: its lease is its own, taken once the
    # earlier attempt's heartbeat has stopped for two beats (not the full staleness).
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    lease._create(path, Holder("t2", "gpu-node-8", 99, "train", "slurm:777", now, now - 2 * lease.HEARTBEAT_S - 1))
    said.clear()
    held = Lease.acquire(str(tmp_path), "train", said.append)
    assert held.holder.job == "slurm:777" and said[-1].endswith("the same slurm job, started again")
    held.release()
    # ... but while that attempt still beats, the same job waits for it, then is refused.
    monkeypatch.setattr(lease, "SAME_JOB_WAIT_S", 2)
    lease._create(path, Holder("t4", "gpu-node-8", 99, "train", "slurm:777", now, time.time() + 5))
    with pytest.raises(UserError, match="is in use by pid 99 on host gpu-node-8"):
        Lease.acquire(str(tmp_path), "train", said.append)
    os.unlink(path)

    # On this host, a holder whose process is gone is gone: no need to wait for its heartbeat to age.
    monkeypatch.delenv("SLURM_JOB_ID")
    gone = subprocess.Popen(["true"])
    gone.wait()
    lease._create(path, Holder("t3", socket.gethostname(), gone.pid, "train", None, now, time.time()))
    held = Lease.acquire(str(tmp_path), "evaluate", said.append)
    assert said[-1].endswith("its process is gone")
    held.release()
    # A torn lease file (a full disk while it was written) is nobody's: taken over, said so.
    open(path, "w").write('{"token": "t5", "ho')
    held = Lease.acquire(str(tmp_path), "train", said.append)
    assert said[-1] == f"took over the lease of {tmp_path}: its file is unreadable"
    held.release()


def test_on_object_storage_one_of_two_racing_writers_gets_the_lease(s3, monkeypatch):
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    run_dir = f"s3://{s3.bucket}/leases/run-{os.getpid()}"

    def take(_):
        try:
            return Lease.acquire(run_dir, "train", print)
        except UserError as e:
            return e

    with ThreadPoolExecutor(4) as pool:  # four at once: S3's If-None-Match lets exactly one create it
        outcomes = list(pool.map(take, range(4)))
    won = [o for o in outcomes if isinstance(o, Lease)]
    assert len(won) == 1, outcomes
    assert all("is in use by" in str(o) or "just taken" in str(o) for o in outcomes if o not in won)
    stored = json.loads(s3.client().get_object(Bucket=s3.bucket, Key=f"leases/run-{os.getpid()}/lease.json")
                        ["Body"].read())
    assert stored["token"] == won[0].holder.token
    with pytest.raises(UserError, match="is in use by"):
        make_plan(load_config(DIGITS), run_dir=run_dir)  # `train` is refused before anything starts
    won[0].release()
    assert s3.keys(f"leases/run-{os.getpid()}/lease.json") == []
    Lease.acquire(run_dir, "train", print).release()


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs: room for the digits LeNet's first checkpoint (0.5 MB), not for a second."""
    if os.geteuid() != 0 and os.environ.get("CI") != "true":
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=True)  # a pooled Ray worker may still hold its log


@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_is_one_line_leaves_nothing_partial_and_resume_is_bitwise(small_disk, tmp_path):
    sets = ["train.epochs=3", "checkpoint.every_epochs=1"]
    reference = raytrain_app.fit(DIGITS, run_dir=str(tmp_path / "whole"), overrides=sets, **QUIET)
    run_dir = small_disk / "run"
    with pytest.raises(raytrain_app.TrainingFailed) as failed:
        raytrain_app.fit(DIGITS, run_dir=str(run_dir), overrides=sets, **QUIET)
    first = rundir.kept(str(run_dir))
    assert [c.epoch for c in first] == [1]
    assert str(failed.value).startswith(f"checkpoint at step {2 * first[0].step} could not be written to {run_dir}: "
                                        "no space left on device (")
    assert str(failed.value).endswith(f"; the last good checkpoint is step {first[0].step}: free space and --resume")
    # the partial one: gone
    assert sorted(p.name for p in run_dir.glob("checkpoint_*") if p.is_dir()) == [first[0].name]
    assert not list(run_dir.rglob("*.tmp"))
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "failed" and record["reason"] == str(failed.value)

    # A resume with another model is refused before Ray starts, and changes nothing.
    before = files_of(run_dir)
    with pytest.raises(UserError) as refused:
        make_plan(load_config(DIGITS, [*sets, "model.name=mlp"]), run_dir=str(run_dir), resume=True)
    assert str(refused.value) == f"--resume: {first[0].name} has model lenet, the config says mlp: resume with the " \
                                 "model it was trained with, or start a new run"
    ray_temp = short_temp_dir()  # where Ray would put its session, had it started
    proc = command(["train", DIGITS, "--run-dir", str(run_dir), "--resume", "--ray",
                    *sum((["--set", s] for s in sets), []), "--set", "model.args={hidden: [16]}",
                    "--set", "model.name=mlp"], tmp_path, env={**os.environ, "RAY_TMPDIR": ray_temp})
    assert proc.returncode == 2 and "has model lenet, the config says mlp" in proc.stderr, proc
    assert files_of(run_dir) == before and os.listdir(ray_temp) == []

    # With room again, --resume continues from the last good checkpoint, bitwise.
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)
    resumed = raytrain_app.fit(DIGITS, run_dir=str(run_dir), overrides=sets, resume=True, **QUIET)
    assert [row["epoch"] for row in resumed.metrics] == [1, 2, 3]
    ours, theirs = (torch.load(Path(r.final_checkpoint) / "state.pt", weights_only=True)["model"]
                    for r in (resumed, reference))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.slow
def test_the_compile_caches_archive_gives_way_to_a_checkpoint_on_a_full_disk(small_disk, tmp_path, monkeypatch):
    """1.25 MB: room for two checkpoints of the digits LeNet (0.53 MB each on a tmpfs, the second
    written before the first is pruned), not for both and the compile cache's archive (0.3 MB)
    beside them. The second checkpoint removes the archive and is written; the run finishes."""
    subprocess.run(["mount", "-o", "remount,size=1280k", str(small_disk)], check=True)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a cold compile, this test's own
    run_dir = small_disk / "run"
    sets = ["train.epochs=2", "checkpoint.every_epochs=1", "checkpoint.keep=1", "scaling.workers=1",
            "train.compile=default", "train.limit_batches=10", "train.limit_eval_batches=2",
            "tracking.tensorboard=false", "tracking.report_png=false"]
    said = []
    result = raytrain_app.fit(DIGITS, run_dir=str(run_dir), overrides=sets, **{**QUIET, "echo": said.append})
    assert [row["epoch"] for row in result.metrics] == [1, 2]
    assert [c.epoch for c in rundir.kept(str(run_dir))] == [2]
    archive = run_dir / "compile_cache.bin"
    assert not archive.exists()
    assert [line for line in said if re.fullmatch(
        rf"warning: compile cache {archive} removed, the next checkpoint needs its space \([\d.]+ MB free, a "
        r"checkpoint takes [\d.]+ MB\): a restart compiles again", line)], said


def test_an_index_that_names_a_pruned_checkpoint_is_mended_and_the_run_resumes_on_ray(ray_cluster, tmp_path):
    """On Ray because Ray Train's controller is what refuses such an index. A controller stopped
    (a job's `stop`, a preemption) after it deleted a checkpoint past `checkpoint.keep` and before
    it wrote its index again leaves an index naming a checkpoint that is gone; the next start
    takes it out, says so, and resumes from the latest."""
    run_dir = tmp_path / "run"
    sets = ["train.epochs=3", "checkpoint.every_epochs=1", "checkpoint.keep=2", "tracking.report_png=false"]
    raytrain_app.fit(DIGITS, run_dir=str(run_dir), overrides=sets, **QUIET)
    index = snapshot.read(str(run_dir))
    latest = index["latest_checkpoint_result"]["checkpoint_dir_name"]
    [pruned] = [e["checkpoint_dir_name"] for e in index["checkpoint_results"] if e["checkpoint_dir_name"] != latest]
    shutil.rmtree(run_dir / pruned)
    said = []
    resumed = raytrain_app.fit(DIGITS, run_dir=str(run_dir), overrides=[*sets, "train.epochs=4"], resume=True,
                               local=False, echo=said.append)
    assert [row["epoch"] for row in resumed.metrics] == [1, 2, 3, 4]
    assert f"warning: the run's checkpoint index named {pruned}, which is gone (a run stopped while it pruned " \
           "checkpoints): taken out of the index" in said, said
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert f"resumed from {run_dir}/{latest} at step" in log, log
    assert pruned not in json.dumps(snapshot.read(str(run_dir)))


def test_a_model_that_does_not_fit_the_checkpoint_is_named_not_called_damage(tmp_path):
    run_dir = tmp_path / "run"
    model = "model.name=tests.helpers:faulty_mlp"  # an MLP, and args that change no weight (a fault never armed)
    sets = ["train.epochs=1", model, f"model.args={{marker: {tmp_path / 'a'}, at: 100000}}"]
    raytrain_app.fit(DIGITS, run_dir=str(run_dir), overrides=sets, **QUIET)
    name = rundir.kept(str(run_dir))[-1].name
    before = files_of(run_dir)
    with pytest.raises(UserError) as other_inputs:  # the same builder and args, 8x8 inputs instead of 28x28
        make_plan(load_config(DIGITS, [*sets, "data.args={}"]), run_dir=str(run_dir), resume=True)
    assert str(other_inputs.value) == (f"--resume: {name} has parameter inner.1.weight shaped [32, 784], the config's "
                                       "model has [32, 64] (the data's inputs or classes changed?)")
    assert files_of(run_dir) == before
    # Args that change no weight's shape resume, and say so.
    fits = make_plan(load_config(DIGITS, [model, "train.epochs=2",  # one more epoch: else nothing to train
                                          f"model.args={{marker: {tmp_path / 'b'}, at: 100000}}"]),
                     run_dir=str(run_dir), resume=True)
    fits.lease.release()
    assert fits.warnings == (f"--resume: {name} has model.args.marker {str(tmp_path / 'a')!r}, the config says "
                             f"{str(tmp_path / 'b')!r}: the weights fit, so the run resumes with the config's",)


def cosine(step: int, warmup: int, total: int) -> float:
    """The documented curve's factor at `step`: linear warmup, then cosine to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))


@pytest.mark.parametrize("how", ["continue", "restart"])
def test_extending_a_run_moves_the_lr_schedules_end_as_on_extend_says(how):
    """3 epochs of 10 steps planned, resumed at step 20 with 5: the LR curve after the resume."""
    config = ScheduleConfig(warmup_epochs=1, on_extend=how)
    param = [torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.SGD(param, lr=0.1)
    schedule = build_schedule(optimizer, config, 10, 3)
    for _ in range(20):
        optimizer.step()
        schedule.step()
    saved = schedule.state_dict()

    optimizer = torch.optim.SGD(param, lr=0.1)
    schedule = build_schedule(optimizer, config, 10, 5)
    schedule.load_state_dict(saved)  # as a checkpoint restores it: the curve it was on
    said = extend_schedule(optimizer, schedule, 20, 10, 5, how)
    assert said.startswith("the learning rate schedule's last step moves from 30 to 50") and how in said
    curve = [optimizer.param_groups[0]["lr"]]
    for _ in range(30):
        optimizer.step()
        schedule.step()
        curve.append(optimizer.param_groups[0]["lr"])
    assert curve[-1] == pytest.approx(0.0, abs=1e-12)  # the new end
    if how == "continue":  # the curve planned over 50 steps, from step 20 on, as if planned so from the start
        assert curve == pytest.approx([0.1 * cosine(20 + k, 10, 50) for k in range(31)])
        assert all(a >= b for a, b in zip(curve, curve[1:]))
    else:  # warmup again (10 steps), then a cosine over the 20 after it
        assert curve[:3] == pytest.approx([0.01, 0.02, 0.03]) and curve[9] == pytest.approx(0.1)
        assert curve[20] == pytest.approx(0.05)


def test_a_finished_cosine_extended_by_resume_trains_on_at_the_lr_the_new_total_gives(tmp_path):
    """Trained to its end, the cosine is at 0: a resume with more epochs picks the curve planned
    over the new total up at the step the run is at (it trained on at lr 0 before)."""
    run_dir = tmp_path / "run"
    sets = ["scaling.workers=1", "schedule.warmup_epochs=1", "tracking.report_png=false"]
    done = raytrain_app.fit(DIGITS, run_dir=str(run_dir), overrides=[*sets, "train.epochs=2"], **QUIET)
    assert done.metrics[-1]["lr"] == 0.0  # the cosine's end
    said = []
    resumed = raytrain_app.fit(DIGITS, run_dir=str(run_dir), overrides=[*sets, "train.epochs=4"], resume=True,
                               **{**QUIET, "echo": said.append})
    steps = done.metrics[0]["step"]  # per epoch
    lr = load_config(DIGITS).optimizer.lr  # one worker: linear scaling leaves it as it is
    third, fourth = resumed.metrics[2:]
    assert third["lr"] > 0 and third["lr"] == pytest.approx(lr * cosine(3 * steps, steps, 4 * steps))  # 1/4 of lr
    assert fourth["lr"] == 0.0  # the new end
    assert (f"the learning rate schedule's last step moves from {2 * steps} to {4 * steps}: it follows the curve "
            "planned over the new total from the step it is at (schedule.on_extend: continue)") in said, said
