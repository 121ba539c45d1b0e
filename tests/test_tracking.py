"""Rank 0's trackers, written and read back for real: TensorBoard event files through
TensorBoard's own reader, an MLflow database through MlflowClient, a W&B offline run on disk.
A first attempt that dies and a restart from an earlier step must leave one curve, not two.
(The Ray-level run with an `mlflow server` on loopback is in test_reliability.)"""

import json

import pytest
import torch

from raytrain_app import tracking
from raytrain_app.config import JobConfig
from raytrain_app.errors import ConfigError, UserError
from raytrain_app.worker.metrics import Totals
from raytrain_app.worker.state import EpochClock

EVERY = 2
STEPS_PER_EPOCH = 5


class Position:
    """What the loop's TrainState offers the trackers: the step, rank 0's totals, the clock, the lr."""

    def __init__(self):
        self.step, self.batch, self.totals, self.clock = 0, 0, None, EpochClock()
        self.clock.start()
        self.optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def loss_at(step: int, number: int) -> float:
    """Step `step`'s loss in attempt `number` (1 or 2). An exact resume would repeat attempt 1's
    values; here the restarted attempt's differ, so that which attempt a kept point came from shows."""
    return number + 1.0 / step


def mean_loss(steps: tuple, number: int) -> float:
    return sum(loss_at(step, number) for step in steps) / len(steps)


def attempt(job: JobConfig, run_dir: str, restored: int, until: int, number: int) -> tracking.Trackers:
    """Steps restored+1..until as the loop runs them in attempt `number`, with epoch rows at each
    epoch's end."""
    at = Position()
    at.step = restored
    trackers = tracking.Trackers(job, run_dir, rank=0, world_size=2, state=at)
    for step in range(restored + 1, until + 1):
        if (step - 1) % STEPS_PER_EPOCH == 0:
            at.totals = Totals(torch.device("cpu"))
        at.totals.add(torch.tensor(loss_at(step, number)), 4)
        at.step = step
        if step == 1:
            trackers.startup({"imports+checks": 1.5, "total": 4.0})
        trackers.step(at)
        if step % STEPS_PER_EPOCH == 0:
            trackers.epoch({"epoch": step // STEPS_PER_EPOCH, "step": step, "eval_loss": loss_at(step, number),
                            "eval_accuracy": 0.5, "checkpoint": "not a number"})
    return trackers


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("tracked") / "run")
    job = JobConfig.from_dict({"name": "tracked", "optimizer": {"lr": 0.1},
                               "tracking": {"log_every_steps": EVERY, "wandb": {"project": "p", "mode": "offline"},
                                            "mlflow": {"experiment": "exp"}}})
    tracking.check(job.tracking, run_dir)
    attempt(job, run_dir, restored=0, until=8, number=1).close()  # ends after step 8 (its process dies) ...
    attempt(job, run_dir, restored=5, until=10, number=2).close()  # ... and restarts from its step-5 checkpoint
    tracking.finish(job.tracking, run_dir, "FINISHED", "/runs/x/checkpoint_best", {"eval_loss": 0.1})
    return run_dir


def test_tensorboard_shows_one_curve_across_a_restart(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(f"{tracked}/tensorboard", size_guidance={"scalars": 0})
    events.Reload()
    losses = events.Scalars("step/train_loss")
    assert [e.step for e in losses] == list(range(EVERY, 11, EVERY))
    # Each point is the mean loss since the previous one within its epoch (epoch 2 is steps 6 to
    # 10). The restart purged the first attempt's points after its step-5 checkpoint: those from
    # step 6 on are the restarted attempt's.
    assert [e.value for e in losses] == pytest.approx([mean_loss(steps, number) for steps, number in (
        ((1, 2), 1), ((3, 4), 1), ((6,), 2), ((7, 8), 2), ((9, 10), 2))])
    evals = events.Scalars("epoch/eval_loss")
    assert [e.step for e in evals] == [5, 10]
    assert [e.value for e in evals] == pytest.approx([loss_at(5, 1), loss_at(10, 2)])
    assert events.Scalars("startup/imports_checks_s")[0].value == 1.5
    assert "epoch/checkpoint" not in events.Tags()["scalars"]
    assert "config" in "".join(events.Tags()["tensors"])  # the resolved config, as text


def test_mlflow_run_is_reused_and_holds_each_step_once(tracked):
    from mlflow import MlflowClient

    recorded = json.loads(open(f"{tracked}/tracking.json").read())["mlflow"]
    client = MlflowClient(recorded["tracking_uri"])
    [run] = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert run.info.run_id == recorded["run_id"] and run.info.status == "FINISHED"
    assert run.info.run_name == "run"
    history = client.get_metric_history(run.info.run_id, "step/train_loss")
    assert sorted(m.step for m in history) == list(range(EVERY, 11, EVERY))
    # MLflow keeps what it holds: the restarted attempt skipped the steps up to the first one's last
    # point (8), so only step 10 is the restarted attempt's; each point the mean loss since the
    # previous one within its epoch (epoch 2 is steps 6 to 10).
    values = {m.step: m.value for m in history}
    assert [values[step] for step in sorted(values)] == pytest.approx([mean_loss(steps, number) for steps, number in (
        ((1, 2), 1), ((3, 4), 1), ((6,), 1), ((7, 8), 1), ((9, 10), 2))])
    evals = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "epoch/eval_loss")}
    assert sorted(evals) == [5, 10] and [evals[5], evals[10]] == pytest.approx([loss_at(5, 1), loss_at(10, 2)])
    assert run.data.params["optimizer.lr"] == "0.1" and run.data.params["tracking.log_every_steps"] == "2"
    assert run.data.tags["best_checkpoint"] == "/runs/x/checkpoint_best"
    assert client.download_artifacts(run.info.run_id, "best_checkpoint.json").endswith(".json")


def test_wandb_offline_run_keeps_its_id_across_the_restart(tracked):
    """wandb 0.31 has no reader for its record files; their uncompressed records name the keys."""
    import pathlib

    recorded = json.loads(open(f"{tracked}/tracking.json").read())["wandb"]
    runs = sorted(pathlib.Path(tracked, "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(recorded["id"]) for r in runs)
    records = [(r / f"run-{recorded['id']}.wandb").read_bytes() for r in runs]
    assert all(b"step/train_loss" in r and b"epoch/eval_loss" in r for r in records)
    assert b"optimizer.lr" in records[0]  # the config, logged once per run


def test_a_missing_tracker_package_or_an_unreachable_server_is_one_line(tmp_path, monkeypatch):
    import builtins

    job = JobConfig.from_dict({"tracking": {"mlflow": {"tracking_uri": "http://127.0.0.1:9"}}})
    with pytest.raises(UserError, match=r"^tracking.mlflow.tracking_uri http://127.0.0.1:9 does not answer"):
        tracking.check(job.tracking, str(tmp_path))
    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "mlflow" else real_import(name, *a, **k))
    with pytest.raises(UserError, match=r"pip install 'raytrain-app\[mlflow\]'"):
        tracking.check(job.tracking, str(tmp_path))


def test_credentials_stay_out_of_the_job_file():
    with pytest.raises(ConfigError) as refused:
        JobConfig.from_dict({"tracking": {"mlflow": {"tracking_uri": "https://me:s3cr3t@mlflow.example.com"}}})
    [line] = refused.value.lines
    assert "tracking.mlflow.tracking_uri: must not carry a password: set MLFLOW_TRACKING_USERNAME and " \
           "MLFLOW_TRACKING_PASSWORD" in line
    assert "s3cr3t" not in line  # the message does not repeat the secret
