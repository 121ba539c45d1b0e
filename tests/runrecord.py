"""A local run directory's record read by hand: its files opened with `json`, by the names and
in the format docs/reference/run-directory.md gives, not through `raytrain_app.rundir`,
which the commands under test read them with. Tests take their expected answers from here."""

import glob
import json
import os


def metrics(run_dir) -> list[dict]:
    """metrics.jsonl's rows, one per epoch."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def positions(run_dir) -> dict[str, dict]:
    """Each kept checkpoint's checkpoint.json ({"epoch", "step", "batch"}) by its path, oldest
    first (Ray names checkpoints by the time they were taken)."""
    found = sorted(glob.glob(os.path.join(str(run_dir), "checkpoint_*", "checkpoint.json")))
    return {os.path.dirname(path): json.loads(open(path).read()) for path in found}


def latest(run_dir) -> tuple[str, dict]:
    """The checkpoint `--resume` continues from: the latest that Ray Train's index
    (checkpoint_manager_snapshot.json, in Ray's own format) names, not merely the newest
    directory (one whose write a stop cut short is not in the index); its path and position."""
    index = json.loads(open(os.path.join(run_dir, "checkpoint_manager_snapshot.json")).read())
    path = os.path.join(run_dir, index["latest_checkpoint_result"]["checkpoint_dir_name"])
    return path, json.loads(open(os.path.join(path, "checkpoint.json")).read())


def best(run_dir, metric: str = "eval_accuracy") -> tuple[str, dict]:
    """The best checkpoint as docs/how-to/use-a-checkpoint.md defines it: of the epoch-end checkpoints still kept, the
    one whose epoch scored the highest `metric` in metrics.jsonl, ties going to the earliest
    epoch. Its path, and its epoch's row."""
    epoch_ends = {position["epoch"]: path for path, position in positions(run_dir).items() if position["batch"] == 0}
    scored = sorted((row for row in metrics(run_dir) if row["epoch"] in epoch_ends), key=lambda row: row["epoch"])
    row = max(scored, key=lambda row: row[metric])  # the first of equal maxima: the earliest epoch
    return epoch_ends[row["epoch"]], row
