"""A run directory's record, read in one place: its epochs' metrics, the checkpoints Ray kept,
and which of them is best.

"Best" has one meaning everywhere (the summary, `runs`, sweeps, `evaluate`, `predict`, `export`
and `load_model`): the epoch-end checkpoint whose epoch scored best by the run's
`checkpoint.metric` and `mode` in metrics.jsonl, ties going to the earliest epoch. Mid-epoch
checkpoints never count (they have no score). Where no kept checkpoint has a score, commands
use the latest instead, and say so.

Reading it needs neither torch nor Ray: each checkpoint names its position in a small
`checkpoint.json` beside the weights.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import socket
import time
from dataclasses import dataclass
from typing import Optional

import pyarrow.fs as pafs

from raytrain_app import storage
from raytrain_app.config.files import loads
from raytrain_app.errors import UserError
from raytrain_app.rundir.layout import CONFIG, METRICS, POSITION, RESTARTS, SNAPSHOT, STATE_FILE


@dataclass(frozen=True)
class Kept:
    """A checkpoint kept in a run directory, and where in training it was taken."""

    path: str  # local path or URI
    epoch: int  # completed epochs
    step: int
    batch: int  # micro-batches into the next epoch: 0 at an epoch's end

    @property
    def name(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))


@dataclass(frozen=True)
class Chosen:
    """The checkpoint a command uses, and why it is that one, for its console line."""

    path: str
    why: str  # "best: eval_accuracy 0.9805 at epoch 7", "latest: epoch 12", "named"

    @property
    def name(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))


def read_metrics(run_dir: str) -> list[dict]:
    """metrics.jsonl's rows, one per epoch (a script's: one per report); none before the first."""
    return _jsonl(storage.join(run_dir, METRICS))


def read_restarts(run_dir: str) -> list[dict]:
    """restarts.jsonl's rows: {"time", "kind", "reason"} per restart or resume."""
    return _jsonl(storage.join(run_dir, RESTARTS))


def _jsonl(path: str) -> list[dict]:
    """A JSON-lines file's rows; a last line still being written is not one yet."""
    if not storage.exists(path):
        return []
    lines = [(n, line) for n, line in enumerate(storage.read_text(path).splitlines(), 1) if line.strip()]
    rows = []
    for n, line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            if n != lines[-1][0]:
                raise UserError(f"{path}: line {n} is not JSON") from None
    return rows


def read_config(run_dir: str) -> Optional[dict]:
    """config.yaml as plain data (the resolved config the run started with), or None."""
    path = storage.join(run_dir, CONFIG)
    if not storage.exists(path):
        return None
    try:
        config = loads(storage.read_text(path))
    except Exception:  # noqa: BLE001 - a torn or foreign file: no config to go by
        return None
    return config if isinstance(config, dict) else None


def kept(run_dir: str) -> list[Kept]:
    """The run's checkpoints that say where they were taken, oldest first (Ray names them by
    time); one being written, or left half-written, is not one yet."""
    found = (_kept(storage.join(run_dir, name)) for name in storage.subdirectories(run_dir)
             if name.startswith("checkpoint_"))
    return [k for k in found if k is not None]


def write_position(checkpoint_dir: str, epoch: int, step: int, batch: int) -> None:
    """A checkpoint's POSITION file, written with it (by rank 0, into its local directory)."""
    storage.write_text(storage.join(checkpoint_dir, POSITION), json.dumps({"epoch": epoch, "step": step,
                                                                           "batch": batch}))


def _kept(path: str) -> Optional[Kept]:
    position = storage.join(path, POSITION)
    try:
        if storage.exists(position):
            saved = json.loads(storage.read_text(position))
        else:  # written before checkpoints named their position: it is in rank 0's state
            from raytrain_app.rundir.checkpoints import loop_state  # torch, only for such a run

            saved = loop_state(path)
        return Kept(path, int(saved["epoch"]), int(saved["step"]), int(saved["batch"]))
    except (UserError, ValueError, KeyError, OSError):
        return None


def remove_partial(run_dir: str) -> list[str]:
    """Remove what a failed write left (a checkpoint Ray's index does not name, files still under
    their temporary name); returns their names. Only with the run directory's lease held: a
    checkpoint being written looks the same."""
    snapshot = storage.join(run_dir, SNAPSHOT)
    try:
        index = json.loads(storage.read_text(snapshot)) if storage.exists(snapshot) else None
    except ValueError:
        index = None  # torn: nothing can be told apart, so nothing goes
    named = set(_values(index, "checkpoint_dir_name")) if index is not None else None
    fs, inner = storage.filesystem_for(run_dir)
    removed = []
    for info in fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True)):
        if info.type == pafs.FileType.Directory and info.base_name.startswith("checkpoint_"):
            if named is not None and info.base_name not in named:
                fs.delete_dir(info.path)
                removed.append(info.base_name)
        elif info.type == pafs.FileType.File and info.base_name.endswith(".tmp"):
            fs.delete_file(info.path)
            removed.append(info.base_name)
    return removed


def unwritten(e: Exception, run_dir: str) -> str:
    """A checkpoint that could not be written (a full disk, `CheckpointNotWritten`): what was not
    written, and what is safe. Removes the partial write first, which frees the space to say so."""
    remove_partial(run_dir)
    good = kept(run_dir)
    then = (f"the last good checkpoint is step {good[-1].step}: free space and --resume" if good else
            "no checkpoint was written before it: free space and start again")
    return f"{e}; {then}"


def _values(tree, key: str):
    """Every value under `key` anywhere in parsed JSON."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k == key and isinstance(v, str):
                yield v
            yield from _values(v, key)
    elif isinstance(tree, list):
        for v in tree:
            yield from _values(v, key)


def best_row(rows: list[dict], metric: str, mode: str, epochs: Optional[set[int]] = None) -> Optional[dict]:
    """The epoch row with the best finite `metric` (among `epochs`, if given); ties go to the
    earliest epoch."""
    scored = [row for row in rows if "epoch" in row and (epochs is None or row["epoch"] in epochs)
              and isinstance(row.get(metric), (int, float)) and math.isfinite(row[metric])]
    if not scored:
        return None
    sign = -1 if mode == "max" else 1
    return min(scored, key=lambda row: (sign * row[metric], row["epoch"]))


def ranking(config: Optional[dict]) -> tuple[Optional[str], Optional[str]]:
    """The metric and mode that rank a run's checkpoints, from its resolved config (none for a script)."""
    if not config or config.get("script"):
        return None, None
    checkpoint = config.get("checkpoint", {})
    return checkpoint.get("metric"), checkpoint.get("mode")


def best(run_dir: str, checkpoints: Optional[list[Kept]] = None,
         rows: Optional[list[dict]] = None) -> tuple[Optional[Kept], Optional[dict]]:
    """The best kept checkpoint and its epoch's metrics row, or (None, None) where none has a score."""
    metric, mode = ranking(read_config(run_dir))
    if metric is None:
        return None, None
    checkpoints = kept(run_dir) if checkpoints is None else checkpoints
    by_epoch = {c.epoch: c for c in checkpoints if not c.batch}  # a re-run epoch's newest, which its row is of
    row = best_row(read_metrics(run_dir) if rows is None else rows, metric, mode, set(by_epoch))
    return (by_epoch[row["epoch"]], row) if row else (None, None)


def describe(row: dict, metric: str) -> str:
    return f"{metric} {row[metric]:.4f} at epoch {row['epoch']}"


def choose(path: str, which: Optional[str] = None) -> Chosen:
    """The checkpoint `which` names in the run directory or checkpoint `path`: "best", "latest", a
    checkpoint_* name, or None for the default: best where a checkpoint has a score, else latest."""
    path = storage.normalize(path)
    if not storage.exists(path):
        raise UserError(f"{path} does not exist: name a run directory or one of its checkpoint_* directories")
    if storage.is_file(path):
        raise UserError(f"{path} is a file: name a run directory or one of its checkpoint_* directories")
    if storage.exists(storage.join(path, STATE_FILE)):  # a checkpoint itself
        if which not in (None, "latest"):
            raise UserError(f"--checkpoint {which}: {path} is a checkpoint already; name its run directory instead")
        return Chosen(path, "named")
    checkpoints = kept(path)
    if not checkpoints:
        others = [name for name in storage.subdirectories(path) if name.startswith("checkpoint_")]
        if others:  # a script's checkpoints hold its own files
            raise UserError(f"{storage.join(path, others[-1])} holds no readable {STATE_FILE}: only the checkpoints "
                            "of raytrain-app's own training loop can be used here")
        raise UserError(f"no checkpoint in {path}: name a run directory or one of its checkpoint_* directories")
    latest = Chosen(checkpoints[-1].path, f"latest: epoch {checkpoints[-1].epoch}"
                                          + (f", batch {checkpoints[-1].batch}" if checkpoints[-1].batch else ""))
    if which == "latest":
        return latest
    if which not in (None, "best"):
        names = [c.name for c in checkpoints]
        if which not in names:
            raise UserError(f"--checkpoint: {path} has no {which} (latest, best, or one of {', '.join(names)})")
        return Chosen(storage.join(path, which), "named")
    found, row = best(path, checkpoints)
    if found:
        return Chosen(found.path, f"best: {describe(row, ranking(read_config(path))[0])}")
    if which == "best":
        metric = ranking(read_config(path))[0] or "checkpoint.metric"
        raise UserError(f"--checkpoint best: no checkpoint of {path} has a {metric} in its {METRICS}; use latest")
    return Chosen(latest.path, latest.why + " (no checkpoint has a score)")


# ---- what a run writes, as it goes ----------------------------------------------------------

class MetricsLog:
    """metrics.jsonl, one object per epoch; a re-run epoch (after a restart) replaces its row.
    A script's reports without an `epoch` are numbered by their `report` count instead."""

    def __init__(self, path: str, resume: bool):
        self.path = path
        self._rows: dict[int, dict] = {}
        if resume:
            self._rows = {_key(row): row for row in _jsonl(path)}

    def add(self, row: dict) -> None:
        key = _key(row)
        self._rows[key] = row
        self._rows = {e: r for e, r in self._rows.items() if e <= key}
        self._write()

    def fill(self, rows: list[dict]) -> None:
        """Rows of epochs the file lacks (a checkpoint's, written before its driver wrote them);
        those it has stand."""
        missing = [row for row in rows if _key(row) not in self._rows]
        if missing:
            self._rows.update((_key(row), row) for row in missing)
            self._write()

    def rows(self) -> list[dict]:
        return [self._rows[e] for e in sorted(self._rows)]

    def _write(self) -> None:
        storage.write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.rows()))


def _key(row: dict) -> int:
    return row.get("epoch", row.get("report", 0))


def read_record(run_dir: str) -> dict:
    """run.json as record_status wrote it, or {} before it has."""
    path = storage.join(run_dir, "run.json")
    return json.loads(storage.read_text(path)) if storage.exists(path) else {}


def record_status(run_dir: str, status: str, reason: str = "", launch: Optional[dict] = None) -> None:
    """RUN_DIR/run.json: whether the run is running (and which process runs it), finished,
    failed or interrupted, for `raytrain-app runs`; its first start survives resumes, and how it
    was launched (`launch`: where, how many workers, a script and its arguments) the updates."""
    path = storage.join(run_dir, "run.json")
    earlier = read_record(run_dir)
    now = time.time()
    launch = launch or earlier.get("launch")
    record = {"status": status, "started": earlier.get("started", now), "updated": now,
              "host": socket.gethostname(), "pid": os.getpid(), **({"launch": launch} if launch else {}),
              **({"reason": reason} if reason else {})}
    storage.write_text(path, json.dumps(record) + "\n")


def record_restart(run_dir: str, kind: str, reason: str) -> None:
    """One line in RUN_DIR/restarts.jsonl: `report.png` marks it on the time axis."""
    path = storage.join(run_dir, RESTARTS)
    earlier = storage.read_text(path) if storage.exists(path) else ""
    storage.write_text(path, earlier + json.dumps({"time": time.time(), "kind": kind, "reason": reason}) + "\n")
