"""Datasets in their real on-disk formats, and the eval sharding that counts each sample once."""

import pickle
import struct

import numpy as np
import pyarrow as pa
import pyarrow.csv as pv
import pyarrow.parquet as pq
import pytest
import torch

from raytrain_app.config.sections import DataConfig, TaskConfig
from raytrain_app.data import EvalShard, build_datasets
from raytrain_app.data.preprocess import recipe
from raytrain_app.errors import ConfigError, UserError
from raytrain_app.tasks import build_task


def test_digits_are_the_real_sklearn_digits():
    data = build_datasets(DataConfig(name="digits"))
    assert len(data.train) + len(data.eval) == 1797
    assert data.input_shape == (1, 8, 8) and data.num_classes == 10
    assert int(data.train.x.max()) == 16 and data.train.x.dtype == torch.uint8
    x, _ = data.train.__getitems__(list(range(512)))
    assert abs(float(x.mean())) < 0.1 and abs(float(x.std()) - 1) < 0.1  # normalised with train statistics
    again = build_datasets(DataConfig(name="digits"))
    assert torch.equal(again.eval.y, data.eval.y)  # the split is fixed by data.split_seed


def test_digits_resize_for_lenet():
    assert build_datasets(DataConfig(name="digits", args={"resize": 28})).input_shape == (1, 28, 28)


def test_parquet_scalar_feature_columns(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"a": [1.0, 2.0, 3.0, 4.0, 5.0], "b": [0, 1, 0, 1, 0], "y": [0, 1, 2, 1, 0]}), path)
    data = build_datasets(DataConfig(name="parquet", eval_fraction=0.4,
                                     args={"path": str(path), "features": ["a", "b"], "label": "y"}))
    assert data.input_shape == (2,) and len(data.train) == 3 and len(data.eval) == 2 and data.num_classes == 3


def _write_idx(path, array: np.ndarray):
    code = {1: 3, 3: 3}
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())
    return code


@pytest.mark.parametrize("name, folder", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_mnist_family_reads_idx_files(tmp_path, name, folder):
    raw = tmp_path / folder / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 12), ("t10k", 5)):
        _write_idx(raw / f"{split}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(raw / f"{split}-labels-idx1-ubyte", np.arange(n) % 10)
    data = build_datasets(DataConfig(name=name, args={"root": str(tmp_path)}))
    assert (len(data.train), len(data.eval)) == (12, 5)
    assert data.input_shape == (1, 28, 28)
    assert data.eval.y.tolist() == [0, 1, 2, 3, 4]


def test_cifar10_reads_python_batches(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), "labels": [0, 1, 2, 9]}
        (folder / name).write_bytes(pickle.dumps(batch))
    data = build_datasets(DataConfig(name="cifar10", args={"root": str(tmp_path)}))
    assert (len(data.train), len(data.eval), data.input_shape) == (20, 4, (3, 32, 32))
    x, _ = data.train.__getitems__([0, 1, 2])
    assert x.shape == (3, 3, 32, 32)  # augmented batches keep their shape


def test_synthetic_has_the_requested_shape():
    data = build_datasets(DataConfig(name="synthetic", args={"shape": [3, 8, 8], "train_size": 10, "eval_size": 3}))
    assert data.input_shape == (3, 8, 8) and len(data.train) == 10


@pytest.mark.parametrize("config, error, message", [
    (DataConfig(name="parquet", args={"path": "/nonexistent/x.parquet"}), UserError, "dataset file not found"),
    (DataConfig(name="mnist", args={"root": "/nonexistent"}), UserError, "MNIST not found under /nonexistent"),
    (DataConfig(name="cifar10", args={"root": "/nonexistent"}), UserError, "CIFAR-10 file not found"),
    (DataConfig(name="imagenet"), ConfigError, "unknown name 'imagenet'"),
    (DataConfig(name="no_such_module:build"), ConfigError, "cannot import 'no_such_module'"),
    (DataConfig(name="os:no_such_function"), ConfigError, "has no callable 'no_such_function'"),
    (DataConfig(name="digits", args={"colour": 1}), ConfigError, "data.args.colour: unknown argument"),
    (DataConfig(name="digits", args={"resize": "big"}), ConfigError, "data.args.resize: must be an integer"),
])
def test_data_errors(config, error, message):
    with pytest.raises(error, match=message):
        build_datasets(config)


def test_empty_and_unlabelled_parquet(tmp_path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"image": pa.array([], pa.list_(pa.float32())), "label": pa.array([], pa.int64())}), empty)
    with pytest.raises(UserError, match="dataset is empty"):
        build_datasets(DataConfig(name="parquet", args={"path": str(empty)}))
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"image": [[1.0], [2.0]], "label": [True, False]}), bad)
    with pytest.raises(UserError, match="label column 'label' must hold numbers, names or lists of numbers"):
        build_datasets(DataConfig(name="parquet", args={"path": str(bad)}))


def test_names_are_classes_numbered_in_sorted_order_in_parquet_and_csv(tmp_path):
    """The same names in a Parquet file and a CSV: the same class ids (sorted names), the names
    kept; a CSV's features are every other column; a name the training files lack is refused in
    eval files; a CSV named as Parquet is pointed at `name: csv`."""
    names = ["owl", "cat", "emu", "cat", "owl", "ant"] * 3
    table = pa.table({"a": [float(i) for i in range(18)], "b": [i % 4 for i in range(18)], "kind": names})
    pq.write_table(table, tmp_path / "t.parquet")
    pv.write_csv(table, tmp_path / "t.csv")
    ids = [["ant", "cat", "emu", "owl"].index(n) for n in names]
    for name, args in (("parquet", {"path": str(tmp_path / "t.parquet"), "features": ["a", "b"]}),
                       ("csv", {"path": str(tmp_path / "t.csv")})):  # features: every column but the label
        data = build_datasets(DataConfig(name=name, eval_fraction=0.2, args={**args, "label": "kind"}))
        assert data.num_classes == 4 and data.input_shape == (2,)
        made = recipe(data.train)
        assert made["classes"] == ["ant", "cat", "emu", "owl"] and made["features"] == ["a", "b"]
        assert sorted(data.train.y.tolist() + data.eval.y.tolist()) == sorted(ids)

    pv.write_csv(pa.table({"a": [1.0], "b": [2], "kind": ["yak"]}), tmp_path / "eval.csv")
    with pytest.raises(UserError, match=r"eval.csv: label 'yak' in column 'kind' is not one of the 4 classes trained "
                                        r"on \(ant, cat, emu, owl\)"):
        build_datasets(DataConfig(name="csv", args={"path": str(tmp_path / "t.csv"), "label": "kind",
                                                    "eval_path": str(tmp_path / "eval.csv")}))
    with pytest.raises(UserError, match=r"t.csv is CSV, not Parquet: read it with data: \{name: csv, "):
        build_datasets(DataConfig(name="parquet", args={"path": str(tmp_path / "t.csv")}))
    with pytest.raises(UserError, match=r"t.parquet: no column 'knd' \(did you mean 'kind'\?\)"):
        build_datasets(DataConfig(name="parquet", args={"path": str(tmp_path / "t.parquet"), "label": "knd",
                                                        "features": ["a", "b"]}))


def test_labels_out_of_range_for_the_model():
    data = build_datasets(DataConfig(name="digits"))
    with pytest.raises(UserError, match=r"labels range over \[0, 9\] but the model has 5 outputs"):
        build_task(TaskConfig()).check(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 5)),
                                       data.train, data.eval, "linear")


@pytest.mark.parametrize("size, world", [(25, 2), (7, 3), (2, 4), (100, 1)])
def test_eval_shards_count_every_sample_exactly_once(size, world):
    shards = [list(EvalShard(size, r, world)) for r in range(world)]
    assert sorted(sum(shards, [])) == list(range(size))
