"""`raytrain-app runs`: real run directories as the driver leaves them, read in process (no Ray)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Optional
from unittest import mock

import psutil
import pytest

from raytrain_app import rundir
from raytrain_app.config import JobConfig, dump_yaml
from raytrain_app.config.resolve import resolve_auto
from raytrain_app.driver.plan import make_plan
from raytrain_app.errors import UserError
from raytrain_app.rundir import SNAPSHOT as CHECKPOINT_SNAPSHOT
from raytrain_app.rundir import listing as runs
from tests.helpers import save_checkpoint

NOW = time.time()


def make_run(root, name: str, epochs: int = 5, done: int = 5, record: Optional[dict] = None,
             snapshot: bool = False, checkpoint: Optional[dict] = None, accuracy: Optional[list] = None,
             kept: Optional[list[int]] = None):
    """A run directory written by the run's own writers: config.yaml as `train` writes it
    (resolved), a metrics row per finished epoch (MetricsLog), a checkpoint directory naming its
    position for each of the `kept` epochs (default: all), run.json (record_status, as the run
    that `record` describes wrote it), and Ray's checkpoint snapshot when `snapshot`."""
    path = root / name
    path.mkdir()
    ranking = checkpoint or {"metric": "eval_accuracy", "mode": "max"}
    config = JobConfig.from_dict({"name": name.split("-")[0], "train": {"epochs": epochs}, "checkpoint": ranking})
    (path / "config.yaml").write_text(dump_yaml(config))
    accuracy = accuracy or [0.5 + 0.05 * epoch for epoch in range(1, done + 1)]
    log = rundir.MetricsLog(str(path / rundir.METRICS), resume=False)
    for epoch in range(1, done + 1):
        log.add({"epoch": epoch, "step": 10 * epoch, "train_loss": 1.0 / epoch, "eval_loss": 1.1 / epoch,
                 "eval_accuracy": accuracy[epoch - 1], "time": NOW - 100 + epoch})
    for epoch in range(1, done + 1) if kept is None else kept:
        rundir.write_position(str(path / f"checkpoint_2026-01-01_00-00-{epoch:02d}.000000"), epoch, 10 * epoch, 0)
    if record is not None:
        write_record(str(path), **record)
    if snapshot:
        (path / CHECKPOINT_SNAPSHOT).write_text(json.dumps({"checkpoints": [f"checkpoint_{done}"]}))
    return path


def write_record(path: str, status: str, pid: int, started: float, updated: float, host: str, reason: str) -> None:
    """run.json as record_status writes it for a run that started at `started` and last said
    `status` at `updated`, in process `pid` on `host`: the writer's own code, at those times."""
    with mock.patch("raytrain_app.rundir.os.getpid", return_value=pid), \
            mock.patch("raytrain_app.rundir.socket.gethostname", return_value=host), \
            mock.patch("raytrain_app.rundir.time.time", side_effect=[started, updated]):
        rundir.record_status(path, "running")
        rundir.record_status(path, status, reason)


def record(status: str, pid: Optional[int] = None, started: float = NOW - 60, updated: Optional[float] = None,
           host: Optional[str] = None, reason: str = "") -> dict:
    return {"status": status, "started": started, "updated": NOW - 30 if updated is None else updated,
            "host": host or socket.gethostname(), "pid": pid or os.getpid(), "reason": reason}


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def only(root) -> runs.RunInfo:
    found = runs.find_runs(str(root))
    assert len(found) == 1
    return found[0]


def test_finished_run(tmp_path):
    make_run(tmp_path, "digits-20260101-120000", epochs=3, done=3, record=record("finished"), snapshot=True)
    run = only(tmp_path)
    assert (run.name, run.epochs_done, run.epochs, run.status) == ("digits-20260101-120000", 3, 3, "finished")
    assert run.started == NOW - 60  # run.json's, not the directory name's
    assert run.path == str(tmp_path / "digits-20260101-120000")


def test_running_with_a_live_process(tmp_path):
    # written by this very process, after it started
    make_run(tmp_path, "live", done=2, record=record("running", pid=os.getpid(), updated=time.time() - 1))
    assert only(tmp_path).status == "running"


def test_running_on_another_host_is_not_checked_here(tmp_path):
    make_run(tmp_path, "elsewhere", done=2, record=record("running", pid=dead_pid(), host="gpu-node-7"))
    assert only(tmp_path).status == "running on gpu-node-7"


@pytest.mark.parametrize("pid, updated", [
    (None, None),  # the process that wrote "running" is gone
    ("self", psutil.Process().create_time() - 60),  # its pid now belongs to a later process: this one
], ids=["dead pid", "reused pid"])
def test_running_whose_process_died_is_resumable_with_a_checkpoint(tmp_path, pid, updated):
    pid = os.getpid() if pid == "self" else dead_pid()
    make_run(tmp_path, "killed", epochs=5, done=2, snapshot=True,
             record=record("running", pid=pid, started=(updated or NOW) - 10, updated=updated))
    run = only(tmp_path)
    assert (run.epochs_done, run.epochs, run.status) == (2, 5, "resumable")


def test_running_whose_process_is_a_zombie_is_not_running(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])  # exits; unreaped, it stays a zombie
    try:
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
        make_run(tmp_path, "zombie", done=2, snapshot=True,
                 record=record("running", pid=child.pid, updated=time.time()))
        assert only(tmp_path).status == "resumable"
    finally:
        child.wait()


def test_running_whose_process_died_without_a_checkpoint_failed(tmp_path):
    make_run(tmp_path, "killed", epochs=5, done=0, record=record("running", pid=dead_pid()))
    assert only(tmp_path).status == "failed"


@pytest.mark.parametrize("status, snapshot, done, expected", [
    ("failed", False, 2, "failed"),
    ("failed", True, 2, "resumable"),
    ("failed", True, 5, "failed"),  # every epoch done: nothing left to resume
    ("interrupted", False, 2, "interrupted"),
    ("interrupted", True, 2, "resumable"),
])
def test_ended_runs(tmp_path, status, snapshot, done, expected):
    make_run(tmp_path, "ended", epochs=5, done=done, snapshot=snapshot, record=record(status, reason="boom"))
    assert only(tmp_path).status == expected


@pytest.mark.parametrize("done, snapshot, expected", [
    (4, False, "finished"), (2, True, "resumable"), (2, False, "failed"),
])
def test_older_runs_without_run_json_are_inferred(tmp_path, done, snapshot, expected):
    make_run(tmp_path, "digits-20250102-030405", epochs=4, done=done, snapshot=snapshot)
    run = only(tmp_path)
    assert run.status == expected
    assert run.started == time.mktime((2025, 1, 2, 3, 4, 5, 0, 0, -1))  # from the run's default name


def test_folders_that_are_no_runs_are_skipped(tmp_path):
    make_run(tmp_path, "real", record=record("finished"))
    (tmp_path / "notes").mkdir()
    (tmp_path / "metrics-only").mkdir()
    (tmp_path / "metrics-only" / "metrics.jsonl").write_text('{"epoch": 1}\n')
    (tmp_path / "README.txt").write_text("not a directory")
    assert [run.name for run in runs.find_runs(str(tmp_path))] == ["real"]


def test_best_follows_the_checkpoint_metric_and_mode(tmp_path):
    make_run(tmp_path, "acc", done=4, accuracy=[0.6, 0.9712, 0.8, 0.7], record=record("finished"))
    loss = make_run(tmp_path, "loss", done=4, checkpoint={"metric": "eval_loss", "mode": "min"},
                    record=record("finished", started=NOW - 120))
    rows = [json.loads(line) for line in (loss / "metrics.jsonl").read_text().splitlines()]
    rows[0]["eval_loss"] = float("nan")  # a diverged epoch (train.stop_on_nonfinite: false) is no best
    (loss / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    best = {run.name: run.best for run in runs.find_runs(str(tmp_path))}
    assert best == {"acc": "eval_accuracy 0.9712 (epoch 2)", "loss": "eval_loss 0.2750 (epoch 4)"}


def test_best_is_a_kept_checkpoints_and_a_tie_goes_to_the_earliest(tmp_path):
    """Epoch 2 scored best, but its checkpoint is gone: the best is the best of what is kept. Of
    epochs 3 and 5, tied, the earlier."""
    make_run(tmp_path, "tied", done=5, accuracy=[0.6, 0.99, 0.9, 0.8, 0.9], kept=[1, 3, 4, 5],
             record=record("finished"))
    assert only(tmp_path).best == "eval_accuracy 0.9000 (epoch 3)"


def test_a_run_without_epochs_has_no_best(tmp_path):
    make_run(tmp_path, "early", done=0, record=record("failed"))
    run = only(tmp_path)
    assert (run.best, run.epochs_done, run.status) == ("-", 0, "failed")


@pytest.mark.parametrize("status, expected", [("interrupted", "resumable"), (None, "unknown")])
def test_script_runs_count_reports_and_plan_no_epochs(tmp_path, status, expected):
    path = tmp_path / "script-run"
    path.mkdir()
    (path / "config.yaml").write_text(dump_yaml(JobConfig.from_dict({"name": "s", "script": {"path": "t.py"}})))
    (path / "metrics.jsonl").write_text("".join(json.dumps({"report": i, "loss": 1.0 / i}) + "\n" for i in (1, 2, 3)))
    if status:
        write_record(str(path), **record(status))
    (path / CHECKPOINT_SNAPSHOT).write_text("{}")  # an older script's run keeps it whether it finished or not
    run = only(tmp_path)
    assert (run.epochs_done, run.epochs, run.best, run.status) == (3, None, "-", expected)
    header, line = runs.table([run]).splitlines()
    assert line[header.index("EPOCHS"):].split()[0] == "3"  # no plan to show


def test_newest_first_by_start_else_modification_time(tmp_path):
    make_run(tmp_path, "old", record=record("finished", started=NOW - 3600))
    make_run(tmp_path, "new", record=record("finished", started=NOW - 60))
    undated = make_run(tmp_path, "undated")  # no run.json, no time in its name: config.yaml's mtime
    os.utime(undated / "config.yaml", (NOW - 600, NOW - 600))
    assert [run.name for run in runs.find_runs(str(tmp_path))] == ["new", "undated", "old"]


def test_table_has_a_header_and_one_aligned_row_per_run(tmp_path):
    started = time.mktime((2026, 3, 4, 5, 6, 7, 0, 0, -1))
    make_run(tmp_path, "a-much-longer-run-name", epochs=10, done=3, snapshot=True,
             record=record("failed", started=started))
    make_run(tmp_path, "short", epochs=3, done=3, record=record("finished", started=started - 60))
    lines = runs.table(runs.find_runs(str(tmp_path))).splitlines()
    assert lines[0].split() == ["NAME", "START", "EPOCHS", "BEST", "STATUS"]
    assert len(lines) == 3
    assert lines[1].split()[:4] == ["a-much-longer-run-name", "2026-03-04", "05:06", "3/10"]
    assert lines[1].endswith("resumable") and lines[2].endswith("finished")
    for column in ("START", "EPOCHS", "BEST", "STATUS"):
        at = lines[0].index(column)
        assert all(line[at - 2:at] == "  " and line[at] != " " for line in lines[1:]), column


def test_json_lists_every_field(tmp_path):
    make_run(tmp_path, "digits", epochs=3, done=3, record=record("finished"))
    [row] = json.loads(runs.as_json(runs.find_runs(str(tmp_path))))
    assert row == {"path": str(tmp_path / "digits"), "name": "digits", "started": NOW - 60, "epochs_done": 3,
                   "epochs": 3, "best": "eval_accuracy 0.6500 (epoch 3)", "status": "finished"}


# A run directory as the README documents its files (and run.json as `runs` reads it), written
# out by hand: a format that the writers and `runs` got wrong alike would pass the tests above.
HANDWRITTEN = {
    "config.yaml": "name: digits\ntrain:\n  epochs: 4\ncheckpoint:\n  metric: eval_loss\n  mode: min\n",
    "metrics.jsonl": '{"epoch": 1, "step": 45, "train_loss": 0.9, "eval_loss": 0.3, "eval_accuracy": 0.91}\n'
                     '{"epoch": 2, "step": 90, "train_loss": 0.5, "eval_loss": 0.3, "eval_accuracy": 0.93}\n'
                     '{"epoch": 3, "step": 135, "train_loss": 0.2, "eval_loss": 0.1, "eval_accuracy": 0.97}\n',
    "run.json": '{"status": "interrupted", "started": 1767261600.5, "updated": 1767262500.0, "host": "gpu-node-7", '
                '"pid": 4242, "reason": "interrupted (Ctrl-C)"}\n',
    "checkpoint_manager_snapshot.json": "{}",
    # epochs 1 and 2 tie on eval_loss; epoch 3 scored best, but only a checkpoint inside epoch 4 is kept of it
    "checkpoint_2026-01-01_10-01-00.000000/checkpoint.json": '{"epoch": 1, "step": 45, "batch": 0}',
    "checkpoint_2026-01-01_10-02-00.000000/checkpoint.json": '{"epoch": 2, "step": 90, "batch": 0}',
    "checkpoint_2026-01-01_10-03-30.000000/checkpoint.json": '{"epoch": 3, "step": 140, "batch": 10}',
}


def test_a_handwritten_run_directory_reads_as_documented(tmp_path):
    for name, text in HANDWRITTEN.items():
        (tmp_path / "by-hand" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "by-hand" / name).write_text(text)
    [row] = json.loads(runs.as_json(runs.find_runs(str(tmp_path))))
    assert row == {"path": str(tmp_path / "by-hand"), "name": "by-hand", "started": 1767261600.5, "epochs_done": 3,
                   "epochs": 4, "best": "eval_loss 0.3000 (epoch 1)", "status": "resumable"}


def test_a_missing_directory_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no such directory: .*nowhere"):
        runs.find_runs(str(tmp_path / "nowhere"))


def test_resume_if_any_starts_a_fresh_run_dir_and_continues_one_with_a_checkpoint(tmp_path):
    """The entrypoint of a job its scheduler may run again (a retried RayJob, a requeued SLURM job)."""
    config = JobConfig.from_dict({"name": "again", "train": {"epochs": 1}})
    fresh = make_plan(config, run_dir=str(tmp_path / "run"), resume="if_any")
    fresh.lease.release()
    assert fresh.resume is False
    save_checkpoint(tmp_path / "run" / "checkpoint_2026-01-01_00-00-00.000000", resolve_auto(config))
    (tmp_path / "run" / CHECKPOINT_SNAPSHOT).write_text("{}")
    again = make_plan(config, run_dir=str(tmp_path / "run"), resume="if_any")
    again.lease.release()
    assert again.resume is True
    with pytest.raises(UserError, match="already holds a run"):  # without it, a second start is refused
        make_plan(config, run_dir=str(tmp_path / "run"))
    with pytest.raises(UserError, match="--resume-if-any needs --run-dir"):
        make_plan(config, resume="if_any")
