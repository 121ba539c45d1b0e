"""`data.engine: ray_data`: training batches from Ray Data's split of the Parquet files, on the
session's Ray cluster. Its two limits are part of what is tested: no fixed order (so the shards are
checked as sets), and resume at epoch boundaries only (a killed worker restarts its epoch)."""

import pytest

from raytrain_app.config import JobConfig
from raytrain_app.errors import ConfigError
from tests.test_distributed import job, run
from tests.test_reliability import resumed_at
from tests.test_stream import ROWS, write_numbered

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_every_rank_trains_on_as_many_disjoint_rows_each_epoch_and_a_killed_worker_restarts_its_epoch(tmp_path):
    """Rows numbered by their label, trained under Ray Train with Ray Data as the reader: a custom
    step records the labels of every batch each rank's process trains on. Ray Train splits the
    data with `streaming_split(world_size, equal=True)`: each epoch, the ranks' rows are disjoint,
    as many on each, and all but a few (fewer than a batch a rank) of the rows. Rank 1 is
    SIGKILLed in epoch 2: Ray Data resumes at epoch boundaries only, so the restarted group
    trains epoch 2 again, whole, from epoch 1's checkpoint."""
    train, seen, marker = write_numbered(tmp_path / "train"), tmp_path / "seen", tmp_path / "fault"
    seen.mkdir()
    marker.touch()
    per_epoch = ROWS // 2 // 16
    model = {"name": "tests.helpers:faulty_label_recorder",
             "args": {"out_dir": str(seen), "marker": str(marker), "at": per_epoch + 5, "rank": 1}}
    config = job(model=model, task={"name": "tests.helpers:record_labels"},
                 checkpoint={"every_epochs": 1, "mode": "min"}, failure={"max_failures": 1},
                 data={"name": "parquet", "engine": "ray_data",
                       "args": {"path": str(train), "eval_path": str(train / "part-2.parquet"),
                                "features": ["x", "one"], "buffer_rows": 100}},
                 train={"epochs": 2, "batch_size": 16})
    result = run(config, tmp_path / "run", local=False)
    assert not marker.exists()  # the fault really happened
    log = (tmp_path / "run" / "logs" / "rank-1.log").read_text()
    assert "data from Ray Data" in log
    assert resumed_at(log)[:3] == (per_epoch, 2, 0)  # the epoch boundary, never inside the epoch
    assert [row["epoch"] for row in result.metrics] == [1, 2]
    assert [row["step"] for row in result.metrics] == [per_epoch, 2 * per_epoch]

    # Each rank's two processes: the first trained epoch 1 and part of epoch 2, the restarted one epoch 2.
    files = {rank: sorted(seen.glob(f"rank-{rank}-*.txt"), key=lambda p: p.stat().st_mtime) for rank in (0, 1)}
    assert [len(f) for f in files.values()] == [2, 2], files
    batches = {rank: [[[int(v) for v in line.split()] for line in path.open()] for path in paths]
               for rank, paths in files.items()}
    assert all(len(batches[rank][0]) > per_epoch and len(batches[rank][1]) == per_epoch for rank in (0, 1))
    assert all(len(x) == 16 for rank in (0, 1) for attempt in batches[rank] for x in attempt)
    for epoch in ([batches[rank][0][:per_epoch] for rank in (0, 1)], [batches[rank][1] for rank in (0, 1)]):
        rows = [[r for batch in epoch[rank] for r in batch] for rank in (0, 1)]
        assert not set(rows[0]) & set(rows[1])  # disjoint
        assert len(set(rows[0])) == len(rows[0]) == len(rows[1]) == per_epoch * 16  # as many, none twice
        assert set(rows[0]) | set(rows[1]) <= set(range(ROWS))
        assert ROWS - len(rows[0]) - len(rows[1]) < 2 * 16  # all but what does not fill a batch a rank


def test_its_limits_are_refused_in_one_line_each():
    base = {"data": {"name": "parquet", "engine": "ray_data", "args": {"path": "a", "eval_path": "b"}}}
    for change, message in (
            ({"checkpoint": {"every_steps": 10}}, "checkpoint.every_steps: data.engine: ray_data resumes at epoch "
                                                  "boundaries only"),
            ({"data": {**base["data"], "args": {"path": "a"}}}, "data.engine: ray_data needs data.args.eval_path"),
            ({"data": {"engine": "ray_data"}}, "data.engine: ray_data reads Parquet only (data.name: parquet), "
                                               "not 'digits'")):
        with pytest.raises(ConfigError) as raised:
            JobConfig.from_dict({**base, **change})
        assert [line for line in raised.value.lines if message in line], raised.value.lines
