"""Encoded images as people store them: JPEG, PNG, WebP (or anything Pillow opens) in an
ImageFolder tree, local or on object storage; as bytes in Parquet, either in the Hugging Face
`datasets` layout (an `image` struct of `bytes` and `path`) or as a plain binary column; or in
WebDataset tar shards (`KEY.jpg` beside `KEY.cls`).

Samples stay encoded until a DataLoader worker process reads them: it decodes each one with
torchvision's decoders (libjpeg-turbo, libpng) and transforms it with torchvision.transforms.v2
(training: a random resized crop and a flip; evaluation: a resize and a centre crop), so the
original pixels reach the crop and decoding runs on as many cores as the loader has workers.

A training sample's random crop and flip are drawn from (the run's seed, the epoch, the sample):
the same whichever rank, worker process or resume reads it, so a resumed run trains bitwise what
the uninterrupted one trained (`DrawnShard`).

An ImageFolder tree is listed once and each file read when sampled, so it may be any size; so are
tar shards, whose headers are read once and each image read at its offset. The image bytes of
Parquet files are held in memory, still encoded (about a tenth of the pixels).

What the evaluation transform does is the model's to keep (`recipe`): `load_model`, `predict`
and `evaluate --data` apply it to image files, folders and byte columns.
"""

from __future__ import annotations

import json
import posixpath
import tarfile
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from raytrain_app import storage
from raytrain_app.data.parquet_files import class_ids, class_names, is_text
from raytrain_app.errors import UserError

IMAGE_SUFFIXES = (".bmp", ".jpeg", ".jpg", ".pgm", ".png", ".ppm", ".tif", ".tiff", ".webp")  # torchvision's
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
ON_BAD = ("error", "skip")
MAX_LOADER_PROCESSES = 64  # skip counters per DataLoader worker process (and one for the training process)


def decode_processes(cpus: float) -> int:
    """Loader processes that decode images: one per CPU, at most 8; the training process waits."""
    return max(1, min(8, int(cpus)))


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


def decode(data: bytes, name: str) -> torch.Tensor:
    """An image's RGB pixels (uint8, C x H x W): torchvision's decoders, Pillow for the formats
    they lack; a UserError naming `name` when neither reads it."""
    from torchvision.io import ImageReadMode, decode_image

    try:
        return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except RuntimeError as e:
        reason = str(e).rsplit(", ", 1)[-1].strip()
        if "Unsupported image file" not in reason:
            raise UserError(f"{name}: not a readable image ({reason})") from None
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            pixels = np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (OSError, ValueError, UnidentifiedImageError, Image.DecompressionBombError) as e:
        raise UserError(f"{name}: not a readable image ({e})") from None
    return torch.from_numpy(pixels.transpose(2, 0, 1).copy())


@dataclass(frozen=True)
class Transforms:
    """How pixels become the model's input: the training augmentation and the evaluation
    transform, as the config gives them (and the checkpoint keeps them, `recipe`)."""

    size: int = 224  # the crop the model sees: size x size
    resize: Optional[int] = None  # evaluation resizes the shorter side to this, then crops; None: size / 0.875
    scale: tuple[float, float] = (0.08, 1.0)  # the random crop's share of the image's area
    ratio: tuple[float, float] = (3 / 4, 4 / 3)  # and its aspect ratio
    flip: bool = True  # a random horizontal flip in training
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD

    @property
    def eval_resize(self) -> int:
        return self.resize or round(self.size / 0.875)

    def train(self):
        import torchvision.transforms.v2 as T

        return T.Compose([T.RandomResizedCrop(self.size, scale=self.scale, ratio=self.ratio, antialias=True),
                          *([T.RandomHorizontalFlip()] if self.flip else []), *self._normalise()])

    def eval(self):
        import torchvision.transforms.v2 as T

        return T.Compose([T.Resize(self.eval_resize, antialias=True), T.CenterCrop(self.size), *self._normalise()])

    def _normalise(self):
        import torchvision.transforms.v2 as T

        return [T.ToDtype(torch.float32, scale=True), T.Normalize(list(self.mean), list(self.std))]


@dataclass
class BadImage:
    """What a batch becomes when one of its images does not decode (`on_bad: error`): the line
    to say, raised by the training process (`CheckedBatches`), not as a worker process's traceback."""

    line: str


class EncodedImages(Dataset):
    """(pixels, label) pairs decoded and transformed on reading. Keys are sample indices, or
    (index, seed, epoch) from `DrawnShard`, which fix the sample's random draws."""

    def __init__(self, source: Encoded, transforms: Transforms, train: bool, on_bad: str = "error",
                 column: str = "image", label: str = "label"):
        self.source, self.transforms, self.train, self.on_bad = source, transforms, train, on_bad
        self.column, self.label = column, label
        self.transform = transforms.train() if train else transforms.eval()
        # Bad images skipped so far, one slot per loader process: shared memory, which the
        # processes a DataLoader forks write and the training process reads (`skipped`).
        self.skips = torch.zeros(MAX_LOADER_PROCESSES + 1, dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: Union[int, tuple[int, int, int]]):
        i, seed, epoch = key if isinstance(key, tuple) else (key, None, None)
        name = self.source.name(i)
        try:
            pixels = decode(self.source.read(i), name)
        except UserError as e:
            if self.on_bad == "skip":
                self._count_skip()
                return None
            return BadImage(f"{e.lines[0]}; set data.args.on_bad: skip to train without such images")
        except (OSError, pa.ArrowException) as e:
            return BadImage(f"cannot read {name}: {storage.explain(e)}")
        if seed is None or not self.train:
            x = self.transform(pixels)
        else:
            with torch.random.fork_rng(devices=[]):  # the CPU generator's only: torch.manual_seed would queue
                # a CUDA seeding with its stack trace, a millisecond a sample
                torch.default_generator.manual_seed(((seed * 1_000_003 + epoch) * 1_000_000_007 + i) % 2**63)
                x = self.transform(pixels)
        label = -1 if self.source.labels is None else int(self.source.labels[i])
        return x, label

    def _count_skip(self) -> None:
        from torch.utils.data import get_worker_info

        worker = get_worker_info()
        self.skips[0 if worker is None else 1 + worker.id % MAX_LOADER_PROCESSES] += 1

    def skipped(self) -> int:
        """Bad images skipped so far, over this dataset's loader processes."""
        return int(self.skips.sum())

    @staticmethod
    def collate(samples: list):
        """A batch of the samples that decoded; a bad one's line, where bad images are errors."""
        bad = next((s for s in samples if isinstance(s, BadImage)), None)
        if bad:
            return bad
        kept = [s for s in samples if s is not None]
        if not kept:
            return BadImage("every image of a batch was unreadable and skipped; check the data "
                            f"({len(samples)} images in a row)")
        return default_collate(kept)

    @property
    def num_classes(self) -> Optional[int]:
        return self.source.num_classes

    @property
    def recipe(self) -> dict:
        """How the trained model reads new images (data.preprocess.recipe)."""
        t = self.transforms
        return {"kind": "images", "features": self.column, "label": self.label, "shape": [3, t.size, t.size],
                "size": t.size, "resize": t.eval_resize, "mean": list(t.mean), "std": list(t.std),
                "classes": list(self.source.classes) if self.source.classes else None}


@dataclass
class CheckedBatches:
    """A DataLoader over EncodedImages that raises a bad image's one line where it is met."""

    loader: object
    dataset: EncodedImages = field(init=False)

    def __post_init__(self):
        self.dataset = self.loader.dataset

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        for batch in self.loader:
            if isinstance(batch, BadImage):
                raise UserError(batch.line)
            yield batch


def images(path: str, eval_fraction: float, split_seed: int, eval_path: Optional[str] = None, size: int = 224,
           resize: Optional[int] = None, scale: tuple[float, float] = (0.08, 1.0),
           ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = True,
           mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD,
           column: str = "image", label: str = "label", on_bad: str = "error"):
    """Encoded images (JPEG, PNG, ...) from an ImageFolder tree (ROOT/CLASS_NAME/IMAGE, local or a
    URI) or Parquet files with image bytes (the Hugging Face layout, a struct of bytes and path,
    or a binary column `column`) and a label column `label` (class ids or names). Training crops
    a random `scale` share of each image at a random aspect `ratio`, resizes it to `size`, may
    flip it, and normalises it by `mean` and `std`; evaluation resizes the shorter side to
    `resize` (default size / 0.875) and crops the centre. `path` may also be WebDataset tar
    shards (KEY.jpg beside KEY.cls). The eval set is `eval_path`, or else a
    seeded `eval_fraction` of the images. `on_bad`: an image that does not decode stops the run
    with its name (`error`), or is skipped and counted in each epoch's `skipped_images` (`skip`)."""
    if on_bad not in ON_BAD:
        raise UserError(f"data.args.on_bad must be one of {', '.join(ON_BAD)}, got {on_bad!r}")
    transforms = Transforms(size, resize, tuple(scale), tuple(ratio), flip, tuple(mean), tuple(std))
    if len(transforms.mean) != 3 or len(transforms.std) != 3:
        raise UserError("data.args.mean and std take three values, one per colour channel (RGB)")
    train = find(path, column=column, label=label)
    if eval_path:
        evaluated = find(eval_path, column=column, label=label, classes=train.classes)
        if train.classes is None and evaluated.classes is not None:  # class ids beside names: refuse
            raise UserError(f"data.args.eval_path {eval_path} names its classes and {path} does not")
    else:
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(split_seed)).numpy()
        n_eval = max(1, round(len(train) * eval_fraction))
        train, evaluated = train.take(np.sort(order[n_eval:])), train.take(np.sort(order[:n_eval]))
    return (EncodedImages(train, transforms, True, on_bad, column, label),
            EncodedImages(evaluated, transforms, False, on_bad, column, label))


def transforms_of(recipe: dict) -> Transforms:
    """The evaluation half of a trained model's transforms, from its recipe."""
    return Transforms(size=recipe["size"], resize=recipe["resize"], mean=tuple(recipe["mean"]),
                      std=tuple(recipe["std"]))


def labelled(path: str, recipe: dict) -> EncodedImages:
    """Labelled images as a trained model evaluates them: its classes, its eval transform."""
    found = find(path, column=recipe.get("features") or "image", label=recipe.get("label") or "label",
                 classes=recipe.get("classes"))
    return EncodedImages(found, transforms_of(recipe), False, "error", recipe.get("features") or "image",
                         recipe.get("label") or "label")


class ImagePreprocess(nn.Module):
    """A trained model's evaluation transform as a module: images in, the model's input out.
    Images are a uint8 batch (N x 3 x H x W), or a list of image files (paths or URIs), encoded
    bytes or C x H x W tensors, each of any size."""

    def __init__(self, recipe: dict):
        super().__init__()
        transforms = transforms_of(recipe)
        import torchvision.transforms.v2 as T

        self.resize = T.Compose([T.Resize(transforms.eval_resize, antialias=True), T.CenterCrop(transforms.size)])
        self.normalise = ImageNormalise(recipe)

    def forward(self, x) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            x = self.resize(x)
        else:
            x = torch.stack([self.resize(pixels(item)) for item in x])
        return self.normalise(x)


class ImageNormalise(nn.Module):
    """The end of the evaluation transform: images already resized and centre-cropped (a uint8
    batch, N x 3 x size x size) in, the model's input out. It is what an exported TorchScript or
    ONNX file holds of the transform: a traced graph would fix the sizes a resize computes from
    each image's own."""

    def __init__(self, recipe: dict):
        super().__init__()
        self.register_buffer("mean", torch.tensor(recipe["mean"], dtype=torch.float32).reshape(3, 1, 1))
        self.register_buffer("std", torch.tensor(recipe["std"], dtype=torch.float32).reshape(3, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torchvision.transforms.v2.functional as F

        return (F.to_dtype(x.to(self.mean.device), torch.float32, scale=True) - self.mean) / self.std


def pixels(image) -> torch.Tensor:
    """An image given as a path or URI, encoded bytes, or a pixel tensor, as a C x H x W tensor."""
    if isinstance(image, torch.Tensor):
        return image
    if isinstance(image, (bytes, bytearray, memoryview)):
        return decode(bytes(image), "an image given as bytes")
    return decode(storage.read_bytes(str(image)), str(image))
