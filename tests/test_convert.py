"""`raytrain-app convert` on real files, run as users run it (a process of its own): ImageFolder
trees and CSV files written here, converted, and read back with pyarrow and with the project's
reader."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from raytrain_app.config.sections import DataConfig
from raytrain_app.data import build_datasets
from raytrain_app.data.parquet import read_table
from raytrain_app.data.parquet_files import feature_matrix
from raytrain_app.errors import UserError
from tests.commands import Finished, command
from tests.conftest import REPO

CLASSES = ["zebra", "ant", "moth"]  # created out of order: labels must follow the sorted names


def convert(*args) -> Finished:
    return command(["convert", *map(str, args)], REPO)


def converted(*args) -> Finished:
    result = convert(*args)
    assert result.returncode == 0, result.stderr
    return result


def image_tree(root: Path) -> dict[Path, int]:
    """3 classes x 7 images of random pixels and different sizes, one RGBA, one greyscale, one
    JPEG and one BMP among them; each path with its expected label."""
    rng = np.random.default_rng(7)
    labels = {}
    for name in CLASSES:
        (root / name).mkdir(parents=True)
        for i in range(7):
            mode, suffix = {0: ("RGBA", ".png"), 1: ("L", ".png"), 2: ("RGB", ".jpg"), 3: ("RGB", ".BMP")}.get(
                i, ("RGB", ".png"))
            channels = len(mode)
            pixels = rng.integers(0, 256, (9 + i, 12 + 2 * i, channels), dtype=np.uint8)
            path = root / name / f"{i}{suffix}"
            Image.fromarray(pixels.squeeze(2) if channels == 1 else pixels, mode).save(path)
            labels[path] = sorted(CLASSES).index(name)
    (root / "ant" / "notes.txt").write_text("not an image: skipped")
    return labels


def expected_pixels(path: Path, grey: bool, size: int = 8) -> bytes:
    """What PIL gives for the same conversion and bilinear resize, in CHW order."""
    with Image.open(path) as image:
        array = np.asarray(image.convert("L" if grey else "RGB").resize((size, size), Image.BILINEAR))
    return array.reshape(size, size, -1).transpose(2, 0, 1).tobytes()


def parts(out: Path) -> list[Path]:
    return sorted(out.glob("*.parquet"))


def rows(out: Path) -> list[tuple[bytes, int]]:
    """Every (image, label) row of the output, in file and row order: pyarrow's own reading of
    each image's bytes (the column is fixed-size binary)."""
    found = []
    for part in parts(out):
        table = pq.read_table(part)
        found += list(zip(table.column("image").to_pylist(), table.column("label").to_pylist()))
    return found


SHARDING = ["--size", 8, "--rows-per-file", 8, "--row-group-rows", 3]


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> tuple[Path, dict[Path, int], Path, str]:
    """The image tree with its labels, its conversion (RGB, default seed) and what the script
    printed: read, never changed."""
    tmp = tmp_path_factory.mktemp("images")
    labels = image_tree(tmp / "tree")
    result = converted("images", tmp / "tree", tmp / "out", *SHARDING)
    return tmp / "tree", labels, tmp / "out", result.stdout


def test_an_image_folder_becomes_sharded_files_with_every_image_once(images):
    tree, labels, out, stdout = images
    assert stdout.strip() == f"wrote 21 rows of 3 classes in 3 files to {out}"

    files = parts(out)
    assert [f.name for f in files] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    groups = [[pq.ParquetFile(f).metadata.row_group(g).num_rows for g in range(pq.ParquetFile(f).num_row_groups)]
              for f in files]
    assert groups == [[3, 3, 2], [3, 3, 2], [3, 2]]  # no row group straddles two files

    schema = pq.read_schema(files[0])
    assert all(pq.read_schema(f).equals(schema, check_metadata=True) for f in files)
    assert schema.field("image").type == pa.binary(3 * 8 * 8)  # plain bytes: no repetition levels to decode
    assert schema.field("label").type == pa.int64()
    meta = {k.decode(): v.decode() for k, v in schema.metadata.items()}
    assert meta == {"raytrain.features": '"image"', "raytrain.label": "label", "raytrain.shape": "[3, 8, 8]",
                    "raytrain.num_classes": "3", "raytrain.classes": json.dumps(["ant", "moth", "zebra"]),
                    "raytrain.source": f"imagefolder:{tree}"}

    expected = sorted((expected_pixels(path, grey=False), label) for path, label in labels.items())
    assert len({image for image, _ in expected}) == 21  # distinct, so "once each" means something
    assert sorted(rows(out)) == expected


def test_grey_images_have_one_channel(tmp_path):
    labels = image_tree(tmp_path / "tree")
    converted("images", tmp_path / "tree", tmp_path / "out", *SHARDING, "--grey")
    schema = pq.read_schema(parts(tmp_path / "out")[0])
    assert schema.metadata[b"raytrain.shape"] == b"[1, 8, 8]"
    assert schema.field("image").type == pa.binary(8 * 8)
    assert sorted(rows(tmp_path / "out")) == sorted((expected_pixels(p, grey=True), label)
                                                    for p, label in labels.items())


def test_rows_are_shuffled_by_the_seed(images, tmp_path):
    tree, _, out, _ = images
    converted("images", tree, tmp_path / "again", *SHARDING, "--seed", 0)
    converted("images", tree, tmp_path / "other", *SHARDING, "--seed", 1)
    order = rows(out)
    assert [label for _, label in order] != sorted(label for _, label in order)  # not one class after another
    assert rows(tmp_path / "again") == order
    assert rows(tmp_path / "other") != order and sorted(rows(tmp_path / "other")) == sorted(order)


def test_the_project_reader_loads_a_converted_file(images):
    first = parts(images[2])[0]
    x, y = read_table(str(first), "image", "label", None)
    table = pq.read_table(first)
    assert tuple(x.shape) == (8, 3, 8, 8)
    assert y.tolist() == table.column("label").to_pylist()
    assert x.dtype == torch.uint8 and x.numpy().tobytes() == b"".join(table.column("image").to_pylist())


@pytest.mark.parametrize("streaming", [False, True])
def test_the_binary_layout_and_older_list_files_read_as_the_same_images(tmp_path, streaming):
    """The same pixels stored both ways, as `convert images` writes them now (fixed-size binary)
    and as it wrote them before (fixed_size_list<uint8>): read whole or streamed, the same tensors."""
    rng = np.random.default_rng(3)
    pixels, labels = rng.integers(0, 256, (50, 3 * 4 * 4), dtype=np.uint8), rng.integers(0, 4, 50)
    meta = {"raytrain.features": '"image"', "raytrain.label": "label", "raytrain.shape": "[3, 4, 4]"}
    layouts = {"binary": pa.Array.from_buffers(pa.binary(48), 50, [None, pa.py_buffer(pixels.tobytes())]),
               "list": pa.FixedSizeListArray.from_arrays(pa.array(pixels.ravel()), 48)}
    read = {}
    for name, column in layouts.items():
        (tmp_path / name).mkdir()
        table = pa.table({"image": column, "label": labels}).replace_schema_metadata(meta)
        pq.write_table(table, tmp_path / name / "part.parquet", row_group_size=16)
        data = build_datasets(DataConfig(name="parquet", args={"path": str(tmp_path / name), "streaming": streaming,
                                                               "eval_fraction": 0.2}))
        if streaming:  # every row, and a window that starts inside a row group (a slice of its batch)
            order = range(len(data.train.groups))
            read[name] = [data.train.decode(data.train.read_rows(order, lo, hi)) for lo, hi in
                          ((0, len(data.train)), (5, 12))]
        else:
            read[name] = [data.train]
        batch = pa.record_batch([column, pa.array(labels)], names=["image", "label"]).slice(5, 7)  # as `predict` reads
        assert feature_matrix(batch, "image", name).tobytes() == pixels[5:12].tobytes()
    for binary, listed in zip(read["binary"], read["list"], strict=True):
        assert len(binary) == len(listed) >= 7
        for i in range(len(listed)):
            (xb, yb), (xl, yl) = binary[i], listed[i]
            assert torch.equal(xb, xl) and int(yb) == int(yl)


def test_the_project_reader_finds_columns_and_shape_in_the_metadata(images, tmp_path):
    x, y = read_table(str(images[2]), None, None, None)  # every file, names and shape from the metadata
    assert tuple(x.shape) == (21, 3, 8, 8) and sorted(y.tolist()) == [0] * 7 + [1] * 7 + [2] * 7
    (tmp_path / "data.csv").write_text("a,b,y\n" + "".join(f"{i},{i / 4},{i % 3}\n" for i in range(10)))
    converted("csv", tmp_path / "data.csv", tmp_path / "out", "--label", "y", "--rows-per-file", 4)
    x, y = read_table(str(tmp_path / "out"), None, None, None)
    assert x.tolist() == [[i, i / 4] for i in range(10)] and y.tolist() == [i % 3 for i in range(10)]


def csv_file(path: Path) -> list[dict]:
    records = [{"n": i - 3, "r": i * 0.37 - 1, "klass": (i * 5) % 4, "w": i / 8} for i in range(11)]
    path.write_text("n,r,klass,w\n" + "".join(f"{d['n']},{d['r']},{d['klass']},{d['w']}\n" for d in records))
    return records


def test_a_csv_keeps_its_numbers_and_row_order(tmp_path):
    records = csv_file(tmp_path / "data.csv")
    out = tmp_path / "out"
    result = converted("csv", tmp_path / "data.csv", out, "--label", "klass", "--rows-per-file", 4,
                       "--row-group-rows", 3)
    assert result.stdout.strip() == f"wrote 11 rows with 4 classes in 3 files to {out}"
    files = parts(out)
    assert [pq.ParquetFile(f).metadata.num_rows for f in files] == [4, 4, 3]
    table = pa.concat_tables(pq.read_table(f) for f in files)
    assert table.schema.remove_metadata() == pa.schema([("n", pa.int64()), ("r", pa.float32()), ("w", pa.float32()),
                                                        ("klass", pa.int64())])
    assert table.column("n").to_pylist() == [d["n"] for d in records]
    assert table.column("klass").to_pylist() == [d["klass"] for d in records]
    for name in "rw":
        assert table.column(name).to_numpy().tolist() == [float(np.float32(d[name])) for d in records]
    assert all(pq.read_schema(f).equals(pq.read_schema(files[0]), check_metadata=True) for f in files)
    meta = {k.decode(): v.decode() for k, v in pq.read_schema(files[0]).metadata.items()}
    assert meta == {"raytrain.features": '["n", "r", "w"]', "raytrain.label": "klass", "raytrain.shape": "[3]",
                    "raytrain.num_classes": "4", "raytrain.source": f"csv:{tmp_path / 'data.csv'}"}


def test_a_csv_feature_subset_and_a_real_valued_label(tmp_path):
    records = csv_file(tmp_path / "data.csv")
    out = tmp_path / "out"
    result = converted("csv", tmp_path / "data.csv", out, "--label", "w", "--features", "klass,n")
    assert result.stdout.strip() == f"wrote 11 rows with a real-valued label in 1 files to {out}"
    table = pq.read_table(parts(out)[0])
    assert table.schema.names == ["klass", "n", "w"] and table.schema.field("w").type == pa.float32()
    assert table.column("klass").to_pylist() == [d["klass"] for d in records]
    meta = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    assert meta["raytrain.features"] == '["klass", "n"]' and meta["raytrain.shape"] == "[2]"
    assert "raytrain.num_classes" not in meta


def test_new_rows_without_a_label_for_predict(tmp_path):
    records = csv_file(tmp_path / "data.csv")
    out = tmp_path / "out"
    result = converted("csv", tmp_path / "data.csv", out, "--no-label", "--features", "n,klass")
    assert result.stdout.strip() == f"wrote 11 rows with no label in 1 files to {out}"
    table = pq.read_table(parts(out)[0])
    assert table.schema.names == ["n", "klass"] and table.column("n").to_pylist() == [d["n"] for d in records]
    meta = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    assert meta["raytrain.features"] == '["n", "klass"]' and "raytrain.label" not in meta


def test_a_csv_of_several_blocks_fills_row_groups_across_them(tmp_path):
    """pyarrow parses a CSV a block (1 MB) at a time; row groups and files are cut independently."""
    n = 200_000
    values = np.arange(n)
    with open(tmp_path / "big.csv", "w") as f:
        f.write("id,label\n")
        f.write("".join(f"{i},{i % 10}\n" for i in values.tolist()))
    assert (tmp_path / "big.csv").stat().st_size > 1 << 20
    out = tmp_path / "out"
    converted("csv", tmp_path / "big.csv", out, "--label", "label", "--rows-per-file", 80_000,
              "--row-group-rows", 7_000)
    files = parts(out)
    groups = [[pq.ParquetFile(f).metadata.row_group(g).num_rows for g in range(pq.ParquetFile(f).num_row_groups)]
              for f in files]
    assert groups == [[7_000] * 11 + [3_000]] * 2 + [[7_000] * 5 + [5_000]]
    assert np.array_equal(pa.concat_tables(pq.read_table(f) for f in files).column("id").to_numpy(), values)


KINDS = ["dog", "cat", "emu", "cat", "Dog", "dog", "ant", "cat", "emu"]  # "Dog" sorts before "ant"


def test_a_label_of_names_becomes_sorted_class_ids_with_the_names_kept(tmp_path):
    """Numbered as the csv dataset numbers them (sorted names), the names in the metadata, where
    training on the files finds them; a file lacking some names is numbered like another by --classes."""
    names = sorted(set(KINDS))
    assert names == ["Dog", "ant", "cat", "dog", "emu"]
    (tmp_path / "pets.csv").write_text("w,kind,h\n" + "".join(f"{i},{k},{i / 2}\n" for i, k in enumerate(KINDS)))
    result = converted("csv", tmp_path / "pets.csv", tmp_path / "out", "--label", "kind", "--rows-per-file", 4)
    assert result.stdout.strip() == f"wrote 9 rows with 5 classes in 3 files to {tmp_path / 'out'}"
    table = pa.concat_tables(pq.read_table(f) for f in parts(tmp_path / "out"))
    assert table.schema.field("kind").type == pa.int64()
    assert table.column("kind").to_pylist() == [names.index(k) for k in KINDS]
    meta = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    assert meta["raytrain.classes"] == json.dumps(names) and meta["raytrain.num_classes"] == "5"
    data = build_datasets(DataConfig(name="parquet", args={"path": str(tmp_path / "out")}))
    assert data.num_classes == 5 and data.train.stored.classes == tuple(names)

    (tmp_path / "more.csv").write_text("w,kind,h\n1,emu,2.5\n3,ant,4.5\n")
    converted("csv", tmp_path / "more.csv", tmp_path / "more", "--label", "kind", "--classes", ",".join(names))
    assert pq.read_table(tmp_path / "more").column("kind").to_pylist() == [4, 1]
    converted("csv", tmp_path / "more.csv", tmp_path / "alone", "--label", "kind")  # numbered ant 0, emu 1
    with pytest.raises(UserError, match="its class ids stand for ant, emu, not for the classes trained on, Dog, "
                                        "ant, cat, dog, emu: convert it with --classes Dog,ant,cat,dog,emu"):
        build_datasets(DataConfig(name="parquet", args={"path": str(tmp_path / "out"),
                                                        "eval_path": str(tmp_path / "alone")}))


def missing_root(tmp_path):
    return ["images", tmp_path / "nope", tmp_path / "out"], "nope"


def parquet_already_there(tmp_path):
    image_tree(tmp_path / "images")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.parquet").write_bytes(b"earlier data")
    return ["images", tmp_path / "images", tmp_path / "out"], "already holds .parquet files"


def unreadable_image(tmp_path):
    image_tree(tmp_path / "images")
    (tmp_path / "images" / "moth" / "x.png").write_bytes(b"garbage, not a PNG")
    return ["images", tmp_path / "images", tmp_path / "out", "--size", 8, "--rows-per-file", 1], "x.png"


def empty_class_folder(tmp_path):
    image_tree(tmp_path / "images")
    (tmp_path / "images" / "owl").mkdir()
    return ["images", tmp_path / "images", tmp_path / "out"], "owl holds no images"


def bad_size(tmp_path):
    image_tree(tmp_path / "images")
    return ["images", tmp_path / "images", tmp_path / "out", "--size", 0], "--size"


def unknown_label(tmp_path):
    csv_file(tmp_path / "data.csv")
    return ["csv", tmp_path / "data.csv", tmp_path / "out", "--label", "target"], "no column 'target'"


def string_feature(tmp_path):
    (tmp_path / "data.csv").write_text("x,name,y\n1,ann,0\n2,bob,1\n")
    return ["csv", tmp_path / "data.csv", tmp_path / "out", "--label", "y"], "column 'name' must hold numbers"


def empty_value(tmp_path):
    (tmp_path / "data.csv").write_text("x,z,y\n1,5,0\n2,,1\n")
    return ["csv", tmp_path / "data.csv", tmp_path / "out", "--label", "y"], "column 'z' has empty values"


def label_or_not(tmp_path):
    csv_file(tmp_path / "data.csv")
    return ["csv", tmp_path / "data.csv", tmp_path / "out"], "give --label COLUMN for training data, or --no-label"


def misspelt_label(tmp_path):
    csv_file(tmp_path / "data.csv")
    return (["csv", tmp_path / "data.csv", tmp_path / "out", "--label", "klas"],
            "no column 'klas' (did you mean 'klass'?)")


def a_name_not_in_classes(tmp_path):
    (tmp_path / "data.csv").write_text("x,y\n1,cat\n2,owl\n")
    return (["csv", tmp_path / "data.csv", tmp_path / "out", "--label", "y", "--classes", "cat,dog"],
            "label 'owl' in column 'y' is not one of the 2 classes of --classes (cat, dog)")


def an_empty_name(tmp_path):
    (tmp_path / "data.csv").write_text("x,y\n1,cat\n2,\n")
    return ["csv", tmp_path / "data.csv", tmp_path / "out", "--label", "y"], "column 'y' has empty values"


def classes_of_numbers(tmp_path):
    csv_file(tmp_path / "data.csv")
    return (["csv", tmp_path / "data.csv", tmp_path / "out", "--label", "klass", "--classes", "a,b"],
            "--classes is for a label of names (")


def no_source(tmp_path):
    return [], "Missing command"


@pytest.mark.parametrize("case", [missing_root, parquet_already_there, unreadable_image, empty_class_folder, bad_size,
                                  unknown_label, string_feature, empty_value, label_or_not, misspelt_label,
                                  a_name_not_in_classes, an_empty_name, classes_of_numbers, no_source],
                         ids=lambda case: case.__name__)
def test_user_errors_are_one_line_and_exit_2_leaving_no_files(tmp_path, case):
    args, fragment = case(tmp_path)
    before = {p: p.read_bytes() for p in parts(tmp_path / "out")}
    result = convert(*args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("error: ") and fragment in line
    assert {p: p.read_bytes() for p in parts(tmp_path / "out")} == before  # nothing written, nothing overwritten
