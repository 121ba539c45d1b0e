"""Parquet datasets read with pyarrow: the bundled digits and any user file.

A file holds one label column (integer class ids, real-valued targets, or a list per row: a
target vector or multi-label 0/1s) and either one image/feature column (a list or fixed-size list
of numbers per row, reshaped to `shape`) or several scalar feature columns. The shape can be
given in the config or stored in the file's schema metadata under `raytrain.shape`, as the
bundled digits file does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from raytrain_app.data.arrays import make_pair, split
from raytrain_app.errors import UserError
from raytrain_app.storage import filesystem_for

DIGITS_FILE = Path(__file__).with_name("digits.parquet")


def digits(eval_fraction: float, split_seed: int, resize: int = 0):
    """scikit-learn's 1,797 real handwritten digits (8x8, grey levels 0..16), shipped with the package."""
    return parquet(str(DIGITS_FILE), eval_fraction, split_seed, resize=resize)


def parquet(
    path: str,
    eval_fraction: float,
    split_seed: int,
    features: Union[str, list] = "image",
    label: str = "label",
    shape: Optional[list] = None,
    eval_path: Optional[str] = None,
    resize: int = 0,
    augment: bool = False,
):
    x, y = read_table(path, features, label, shape)
    if eval_path:
        x_eval, y_eval = read_table(eval_path, features, label, shape)
    else:
        x, y, x_eval, y_eval = split(x, y, eval_fraction, split_seed)
    return make_pair(x, y, x_eval, y_eval, resize=resize, augment=augment)


def read_table(path: str, features: Union[str, list], label: str, shape: Optional[list]) -> tuple[torch.Tensor, torch.Tensor]:
    fs, fs_path = filesystem_for(path)
    if fs.get_file_info(fs_path).type == pafs.FileType.NotFound:
        raise UserError(f"dataset file not found: {path}")
    try:
        schema = pq.read_schema(fs_path, filesystem=fs)
        columns = [features] if isinstance(features, str) else list(features)
        missing = [c for c in columns + [label] if c not in schema.names]
        if missing:
            raise UserError(f"{path}: no column '{missing[0]}' (columns: {', '.join(schema.names)})")
        table = pq.read_table(fs_path, filesystem=fs, columns=columns + [label])
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{path}: not a readable Parquet file: {e}") from None
    if table.num_rows == 0:
        raise UserError(f"dataset is empty: {path} has no rows")

    y = _labels(table.column(label).combine_chunks(), path, label)

    x = feature_matrix(table, features, path)
    stored = (schema.metadata or {}).get(b"raytrain.shape")
    shape = shape or (json.loads(stored) if stored else [x.shape[1]])
    if int(np.prod(shape)) != x.shape[1]:
        raise UserError(f"{path}: shape {list(shape)} does not match {x.shape[1]} values per row")
    return torch.from_numpy(np.array(x)).reshape(len(y), *shape), y


def _labels(col: pa.Array, path: str, name: str) -> torch.Tensor:
    """Integers are class ids (int64); real numbers are regression targets (float32); a list
    per row is a target vector, or a multi-label 0/1 vector (float32)."""
    if pa.types.is_integer(col.type) and not col.null_count:
        return torch.from_numpy(col.to_numpy().astype(np.int64))
    if pa.types.is_floating(col.type) and not col.null_count:
        return torch.from_numpy(col.to_numpy().astype(np.float32))
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type) or pa.types.is_fixed_size_list(col.type):
        return torch.from_numpy(_column_matrix(col, path, name).astype(np.float32))
    raise UserError(f"{path}: label column '{name}' must hold numbers or lists of numbers without nulls, "
                    f"got {col.type}")


def feature_matrix(rows: Union[pa.Table, pa.RecordBatch], features: Union[str, list], path: str) -> np.ndarray:
    """The feature column(s) as one (rows, values) matrix: a list column, or scalar columns side
    by side. `predict` reads its input's batches with it, as training read the table."""
    def whole(name: str) -> pa.Array:
        col = rows.column(name)
        return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col

    if isinstance(features, str):
        return _column_matrix(whole(features), path, features)
    return np.stack([_scalar_column(whole(c), path, c) for c in features], axis=1)


def _column_matrix(col: pa.Array, path: str, name: str) -> np.ndarray:
    if pa.types.is_fixed_size_list(col.type):
        width = col.type.list_size
    elif pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        if len(set(lengths.tolist())) != 1:
            raise UserError(f"{path}: column '{name}' has rows of different lengths")
        width = int(lengths[0])
    else:
        return _scalar_column(col, path, name)[:, None]
    if col.null_count or not _numeric(col.type.value_type):
        raise UserError(f"{path}: column '{name}' must hold lists of numbers without nulls, got {col.type}")
    return col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), width)


def _scalar_column(col: pa.Array, path: str, name: str) -> np.ndarray:
    if col.null_count or not _numeric(col.type):
        raise UserError(f"{path}: feature column '{name}' must hold numbers without nulls, got {col.type}")
    return col.to_numpy(zero_copy_only=False)


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)
