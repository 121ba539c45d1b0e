"""`checkpoint.async`: checkpoints written in the background while the loop trains on.

Real worker processes (local mode's two, and Ray Train's on the session cluster), real files, and
a real S3-compatible server whose process is stopped (SIGSTOP) to hold a write in flight for as
long as a test needs: an async run checkpoints and ends bitwise as a sync run does (DDP in local
mode and on Ray, FSDP2 through DCP's async_save); a rank SIGKILLed while its checkpoint is being
written leaves the one before as the latest, and the run resumes from it bitwise; a stop
request's checkpoint and the run's last are whole before the processes end. Checkpoints are
opened by hand, as tests/checkpoint_files.py opens them, the shards by torch's own reader.
"""

import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import boto3
import psutil
import pytest
import ray.train
import torch
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import raytrain_app
from raytrain_app.config import updated
from raytrain_app.models import mlp
from tests import runrecord, test_run_integrity
from tests.conftest import REPO
from tests.helpers import Fault, paced
from tests.test_distributed import final_weights, job, run
from tests.test_reliability import resumed_at

FSDP = {"name": "fsdp", "shard_modules": ["Linear"]}  # each Linear its own shard unit, then the root
small_disk = test_run_integrity.small_disk  # a fixture: a 1 MB tmpfs


def config(marker, background: bool, store_pid: int = 0, index: str = ""):
    """Digits on a dropout MLP (23 steps an epoch per rank, 2 epochs), a checkpoint every 5 steps
    and every one kept, written in the `background` or not, one restart allowed. While `marker`
    exists the model stalls the object store and kills rank 1 (see `stalling_mlp`); without it,
    it is a plain MLP."""
    model = {"name": "tests.test_async_checkpoint:stalling_mlp",
             "args": {"marker": str(marker), "store_pid": store_pid, "index": index}}
    return job(model=model, data={"name": "digits"}, train={"epochs": 2, "batch_size": 32},
               checkpoint={"every_steps": 5, "keep": 20, "async": background}, failure={"max_failures": 1})


class StoreStop(nn.Module):
    """On rank 0's training call `at`, while `marker` exists: once the run's index (`index`, the
    run directory's checkpoint_manager_snapshot.json) names the checkpoint at step `committed`,
    stops the object store's process. Every request to the store then hangs, as to a stalled
    store, until the test continues it."""

    def __init__(self, inner: nn.Module, marker: str, store_pid: int, index: str, committed: int, at: int):
        super().__init__()
        self.inner, self.marker, self.store_pid, self.index = inner, marker, store_pid, index
        self.committed, self.at, self.calls = committed, at, 0

    def forward(self, x):
        if self.training and x.shape[0] > 1:
            self.calls += 1
            if self.calls == self.at and os.path.exists(self.marker) and (
                    ray.train.get_context().get_world_rank() == 0):
                bucket, key = self.index.removeprefix("s3://").split("/", 1)
                store = boto3.client("s3")  # (the endpoint and keys in the environment)
                deadline = time.monotonic() + 120
                while json.loads(store.get_object(Bucket=bucket, Key=key)["Body"].read())[
                        "latest_checkpoint_result"]["metrics"]["step"] < self.committed:
                    assert time.monotonic() < deadline, f"no checkpoint at step {self.committed} in {self.index}"
                    time.sleep(0.05)
                os.kill(self.store_pid, signal.SIGSTOP)
        return self.inner(x)


def stalling_mlp(input_shape: tuple, num_classes: int, marker: str, store_pid: int, index: str) -> nn.Module:
    """The dropout MLP; while `marker` exists, rank 0 stops the store at its 35th training call
    (epoch 2, batch 12), once the checkpoint at step 30 is committed and before the one at step 35
    is taken, and rank 1 is SIGKILLed at its 37th, two steps on (see tests.helpers.Fault)."""
    model = mlp(input_shape, num_classes, hidden=[32], dropout=0.2)
    return Fault(StoreStop(model, marker, store_pid, index, committed=30, at=35), marker, at=37, rank=1, fault="kill")


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    """The uninterrupted run, checkpoints written in the loop (no marker: it never faults)."""
    tmp = tmp_path_factory.mktemp("sync")
    return run(config(tmp / "never", background=False), tmp / "run")


@pytest.fixture
def store_process(s3) -> psutil.Process:
    """The session's S3-compatible server's process, which a test stops and continues."""
    port = s3.endpoint.rsplit(":", 1)[1]
    [server] = [p for p in psutil.Process().children() if p.cmdline()[-2:] == ["-p", port]]
    yield server
    server.resume()  # (a failed test's stop)


def opened(read, shards=None) -> dict:
    """A checkpoint opened by hand (`read(name)` gives a file's bytes): every file against its
    `.sha256`, then what a resume continues from: state.pt's weights, optimizer, schedule and
    position, and each rank's random streams and running loss sums (not its clocks). A sharded
    checkpoint's weights and optimizer state are its `shards` (a local directory), consolidated by
    torch's own `dcp_to_torch_save`."""
    parts = {}
    for name in ("state.pt", "rank0.pt", "rank1.pt"):
        data = read(name)
        assert hashlib.sha256(data).hexdigest() == read(f"{name}.sha256").decode().split()[0], name
        parts[name] = torch.load(io.BytesIO(data), weights_only=True)
    state = parts.pop("state.pt")
    if shards:
        for path in shards.iterdir():
            if not path.name.endswith(".sha256"):
                digest = (shards / f"{path.name}.sha256").read_text().split()[0]
                assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, path
        with tempfile.TemporaryDirectory() as scratch:
            dcp_to_torch_save(shards, f"{scratch}/whole.pt")
            state.update(torch.load(f"{scratch}/whole.pt", weights_only=True))
    resumed = {key: state[key] for key in ("model", "optimizer", "scheduler", "epoch", "step", "batch", "samples")}
    for name, own in parts.items():
        resumed[name] = {"rng": own["rng"], "sums": own["totals"] and own["totals"]["sums"]}
    return resumed


def kept(run_dir) -> dict[int, dict]:
    """A local run's kept checkpoints, opened, by step."""
    return {position["step"]: opened(lambda name: (Path(path) / name).read_bytes(),
                                     Path(path) / "shards" if (Path(path) / "shards").is_dir() else None)
            for path, position in runrecord.positions(run_dir).items()}


def assert_same(a, b, where="") -> None:
    """Bitwise equal: tensors by `torch.equal`, the rest by `==`, through dicts, lists and tuples."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.slow
def test_an_async_run_checkpoints_and_ends_bitwise_as_a_sync_run(sync_run, tmp_path):
    """Every checkpoint of the async run is the one the sync run wrote at that step, bit for bit:
    the copy the loop takes is the state as it was, not as the next steps made it."""
    result = run(config(tmp_path / "never", background=True), tmp_path / "run")
    ours, theirs = kept(tmp_path / "run"), kept(sync_run.run_dir)
    assert sorted(ours) == sorted(theirs) == [5, 10, 15, 20, 23, 25, 30, 35, 40, 45, 46]
    assert_same(ours, theirs)
    assert_same(final_weights(result), final_weights(sync_run))
    assert runrecord.latest(tmp_path / "run")[1]["step"] == 46  # the last one, committed before the run ended


@pytest.mark.slow
def test_a_sharded_async_run_checkpoints_through_dcps_async_save_bitwise_as_a_sync_run(tmp_path):
    """FSDP2 over the two ranks: each rank's shards go through torch.distributed.checkpoint's
    async_save, and every checkpoint, its shards consolidated, is the sync run's at its step."""
    runs = {background: run(updated(config(tmp_path / "never", background), {"strategy": FSDP}),
                            tmp_path / str(background)) for background in (False, True)}
    ours, theirs = kept(tmp_path / "True"), kept(tmp_path / "False")
    assert sorted(ours) == sorted(theirs) == [5, 10, 15, 20, 23, 25, 30, 35, 40, 45, 46]
    assert_same(ours, theirs)
    assert_same(final_weights(runs[True]), final_weights(runs[False]))


@pytest.mark.slow
def test_a_rank_killed_while_its_checkpoint_is_written_resumes_from_the_one_before_bitwise(sync_run, s3, store_process,
                                                                                           tmp_path, monkeypatch):
    """Rank 0 stops the store just before the checkpoint at step 35, whose write then hangs in
    the background while both ranks train on; rank 1 is SIGKILLed two steps later, its write
    still in flight. The run directory's latest checkpoint is still step 30's, the group restarts
    from it, and the run ends bitwise as the uninterrupted one. A loop that waited for the write
    would never reach the kill."""
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    marker = tmp_path / "fault"
    marker.touch()
    prefix = f"async/{tmp_path.name}"
    run_dir = f"s3://{s3.bucket}/{prefix}"
    killed = []

    def continue_the_store() -> None:
        deadline = time.monotonic() + 120
        while marker.exists() and time.monotonic() < deadline:  # (rank 1 removes it as it kills itself)
            time.sleep(0.1)
        killed.append(not marker.exists())
        store_process.resume()

    watch = threading.Thread(target=continue_the_store)
    watch.start()
    try:
        result = run(config(marker, True, store_process.pid, f"{run_dir}/checkpoint_manager_snapshot.json"), run_dir)
    finally:
        watch.join()
    assert killed == [True], "the loop waited for the stalled write: rank 1 never reached its kill"

    log = s3.client().get_object(Bucket=s3.bucket, Key=f"{prefix}/logs/rank-0.log")["Body"].read().decode()
    step, epoch, batch, _ = resumed_at(log)
    assert (step, epoch, batch) == (30, 2, 7)
    restarts = s3.client().get_object(Bucket=s3.bucket, Key=f"{prefix}/restarts.jsonl")["Body"].read().decode()
    assert "killed by SIGKILL" in restarts
    assert_same(final_weights(result), final_weights(sync_run))
    assert [row["epoch"] for row in result.metrics] == [1, 2]


@pytest.mark.slow
def test_a_background_write_that_fails_is_the_sync_ones_one_line_error(small_disk):
    """A 1 MB disk holds the digits LeNet's first checkpoint, not its second: the second's write
    fails in the background, and the run fails with the line a sync write's failure gives, at the
    checkpoint after it, naming the step that was not written."""
    run_dir = small_disk / "run"
    with pytest.raises(raytrain_app.TrainingFailed) as failed:
        raytrain_app.fit(f"{REPO}/examples/digits.yaml", run_dir=str(run_dir), local=True, echo=lambda line: None,
                         overrides=["train.epochs=3", "checkpoint.every_epochs=1", "checkpoint.async=true"])
    _, first = runrecord.latest(run_dir)
    assert first["epoch"] == 1
    assert re.fullmatch(rf"checkpoint at step {2 * first['step']} could not be written to {run_dir}: no space left "
                        rf"on device \(\d+ MB free\); the last good checkpoint is step {first['step']}: free space and "
                        r"--resume", str(failed.value)), str(failed.value)


def ballasted(input_shape: tuple, num_classes: int, megabytes: int, seconds: float) -> nn.Module:
    """tests.helpers.Paced (a linear classifier whose training batches sleep `seconds`) with
    `megabytes` of frozen weights: a state that takes a while to write and nothing to train."""
    model = paced(input_shape, num_classes, seconds)
    model.ballast = nn.Parameter(torch.zeros(megabytes * 2**18), requires_grad=False)
    return model


@pytest.mark.slow
def test_a_stop_requests_checkpoint_and_the_last_are_whole_before_the_processes_end(tmp_path):
    """SIGUSR1 mid-epoch: the checkpoint at the step the ranks stop at is whole and the latest when
    the command has ended (exit 75); `--resume` continues from it and ends with the last step's
    checkpoint whole and the latest. Each holds 200 MB of weights, whose write outlasts a worker
    process's exit by far: a process that did not wait for it would leave the one before."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "raytrain_app.cli", "train", "examples/digits.yaml", "--local",
               "--run-dir", str(run_dir), "--set", "train.epochs=2", "--set", "checkpoint.every_epochs=100",
               "--set", "checkpoint.async=true", "--set", "tracking.report_png=false",
               "--set", "model={name: 'tests.test_async_checkpoint:ballasted', args: {megabytes: 200, seconds: 0.1}}"]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = run_dir / "logs" / "rank-0.log"
    deadline = time.monotonic() + 120
    while "first step of this group" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGUSR1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, out + err
    step, epoch, batch = map(int, re.search(r"stopped on SIGUSR1 at step (\d+) \(epoch (\d+), batch (\d+)\)",
                                            err).groups())
    assert epoch == 1 and 0 < batch < 23
    path, position = runrecord.latest(run_dir)
    assert position == {"epoch": 0, "step": step, "batch": batch}
    assert opened(lambda name: (Path(path) / name).read_bytes())["step"] == step

    resumed = subprocess.run([*command, "--resume"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"epoch 1 from batch {batch}" in resumed.stdout + resumed.stderr
    path, position = runrecord.latest(run_dir)
    assert position == {"epoch": 2, "step": 46, "batch": 0}
    assert opened(lambda name: (Path(path) / name).read_bytes())["step"] == 46


def test_on_ray_trains_upload_thread_writes_the_checkpoints_and_the_run_is_bitwise_a_sync_one(ray_cluster, sync_run,
                                                                                              s3, tmp_path):
    """On Ray because Ray Train's own asynchronous upload is what is used there: into the
    session's S3-compatible bucket, every checkpoint the controller kept is the sync run's at its
    step, bit for bit, and the last is the latest."""
    prefix = f"async-ray/{tmp_path.name}"
    result = run(config(tmp_path / "never", background=True), f"s3://{s3.bucket}/{prefix}", local=False)
    client = s3.client()

    def read(key: str) -> bytes:
        return client.get_object(Bucket=s3.bucket, Key=f"{prefix}/{key}")["Body"].read()

    index = json.loads(read("checkpoint_manager_snapshot.json"))
    ours = {entry["metrics"]["step"]: opened(lambda name, d=entry["checkpoint_dir_name"]: read(f"{d}/{name}"))
            for entry in index["checkpoint_results"]}
    theirs = kept(sync_run.run_dir)
    assert sorted(ours) == sorted(theirs) and index["latest_checkpoint_result"]["metrics"]["step"] == 46
    assert_same(ours, theirs)
    assert_same(final_weights(result), final_weights(sync_run))
