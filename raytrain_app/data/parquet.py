"""Tables read with pyarrow: Parquet (the bundled digits and any user's files) and CSV.

`path` names one file, a directory (every .parquet, or .csv, file under it), a glob, or a URI of
either (`s3://`, `gs://`, `hdfs://`, through `pyarrow.fs`). Files hold one label column (integer
class ids, class names, real-valued targets, or a list per row: a target vector or multi-label
0/1s) and either one image/feature column (a list or fixed-size list of numbers per row, reshaped
to `shape`) or several scalar feature columns. What the config leaves out comes from the schema
metadata that `raytrain-app convert` writes (`raytrain.features`, `raytrain.label`,
`raytrain.shape`, `raytrain.num_classes`, `raytrain.classes`), as the bundled digits file stores
its shape; a CSV's features are by default every column but the label.

Class names become class ids by their sorted order (`parquet_files.class_names`), which every
checkpoint records, so that new data is mapped as the training data was.

Small datasets are read whole into memory; `streaming: true` reads Parquet a window of rows at a
time instead (`stream.py`). A CSV is always read whole: `raytrain-app convert csv` makes a large
one into Parquet that streams.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch

from raytrain_app.data.arrays import make_pair, split
from raytrain_app.data.parquet_files import ParquetFiles
from raytrain_app.data.stream import stream_pair

DIGITS_FILE = Path(__file__).with_name("digits.parquet")


def digits(eval_fraction: float, split_seed: int, resize: int = 0):
    """scikit-learn's 1,797 real handwritten digits (8x8, grey levels 0..16), shipped with the package."""
    return parquet(str(DIGITS_FILE), eval_fraction, split_seed, resize=resize)


def parquet(
    path: str,
    eval_fraction: float,
    split_seed: int,
    features: Union[str, list, None] = None,
    label: Optional[str] = None,
    shape: Optional[list] = None,
    eval_path: Optional[str] = None,
    resize: int = 0,
    augment: bool = False,
    streaming: bool = False,
    buffer_rows: int = 10_000,
):
    files, eval_files = _found(path, eval_path, features, label, shape)
    if streaming:
        return stream_pair(files, eval_files, eval_fraction, split_seed, buffer_rows, resize, augment)
    return _in_memory(files, eval_files, eval_fraction, split_seed, resize, augment)


def csv(path: str, eval_fraction: float, split_seed: int, features: Union[str, list, None] = None,
        label: Optional[str] = None, eval_path: Optional[str] = None):
    """CSV files with a header row, read by pyarrow's CSV reader into memory: numeric feature
    columns (every column but the label unless `features` names them) and a label column of class
    ids, class names or real-valued targets."""
    return _in_memory(*_found(path, eval_path, features, label, format="csv"), eval_fraction, split_seed)


def _found(path: str, eval_path: Optional[str], features, label, shape=None, format: str = "parquet"):
    """The training files, and the eval files, which must be like them (None without `eval_path`)."""
    files = ParquetFiles.find(path, features, label, shape, format=format)
    return files, (ParquetFiles.find(eval_path, files.features, files.label, files.shape, like=files)
                   if eval_path else None)


def _in_memory(files: ParquetFiles, eval_files: Optional[ParquetFiles], eval_fraction: float, split_seed: int,
               resize: int = 0, augment: bool = False):
    """Every row read at once: the eval files' as eval data, or else a seeded `eval_fraction` of the rows."""
    x, y = files.read()
    if eval_files:
        x_eval, y_eval = eval_files.read()
    else:
        x, y, x_eval, y_eval = split(x, y, eval_fraction, split_seed)
    features = files.features if isinstance(files.features, str) else tuple(files.features)
    return make_pair(x, y, x_eval, y_eval, resize=resize, augment=augment, features=features, label=files.label,
                     classes=files.classes)


def read_table(path: str, features: Union[str, list, None], label: Optional[str],
               shape: Optional[list]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of the files `path` names, as (inputs, labels) tensors."""
    return ParquetFiles.find(path, features, label, shape).read()
