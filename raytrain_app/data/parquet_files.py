"""Parquet files as pyarrow sees them: found under a path, a glob or a URI, with their row
groups, columns and the schema metadata `raytrain-app convert` writes, and rows turned into
tensors. The in-memory reader (`parquet.py`), the stream (`stream.py`), Ray Data and the files
users bring to `evaluate` and `predict` all read through here.

CSV files are read here too, through the same `pyarrow.dataset` calls (`format="csv"`), so that
their columns are found, checked and turned into tensors as a Parquet file's are; they have no
row groups, so they are read whole, never streamed.

A label column of names (strings) holds classes: class id i is the i-th of the sorted names. The
names come from the files' metadata (`raytrain.classes`), from a trained model, or else from the
label column itself, read alone: every rank and every machine sorts the same names the same way.
"""

from __future__ import annotations

import difflib
import fnmatch
import hashlib
import json
import posixpath
from dataclasses import dataclass
from typing import Iterable, Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pv
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import torch

from raytrain_app.errors import UserError
from raytrain_app.storage import explain, filesystem_for

GLOB = "*?["
CSV_SUFFIXES = (".csv", ".csv.gz")
KINDS = {"parquet": "Parquet", "csv": "CSV"}

def is_csv(path: str) -> bool:
    return path.lower().endswith(CSV_SUFFIXES)

def missing_hint(name: str, present: list[str]) -> str:
    """What a message about a missing column adds: the closest name, else the columns there are."""
    close = difflib.get_close_matches(name, present, n=1)
    return f" (did you mean '{close[0]}'?)" if close else f" (columns: {', '.join(present)})"

def csv_reading(columns: Optional[list[str]] = None) -> pv.ConvertOptions:
    """How every CSV is read (of its `columns`, or all): an empty field is a missing value in a
    text column too (pyarrow's default reads it as ""), so an empty label is refused as an empty
    number is, not taken for a class named ""."""
    return pv.ConvertOptions(include_columns=columns, strings_can_be_null=True)

def dataset_format(format: str):
    """What `pyarrow.dataset` reads files of `format` ("parquet" or "csv") with."""
    return pads.CsvFileFormat(convert_options=csv_reading()) if format == "csv" else format

@dataclass(frozen=True)
class RowGroup:
    """A unit of streaming: one row group of one file."""

    path: str
    index: int
    rows: int
    label_max: Optional[int] = None  # an integer label's largest value, from the footer's statistics

@dataclass
class ParquetFiles:
    """The Parquet (or CSV) files a path names, checked once: they exist, share the schema of the
    columns read, and hold those columns; with their row groups, for streaming, and the names of
    the label's classes, where it has names."""

    path: str  # as the user wrote it, for messages
    fs: pafs.FileSystem
    files: list[str]
    features: Union[str, list]
    label: str
    shape: Optional[list[int]]
    types: dict[str, pa.DataType]  # of the columns read
    row_groups: list[RowGroup]  # none for CSV
    metadata: dict[str, str]
    classes: Optional[list[str]] = None  # class id i is classes[i]; None: the labels are ids or values
    format: str = "parquet"  # or "csv"

    @classmethod
    def find(cls, path: str, features=None, label=None, shape=None, like: Optional["ParquetFiles"] = None,
             format: str = "parquet", classes: Optional[list[str]] = None):
        """Columns not given come from the metadata, else: the label `label`, the features `image`
        (Parquet) or every other column (CSV). `like`: the training files these eval files must
        match (format, column types, classes). `classes`: the names the labels must be (a trained
        model's); by default `like`'s, the metadata's, or a text label's own sorted values."""
        format = like.format if like else format
        fs, files = _list(path, format)
        try:
            fragments = list(pads.dataset(files, filesystem=fs, format=dataset_format(format)).get_fragments())
            schemas = [f.physical_schema for f in fragments]
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{path}: not a readable {KINDS[format]} file: {explain(e)}") from None
        names = schemas[0].names
        meta = {k.decode(): v.decode() for k, v in (schemas[0].metadata or {}).items() if k.startswith(b"raytrain.")}
        label = label or meta.get("raytrain.label", "label")
        default = "image" if format == "parquet" else [c for c in names if c != label]
        features = features or (json.loads(meta["raytrain.features"]) if "raytrain.features" in meta else default)
        columns = ([features] if isinstance(features, str) else list(features)) + [label]
        missing = [c for c in columns if c not in names]
        if missing:
            raise UserError(f"{path}: no column '{missing[0]}'{missing_hint(missing[0], names)}")
        types = {c: schemas[0].field(c).type for c in columns}
        expected, first = (like.types, like.files[0]) if like else (types, files[0])
        for file, schema in zip(files, schemas):
            for c in columns:
                got = schema.field(c).type if c in schema.names else "no such column"
                if got != expected[c]:
                    raise UserError(f"{path}: files have different schemas: {posixpath.basename(file)} has "
                                    f"{c}: {got}, {posixpath.basename(first)} has {c}: {expected[c]}")
        integer, parquet = pa.types.is_integer(types[label]), format == "parquet"
        row_groups = [RowGroup(file, i, rg["num_rows"], _largest(rg, label) if integer else None)
                      for file, f in zip(files, fragments) for i, rg in enumerate(f.metadata.to_dict()["row_groups"])
                      if rg["num_rows"]] if parquet else []  # a CSV has none: it is read whole
        if parquet and not row_groups:
            raise UserError(f"dataset is empty: {path} has no rows")
        shape = shape or (json.loads(meta["raytrain.shape"]) if "raytrain.shape" in meta else None)
        classes = classes or (like.classes if like else None)
        own = json.loads(meta["raytrain.classes"]) if "raytrain.classes" in meta else None
        if classes and own and own != classes:
            raise UserError(f"{path}: its class ids stand for {', '.join(own)}, not for the classes trained on, "
                            f"{', '.join(classes)}: convert it with --classes {','.join(classes)}")
        found = cls(path, fs, files, features, label, shape, types, row_groups, meta, classes or own, format)
        if found.classes is None and is_text(types[label]):
            found.classes = class_names([_whole(found._table([label]).column(0))], path, label)
        return found

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
        return self.tensors(self._table(self.columns))

    def _table(self, columns: list[str]) -> pa.Table:
        try:
            return pads.dataset(self.files, filesystem=self.fs, format=dataset_format(self.format)).to_table(
                columns=columns)
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{self.path}: not a readable {KINDS[self.format]} file: {explain(e)}") from None

    def labels(self) -> torch.Tensor:
        """Every label, reading the label column alone: a check of them all, before the rest is read."""
        return label_tensor(_whole(self._table([self.label]).column(0)), self.path, self.label, self.classes)

    def tensors(self, rows: Union[pa.Table, pa.RecordBatch]) -> tuple[torch.Tensor, torch.Tensor]:
        y = label_tensor(_whole(rows.column(self.label)), self.path, self.label, self.classes)
        x = feature_matrix(rows, self.features, self.path)
        shape = self.shape or [x.shape[1]]
        if int(np.prod(shape)) != x.shape[1]:
            raise UserError(f"{self.path}: shape {list(shape)} does not match {x.shape[1]} values per row")
        return torch.from_numpy(np.array(x)).reshape(len(y), *shape), y

def _list(path: str, format: str) -> tuple[pafs.FileSystem, list[str]]:
    """The files a path names, sorted: itself, the .parquet (or .csv) files under a directory, or
    a glob's matches (shell-style, where `*` also crosses directories). CSV named as Parquet is
    refused here, with the name that reads it, before pyarrow's "magic bytes not found"."""
    fs, where = filesystem_for(path)
    glob = any(c in where for c in GLOB)
    base = where[: min(where.index(c) for c in GLOB if c in where)].rpartition("/")[0] if glob else where
    try:
        info = fs.get_file_info(base)
        if info.type == pafs.FileType.NotFound:
            raise UserError(f"dataset file not found: {path}")
        if info.type == pafs.FileType.File and not glob:
            return fs, _as(format, path, [where])
        found = fs.get_file_info(pafs.FileSelector(base, recursive=True))
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"cannot read {path}: {explain(e)}") from None
    hidden = lambda p: any(part.startswith(("_", ".")) for part in posixpath.relpath(p, base).split("/"))  # noqa: E731
    wanted = is_csv if format == "csv" else (lambda p: p.endswith(".parquet"))
    files = sorted(i.path for i in found if i.type == pafs.FileType.File and not hidden(i.path)
                   and (fnmatch.fnmatch(i.path, where) if glob else wanted(i.path)))
    if not files:
        raise UserError(f"{path}: {'the pattern matches' if glob else 'the directory holds'} no "
                        f"{KINDS[format]} file")
    return fs, _as(format, path, files)

def _as(format: str, path: str, files: list[str]) -> list[str]:
    """The files, unless CSV is named as Parquet."""
    if format == "parquet" and any(is_csv(f) for f in files):
        raise UserError(f"{path} is CSV, not Parquet: read it with data: {{name: csv, args: {{path: {path}, "
                        f"label: COLUMN}}}}")
    return files

def _largest(row_group: dict, column: str) -> Optional[int]:
    stats = next((c["statistics"] for c in row_group["columns"] if c["path_in_schema"] == column), None)
    return int(stats["max"]) if stats and stats.get("has_min_max") else None

def _whole(col):
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col

def label_tensor(col: pa.Array, path: str, name: str, classes: Optional[list[str]] = None) -> torch.Tensor:
    """Integers are class ids (int64), and so are names, by `classes`; real numbers are
    regression targets (float32); a list per row is a target vector, or a multi-label 0/1 vector
    (float32)."""
    if is_text(col.type):
        return torch.from_numpy(class_ids(col, classes or [], path, name))
    if pa.types.is_integer(col.type) and not col.null_count:
        return torch.from_numpy(col.to_numpy().astype(np.int64))
    if pa.types.is_floating(col.type) and not col.null_count:
        return torch.from_numpy(col.to_numpy().astype(np.float32))
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type) or pa.types.is_fixed_size_list(col.type):
        return torch.from_numpy(_column_matrix(col, path, name).astype(np.float32))
    raise UserError(f"{path}: label column '{name}' must hold numbers, names or lists of numbers without nulls, "
                    f"got {col.type}")

def is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or (
        pa.types.is_dictionary(t) and is_text(t.value_type))

def class_names(columns: Iterable[pa.Array], path: str, name: str) -> list[str]:
    """The classes of a label of names, given in pieces (a converter's batches): the distinct
    names, sorted by code point, which is the same order on every machine whatever its locale."""
    return sorted(set().union(*(pc.unique(_names(col, path, name)).to_pylist() for col in columns)))

def class_ids(col: pa.Array, classes: list[str], path: str, name: str, whose: str = "trained on") -> np.ndarray:
    """Each name's index in `classes` (int64); a name that is not one of them is refused, named."""
    names = _names(col, path, name)
    ids = pc.index_in(names, value_set=pa.array(classes, pa.string()))
    if ids.null_count:
        unknown = names.filter(ids.is_null())[0].as_py()
        known = ", ".join(classes[:20]) + (", ..." if len(classes) > 20 else "")
        raise UserError(f"{path}: label '{unknown}' in column '{name}' is not one of the {len(classes)} classes "
                        f"{whose} ({known})")
    return ids.to_numpy().astype(np.int64)

def _names(col, path: str, name: str) -> pa.Array:
    names = _whole(col).cast(pa.string())
    if names.null_count:
        raise UserError(f"{path}: label column '{name}' has empty values")
    return names

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
    if pa.types.is_fixed_size_binary(col.type):  # bytes: uint8 values (images, as `convert images` writes them)
        if col.null_count:
            raise UserError(f"{path}: column '{name}' has empty (null) rows")
        width = col.type.byte_width
        return np.frombuffer(col.buffers()[1], np.uint8, len(col) * width, col.offset * width).reshape(len(col), width)
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
