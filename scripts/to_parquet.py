"""Convert an ImageFolder tree or a CSV file into sharded Parquet files for the `parquet` reader.

    python scripts/to_parquet.py images ROOT OUT_DIR [--size 32] [--grey] [--seed 0]
    python scripts/to_parquet.py csv FILE.csv OUT_DIR --label COLUMN [--features a,b,c]
    python scripts/to_parquet.py csv NEW.csv OUT_DIR --no-label [--features a,b,c]     # rows to predict

Both write OUT_DIR/part-00000.parquet, part-00001.parquet, ... with one schema, and metadata that
lets the reader find the columns without a config: `raytrain.features`, `raytrain.shape`,
`raytrain.num_classes` and `raytrain.classes` as JSON, `raytrain.label` and `raytrain.source` as
plain text (as the reader and `sklearn_to_parquet.py` use them).

The streaming reader shards and shuffles by row group, and shuffles rows only within a window of
them: so files are cut into many row groups, and image rows are shuffled before writing (an
ImageFolder lists one class after another). A CSV's row order is kept: shuffle a CSV sorted by
label first.

Neither the images nor the CSV are held whole: rows are made and written a row group at a time.
A failed run removes the files it wrote, so OUT_DIR never holds half a dataset.
"""

import json
import random
import sys
from pathlib import Path
from typing import Iterable, Iterator, Optional

import click
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pv
import pyarrow.parquet as pq
from PIL import Image

IMAGE_SUFFIXES = (".bmp", ".jpeg", ".jpg", ".pgm", ".png", ".ppm", ".tif", ".tiff", ".webp")  # torchvision's


class UserError(click.ClickException):
    """A problem the user can fix."""


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


def sharding(command):
    """The options both sources share."""
    command = click.option("--row-group-rows", type=click.IntRange(min=1), default=4096, show_default=True,
                           help="Rows per row group: the unit the streaming reader shards and shuffles.")(command)
    return click.option("--rows-per-file", type=click.IntRange(min=1), default=50_000, show_default=True,
                        help="Rows per Parquet file.")(command)


@click.group(no_args_is_help=False)  # "Missing command." on one line, as every other error
def cli() -> None:
    """Convert images or a CSV file into sharded Parquet files for raytrain-app."""


@cli.command()
@click.argument("root", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--size", type=click.IntRange(min=1), default=32, show_default=True,
              help="Resize every image to SIZE x SIZE (bilinear).")
@click.option("--grey", is_flag=True, help="One grey channel instead of RGB.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the row shuffle.")
@sharding
def images(root: Path, out_dir: Path, size: int, grey: bool, seed: int, rows_per_file: int,
           row_group_rows: int) -> None:
    """Images in ROOT/CLASS_NAME/ folders (torchvision's ImageFolder layout). Label i is the i-th
    class folder in sorted order, as ImageFolder numbers them."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise UserError(f"{root} has no class folders (expected ROOT/CLASS_NAME/IMAGE)")
    samples = []
    for label, name in enumerate(classes):
        found = sorted(p for p in (root / name).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        if not found:
            raise UserError(f"class folder {root / name} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        samples += [(path, label) for path in found]
    random.Random(seed).shuffle(samples)  # paths only: pixels are read a row group at a time

    mode, channels = ("L", 1) if grey else ("RGB", 3)
    image_type = pa.list_(pa.uint8(), channels * size * size)
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

    def batches() -> Iterator[pa.RecordBatch]:
        """One row group each, cut where `write_parts` cuts: only one is ever decoded at a time."""
        start = 0
        while start < len(samples):
            chunk = samples[start:start + group_size(start, row_group_rows, rows_per_file)]
            values = pa.array(np.stack([pixels(path) for path, _ in chunk]).ravel())
            yield pa.record_batch([pa.FixedSizeListArray.from_arrays(values, type=image_type),
                                   pa.array([label for _, label in chunk], pa.int64())], schema=schema)
            start += len(chunk)

    prepare(out_dir)
    rows, files = write_parts(batches(), schema, out_dir, rows_per_file, row_group_rows)
    click.echo(f"wrote {rows} rows of {len(classes)} classes in {files} files to {out_dir}")


@cli.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--label", help="The label column.")
@click.option("--no-label", is_flag=True, help="New rows without a label, for `raytrain-app predict`.")
@click.option("--features", help="Feature columns, comma-separated (default: every column but the label).")
@sharding
def csv(file: Path, out_dir: Path, label: Optional[str], no_label: bool, features: Optional[str],
        rows_per_file: int, row_group_rows: int) -> None:
    """A CSV file with a header row and numeric columns. Types are pyarrow's inference from the
    first block: integer features stay int64, real ones become float32. An integer label is a
    class id and gives num_classes (its maximum + 1); a real one is a regression target. With
    --no-label the rows are new data to predict, with the same feature columns.

    The file is read twice: a first pass checks every value and finds the largest label before
    anything is written, since every file's schema must carry num_classes."""
    if bool(label) == no_label:
        raise UserError("give --label COLUMN for training data, or --no-label for new rows to predict")
    names = open_csv(file).schema.names
    columns = features.split(",") if features else [c for c in names if c != label]
    wanted = columns + ([label] if label else [])
    unknown = [c for c in wanted if c not in names]
    if unknown:
        raise UserError(f"{file}: no column '{unknown[0]}' (columns: {', '.join(names)})")
    repeated = [c for c in wanted if wanted.count(c) > 1]
    if repeated:
        raise UserError(f"{file}: column '{repeated[0]}' is named twice in --features and --label")

    reader = open_csv(file, wanted)
    schema = pa.schema([(f.name, stored_type(f, file)) for f in reader.schema])
    rows_seen, highest = 0, []
    for batch in checked(reader, file):
        rows_seen += batch.num_rows
        if label:
            highest.append(pc.max(batch.column(label)).as_py())
    if not rows_seen:
        raise UserError(f"{file} has no rows")
    num_classes = max(highest) + 1 if label and schema.field(label).type == pa.int64() else None
    schema = schema.with_metadata(metadata(features=columns, label=label, shape=[len(columns)],
                                           num_classes=num_classes, source=f"csv:{file}"))

    prepare(out_dir)
    batches = (pa.record_batch([batch.column(f.name).cast(f.type) for f in schema], schema=schema)
               for batch in checked(open_csv(file, schema.names), file))
    rows, files = write_parts(batches, schema, out_dir, rows_per_file, row_group_rows)
    target = (f"{num_classes} classes" if num_classes is not None else "a real-valued label") if label else "no label"
    click.echo(f"wrote {rows} rows with {target} in {files} files to {out_dir}")


def stored_type(field: pa.Field, file: Path) -> pa.DataType:
    """int64 for integers, float32 for real numbers: the precision training uses, where CSV
    inference gives float64."""
    if pa.types.is_integer(field.type):
        return pa.int64()
    if pa.types.is_floating(field.type):
        return pa.float32()
    raise UserError(f"{file}: column '{field.name}' must hold numbers, got {field.type}")


def open_csv(file: Path, columns: Optional[list] = None) -> pv.CSVStreamingReader:
    """A reader of the CSV's `columns` (all by default), which parses the first block to infer types."""
    try:
        return pv.open_csv(file, convert_options=pv.ConvertOptions(include_columns=columns))
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


def main() -> None:
    """Every user error, click's own included, as one line and exit code 2."""
    try:
        cli.main(prog_name="to_parquet.py", standalone_mode=False)
    except click.ClickException as e:
        print(f"to_parquet: {e.format_message()}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
