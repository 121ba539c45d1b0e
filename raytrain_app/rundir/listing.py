"""`raytrain-app runs`: which of the runs under a directory are worth resuming or comparing,
without loading their weights.

A run's files say what happened only in pieces: metrics.jsonl how far it got, config.yaml how far
it was meant to go and which metric ranks it, the checkpoint snapshot whether `--resume` has
something to start from, run.json how it ended. And a run whose process was killed never wrote
that it ended: run.json still says "running", so whether it is running is asked of the process.
"""

from __future__ import annotations

import json
import re
import socket
import time
from dataclasses import asdict, dataclass
from typing import Optional

from raytrain_app import rundir, storage
from raytrain_app.console import columns
from raytrain_app.errors import UserError
from raytrain_app.rundir.lease import process_alive

_DEFAULT_DIR = re.compile(r"-(\d{8}-\d{6})$")  # runs/NAME-YYYYmmdd-HHMMSS, as `train` names them
COLUMNS = ("NAME", "START", "EPOCHS", "BEST", "STATUS")


@dataclass(frozen=True)
class RunInfo:
    path: str  # the run directory, a local path or URI
    name: str  # the directory's name, for `train --run-dir DIR/NAME --resume` and `report DIR/NAME`
    started: Optional[float]  # Unix seconds: run.json's first start, else the time in a default run name
    epochs_done: int  # the highest epoch in metrics.jsonl; a script's runs without epochs: its reports
    epochs: Optional[int]  # planned (train.epochs); None for a script, which plans its own
    best: str  # "eval_accuracy 0.9712 (epoch 11)" by checkpoint.metric and mode, or "-"
    status: str  # finished, running, running on HOST, resumable, failed, interrupted or unknown


def find_runs(directory: str = "runs") -> list[RunInfo]:
    """The runs directly under `directory`, newest first; folders without config.yaml are no runs."""
    if not storage.exists(directory):
        raise UserError(f"no such directory: {directory}")
    base = storage.normalize(directory)
    found = [(run, _mtime(storage.join(run.path, "config.yaml")))
             for name in storage.subdirectories(base) if (run := _read_run(base, name)) is not None]
    found.sort(key=lambda run_mtime: run_mtime[0].started or run_mtime[1], reverse=True)
    return [run for run, _ in found]


def _read_run(base: str, name: str) -> Optional[RunInfo]:
    """One run directory's summary, or None when it holds no run (no config.yaml that parses)."""
    path = storage.join(base, name)
    config = rundir.read_config(path)
    if config is None:
        return None
    record = rundir.read_record(path)
    rows = rundir.read_metrics(path)
    script = bool(config.get("script"))
    epochs = None if script else config.get("train", {}).get("epochs")
    epochs_done = max((row["epoch"] for row in rows if "epoch" in row), default=len(rows) if script else 0)
    snapshot = storage.exists(storage.join(path, rundir.SNAPSHOT))
    return RunInfo(
        path=path, name=name, started=record.get("started", _started_from_name(name)),
        epochs_done=epochs_done, epochs=epochs,
        best="-" if script else _best(path, rows),
        status=_status(record, epochs_done, epochs, snapshot) + (" (smoke)" if _smoke(config) else ""),
    )


def _smoke(config: dict) -> bool:
    """A `--smoke` run's: it trained only the first batches of its epoch."""
    return bool(config.get("train", {}).get("limit_batches"))


def table(runs: list[RunInfo]) -> str:
    """Aligned columns, one line per run under a header."""
    return columns(COLUMNS, [(run.name, _when(run.started), _epochs(run), run.best, run.status) for run in runs])


def as_json(runs: list[RunInfo]) -> str:
    return json.dumps([asdict(run) for run in runs], indent=2)


def _status(record: dict, epochs_done: int, epochs: Optional[int], snapshot: bool) -> str:
    """finished as recorded; running while the recording process lives (on another host: "running
    on HOST", unchecked); else resumable with a checkpoint and epochs to go, failed or interrupted
    without. A run from before run.json finished if it did all its epochs; a script's says nothing."""
    recorded = record.get("status")
    if recorded in ("finished", "stopped early"):  # stopped early: by train.early_stopping or a sweep's scheduler
        return recorded
    if recorded == "running":
        if record.get("host") != socket.gethostname():
            return f"running on {record.get('host')}"  # another machine's process: not ours to ask
        if process_alive(record.get("pid"), record.get("updated", record.get("started", 0.0))):
            return "running"
    if recorded is None and epochs is None:
        return "unknown"  # an older script's run: its checkpoints stay whether it ended well or not
    if recorded is None and epochs_done >= epochs:
        return "finished"  # an older run, from before run.json: it got as far as it meant to
    if snapshot and (epochs is None or epochs_done < epochs):
        return "resumable"
    ended = ("failed", "interrupted", "stopped", "stopped early")
    return recorded if recorded in ended else "failed"  # "running": it died


def _best(path: str, rows: list[dict]) -> str:
    """The best checkpoint's score and epoch, as every command picks it (`rundir.best`)."""
    found, row = rundir.best(path, rows=rows)
    metric, _ = rundir.ranking(rundir.read_config(path))
    return f"{metric} {row[metric]:.4f} (epoch {row['epoch']})" if found else "-"


def _started_from_name(name: str) -> Optional[float]:
    found = _DEFAULT_DIR.search(name)
    return time.mktime(time.strptime(found.group(1), "%Y%m%d-%H%M%S")) if found else None


def _mtime(path: str) -> float:
    fs, p = storage.filesystem_for(path)
    mtime = fs.get_file_info(p).mtime
    return mtime.timestamp() if mtime else 0.0


def _when(started: Optional[float]) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(started)) if started is not None else "-"


def _epochs(run: RunInfo) -> str:
    return f"{run.epochs_done}/{run.epochs}" if run.epochs is not None else str(run.epochs_done)
