"""Faults made to happen for real: a worker SIGKILLed mid-epoch on the real Ray cluster (its run
directory in a real S3-compatible store), a rank that stalls inside a step under Ray Train's
collectives, and in local mode a crash and --resume, damaged and hostile checkpoint files, a
loss that goes NaN on one rank."""

import errno
import hashlib
import math
import os
import pickle
import re
import time

import psutil
import pyarrow.fs as pafs
import pytest
import torch

from raytrain_app.driver.on_ray import explain_failure
from raytrain_app.driver.plan import make_plan
from raytrain_app.driver.trainer import run_training
from raytrain_app.errors import TrainingFailed
from raytrain_app.rundir import checkpoints
from raytrain_app.worker import checkpoint
from raytrain_app.worker.state import TrainState
from tests.test_distributed import final_weights, job, run


def faulty(marker, at, fault, rank=1, **sections):
    """Digits with a dropout MLP: 1438 rows / 2 ranks / 32 = 23 steps per epoch per rank."""
    model = {"name": "tests.helpers:faulty_mlp",
             "args": {"marker": str(marker), "at": at, "rank": rank, "fault": fault}}
    return job(model=model, data={"name": "digits"}, **{"train": {"epochs": 2, "batch_size": 32}, **sections})


def step_checkpointed(marker, fault, rank=1, **tracking):
    """Step checkpoints every 5 steps: call 40 is epoch 2's 17th batch, after checkpoints at steps 25,
    30 and 35 (epoch 2, batches 2, 7, 12). Ray registers a reported checkpoint asynchronously, so a
    restart resumes from whichever of them was registered last, always mid-epoch. TensorBoard
    gets a point every step."""
    return faulty(marker, at=40, fault=fault, rank=rank, checkpoint={"every_steps": 5}, failure={"max_failures": 1},
                  tracking={"tensorboard": True, "log_every_steps": 1, **tracking})


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run the faulty ones must reproduce bitwise (no marker: it never faults)."""
    return run(step_checkpointed(tmp_path_factory.mktemp("never") / "marker", "kill"),
               tmp_path_factory.mktemp("straight") / "run")


def resumed_at(log: str) -> tuple[int, int, int, str]:
    """(step, epoch, batch) from the log's "resumed from" line, and the log after it."""
    before, _, after = log.partition("resumed from ")
    step, epoch, batch = map(int, re.match(r"\S+ at step (\d+): epoch (\d+) from batch (\d+)", after).groups())
    return step, epoch, batch, after


def straight_and_killed(config, tmp_path) -> tuple:
    """`config(marker)` run without its marker, then with it (a worker dies); both results and
    where the killed run resumed, (step, epoch, batch)."""
    straight = run(config(tmp_path / "never"), tmp_path / "straight")
    marker = tmp_path / "fault"
    marker.touch()
    killed = run(config(marker), tmp_path / "killed")
    assert not marker.exists()  # the fault really happened
    return straight, killed, resumed_at((tmp_path / "killed" / "logs" / "rank-1.log").read_text())[:3]


def test_killed_worker_restarts_and_resumes_mid_epoch_bitwise_from_the_bucket(ray_cluster, straight, tmp_path,
                                                                              mlflow_server, s3):
    """On Ray: Ray Train's own restart of the worker group is what is tested (local mode's has its
    test in test_local_mode). The run directory is in the S3-compatible store, so the restart
    restores from the bucket. The worker killed is rank 0, the trackers' writer: what reached the
    bucket before its death is all its curves keep."""
    marker = tmp_path / "fault"
    marker.touch()
    run_dir = f"s3://{s3.bucket}/reliability/killed"
    lines = []
    killed = run_training(make_plan(step_checkpointed(marker, "kill", rank=0, mlflow={
        "tracking_uri": mlflow_server, "experiment": "killed"}), run_dir=run_dir), echo=lines.append)
    assert not marker.exists()  # the fault really happened
    # One line of ours for the dead worker, naming the checkpoint in the bucket the group restarts from.
    assert [line for line in lines if re.fullmatch(
        rf"warning: rank 0 on node \S+ \(pid \d+\): worker process died without an exception \(.*\); restarting from "
        rf"{run_dir}/checkpoint_\S+ \(restart 1 of 1\)", line)], lines
    log = s3.client().get_object(Bucket=s3.bucket, Key="reliability/killed/logs/rank-0.log")["Body"].read().decode()
    assert log.count("rank 0/2 on node") == 2  # both attempts, in one log kept in the bucket
    step, epoch, batch, _ = resumed_at(log)
    assert epoch == 2 and step in (25, 30, 35) and batch == step - 23
    assert killed.best_checkpoint.startswith(f"{run_dir}/checkpoint_")

    assert [row["epoch"] for row in killed.metrics] == [1, 2]
    for name, w in final_weights(straight).items():
        assert torch.equal(final_weights(killed)[name], w), name
    assert killed.metrics[-1]["train_loss"] == pytest.approx(straight.metrics[-1]["train_loss"], rel=1e-12)

    # The trackers show one curve, the uninterrupted run's: the killed attempt's points up to its
    # checkpoint were in the bucket before it, TensorBoard purged those past the restored step,
    # and the MLflow run (the same one) skipped those it held.
    curve = tensorboard_curve(straight.run_dir)
    assert [step for step, _ in curve] == list(range(1, 47))
    (tmp_path / "tensorboard").mkdir()
    pafs.copy_files(f"{s3.bucket}/reliability/killed/tensorboard", str(tmp_path / "tensorboard"),
                    source_filesystem=pafs.FileSystem.from_uri(run_dir)[0])
    assert tensorboard_curve(str(tmp_path)) == curve
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server)
    [tracked] = client.search_runs([client.get_experiment_by_name("killed").experiment_id])
    assert tracked.info.status == "FINISHED" and tracked.data.tags["best_checkpoint"] == killed.best_checkpoint
    history = sorted((m.step, m.value) for m in client.get_metric_history(tracked.info.run_id, "step/train_loss"))
    assert [step for step, _ in history] == list(range(1, 47))
    assert [value for _, value in history] == pytest.approx([v for _, v in curve], rel=1e-6)  # TensorBoard: float32
    epochs = client.get_metric_history(tracked.info.run_id, "epoch/eval_accuracy")
    assert [m.value for m in epochs] == [row["eval_accuracy"] for row in killed.metrics]


def tensorboard_curve(run_dir: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("step/train_loss")]


@pytest.mark.slow
def test_resume_after_a_crash_reproduces_the_uninterrupted_run(straight, tmp_path):
    marker = tmp_path / "fault"
    marker.touch()
    crashing = faulty(marker, at=40, fault="crash", checkpoint={"every_steps": 5})  # no restarts
    with pytest.raises(TrainingFailed, match="injected crash"):
        run(crashing, tmp_path / "crashed")
    marker.unlink()
    resumed = run(crashing, tmp_path / "crashed", resume=True)

    # It continued inside epoch 2 from its last step checkpoint, and epoch 1 was not trained again.
    step, epoch, batch, after = resumed_at((tmp_path / "crashed" / "logs" / "rank-0.log").read_text())
    assert epoch == 2 and step in (25, 30, 35) and batch == step - 23
    assert re.findall(r" INFO epoch (\d+) ", after) == ["2"]
    assert [row["epoch"] for row in resumed.metrics] == [1, 2]
    for name, w in final_weights(straight).items():
        assert torch.equal(final_weights(resumed)[name], w), name


def test_a_stalled_rank_fails_the_run_within_the_collective_timeout(ray_cluster, tmp_path):
    """On Ray: how Ray Train reports the ranks' timed-out collectives is what is tested."""
    marker = tmp_path / "fault"
    marker.touch()
    config = faulty(marker, at=3, fault="stall", scaling={"timeout_s": 5})
    lines = []
    start = time.monotonic()
    with pytest.raises(TrainingFailed, match=r"a collective timed out after 5s .* rank\(s\) 0 were waiting; "
                                             r"rank\(s\) 1 stalled"):
        run_training(make_plan(config, run_dir=str(tmp_path / "run")), echo=lines.append,
                     marks={"start": time.time()})
    failed_after = time.monotonic() - start
    started_after = float(re.search(r"first step after ([\d.]+)s", "\n".join(lines)).group(1))
    # Two steps, then rank 1 stalls: rank 0 gives up 5 s later, and Ray stops the worker group.
    assert 5 <= failed_after - started_after <= 5 + STALL_SLACK_S, (started_after, failed_after)


def test_a_dead_worker_is_named_before_the_peers_its_death_broke():
    """Which rank Ray reports first is a race; the dead process is the cause either way."""
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError
    from ray.train.v2.api.exceptions import WorkerGroupError

    died = ActorDiedError(ActorDiedErrorContext(
        error_message="The actor is dead because its worker process has died. Worker exit detail: "
                      "Worker unexpectedly exits with a connection error code 2. End of file.",
        pid=4242, node_ip_address="10.0.0.7", actor_id=b"\x01" * 16))
    broken = RuntimeError("Traceback (most recent call last):\n  ...\n"
                          "RuntimeError: [gloo/transport/tcp/pair.cc:545] Read error [10.0.0.7]:1234: Connection reset")
    error = WorkerGroupError("Training failed.", {0: broken, 1: died})
    message = str(explain_failure(error, job()))
    assert re.fullmatch(r"rank 1 on node 10\.0\.0\.7 \(pid 4242\): worker process died without an exception "
                        r"\(Ray gives no exit status: .*\); rank 0: RuntimeError: .*Connection reset",
                        message), message


def test_a_worker_sigkilled_on_ray_is_named_by_rank_node_and_pid_without_rays_socket_words(ray_cluster, tmp_path):
    """Ray's raylet lets the kernel reap its workers (SIGCHLD ignored), so Ray reports a SIGKILLed
    worker as a closed connection ("connection error code 2. End of file"), with no exit status;
    the line says what is known: the rank, its node and pid, and that it died without an exception."""
    marker = tmp_path / "fault"
    marker.touch()
    with pytest.raises(TrainingFailed) as failed:
        run(faulty(marker, at=3, fault="kill"), tmp_path / "run", local=False)
    assert not marker.exists()  # rank 1 SIGKILLed itself
    message = str(failed.value)
    died = re.fullmatch(r"rank 1 on node ([\d.]+) \(pid (\d+)\): worker process died without an exception \(Ray gives "
                        r"no exit status: a signal such as SIGKILL, from kill -9 or the OOM killer, or a crash\)"
                        r"(; rank 0: .*)?", message)
    assert died, message
    assert not psutil.pid_exists(int(died[2]))  # the process named is gone
    assert "End of file" not in message


# Detecting a failed worker (Ray Train polls every 0.5 s), stopping the worker group and two
# steps of training, on a busy 2-core machine.
STALL_SLACK_S = 6


@pytest.mark.slow
def test_damaged_and_hostile_checkpoints_are_reported_and_skipped(tmp_path):
    config = job(data={"name": "digits"}, train={"epochs": 3, "batch_size": 64}, checkpoint={"keep": 3})
    run(config, tmp_path / "run")
    first, second, third = sorted(str(d) for d in (tmp_path / "run").glob("checkpoint_*") if d.is_dir())
    with open(os.path.join(third, "state.pt"), "r+b") as f:
        f.truncate(100)  # a torn write

    pwned = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {pwned}",))

    state = os.path.join(second, "state.pt")
    with open(state, "wb") as f:
        pickle.dump(Exploit(), f)
    with open(state + ".sha256", "w") as f:  # even with a matching checksum
        f.write(hashlib.sha256(open(state, "rb").read()).hexdigest() + "  state.pt\n")

    lines = []
    longer = job(data={"name": "digits"}, train={"epochs": 4, "batch_size": 64}, checkpoint={"keep": 3})
    resumed = run_training(make_plan(longer, run_dir=str(tmp_path / "run"), resume=True, local=True),
                           echo=lines.append)
    assert f"warning: skipping checkpoint {third}: state.pt does not match its checksum (partial or corrupted write)" \
        in lines
    assert any(line.startswith(f"warning: skipping checkpoint {second}: UnpicklingError") for line in lines), lines
    assert not pwned.exists()  # weights_only refused to run the pickle's code
    # Epoch 1's checkpoint (12 steps per epoch: 719 rows per rank / 64) took over: epochs 2 to 4 ran again.
    assert f"resumed from {first} at step 12: epoch 2 from batch 0" in lines
    assert [line.split("|")[0].strip() for line in lines if line.startswith("epoch ")] == [
        "epoch 2/4", "epoch 3/4", "epoch 4/4"]
    assert [row["epoch"] for row in resumed.metrics] == [1, 2, 3, 4]


def test_checkpoint_files_verify_and_detect_damage(tmp_path):
    state = TrainState(torch.nn.Linear(2, 2), None, None, None)
    state.optimizer = torch.optim.SGD(state.model.parameters(), lr=0.1)
    state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda s: 1.0)
    checkpoint.save(str(tmp_path), 0, state, about={})
    assert checkpoint.verify(str(tmp_path), 0) is None
    assert not list(tmp_path.glob("*.tmp"))  # written under temporary names, then renamed
    (tmp_path / "rank0.pt").write_bytes(b"garbage")
    assert "rank0.pt does not match its checksum" in checkpoint.verify(str(tmp_path), 0)
    (tmp_path / "state.pt.sha256").unlink()
    assert checkpoint.verify(str(tmp_path), 0) == "state.pt.sha256 is missing"


def test_a_save_that_fails_midway_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    state = TrainState(torch.nn.Linear(2, 2), None, None, None)
    state.optimizer = torch.optim.SGD(state.model.parameters(), lr=0.1)
    state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda s: 1.0)
    state.epoch = 1
    checkpoint.save(str(tmp_path), 0, state, about={})
    before = (tmp_path / "state.pt").read_bytes()

    def disk_full(obj, path):  # half the bytes reach the disk, then the write fails
        with open(path, "wb") as f:
            f.write(before[: len(before) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    state.epoch = 2
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(str(tmp_path), 0, state, about={})
    assert (tmp_path / "state.pt").read_bytes() == before  # the previous file, whole
    assert checkpoint.verify(str(tmp_path), 0) is None and checkpoints.load_state(str(tmp_path))["epoch"] == 1
    assert not list(tmp_path.glob("*.tmp"))  # and no torn temporary left behind


@pytest.mark.slow
def test_a_non_finite_loss_stops_every_rank_and_keeps_the_last_good_checkpoint(tmp_path):
    marker = tmp_path / "nan"
    marker.touch()
    # Rank 1 alone turns NaN at its 30th batch (epoch 2, step 30): the ranks must agree to stop, or
    # rank 0 would wait in the next all-reduce until scaling.timeout_s.
    config = faulty(marker, at=30, fault="nan", scaling={"timeout_s": 60}, schedule={"name": "constant"})
    start = time.monotonic()
    with pytest.raises(TrainingFailed, match=r"^the training loss was not finite at epoch 2, step 30 \(lr 0\.1\); "
                                             r"the latest checkpoint is the last good one: lower optimizer\.lr "
                                             r"and --resume"):
        run(config, tmp_path / "run")
    assert time.monotonic() - start < 50  # no rank waited for the collective timeout
    for rank in (0, 1):
        log = (tmp_path / "run" / "logs" / f"rank-{rank}.log").read_text()
        assert "stopped: the training loss was not finite at {'epoch': 2, 'step': 30" in log
    saved = [checkpoints.load_state(str(d)) for d in (tmp_path / "run").glob("checkpoint_*") if d.is_dir()]
    assert [(s["epoch"], s["step"]) for s in saved] == [(1, 23)]  # nothing after the bad step was saved

    # --resume with a lower lr continues from that checkpoint, under the new lr.
    lines = []
    lower = faulty(marker, at=30, fault="nan", schedule={"name": "constant"}, optimizer={"lr": 0.05})
    resumed = run_training(make_plan(lower, run_dir=str(tmp_path / "run"), resume=True, local=True),
                           echo=lines.append)
    assert any(re.match(r"resumed from \S+ at step 23: epoch 2 from batch 0$", line) for line in lines), lines
    assert [row["epoch"] for row in resumed.metrics] == [1, 2]
    assert resumed.metrics[-1]["lr"] == 0.05 and resumed.metrics[-1]["train_loss"] < resumed.metrics[0]["train_loss"]


def test_stop_on_nonfinite_false_trains_on(tmp_path):
    marker = tmp_path / "nan"
    marker.touch()
    config = faulty(marker, at=30, fault="nan", train={"epochs": 2, "batch_size": 32, "stop_on_nonfinite": False})
    result = run(config, tmp_path / "run")
    assert [row["epoch"] for row in result.metrics] == [1, 2]
    assert not marker.exists() and math.isnan(result.metrics[-1]["train_loss"])
