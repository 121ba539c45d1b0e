"""`raytrain-app convert`: an ImageFolder tree or a CSV file made into sharded Parquet files for
the `parquet` dataset, and its streaming reader (or, `--encoded`, image bytes for `images`).

Both write OUT_DIR/part-00000.parquet, part-00001.parquet, ... with one schema, and metadata that
lets the reader find the columns without a config: `raytrain.features`, `raytrain.shape`,
`raytrain.num_classes` and `raytrain.classes` as JSON, `raytrain.label` and `raytrain.source` as
plain text (as the reader and `scripts/sklearn_to_parquet.py` use them).

A label of names is stored as class ids, numbered as the `csv` dataset numbers them (the sorted
names, `parquet_files.class_names`), with the names in `raytrain.classes`: a model trained on the
files knows them, and a file converted with another file's `--classes` numbers them the same.

The streaming reader shards and shuffles by row group, and shuffles rows only within a window of
them: so files are cut into many row groups, and image rows are shuffled before writing (an
ImageFolder lists one class after another). A CSV's row order is kept: shuffle a CSV sorted by
label first.

Neither the images nor the CSV are held whole: rows are made and written a row group at a time.
A failed run removes the files it wrote, so OUT_DIR never holds half a dataset.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pv
import pyarrow.parquet as pq

from raytrain_app.data.image_sources import IMAGE_SUFFIXES
from raytrain_app.data.parquet_files import class_ids, class_names, csv_reading, is_text, missing_hint
from raytrain_app.errors import UserError


def metadata(**values) -> dict:
    """Schema metadata: strings as they are, anything else as JSON, as the reader decodes them
    (it decodes `features` always, a name or a list of names: give a name JSON-encoded)."""
    return {f"raytrain.{k}".encode(): (v if isinstance(v, str) else json.dumps(v)).encode()
            for k, v in values.items() if v is not None}


def group_size(written: int, group_rows: int, file_rows: int) -> int:
    """Rows in the row group that starts after `written` rows: `group_rows`, cut short where a
    file ends, so that no row group straddles two files."""
    return min(group_rows, file_rows - written % file_rows)


def row_groups(batches: Iterable[pa.RecordBatch], group_rows: int, file_rows: int) -> Iterator[pa.Table]:
    """Batches of any size, re-cut into row groups; at most one row group is held back."""
    pending, held, written = [], 0, 0
    for batch in batches:
        while batch.num_rows:
            want = group_size(written, group_rows, file_rows)
            take = min(batch.num_rows, want - held)
            pending.append(batch.slice(0, take))
            batch, held = batch.slice(take), held + take
            if held == want:
                yield pa.Table.from_batches(pending)
                pending, held, written = [], 0, written + held
    if held:
        yield pa.Table.from_batches(pending)


def write_parts(batches: Iterable[pa.RecordBatch], schema: pa.Schema, out: Path, file_rows: int,
                group_rows: int) -> tuple[int, int]:
    """Writes the rows to part-NNNNN.parquet files of `file_rows` rows; returns (rows, files).
    On any failure the files written so far are removed: a half-written one has no footer."""
    written, paths, writer = 0, [], None
    try:
        for group in row_groups(batches, group_rows, file_rows):
            if written % file_rows == 0:
                if writer:
                    writer.close()
                paths.append(out / f"part-{len(paths):05d}.parquet")
                writer = pq.ParquetWriter(paths[-1], schema, compression="zstd")
            writer.write_table(group, row_group_size=group.num_rows)
            written += group.num_rows
        if writer:
            writer.close()
    except BaseException:
        if writer:
            writer.close()
        for path in paths:
            path.unlink(missing_ok=True)
        raise
    return written, len(paths)


def prepare(out: Path) -> None:
    """Creates OUT_DIR, refusing one that holds Parquet files already: the reader of a directory
    would mix them with these."""
    if out.is_dir() and any(out.glob("*.parquet")):
        raise UserError(f"{out} already holds .parquet files: give an empty or new directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {out}: {e.strerror}") from None


def images(root: Path, out_dir: Path, size: int = 32, grey: bool = False, seed: int = 0, rows_per_file: int = 50_000,
           row_group_rows: int = 4096, encoded: bool = False) -> str:
    """Images in ROOT/CLASS_NAME/ folders (torchvision's ImageFolder layout), resized to
    `size` x `size`; label i is the i-th class folder in sorted order, as ImageFolder numbers
    them. `encoded`: each file's bytes as they are, in the Hugging Face image layout, for `data:
    images` (which decodes and crops them while training). Returns what was written, in words."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise UserError(f"{root} has no class folders (expected ROOT/CLASS_NAME/IMAGE)")
    samples = []
    for label, name in enumerate(classes):
        found = sorted(p for p in (root / name).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        if not found:
            raise UserError(f"class folder {root / name} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        samples += [(path, label) for path in found]
    random.Random(seed).shuffle(samples)  # paths only: images are read a row group at a time
    write = _encoded if encoded else _decoded
    schema, row_group = write(root, classes, size, grey)

    def batches() -> Iterator[pa.RecordBatch]:
        """One row group each, cut where `write_parts` cuts: only one is ever read at a time."""
        start = 0
        while start < len(samples):
            chunk = samples[start:start + group_size(start, row_group_rows, rows_per_file)]
            yield pa.record_batch([row_group(chunk), pa.array([label for _, label in chunk], pa.int64())],
                                  schema=schema)
            start += len(chunk)

    prepare(out_dir)
    rows, files = write_parts(batches(), schema, out_dir, rows_per_file, row_group_rows)
    return f"wrote {rows} {'encoded images' if encoded else 'rows'} of {len(classes)} classes in {files} files to " \
           f"{out_dir}"


def _decoded(root: Path, classes: list[str], size: int, grey: bool):
    """Pixels resized to size x size, for `data: parquet`: the schema, and a row group's image column."""
    from PIL import Image

    mode, channels = ("L", 1) if grey else ("RGB", 3)
    # Each image's pixels as one fixed-size binary value: Parquet stores them as plain bytes,
    # which decode without the repetition levels a list<uint8> column carries for every pixel
    # (`parquet_files.feature_matrix` reads both).
    image_type = pa.binary(channels * size * size)
    schema = pa.schema([("image", image_type), ("label", pa.int64())],
                       metadata=metadata(features=json.dumps("image"), label="label", shape=[channels, size, size],
                                         num_classes=len(classes), classes=classes, source=f"imagefolder:{root}"))

    def pixels(path: Path) -> np.ndarray:
        try:
            with Image.open(path) as image:
                image = image.convert(mode).resize((size, size), Image.BILINEAR)
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise UserError(f"{path}: not a readable image ({e})") from None
        return np.asarray(image, dtype=np.uint8).reshape(size, size, channels).transpose(2, 0, 1)

    def column(chunk: list) -> pa.Array:
        values = pa.py_buffer(np.stack([pixels(path) for path, _ in chunk]).tobytes())
        return pa.Array.from_buffers(image_type, len(chunk), [None, values])

    return schema, column


def _encoded(root: Path, classes: list[str], size: int, grey: bool):
    """Files' bytes as they are, for `data: images`, in the layout of Hugging Face `datasets`
    (an `image` struct of bytes and path, a ClassLabel `label`), which both read."""
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    huggingface = {"info": {"features": {"image": {"_type": "Image"},
                                         "label": {"names": classes, "_type": "ClassLabel"}}}}
    schema = pa.schema([("image", image_type), ("label", pa.int64())],
                       metadata={**metadata(label="label", num_classes=len(classes), classes=classes,
                                            source=f"imagefolder:{root}"),
                                 b"huggingface": json.dumps(huggingface).encode()})

    def column(chunk: list) -> pa.Array:
        try:
            data = [path.read_bytes() for path, _ in chunk]
        except OSError as e:
            raise UserError(f"cannot read {e.filename}: {e.strerror}") from None
        return pa.StructArray.from_arrays([pa.array(data, pa.binary()),
                                           pa.array([str(path.relative_to(root)) for path, _ in chunk])],
                                          fields=list(image_type))

    return schema, column


def csv(file: Path, out_dir: Path, label: Optional[str] = None, no_label: bool = False,
        features: Optional[list[str]] = None, classes: Optional[list[str]] = None, rows_per_file: int = 50_000,
        row_group_rows: int = 4096) -> str:
    """A CSV file with a header row and numeric feature columns (every column but the label
    unless `features` names them). Types are pyarrow's inference from the first block: integer
    features stay int64, real ones become float32. An integer label is a class id and gives
    num_classes (its maximum + 1); a label of names is stored as class ids, by `classes` (another
    conversion's, so that both number them alike) or the sorted names; a real one is a regression
    target. With `no_label` the rows are new data to predict, with the same feature columns.
    Returns what was written, in words.

    The file is read twice: a first pass checks every value and finds the largest label, or the
    names, before anything is written, since every file's schema must carry them."""
    if bool(label) == no_label:
        raise UserError("give --label COLUMN for training data, or --no-label for new rows to predict")
    names = open_csv(file).schema.names
    columns = features or [c for c in names if c != label]
    wanted = columns + ([label] if label else [])
    unknown = [c for c in wanted if c not in names]
    if unknown:
        raise UserError(f"{file}: no column '{unknown[0]}'{missing_hint(unknown[0], names)}")
    repeated = [c for c in wanted if wanted.count(c) > 1]
    if repeated:
        raise UserError(f"{file}: column '{repeated[0]}' is named twice in --features and --label")

    reader = open_csv(file, wanted)
    named = bool(label) and is_text(reader.schema.field(label).type)
    if classes and not named:
        held = f"{file}: label column '{label}' holds {reader.schema.field(label).type}" if label else "--no-label"
        raise UserError(f"--classes is for a label of names ({held})")
    if classes and len(set(classes)) < len(classes):
        raise UserError(f"--classes names a class twice: {','.join(classes)}")
    schema = pa.schema([(f.name, pa.int64() if named and f.name == label else stored_type(f, file))
                        for f in reader.schema])
    rows_seen, highest, distinct = 0, [], []
    for batch in checked(reader, file):
        rows_seen += batch.num_rows
        if named:
            distinct.append(pc.unique(batch.column(label)))  # a batch's distinct names: few
        elif label:
            highest.append(pc.max(batch.column(label)).as_py())
    if not rows_seen:
        raise UserError(f"{file} has no rows")
    if named:
        found = class_names(distinct, str(file), label)
        class_ids(pa.array(found), classes or found, str(file), label, "of --classes")  # each one of them
        classes = classes or found
        num_classes = len(classes)
    else:
        num_classes = max(highest) + 1 if label and schema.field(label).type == pa.int64() else None
    schema = schema.with_metadata(metadata(features=columns, label=label, shape=[len(columns)],
                                           num_classes=num_classes, classes=classes if named else None,
                                           source=f"csv:{file}"))

    def stored(batch: pa.RecordBatch, field: pa.Field) -> pa.Array:
        if named and field.name == label:
            return pa.array(class_ids(batch.column(label), classes, str(file), label))
        return batch.column(field.name).cast(field.type)

    prepare(out_dir)
    batches = (pa.record_batch([stored(batch, f) for f in schema], schema=schema)
               for batch in checked(open_csv(file, schema.names), file))
    rows, files = write_parts(batches, schema, out_dir, rows_per_file, row_group_rows)
    target = (f"{num_classes} classes" if num_classes is not None else "a real-valued label") if label else "no label"
    return f"wrote {rows} rows with {target} in {files} files to {out_dir}"


def stored_type(field: pa.Field, file: Path) -> pa.DataType:
    """int64 for integers, float32 for real numbers: the precision training uses, where CSV
    inference gives float64."""
    if pa.types.is_integer(field.type):
        return pa.int64()
    if pa.types.is_floating(field.type):
        return pa.float32()
    raise UserError(f"{file}: column '{field.name}' must hold numbers, got {field.type}")


def open_csv(file: Path, columns: Optional[list] = None) -> pv.CSVStreamingReader:
    """A reader of the CSV's `columns` (all by default), which parses the first block to infer
    types; empty fields are missing values, as the `csv` dataset reads them."""
    try:
        return pv.open_csv(file, convert_options=csv_reading(columns))
    except pa.ArrowInvalid as e:
        raise UserError(f"{file}: {str(e).splitlines()[0]}") from None


def checked(reader: pv.CSVStreamingReader, file: Path) -> Iterator[pa.RecordBatch]:
    """The reader's batches, refusing empty values and parse errors (a later block can hold a value
    that does not fit the type inferred from the first)."""
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            return
        except pa.ArrowInvalid as e:
            raise UserError(f"{file}: {str(e).splitlines()[0]}") from None
        for name, column in zip(batch.schema.names, batch.columns):
            if column.null_count:
                raise UserError(f"{file}: column '{name}' has empty values")
        yield batch
