"""Parquet files as pyarrow sees them: found under a path, a glob or a URI, with their row
groups, columns and the schema metadata `scripts/to_parquet.py` writes, and rows turned into
tensors. The in-memory reader (`parquet.py`), the stream (`stream.py`), Ray Data and the files
users bring to `evaluate` and `predict` all read through here."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import posixpath
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import torch

from raytrain_app.errors import UserError
from raytrain_app.storage import explain, filesystem_for

GLOB = "*?["

@dataclass(frozen=True)
class RowGroup:
    """A unit of streaming: one row group of one file."""

    path: str
    index: int
    rows: int
    label_max: Optional[int] = None  # an integer label's largest value, from the footer's statistics

@dataclass
class ParquetFiles:
    """The Parquet files a path names, checked once: they exist, share the schema of the columns
    read, and hold those columns; with their row groups, for streaming."""

    path: str  # as the user wrote it, for messages
    fs: pafs.FileSystem
    files: list[str]
    features: Union[str, list]
    label: str
    shape: Optional[list[int]]
    types: dict[str, pa.DataType]  # of the columns read
    row_groups: list[RowGroup]
    metadata: dict[str, str]

    @classmethod
    def find(cls, path: str, features=None, label=None, shape=None, like: Optional["ParquetFiles"] = None):
        fs, files = _list(path)
        try:
            fragments = list(pads.dataset(files, filesystem=fs, format="parquet").get_fragments())
            schemas = [f.physical_schema for f in fragments]
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{path}: not a readable Parquet file: {explain(e)}") from None
        meta = {k.decode(): v.decode() for k, v in (schemas[0].metadata or {}).items() if k.startswith(b"raytrain.")}
        features = features or (json.loads(meta["raytrain.features"]) if "raytrain.features" in meta else "image")
        label = label or meta.get("raytrain.label", "label")
        columns = ([features] if isinstance(features, str) else list(features)) + [label]
        missing = [c for c in columns if c not in schemas[0].names]
        if missing:
            raise UserError(f"{path}: no column '{missing[0]}' (columns: {', '.join(schemas[0].names)})")
        types = {c: schemas[0].field(c).type for c in columns}
        expected, first = (like.types, like.files[0]) if like else (types, files[0])
        for file, schema in zip(files, schemas):
            for c in columns:
                got = schema.field(c).type if c in schema.names else "no such column"
                if got != expected[c]:
                    raise UserError(f"{path}: files have different schemas: {posixpath.basename(file)} has "
                                    f"{c}: {got}, {posixpath.basename(first)} has {c}: {expected[c]}")
        integer = pa.types.is_integer(types[label])
        row_groups = [RowGroup(file, i, rg["num_rows"], _largest(rg, label) if integer else None)
                      for file, f in zip(files, fragments) for i, rg in enumerate(f.metadata.to_dict()["row_groups"])
                      if rg["num_rows"]]
        if not row_groups:
            raise UserError(f"dataset is empty: {path} has no rows")
        shape = shape or (json.loads(meta["raytrain.shape"]) if "raytrain.shape" in meta else None)
        return cls(path, fs, files, features, label, shape, types, row_groups, meta)

    @property
    def columns(self) -> list[str]:
        return ([self.features] if isinstance(self.features, str) else list(self.features)) + [self.label]

    @staticmethod
    def fingerprint_of(groups: list[RowGroup]) -> str:
        """Which row groups, of which files, of what sizes: a stream position names the same rows
        only over the same fingerprint."""
        return hashlib.sha256(json.dumps([[g.path, g.index, g.rows] for g in groups]).encode()).hexdigest()[:16]

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row, as (inputs, labels) tensors."""
        try:
            table = pads.dataset(self.files, filesystem=self.fs, format="parquet").to_table(columns=self.columns)
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{self.path}: not a readable Parquet file: {explain(e)}") from None
        return self.tensors(table)

    def tensors(self, rows: Union[pa.Table, pa.RecordBatch]) -> tuple[torch.Tensor, torch.Tensor]:
        y = label_tensor(_whole(rows.column(self.label)), self.path, self.label)
        x = feature_matrix(rows, self.features, self.path)
        shape = self.shape or [x.shape[1]]
        if int(np.prod(shape)) != x.shape[1]:
            raise UserError(f"{self.path}: shape {list(shape)} does not match {x.shape[1]} values per row")
        return torch.from_numpy(np.array(x)).reshape(len(y), *shape), y

def _list(path: str) -> tuple[pafs.FileSystem, list[str]]:
    """The files a path names, sorted: itself, the .parquet files under a directory, or a glob's
    matches (shell-style, where `*` also crosses directories)."""
    fs, where = filesystem_for(path)
    glob = any(c in where for c in GLOB)
    base = where[: min(where.index(c) for c in GLOB if c in where)].rpartition("/")[0] if glob else where
    try:
        info = fs.get_file_info(base)
        if info.type == pafs.FileType.NotFound:
            raise UserError(f"dataset file not found: {path}")
        if info.type == pafs.FileType.File and not glob:
            return fs, [where]
        found = fs.get_file_info(pafs.FileSelector(base, recursive=True))
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"cannot read {path}: {explain(e)}") from None
    hidden = lambda p: any(part.startswith(("_", ".")) for part in posixpath.relpath(p, base).split("/"))  # noqa: E731
    files = sorted(i.path for i in found if i.type == pafs.FileType.File and not hidden(i.path)
                   and (fnmatch.fnmatch(i.path, where) if glob else i.path.endswith(".parquet")))
    if not files:
        raise UserError(f"{path}: {'the pattern matches' if glob else 'the directory holds'} no Parquet file")
    return fs, files

def _largest(row_group: dict, column: str) -> Optional[int]:
    stats = next((c["statistics"] for c in row_group["columns"] if c["path_in_schema"] == column), None)
    return int(stats["max"]) if stats and stats.get("has_min_max") else None

def _whole(col):
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col

def label_tensor(col: pa.Array, path: str, name: str) -> torch.Tensor:
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
