"""Where encoded images are, and their labels: image files in an ImageFolder tree, local or on
object storage; bytes in Parquet, in the Hugging Face `datasets` layout (an `image` struct of
`bytes` and `path`) or as a plain binary column; or members of WebDataset tar shards (`KEY.jpg`
beside `KEY.cls`). Nothing here decodes: `Encoded` says where each sample's bytes are and reads
them when asked (images.py turns them into tensors).

An ImageFolder tree is listed once and each file read when sampled, so it may be any size; so are
tar shards, whose headers are read once and each image read at its offset. The image bytes of
Parquet files are held in memory, still encoded (about a tenth of the pixels).
"""

from __future__ import annotations

import json
import posixpath
import tarfile
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrain_app import storage
from raytrain_app.data.parquet_files import class_ids, class_names, is_text
from raytrain_app.errors import UserError

IMAGE_SUFFIXES = (".bmp", ".jpeg", ".jpg", ".pgm", ".png", ".ppm", ".tif", ".tiff", ".webp")  # torchvision's


@dataclass(frozen=True)
class Encoded:
    """Where each sample's encoded bytes are, and its label: files on a pyarrow filesystem
    (`paths`), members of tar shards there (`members`: shard, offset, size; named `keys`), or the
    values of an in-memory binary array (`blobs`, rows `rows` of `origin`)."""

    origin: str  # the folder, shard or Parquet path it was found at, as the user gave it
    labels: Optional[np.ndarray]  # int64 class ids; None for unlabelled images to predict
    classes: Optional[tuple[str, ...]]  # the names of the class ids, where known
    fs: Optional[pafs.FileSystem] = None
    paths: Optional[np.ndarray] = None  # object array of paths inside `fs`
    blobs: Optional[pa.Array] = None  # binary or large_binary
    rows: Optional[np.ndarray] = None  # each blob's row in `origin`, for messages
    shards: tuple[str, ...] = ()  # tar files inside `fs`
    members: Optional[np.ndarray] = None  # int64 (n, 3): each image's shard, data offset and size
    keys: Optional[np.ndarray] = None  # object array: each image's member name

    def __len__(self) -> int:
        for held in (self.paths, self.members, self.blobs):
            if held is not None:
                return len(held)
        return 0

    def read(self, i: int) -> bytes:
        if self.paths is not None:
            with self.fs.open_input_file(self.paths[i]) as f:
                return f.readall()
        if self.members is not None:
            shard, offset, size = (int(v) for v in self.members[i])
            with self.fs.open_input_file(self.shards[shard]) as f:
                f.seek(offset)
                return f.read(size)
        return self.blobs[i].as_buffer()

    def name(self, i: int) -> str:
        """How a message names sample i: its file, its shard and member, or its row."""
        if self.paths is not None:
            return str(self.paths[i])
        if self.members is not None:
            return f"{self.shards[int(self.members[i][0])]}:{self.keys[i]}"
        return f"{self.origin} row {int(self.rows[i])}"

    def take(self, idx: np.ndarray) -> "Encoded":
        labels = None if self.labels is None else self.labels[idx]
        if self.paths is not None:
            return replace(self, labels=labels, paths=self.paths[idx])
        if self.members is not None:
            return replace(self, labels=labels, members=self.members[idx], keys=self.keys[idx])
        return replace(self, labels=labels, blobs=self.blobs.take(pa.array(idx)), rows=self.rows[idx])

    @property
    def num_classes(self) -> Optional[int]:
        if self.classes:
            return len(self.classes)
        return int(self.labels.max()) + 1 if self.labels is not None and len(self.labels) else None


def _kind(path: str) -> str:
    """How `path` holds its images: "parquet", "tar" (WebDataset shards) or "folder" (image files):
    by its suffix, or for a folder by the files in it (Parquet first, then shards, then images)."""
    lower = path.lower().rstrip("/")
    if lower.endswith(".parquet"):
        return "parquet"
    if lower.endswith(".tar"):
        return "tar"
    if lower.endswith(IMAGE_SUFFIXES):
        return "folder"
    fs, inside = storage.filesystem_for(path)
    if _info(fs, inside, path).type != pafs.FileType.Directory:
        return "parquet"  # a file of another name: read as Parquet, or said not to be
    names = [f.path.lower() for f in _listing(fs, inside, path) if f.type == pafs.FileType.File]
    if any(name.endswith(".parquet") for name in names):
        return "parquet"
    has_images = any(name.endswith(IMAGE_SUFFIXES) for name in names)
    return "tar" if any(name.endswith(".tar") for name in names) and not has_images else "folder"


def find(path: str, labelled: bool = True, column: str = "image", label: str = "label",
         classes: Optional[Sequence[str]] = None) -> Encoded:
    """The images `path` names: an ImageFolder tree (ROOT/CLASS_NAME/IMAGE, classes numbered in
    sorted order, as torchvision's ImageFolder numbers them), Parquet file(s) with an image column,
    WebDataset tar shards (a shard, or a folder of them), or, unlabelled, one image or a folder of
    images. `classes`: the names a model was trained on, which number this data's classes instead
    of its own."""
    kind = _kind(path)
    if kind == "parquet":
        return _parquet(path, labelled, column, label, classes)
    if kind == "tar":
        return _tars(path, labelled, classes)
    return _folder(path, labelled, classes)


def _info(fs: pafs.FileSystem, inside: str, shown: str) -> pafs.FileInfo:
    try:
        info = fs.get_file_info(inside)
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"cannot read {shown}: {storage.explain(e)}") from None
    if info.type == pafs.FileType.NotFound:
        raise UserError(f"{shown}: no such file or directory")
    return info


def _listing(fs: pafs.FileSystem, inside: str, shown: str) -> list[pafs.FileInfo]:
    try:
        return fs.get_file_info(pafs.FileSelector(inside, recursive=True))
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"cannot list {shown}: {storage.explain(e)}") from None


def _folder(path: str, labelled: bool, classes: Optional[Sequence[str]]) -> Encoded:
    fs, root = storage.filesystem_for(path)
    if _info(fs, root, path).type == pafs.FileType.File:  # one image to predict
        return Encoded(path, None, None, fs, np.array([root], dtype=object))
    files = sorted(f.path for f in _listing(fs, root, path)
                   if f.type == pafs.FileType.File and f.path.lower().endswith(IMAGE_SUFFIXES))
    if not files:
        raise UserError(f"{path} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    if not labelled:
        return Encoded(path, None, None, fs, np.array(files, dtype=object))
    folders = [posixpath.relpath(f, root).split("/")[0] if "/" in posixpath.relpath(f, root) else None for f in files]
    if None in folders:
        loose = files[folders.index(None)]
        raise UserError(f"{path}: {posixpath.basename(loose)} is not in a class folder "
                        "(expected ROOT/CLASS_NAME/IMAGE)")
    found = sorted(set(folders))
    known = list(classes) if classes else found
    unknown = [name for name in found if name not in known]
    if unknown:
        raise UserError(f"{path}: class folder '{unknown[0]}' is not one of the {len(known)} classes trained on "
                        f"({', '.join(known[:20])})")
    ids = {name: i for i, name in enumerate(known)}
    labels = np.array([ids[name] for name in folders], dtype=np.int64)
    return Encoded(path, labels, tuple(known), fs, np.array(files, dtype=object))


def _tars(path: str, labelled: bool, classes: Optional[Sequence[str]]) -> Encoded:
    """WebDataset shards: uncompressed tar files whose members sharing a key (the member's name up
    to the first dot of its file name) make one sample: an image (`KEY.jpg`, `KEY.png`, ...) and,
    for training, its label in `KEY.cls` (a class id, or a class name). The headers are read once;
    each image is read at its offset when sampled."""
    fs, inside = storage.filesystem_for(path)
    if _info(fs, inside, path).type == pafs.FileType.File:
        shards = [inside]
    else:
        shards = sorted(f.path for f in _listing(fs, inside, path)
                        if f.type == pafs.FileType.File and f.path.lower().endswith(".tar"))
    images: dict[tuple[int, str], tuple[int, int, str]] = {}
    labels: dict[tuple[int, str], str] = {}
    for s, shard in enumerate(shards):
        try:
            with fs.open_input_file(shard) as f, tarfile.open(fileobj=f, mode="r:") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    folder, base = posixpath.split(member.name)
                    stem, _, extension = base.partition(".")
                    key = (s, posixpath.join(folder, stem))
                    if f".{extension.lower()}" in IMAGE_SUFFIXES:
                        images[key] = (member.offset_data, member.size, member.name)
                    elif extension.lower() == "cls" and labelled:
                        labels[key] = tar.extractfile(member).read().decode().strip()
        except (tarfile.TarError, OSError, pa.ArrowException, UnicodeDecodeError) as e:
            raise UserError(f"{shard}: not a readable tar shard ({e})") from None
    if not images:
        raise UserError(f"{path} holds no images in tar shards (KEY.jpg, KEY.png, ... members)")
    keys = sorted(images)
    members = np.array([(s, *images[(s, k)][:2]) for s, k in keys], dtype=np.int64)
    named = np.array([images[key][2] for key in keys], dtype=object)
    found = Encoded(path, None, None, fs, shards=tuple(shards), members=members, keys=named)
    if not labelled:
        return found
    missing = next((key for key in keys if key not in labels), None)
    if missing:
        raise UserError(f"{shards[missing[0]]}: {missing[1]} has no label (a {missing[1]}.cls member)")
    values = [labels[key] for key in keys]
    if not classes and all(v.lstrip("-").isdigit() for v in values):  # class ids
        ids = np.array([int(v) for v in values], dtype=np.int64)
        return replace(found, labels=ids)
    known = list(classes) if classes else sorted(set(values))
    unknown = next((v for v in values if v not in known), None)
    if unknown is not None:
        raise UserError(f"{path}: label '{unknown}' is not one of the {len(known)} classes trained on "
                        f"({', '.join(known[:20])})")
    ids = {name: i for i, name in enumerate(known)}
    return replace(found, labels=np.array([ids[v] for v in values], dtype=np.int64), classes=tuple(known))


def _parquet(path: str, labelled: bool, column: str, label: str, classes: Optional[Sequence[str]]) -> Encoded:
    fs, inside = storage.filesystem_for(path)
    _info(fs, inside, path)
    try:
        table = pq.read_table(inside, filesystem=fs)
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"cannot read {path} as Parquet: {storage.explain(e)}") from None
    if column not in table.column_names:
        raise UserError(f"{path}: no image column '{column}' (columns: {', '.join(table.column_names)}; "
                        "set data.args.column)")
    blobs = table.column(column).combine_chunks()
    if pa.types.is_struct(blobs.type):  # Hugging Face's Image feature: {bytes, path}
        if blobs.type.get_field_index("bytes") < 0:
            raise UserError(f"{path}: image column '{column}' is a struct without a 'bytes' field")
        blobs = blobs.field("bytes")
    if not (pa.types.is_binary(blobs.type) or pa.types.is_large_binary(blobs.type)):
        raise UserError(f"{path}: image column '{column}' holds {blobs.type}, not encoded image bytes "
                        "(a binary column, or a struct of bytes and path)")
    if blobs.null_count:
        row = int(np.flatnonzero(blobs.is_null().to_numpy(zero_copy_only=False))[0])
        raise UserError(f"{path} row {row}: image column '{column}' is empty")
    rows = np.arange(len(blobs))
    if not labelled:
        return Encoded(path, None, None, blobs=blobs, rows=rows)
    if label not in table.column_names:
        raise UserError(f"{path}: no label column '{label}' (columns: {', '.join(table.column_names)}; "
                        "set data.args.label)")
    values = table.column(label).combine_chunks()
    named = classes or _declared_classes(table.schema, label)
    if is_text(values.type):
        named = named or class_names([values], path, label)
        labels = class_ids(values, list(named), path, label)
    else:
        if values.null_count:
            raise UserError(f"{path}: label column '{label}' has empty values")
        labels = values.to_numpy(zero_copy_only=False).astype(np.int64)
        if named and len(labels) and (labels.min() < 0 or labels.max() >= len(named)):
            raise UserError(f"{path}: label column '{label}' holds class id {int(labels.max())}, but there are "
                            f"{len(named)} classes")
    return Encoded(path, labels, tuple(named) if named else None, blobs=blobs, rows=rows)


def _declared_classes(schema: pa.Schema, label: str) -> Optional[list[str]]:
    """Class names a Parquet file declares: `raytrain-app convert`'s metadata, or the Hugging Face
    ClassLabel feature's names."""
    meta = schema.metadata or {}
    if b"raytrain.classes" in meta:
        return json.loads(meta[b"raytrain.classes"])
    if b"huggingface" in meta:
        feature = json.loads(meta[b"huggingface"]).get("info", {}).get("features", {}).get(label, {})
        return feature.get("names") if feature.get("_type") == "ClassLabel" else None
    return None
