"""Faults made to happen for real on a real Ray cluster: a worker SIGKILLed mid-epoch, a rank that
stalls inside a step, damaged and hostile checkpoint files."""

import hashlib
import os
import pickle
import re
import time

import pytest
import torch

from raytrain_app import checkpoint
from raytrain_app.errors import TrainingFailed
from raytrain_app.plan import make_plan
from raytrain_app.trainer import run_training
from tests.test_distributed import final_weights, job, run

pytestmark = pytest.mark.usefixtures("ray_cluster")


def faulty(marker, at, fault, rank=1, **sections):
    """Digits with a dropout MLP: 1438 rows / 2 ranks / 32 = 23 steps per epoch per rank."""
    model = {"name": "tests.helpers:faulty_mlp",
             "args": {"marker": str(marker), "at": at, "rank": rank, "fault": fault}}
    return job(model=model, data={"name": "digits"}, **{"train": {"epochs": 2, "batch_size": 32}, **sections})


def test_killed_worker_restarts_and_resumes_mid_epoch_bitwise(tmp_path):
    marker = tmp_path / "fault"
    config = faulty(marker, at=40, fault="kill", checkpoint={"every_steps": 5}, failure={"max_failures": 1})
    straight = run(config, tmp_path / "straight")  # no marker: never faults

    # Call 40 is epoch 2's 17th batch; step checkpoints were taken at steps 25, 30 and 35 (epoch 2,
    # batches 2, 7, 12). Ray registers a reported checkpoint asynchronously, so the restart resumes
    # from whichever of them was registered last, always mid-epoch.
    marker.touch()
    killed = run(config, tmp_path / "killed")
    assert not marker.exists()  # the fault really happened
    log = (tmp_path / "killed" / "logs" / "rank-1.log").read_text()
    epoch, step, batch = map(int, re.search(r"resumed from .* at epoch (\d+), step (\d+), batch (\d+)", log).groups())
    assert epoch == 1 and step in (25, 30, 35) and batch == step - 23

    assert [row["epoch"] for row in killed.history] == [1, 2]
    for name, w in final_weights(straight).items():
        assert torch.equal(final_weights(killed)[name], w), name
    assert killed.history[-1]["train_loss"] == pytest.approx(straight.history[-1]["train_loss"], rel=1e-12)


def test_failures_beyond_the_limit_name_the_rank_its_node_and_its_error(tmp_path):
    marker = tmp_path / "fault"
    marker.touch()
    with pytest.raises(TrainingFailed, match=r"rank 1 on node [\d.]+ \(pid \d+\): worker process died"):
        run(faulty(marker, at=3, fault="kill"), tmp_path / "run")


def test_a_stalled_rank_fails_the_run_within_the_collective_timeout(tmp_path):
    marker = tmp_path / "fault"
    marker.touch()
    start = time.monotonic()
    with pytest.raises(TrainingFailed, match=r"a collective timed out after 5s .* rank\(s\) 0 were waiting; "
                                             r"rank\(s\) 1 stalled"):
        run(faulty(marker, at=3, fault="stall", scaling={"timeout_s": 5}), tmp_path / "run")
    assert time.monotonic() - start < 90


def test_a_damaged_checkpoint_is_reported_and_skipped(tmp_path):
    config = job(data={"name": "digits"}, train={"epochs": 3, "batch_size": 64}, checkpoint={"keep": 3})
    first = run(config, tmp_path / "run")
    latest = first.last_checkpoint
    with open(os.path.join(latest, "state.pt"), "r+b") as f:
        f.truncate(100)  # a torn write

    lines = []
    longer = job(data={"name": "digits"}, train={"epochs": 4, "batch_size": 64}, checkpoint={"keep": 3})
    resumed = run_training(make_plan(longer, run_dir=str(tmp_path / "run"), resume=True), echo=lines.append)
    assert any(line.startswith(f"warning: skipping checkpoint {latest}: state.pt does not match its checksum")
               for line in lines)
    assert [row["epoch"] for row in resumed.history] == [1, 2, 3, 4]  # epoch 3 re-run from epoch 2's state


def test_a_hostile_checkpoint_cannot_run_code(tmp_path):
    config = job(data={"name": "digits"}, train={"epochs": 2, "batch_size": 64}, checkpoint={"keep": 2})
    first = run(config, tmp_path / "run")
    pwned = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {pwned}",))

    state = os.path.join(first.last_checkpoint, "state.pt")
    with open(state, "wb") as f:
        pickle.dump(Exploit(), f)
    with open(state + ".sha256", "w") as f:  # even with a matching checksum
        f.write(hashlib.sha256(open(state, "rb").read()).hexdigest() + "  state.pt\n")

    lines = []
    longer = job(data={"name": "digits"}, train={"epochs": 3, "batch_size": 64}, checkpoint={"keep": 2})
    run_training(make_plan(longer, run_dir=str(tmp_path / "run"), resume=True), echo=lines.append)
    assert not pwned.exists()
    assert any("skipping checkpoint" in line and "UnpicklingError" in line for line in lines)


def test_checkpoint_files_verify_and_detect_damage(tmp_path):
    state = checkpoint.TrainState(torch.nn.Linear(2, 2), None, None, None)
    state.optimizer = torch.optim.SGD(state.model.parameters(), lr=0.1)
    state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda s: 1.0)
    checkpoint.save(str(tmp_path), state, rank=0, config={})
    assert checkpoint.verify(str(tmp_path), 0) is None
    assert not list(tmp_path.glob("*.tmp"))  # written under temporary names, then renamed
    (tmp_path / "rank0.pt").write_bytes(b"garbage")
    assert "rank0.pt does not match its checksum" in checkpoint.verify(str(tmp_path), 0)
    (tmp_path / "state.pt.sha256").unlink()
    assert checkpoint.verify(str(tmp_path), 0) == "state.pt.sha256 is missing"
