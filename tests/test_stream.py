"""Streaming Parquet (`data.args.streaming: true`): sharded by row groups, equal batches on every
rank, a seeded shuffle buffer, exact evaluation, and a mid-epoch position that resumes exactly.

The stream's properties are checked in-process on real files (and on a real S3-compatible server);
the resume on the session's Ray cluster, by killing a worker mid-epoch.
"""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch

from raytrain_app.config.sections import DataConfig
from raytrain_app.data import build_datasets, eval_loader, train_loader
from raytrain_app.data.parquet import DIGITS_FILE
from raytrain_app.data.stream import ParquetStream
from raytrain_app.worker.loop import resume_warnings
from tests.test_distributed import final_weights, job
from tests.test_reliability import straight_and_killed

ROWS = 1000


def write_numbered(directory, sizes=(150, 230, 80, 300, 240), row_group=40):
    """Files of rows numbered 0..ROWS-1 (the label is the row's number), in row groups of 40."""
    directory.mkdir(parents=True, exist_ok=True)
    start = 0
    for i, n in enumerate(sizes):
        ids = np.arange(start, start + n)
        start += n
        table = pa.table({"x": (ids * 0.5).astype(np.float32), "one": np.ones(n, np.float32),
                          "label": ids.astype(np.float32)})
        pq.write_table(table, directory / f"part-{i}.parquet", row_group_size=row_group)
    assert start == ROWS
    return directory


def numbered(path, buffer_rows=100, **args):
    return build_datasets(DataConfig(name="parquet", args={"path": str(path), "features": ["x", "one"],
                                                           "streaming": True, "buffer_rows": buffer_rows, **args}))


def labels(batches) -> list[list[int]]:
    return [[int(v) for v in y] for _, y in batches]


def epoch_of(data, rank, world, epoch, batch=16, seed=5):
    loader, sampler = train_loader(data, batch, rank, world, seed, 0, False)
    sampler.set_epoch(epoch)
    return loader, sampler


def test_ranks_take_equal_disjoint_shards_reshuffled_each_epoch_and_eval_counts_every_row_once(tmp_path):
    data = numbered(write_numbered(tmp_path / "d"))
    assert isinstance(data.train, ParquetStream) and data.input_shape == (2,)
    train_rows, eval_rows = len(data.train), len(data.eval)
    assert train_rows + eval_rows == ROWS and len(data.eval.groups) == 5  # a fifth of the 26 row groups

    epochs = []
    for epoch in (0, 1):
        shards = [labels(epoch_of(data, rank, 3, epoch)[0]) for rank in range(3)]
        assert {len(s) for s in shards} == {train_rows // 3 // 16}  # the same number of batches on every rank
        assert all(len(b) == 16 for s in shards for b in s)
        rows = [r for s in shards for b in s for r in b]
        # disjoint; under a batch per rank dropped
        assert len(rows) == len(set(rows)) and len(rows) > train_rows - 3 * 16
        epochs.append(rows)
    assert epochs[0] != epochs[1] and sorted(epochs[0]) != sorted(epochs[1])  # a new order, other rows dropped
    assert epochs[0] == [r for rank in range(3) for b in labels(epoch_of(data, rank, 3, 0)[0]) for r in b]  # seeded

    # The buffer shuffles across row groups: a 100-row window mixes rows of several 40-row groups.
    first = labels(epoch_of(data, 0, 1, 0)[0])
    assert len({r // 40 for r in first[0]}) > 1 and first[0] != sorted(first[0])

    evaluated = [r for rank in range(3) for b in labels(eval_loader(data, 16, rank, 3, 0, False)) for r in b]
    assert sorted(evaluated) == sorted(set(evaluated)) and len(evaluated) == eval_rows
    assert not set(evaluated) & set(epochs[0])  # eval rows never train


def test_a_position_inside_an_epoch_resumes_exactly_reading_only_from_its_window(tmp_path, monkeypatch):
    data = numbered(write_numbered(tmp_path / "d"))
    loader, sampler = epoch_of(data, 1, 2, epoch=3)
    whole = labels(loader)
    read = []
    original = ParquetStream._group_rows
    monkeypatch.setattr(ParquetStream, "_group_rows",
                        lambda self, g, a, b: read.append(b - a) or original(self, g, a, b))
    for batch in (1, 6, 7, len(whole) - 1):  # windows hold 6 batches of 16
        sampler.start = batch * 16 * 2  # samples over both ranks
        read.clear()
        assert len(loader) == len(whole) - batch and labels(loader) == whole[batch:]
        assert sum(read) <= len(whole) * 16 - (batch // 6) * 96  # earlier windows are skipped, not read


def test_a_glob_a_directory_and_an_s3_prefix_stream_the_same_rows(tmp_path, s3, monkeypatch):
    local = write_numbered(tmp_path / "d")
    (local / "_SUCCESS").write_text("")  # markers that writers leave are not data
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    remote = f"s3://{s3.bucket}/stream-test"
    pafs.copy_files(str(local), remote.removeprefix("s3://"), source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=pafs.FileSystem.from_uri(remote)[0])
    expected = labels(epoch_of(numbered(local), 0, 2, 1)[0])
    for path in (tmp_path / "d" / "part-*.parquet", remote):
        assert labels(epoch_of(numbered(path), 0, 2, 1)[0]) == expected, path
    assert (len(numbered(tmp_path / "d" / "part-[12].parquet").train)
            + len(numbered(tmp_path / "d" / "part-[12].parquet").eval) == 310)


def test_a_mid_epoch_resume_over_changed_files_says_so(tmp_path):
    """The checkpoint's layout records the row groups; the loop compares them when it resumes."""
    before = numbered(write_numbered(tmp_path / "d"))
    pq.write_table(pq.read_table(tmp_path / "d" / "part-4.parquet"), tmp_path / "d" / "part-5.parquet")  # a new file
    after = numbered(tmp_path / "d")
    assert before.train.fingerprint != after.train.fingerprint
    assert numbered(tmp_path / "d").train.fingerprint == after.train.fingerprint  # the same files, the same print
    layout = lambda data: {"world_size": 2, "strategy": "ddp", "mesh": [], "data": data.train.fingerprint}  # noqa: E731
    [warning] = resume_warnings(layout(before), layout(after), mid_epoch=True)
    assert warning.startswith("the streamed dataset's files changed since the checkpoint")
    assert resume_warnings(layout(before), layout(after), mid_epoch=False) == []  # a new epoch starts over anyway
    assert resume_warnings(layout(after), layout(after), mid_epoch=True) == []
    # Another world size inside an epoch: each rank reads a stretch of its own, so not exact.
    resharded, stretches = resume_warnings(layout(after), {**layout(after), "world_size": 1}, mid_epoch=True)
    assert resharded.startswith("resharded from 2 workers to 1 worker: ")
    assert stretches.startswith("a streamed dataset is read in a stretch per rank: the epoch under way goes on "
                                "over 1 ranks' stretches")
    assert len(resume_warnings(layout(after), {**layout(after), "world_size": 1}, mid_epoch=False)) == 1


def test_a_stream_decodes_rows_as_the_whole_file_reader_does(tmp_path):
    """The metadata's shape and class count, and each row normalised as in memory."""
    table = pq.read_table(DIGITS_FILE)
    pq.write_table(table, tmp_path / "digits.parquet", row_group_size=200)
    streamed = build_datasets(DataConfig(name="parquet", args={"path": str(tmp_path), "streaming": True}))
    whole = build_datasets(DataConfig(name="parquet", args={"path": str(tmp_path)}))
    assert streamed.input_shape == whole.input_shape == (1, 8, 8)
    assert streamed.num_classes == whole.num_classes == 10
    first = table.slice(streamed.train.groups[0].index * 200, 1).to_pylist()[0]  # the train split's first row
    x, y = streamed.train[0]
    pixels = torch.tensor(first["image"], dtype=torch.float32).reshape(1, 8, 8)
    assert int(y) == first["label"]
    # The statistics, computed by pyarrow over every pixel of the training row groups (all of them
    # are within the first NORM_ROWS rows), not taken from the stream.
    train = pa.concat_tables([table.slice(g.index * 200, g.rows) for g in streamed.train.groups])
    values = pc.list_flatten(train.column("image")).cast(pa.float64())
    mean, std = pc.mean(values).as_py(), pc.stddev(values, ddof=1).as_py()
    assert torch.allclose(x, (pixels - mean) / std, atol=1e-5)


@pytest.mark.slow
def test_a_worker_killed_mid_epoch_resumes_the_stream_bitwise(tmp_path):
    """Digits in 10 row groups: 9 train (1617 rows / 2 ranks / 32 = 25 batches); rank 1's 44th
    call is in epoch 2, after the step checkpoints at 30, 35 and 40."""
    pq.write_table(pq.read_table(DIGITS_FILE), tmp_path / "digits.parquet", row_group_size=180)

    def config(marker):
        model = {"name": "tests.helpers:faulty_mlp",
                 "args": {"marker": str(marker), "at": 44, "rank": 1, "fault": "kill"}}
        return job(model=model, data={"name": "parquet", "eval_fraction": 0.1,
                                      "args": {"path": str(tmp_path / "digits.parquet"), "streaming": True,
                                               "buffer_rows": 256}},
                   train={"epochs": 2, "batch_size": 32}, checkpoint={"every_steps": 5},
                   failure={"max_failures": 1})

    straight, killed, (step, epoch, batch) = straight_and_killed(config, tmp_path)
    assert epoch == 2 and step in (30, 35, 40) and batch == step - 25
    for name, w in final_weights(straight).items():
        assert torch.equal(final_weights(killed)[name], w), name
    assert killed.metrics[-1]["train_loss"] == straight.metrics[-1]["train_loss"]


STREAM_RSS = r'''
import resource, sys
from raytrain_app.config import DataConfig
from raytrain_app.data import build_datasets, train_loader
data = build_datasets(DataConfig(name="parquet", args={"path": sys.argv[1], "streaming": True, "buffer_rows": 512}))
loader, sampler = train_loader(data, 64, 0, 1, 0, 0, False)
sampler.set_epoch(0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rows = sum(len(y) for _, y in loader)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(rows, (after - before) * 1024)
'''


def test_streaming_memory_is_bounded_by_the_buffer_not_the_data(tmp_path):
    """96 MB of uint8 images, read a 512-row window at a time (1.5 MB of pixels, 6 MB as floats):
    the reading process's peak memory grows by far less than the data, in a process of its own."""
    rng = np.random.default_rng(0)
    rows, width = 32_768, 3 * 32 * 32
    with pq.ParquetWriter(tmp_path / "big.parquet", pa.schema([("image", pa.list_(pa.uint8(), width)),
                                                              ("label", pa.int64())])) as writer:
        for start in range(0, rows, 4096):
            pixels = rng.integers(0, 256, (4096, width), dtype=np.uint8)
            writer.write_table(pa.table({"image": pa.FixedSizeListArray.from_arrays(pa.array(pixels.ravel()), width),
                                         "label": pa.array(rng.integers(0, 10, 4096))}), row_group_size=1024)
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", STREAM_RSS, str(tmp_path / "big.parquet")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    trained, grew = map(int, done.stdout.split())
    assert trained > 0.75 * rows  # most rows read (the rest is the seeded eval share and a last partial batch)
    assert grew < rows * width / 4, grew  # under a quarter of the data's 96 MB, let alone its 384 MB as floats
