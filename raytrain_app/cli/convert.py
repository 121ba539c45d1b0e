"""`convert images` and `convert csv`: a user's files made into sharded Parquet for `data: parquet`
(the work is in `data/convert.py`)."""

from __future__ import annotations

from pathlib import Path

import click

from raytrain_app.cli.base import exit_codes, main
from raytrain_app.errors import UserError


def _names(ctx, param, value):
    """A comma-separated list of names, or None."""
    return [name.strip() for name in value.split(",")] if value else None


def _sharding(command):
    """The options both sources share."""
    command = click.option("--row-group-rows", type=click.IntRange(min=1), default=4096, show_default=True,
                           help="Rows per row group: the unit the streaming reader shards and shuffles.")(command)
    return click.option("--rows-per-file", type=click.IntRange(min=1), default=50_000, show_default=True,
                        help="Rows per Parquet file.")(command)


@main.group(no_args_is_help=False)  # "Missing command." on one line, as every other user error
def convert():
    """Make images or a CSV file into sharded Parquet files, with the metadata that lets
    `data: {name: parquet, args: {path: OUT_DIR}}` find their columns, shape and classes."""


@convert.command("images")
@click.argument("root", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--size", type=click.IntRange(min=1), default=32, show_default=True,
              help="Resize every image to SIZE x SIZE (bilinear).")
@click.option("--grey", is_flag=True, help="One grey channel instead of RGB.")
@click.option("--encoded", is_flag=True,
              help="Keep each file's bytes as they are (no decoding or resizing), in the Hugging Face image layout, "
                   "for `data: images`, which crops the original pixels while training.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the row shuffle.")
@_sharding
def convert_images(root, out_dir, size, grey, encoded, seed, rows_per_file, row_group_rows):
    """Images in ROOT/CLASS_NAME/ folders (torchvision's ImageFolder layout), shuffled, into
    OUT_DIR/part-*.parquet. Label i is the i-th class folder in sorted order, as ImageFolder
    numbers them; the names are kept.

    \b
    Examples:
      raytrain-app convert images photos/train data/train --size 64
      raytrain-app convert images scans/ data/scans --grey --rows-per-file 10000
      raytrain-app convert images photos/train data/photos --encoded
    """
    from raytrain_app.data import convert as converter

    with exit_codes():
        if encoded and grey:
            raise UserError("--grey decodes the images; --encoded keeps them as they are: give one")
        click.echo(converter.images(root, out_dir, size, grey, seed, rows_per_file, row_group_rows, encoded))


@convert.command("csv")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--label", help="The label column: class ids, class names, or real-valued targets.")
@click.option("--no-label", is_flag=True, help="New rows without a label, for `raytrain-app predict`.")
@click.option("--features", callback=_names, help="Feature columns, comma-separated (default: every column but the "
                                                  "label).")
@click.option("--classes", callback=_names, metavar="NAME,NAME,...",
              help="A label of names: the classes in id order, as another conversion numbered them (default: the "
                   "file's names, sorted).")
@_sharding
def convert_csv(file, out_dir, label, no_label, features, classes, rows_per_file, row_group_rows):
    """A CSV file with a header row and numeric features into OUT_DIR/part-*.parquet, in the
    file's row order. A label of names is stored as class ids (the sorted names, 0, 1, ...), the
    names in the files' metadata, so that training, `evaluate` and `predict` show them.

    \b
    Examples:
      raytrain-app convert csv examples/iris.csv data/iris --label species --row-group-rows 16
      raytrain-app convert csv examples/iris-new.csv data/iris-new --no-label
    """
    from raytrain_app.data import convert as converter

    with exit_codes():
        click.echo(converter.csv(file, out_dir, label, no_label, features, classes, rows_per_file, row_group_rows))
