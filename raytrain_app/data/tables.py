"""Files users bring to a trained model: rows to predict, or labelled rows to score, as Parquet
or CSV, checked against the columns the model was trained on before anything starts.

A CSV is rewritten as Parquet first (streamed, a row group at a time): Ray's tasks and workers
then share one reader, which splits a file by its row groups.
"""

from __future__ import annotations

import posixpath

import pyarrow as pa
import pyarrow.csv as pv
import pyarrow.parquet as pq

from raytrain_app import storage
from raytrain_app.data.parquet_files import csv_reading, is_csv, missing_hint
from raytrain_app.errors import UserError

ROW_GROUP_ROWS = 10_000


def columns_of(path: str, what: str) -> list[str]:
    """The column names of the Parquet or CSV file at `path`; `what` names it in errors (`--input`)."""
    if not storage.exists(path):
        raise UserError(f"{what} {path} does not exist")
    fs, inner = storage.filesystem_for(path)
    try:
        if is_csv(path):
            with fs.open_input_stream(inner) as f:
                return pv.open_csv(f).schema.names
        with fs.open_input_file(inner) as f:
            return pq.ParquetFile(f).schema_arrow.names
    except (pa.ArrowException, OSError) as e:
        kind = "CSV" if is_csv(path) else "Parquet"
        raise UserError(f"{what} {path} is not a readable {kind} file: {storage.explain(e)}") from None


def require(path: str, present: list[str], wanted: list[str], what: str, role: str) -> None:
    """Every `wanted` column is in the file, or one line naming the first missing and the closest name."""
    for name in wanted:
        if name not in present:
            raise UserError(f"{what} {path} has no column '{name}', which the model was trained on as "
                            f"{role}{missing_hint(name, present)}")


def as_parquet(path: str, folder: str, what: str) -> str:
    """`path` itself for Parquet; a CSV rewritten as FOLDER/NAME.parquet (a path or URI)."""
    if not is_csv(path):
        return path
    out = storage.join(folder, posixpath.basename(path).split(".")[0] + ".parquet")
    fs, inner = storage.filesystem_for(path)
    out_fs, out_inner = storage.filesystem_for(out)
    out_fs.create_dir(posixpath.dirname(out_inner), recursive=True)
    try:
        with fs.open_input_stream(inner) as source:
            reader = pv.open_csv(source, convert_options=csv_reading())
            with out_fs.open_output_stream(out_inner) as f, pq.ParquetWriter(f, reader.schema) as writer:
                for batch in reader:
                    writer.write_batch(batch, row_group_size=ROW_GROUP_ROWS)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{what} {path} is not a readable CSV file: {storage.explain(e)}") from None
    return out

