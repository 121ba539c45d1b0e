"""`data.engine: ray_data`: training batches from Ray Data's split of the Parquet files, on the
session's Ray cluster. Its two limits are part of what is tested: no fixed order (so the shards are
checked as sets), and resume at epoch boundaries only (a killed worker restarts its epoch)."""

import pyarrow.parquet as pq
import pytest

from raytrain_app.config import JobConfig
from raytrain_app.data.parquet import DIGITS_FILE
from raytrain_app.errors import ConfigError
from tests.test_distributed import job, run
from tests.test_reliability import resumed_at
from tests.test_stream import ROWS, write_numbered

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_in_a_real_run_every_rank_trains_on_as_many_disjoint_rows_each_epoch(tmp_path):
    """Rows numbered by their label, trained under Ray Train with Ray Data as the reader: a custom
    step records the labels of every batch each rank trains on. Ray Train splits the data with
    `streaming_split(world_size, equal=True)`: each epoch, the ranks' rows are disjoint, as many
    on each, and all but a few (fewer than a batch a rank) of the rows."""
    train = write_numbered(tmp_path / "train")
    (tmp_path / "seen").mkdir()
    config = job(model={"name": "tests.helpers:label_recorder", "args": {"out_dir": str(tmp_path / "seen")}},
                 task={"name": "tests.helpers:record_labels"}, checkpoint={"every_epochs": 1, "mode": "min"},
                 data={"name": "parquet", "engine": "ray_data",
                       "args": {"path": str(train), "eval_path": str(train / "part-2.parquet"),
                                "features": ["x", "one"], "buffer_rows": 100}},
                 train={"epochs": 2, "batch_size": 16})
    result = run(config, tmp_path / "run", local=False)
    assert [row["epoch"] for row in result.metrics] == [1, 2]
    per_epoch = ROWS // 2 // 16
    batches = {rank: [[int(v) for v in line.split()] for line in (tmp_path / "seen" / f"rank-{rank}.txt").open()]
               for rank in (0, 1)}
    assert [len(b) for b in batches.values()] == [2 * per_epoch] * 2 and all(len(x) == 16 for b in batches.values()
                                                                            for x in b)
    for epoch in (0, 1):
        rows = [[r for batch in batches[rank][epoch * per_epoch:(epoch + 1) * per_epoch] for r in batch]
                for rank in (0, 1)]
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


def test_a_killed_worker_restarts_its_epoch_from_the_epoch_checkpoint(tmp_path):
    """Digits in three training files and an eval file: 1500 rows / 2 ranks / 32 = 23 batches an
    epoch, so rank 1's 30th call is inside epoch 2 and the run restarts from epoch 1's checkpoint."""
    table = pq.read_table(DIGITS_FILE)
    for i in range(3):
        (tmp_path / "train").mkdir(exist_ok=True)
        pq.write_table(table.slice(500 * i, 500), tmp_path / "train" / f"part-{i}.parquet")
    pq.write_table(table.slice(1500), tmp_path / "eval.parquet")
    marker = tmp_path / "fault"
    marker.touch()
    model = {"name": "tests.helpers:faulty_mlp", "args": {"marker": str(marker), "at": 30, "rank": 1, "fault": "kill"}}
    result = run(job(model=model, data={"name": "parquet", "engine": "ray_data",
                                        "args": {"path": str(tmp_path / "train"),
                                                 "eval_path": str(tmp_path / "eval.parquet"), "buffer_rows": 256}},
                     train={"epochs": 2, "batch_size": 32}, failure={"max_failures": 1}), tmp_path / "run", local=False)
    assert not marker.exists()  # the fault really happened
    log = (tmp_path / "run" / "logs" / "rank-1.log").read_text()
    assert "data from Ray Data" in log
    step, epoch, batch, _ = resumed_at(log)
    assert (step, epoch, batch) == (23, 2, 0)  # the epoch boundary, never inside the epoch
    assert [row["epoch"] for row in result.metrics] == [1, 2]
    assert [row["step"] for row in result.metrics] == [23, 46]
    assert result.metrics[-1]["eval_accuracy"] > 0.8
