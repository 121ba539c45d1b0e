"""The index of kept checkpoints, kept by a local-mode run the way Ray Train's controller keeps it.

Under Ray, the controller writes `checkpoint_manager_snapshot.json` after each checkpoint and
deletes those past `checkpoint.keep`. Local mode has no controller, so its rank 0 does both here,
in the same format and with the same rule: a run started locally resumes under Ray (and the
other way round), and `runs`, `remove_partial` and `--resume` read one index whichever ran it.

The rule (Ray's `CheckpointManager`): checkpoints are ordered by score, worst first, ties by
report order; the worst beyond `keep` go, never the latest. The index is written before the
deletion, so a crash between the two leaves an index that names only what still exists. Ray's
controller can be stopped between a deletion and the index's next write, and its next start
refuses such an index: `drop_missing` mends it first.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from typing import Optional

from raytrain_app import storage
from raytrain_app.rundir.layout import SNAPSHOT


def read(run_dir: str) -> Optional[dict]:
    """The run's index as plain data, or None before its first checkpoint."""
    path = storage.join(run_dir, SNAPSHOT)
    return json.loads(storage.read_text(path)) if storage.exists(path) else None


def latest(run_dir: str) -> Optional[str]:
    """The URI of the newest checkpoint the index names, or None."""
    index = read(run_dir)
    newest = (index or {}).get("latest_checkpoint_result")
    return storage.join(run_dir, newest["checkpoint_dir_name"]) if newest else None


def add(run_dir: str, name: str, metrics: dict, metric: str, mode: str, keep: int) -> None:
    """Record checkpoint `name` (taken with `metrics`) and drop the worst by `metric` past `keep`."""
    index = read(run_dir) or {"checkpoint_results": [], "checkpoint_report_indices": [], "current_report_index": 0}
    report = index["current_report_index"]
    entry = {"version": 0, "checkpoint_dir_name": name, "metrics": metrics}
    kept = list(zip(index["checkpoint_results"], index["checkpoint_report_indices"])) + [(entry, report)]
    sign = 1 if mode == "max" else -1
    kept.sort(key=lambda pair: (sign * pair[0]["metrics"].get(metric, 0), pair[1]))
    dropped = [pair for pair in kept[:-keep] if pair[0] is not entry]  # never the latest
    kept = [pair for pair in kept if pair not in dropped]
    index.update({
        "ray_version": version("ray"),  # the version that wrote it, as Ray records
        "checkpoint_results": [e for e, _ in kept],
        "checkpoint_report_indices": [i for _, i in kept],
        "latest_checkpoint_result": entry,
        "pending_training_results": [],
        "pending_validation_specs": [],
        "current_report_index": report + 1,
        "validated_checkpoint_dir_names": [],
        "timed_out_validation_checkpoint_dir_names": [],
        "failed_validation_checkpoint_dir_names": [],
    })
    storage.write_text(storage.join(run_dir, SNAPSHOT), json.dumps(index))
    for e, _ in dropped:
        storage.remove(storage.join(run_dir, e["checkpoint_dir_name"]))


def drop_missing(run_dir: str) -> list[str]:
    """Take out of the index the checkpoints it names that are gone; the newest left becomes the
    latest if the latest went. Ray Train's controller, stopped (a job's `stop`, a preemption)
    after it deleted a checkpoint past `keep` and before it wrote the index again, leaves one that
    its next start refuses ("a reference to a checkpoint that does not exist anymore"). Only
    with the run directory's lease held. Returns the names taken out."""
    index = read(run_dir)
    if not index:
        return []
    pairs = list(zip(index["checkpoint_results"], index["checkpoint_report_indices"]))
    gone = {e["checkpoint_dir_name"] for e, _ in pairs
            if not storage.exists(storage.join(run_dir, e["checkpoint_dir_name"]))}
    if not gone:
        return []
    kept = [(e, i) for e, i in pairs if e["checkpoint_dir_name"] not in gone]
    index["checkpoint_results"] = [e for e, _ in kept]
    index["checkpoint_report_indices"] = [i for _, i in kept]
    latest = index.get("latest_checkpoint_result")
    if latest and latest["checkpoint_dir_name"] in gone:
        index["latest_checkpoint_result"] = max(kept, key=lambda pair: pair[1])[0] if kept else None
    storage.write_text(storage.join(run_dir, SNAPSHOT), json.dumps(index))
    return sorted(gone)
