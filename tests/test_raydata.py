"""`data.engine: ray_data`: training batches from Ray Data's split of the Parquet files, on the
session's Ray cluster. Its two limits are part of what is tested: no fixed order (so the shards are
checked as sets), and resume at epoch boundaries only (a killed worker restarts its epoch)."""

import threading

import pyarrow.parquet as pq
import pytest

from raytrain_app.config import DataConfig, JobConfig
from raytrain_app.data import build_datasets
from raytrain_app.data.parquet import DIGITS_FILE
from raytrain_app.data.raydata import RayDataBatches, read_train
from raytrain_app.errors import ConfigError
from tests.test_distributed import job, run
from tests.test_reliability import resumed_at
from tests.test_stream import ROWS, labels, write_numbered

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_every_rank_takes_as_many_batches_of_disjoint_rows_each_epoch(tmp_path):
    """Ray Train splits the dataset as `streaming_split(world_size, equal=True)`; so does this test."""
    train = write_numbered(tmp_path / "train")
    config = DataConfig(name="parquet", engine="ray_data", args={
        "path": str(train), "eval_path": str(train / "part-2.parquet"), "features": ["x", "one"], "buffer_rows": 100})
    data = build_datasets(config)
    assert len(data.train) == ROWS and len(data.eval) == 80
    shards = read_train(config).streaming_split(2, equal=True)
    loaders = [RayDataBatches(shard, data.train, 16, rank, 2, seed=5) for rank, shard in enumerate(shards)]
    assert [len(loader) for loader in loaders] == [ROWS // 2 // 16] * 2

    for epoch in (0, 1):
        seen: list = [None, None]

        def take(rank):  # the ranks read their shards at the same time, as workers do
            loaders[rank].set_epoch(epoch)
            seen[rank] = labels(loaders[rank])

        threads = [threading.Thread(target=take, args=(rank,)) for rank in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [len(s) for s in seen] == [ROWS // 2 // 16] * 2 and all(len(b) == 16 for s in seen for b in s)
        rows = [r for s in seen for b in s for r in b]
        assert len(set(rows)) == len(rows) == 2 * (ROWS // 2 // 16) * 16  # disjoint: 4 rows a rank dropped
        assert set(rows) <= set(range(ROWS))


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
                                        "args": {"path": str(tmp_path / "train"), "eval_path": str(tmp_path / "eval.parquet"),
                                                 "buffer_rows": 256}},
                     train={"epochs": 2, "batch_size": 32}, failure={"max_failures": 1}), tmp_path / "run")
    assert not marker.exists()  # the fault really happened
    log = (tmp_path / "run" / "logs" / "rank-1.log").read_text()
    assert "data from Ray Data" in log
    step, epoch, batch, _ = resumed_at(log)
    assert (step, epoch, batch) == (23, 2, 0)  # the epoch boundary, never inside the epoch
    assert [row["epoch"] for row in result.metrics] == [1, 2]
    assert [row["step"] for row in result.metrics] == [23, 46]
    assert result.metrics[-1]["eval_accuracy"] > 0.8
