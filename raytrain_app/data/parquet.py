"""Parquet datasets read with pyarrow: the bundled digits and any user's files.

`path` names one file, a directory (every .parquet file under it), a glob, or a URI of either
(`s3://`, `gs://`, `hdfs://`, through `pyarrow.fs`). Files hold one label column (integer class
ids, real-valued targets, or a list per row: a target vector or multi-label 0/1s) and either one
image/feature column (a list or fixed-size list of numbers per row, reshaped to `shape`) or
several scalar feature columns. What the config leaves out comes from the schema metadata that
`scripts/to_parquet.py` writes (`raytrain.features`, `raytrain.label`, `raytrain.shape`,
`raytrain.num_classes`), as the bundled digits file stores its shape.

Small datasets are read whole into memory; `streaming: true` reads them a window of rows at a
time instead (`stream.py`).
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
    files = ParquetFiles.find(path, features, label, shape)
    eval_files = (ParquetFiles.find(eval_path, files.features, files.label, files.shape, like=files)
                  if eval_path else None)
    if streaming:
        return stream_pair(files, eval_files, eval_fraction, split_seed, buffer_rows, resize, augment)
    x, y = files.read()
    if eval_files:
        x_eval, y_eval = eval_files.read()
    else:
        x, y, x_eval, y_eval = split(x, y, eval_fraction, split_seed)
    features = files.features if isinstance(files.features, str) else tuple(files.features)
    return make_pair(x, y, x_eval, y_eval, resize=resize, augment=augment, features=features, label=files.label)


def read_table(path: str, features: Union[str, list, None], label: Optional[str],
               shape: Optional[list]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of the files `path` names, as (inputs, labels) tensors."""
    return ParquetFiles.find(path, features, label, shape).read()


