"""Encoded images (JPEG, PNG, WebP, or anything Pillow opens) decoded and transformed into the
model's input; where they are stored, and how they are found, is image_sources.py's.

By default samples stay encoded until a DataLoader worker process reads them: it decodes each one
with torchvision's decoders (libjpeg-turbo, libpng) and transforms it with torchvision.transforms.v2
(training: a random resized crop and a flip; evaluation: a resize and a centre crop), so the
original pixels reach the crop and decoding runs on as many cores as the loader has workers.
With `decode: device`, the loader processes only read each JPEG and draw its crop from its header;
the training process decodes the batch on its device (nvjpeg on a GPU, whose hardware decoder
leaves the CPUs free) and cuts it there.

A training sample's random crop and flip are drawn from (the run's seed, the epoch, the sample):
the same whichever rank, worker process or resume reads it, or wherever it is decoded, so a
resumed run trains bitwise what the uninterrupted one trained (`DrawnShard`).

What the evaluation transform does is the model's to keep (`recipe`): `load_model`, `predict`
and `evaluate --data` apply it to image files, folders and byte columns.
"""

from __future__ import annotations

import io
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Optional, Union

import numpy as np
import pyarrow as pa
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from raytrain_app import storage
from raytrain_app.data.cuda_streams import handed_over
from raytrain_app.data.image_sources import Encoded, find
from raytrain_app.errors import UserError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
ON_BAD = ("error", "skip")
DECODE = ("loader", "device")  # where images are decoded: the DataLoader's processes, or the training device
JPEG_MAGIC = b"\xff\xd8\xff"  # what nvjpeg decodes; other formats are decoded by the loader processes
MAX_LOADER_PROCESSES = 64  # skip counters per DataLoader worker process (and one for the training process)


def decode_processes(cpus: float) -> int:
    """Loader processes that decode images: one per CPU, at most 8; the training process waits."""
    return max(1, min(8, int(cpus)))


def decode(data: bytes, name: str) -> torch.Tensor:
    """An image's RGB pixels (uint8, C x H x W): torchvision's decoders, Pillow for the formats
    they lack; a UserError naming `name` when neither reads it."""
    from torchvision.io import ImageReadMode, decode_image

    try:
        return decode_image(_bytes_tensor(data), mode=ImageReadMode.RGB)
    except RuntimeError as e:
        reason = str(e).rsplit(", ", 1)[-1].strip()
        if "Unsupported image file" not in reason:
            raise UserError(f"{name}: not a readable image ({reason})") from None
    pixels = with_pillow(data, name, lambda image: np.asarray(image.convert("RGB"), dtype=np.uint8))
    return torch.from_numpy(pixels.transpose(2, 0, 1).copy())


def jpeg_size(data: bytes, name: str) -> tuple[int, int]:
    """A JPEG's height and width, from its header alone (Pillow reads no further until asked)."""
    width, height = with_pillow(data, name, lambda image: image.size)
    return height, width


def with_pillow(data: bytes, name: str, use: Callable):
    """`use` of the image Pillow opens from `data`; a UserError naming `name` where it cannot."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return use(image)
    except (OSError, ValueError, UnidentifiedImageError, Image.DecompressionBombError) as e:
        raise UserError(f"{name}: not a readable image ({e})") from None


@dataclass(frozen=True)
class Crop:
    """A training sample's drawn augmentation: the box it cuts from the decoded image, and whether
    it flips. Drawn where the sample is read, applied where it is decoded (the same place, unless
    the training process decodes on its device)."""

    top: int
    left: int
    height: int
    width: int
    flip: bool


@dataclass(frozen=True)
class Transforms:
    """How pixels become the model's input: the training augmentation and the evaluation
    transform, as the config gives them (and the checkpoint keeps them, `recipe`). Drawing a
    crop is apart from applying it, so that a sample's draws happen in a loader process (from its
    seed) while a GPU decodes and cuts it (`decode: device`)."""

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

    def draw(self, height: int, width: int) -> Crop:
        """A random crop and flip for an image of height x width, from torch's CPU generator (which
        the caller seeds per sample): transforms.v2's RandomResizedCrop and RandomHorizontalFlip draws."""
        box = self._random_crop.make_params([torch.empty((), dtype=torch.uint8).expand(3, height, width)])
        return Crop(**box, flip=self.flip and bool(torch.rand(1) < 0.5))

    @cached_property
    def _random_crop(self):
        import torchvision.transforms.v2 as T

        return T.RandomResizedCrop(self.size, scale=self.scale, ratio=self.ratio)

    def cut(self, pixels: torch.Tensor, crop: Optional[Crop] = None) -> torch.Tensor:
        """uint8 pixels (C x H x W, or a batch of one size) cut to size x size, on their device:
        the drawn crop resized (and flipped) in training; in evaluation (no crop) the shorter side
        resized to `eval_resize` and the centre cut."""
        import torchvision.transforms.v2.functional as F

        if crop is None:
            return F.center_crop(F.resize(pixels, [self.eval_resize], antialias=True), [self.size])
        x = F.resized_crop(pixels, crop.top, crop.left, crop.height, crop.width, [self.size, self.size],
                           antialias=True)
        return F.horizontal_flip(x) if crop.flip else x

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """Cut uint8 pixels (one image or a batch) as the model's float input."""
        import torchvision.transforms.v2.functional as F

        return F.normalize(F.to_dtype(x, torch.float32, scale=True), list(self.mean), list(self.std))


@dataclass
class BadImage:
    """What a batch becomes when one of its images does not decode (`on_bad: error`): the line
    to say, raised by the training process (`CheckedBatches`), not as a worker process's traceback."""

    line: str


@dataclass
class Undecoded:
    """A sample for the training process to decode and cut on its device (`decode: device`): a
    JPEG's bytes, or the pixels of an image in another format, which the loader process decoded;
    with its crop. Bytes and arrays, not tensors: a loader process sends each tensor of a batch
    through a shared-memory file of its own, and a batch of 512 would open 512."""

    jpeg: Optional[bytes]
    pixels: Optional[np.ndarray]  # uint8, C x H x W, where `jpeg` is None
    crop: Optional[Crop]  # None: the evaluation transform
    label: int
    name: str


class EncodedImages(Dataset):
    """(pixels, label) pairs decoded and transformed on reading; with `decode: device`, a loader's
    batches (`__getitems__`) keep their JPEGs encoded (`Undecoded`) until the training process
    decodes them on its device (`decode_batch`). Keys are sample indices, or (index, seed, epoch)
    from `DrawnShard`, which fix the sample's random draws."""

    def __init__(self, source: Encoded, transforms: Transforms, train: bool, on_bad: str = "error",
                 column: str = "image", label: str = "label", decode: str = "loader"):
        self.source, self.transforms, self.train, self.on_bad = source, transforms, train, on_bad
        self.column, self.label, self.decode = column, label, decode
        # Bad images skipped so far, one slot per loader process: shared memory, which the
        # processes a DataLoader forks write and the training process reads (`skipped`).
        self.skips = torch.zeros(MAX_LOADER_PROCESSES + 1, dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: Union[int, tuple[int, int, int]]):
        return self._read(key, on_device=False)

    def __getitems__(self, keys: list):
        """A DataLoader's batch of samples; with `decode: device`, still to decode (`Undecoded`)."""
        return [self._read(key, on_device=self.decode == "device") for key in keys]

    def _read(self, key: Union[int, tuple[int, int, int]], on_device: bool):
        i, seed, epoch = key if isinstance(key, tuple) else (key, None, None)
        name = self.source.name(i)
        try:
            data = self.source.read(i)
            encoded = on_device and data[:3] == JPEG_MAGIC  # for the device to decode
            pixels = None if encoded else decode(data, name)
            height, width = jpeg_size(data, name) if encoded else pixels.shape[-2:]
        except UserError as e:
            return self._bad(e.lines[0])
        except (OSError, pa.ArrowException) as e:
            return BadImage(f"cannot read {name}: {storage.explain(e)}")
        crop = self._draw(height, width, i, seed, epoch) if self.train else None
        label = -1 if self.source.labels is None else int(self.source.labels[i])
        if on_device:
            return Undecoded(bytes(data) if encoded else None, None if encoded else pixels.numpy(), crop, label, name)
        return self.transforms.normalise(self.transforms.cut(pixels, crop)), label

    def _draw(self, height: int, width: int, i: int, seed: Optional[int], epoch: Optional[int]) -> Crop:
        """Sample i's crop: from its (seed, epoch, i) where the sampler gives them, so the same
        wherever it is read; else from this process's generator."""
        if seed is None:
            return self.transforms.draw(height, width)
        with torch.random.fork_rng(devices=[]):  # the CPU generator's only: torch.manual_seed would queue
            # a CUDA seeding with its stack trace, a millisecond a sample
            torch.default_generator.manual_seed(((seed * 1_000_003 + epoch) * 1_000_000_007 + i) % 2**63)
            return self.transforms.draw(height, width)

    def _bad(self, line: str) -> Optional[BadImage]:
        """None for a bad image skipped (and counted); else the line to stop the run with."""
        if self.on_bad == "skip":
            from torch.utils.data import get_worker_info

            worker = get_worker_info()
            self.skips[0 if worker is None else 1 + worker.id % MAX_LOADER_PROCESSES] += 1
            return None
        return BadImage(f"{line}; set data.args.on_bad: skip to train without such images")

    def skipped(self) -> int:
        """Bad images skipped so far, over this dataset's loader processes."""
        return int(self.skips.sum())

    @staticmethod
    def collate(samples: list):
        """A batch of the samples that decoded (a list of them where the training process
        decodes); a bad one's line, where bad images are errors."""
        bad = next((s for s in samples if isinstance(s, BadImage)), None)
        if bad:
            return bad
        kept = [s for s in samples if s is not None]
        if not kept:
            return BadImage(every_image_skipped(len(samples)))
        return kept if isinstance(kept[0], Undecoded) else default_collate(kept)

    def decode_batch(self, samples: list[Undecoded], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Undecoded samples as the model's input and labels on `device`: the JPEGs decoded there
        in one call (nvjpeg on a GPU), every image cut by its crop, the batch normalised. A JPEG the
        batch decoder rejects is decoded on its own, then by the CPU decoders (which read what
        nvjpeg does not, CMYK for one); one that none reads is bad (`on_bad`)."""
        from torchvision.io import ImageReadMode, decode_jpeg

        jpegs = [s for s in samples if s.jpeg is not None]
        try:
            decoded = decode_jpeg([_bytes_tensor(s.jpeg) for s in jpegs], mode=ImageReadMode.RGB,
                                  device=device) if jpegs else []
        except RuntimeError:  # one of them does not decode here: each on its own, to name it
            if device.type == "cuda":  # outputs nvjpeg freed may still be written on its stream
                torch.cuda.synchronize(device)
            decoded = [self._decode_one(s, device) for s in jpegs]
        decoded = iter(decoded)
        cut, labels = [], []
        for sample in samples:
            pixels = next(decoded) if sample.jpeg is not None else torch.from_numpy(sample.pixels).to(device)
            if pixels is not None:
                cut.append(self.transforms.cut(pixels, sample.crop))
                labels.append(sample.label)
        if not cut:
            raise UserError(every_image_skipped(len(samples)))
        x = self.transforms.normalise(torch.stack(cut))
        return x, torch.tensor(labels, dtype=torch.int64).to(device, non_blocking=True)

    def _decode_one(self, sample: Undecoded, device: torch.device) -> Optional[torch.Tensor]:
        """One JPEG of a batch the batch decoder refused, decoded on `device`, or else by the CPU
        decoders; None where it is bad and skipped, a UserError naming it where bad is an error."""
        from torchvision.io import ImageReadMode, decode_jpeg

        with suppress(RuntimeError):
            return decode_jpeg(_bytes_tensor(sample.jpeg), mode=ImageReadMode.RGB, device=device)
        try:
            return decode(sample.jpeg, sample.name).to(device)
        except UserError as e:
            bad = self._bad(e.lines[0])
            if bad is not None:
                raise UserError(bad.line) from None
            return None

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


def _bytes_tensor(data: bytes) -> torch.Tensor:
    """Encoded bytes as the 1-D uint8 tensor torchvision's decoders take (a copy: bytes are read-only)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def every_image_skipped(n: int) -> str:
    """What stops a run when a whole batch's images were bad and skipped: the data is not images."""
    return f"every image of a batch was unreadable and skipped; check the data ({n} images in a row)"


@dataclass
class CheckedBatches:
    """A DataLoader over EncodedImages that raises a bad image's one line where it is met. With
    `decode: device` it decodes each batch on `device` a batch ahead of the one being trained,
    its cutting on a CUDA stream of its own, so the step waits only for its own batch. nvjpeg's
    call returns once its batch is decoded (on the GPU's hardware JPEG engine where it has one);
    meanwhile the steps the loop queued ahead (it reads no value back per step) keep the GPU busy."""

    loader: object
    device: Optional[torch.device] = None  # None: the CPU
    dataset: EncodedImages = field(init=False)

    def __post_init__(self):
        self.dataset = self.loader.dataset
        self.device = self.device or torch.device("cpu")

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        if self.dataset.decode != "device":
            yield from map(self._checked, self.loader)
            return
        side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        ready = None
        for batch in self.loader:
            if side is not None:
                # nvjpeg writes its outputs on a stream of its own, which waits for nothing of this one:
                # once the last batch's cutting is done (queued a step ago), what it freed is free to reuse.
                side.synchronize()
            with torch.cuda.stream(side) if side is not None else nullcontext():
                x, y = self.dataset.decode_batch(self._checked(batch), self.device)
                decoded = side.record_event() if side is not None else None
            if ready is not None:
                yield self._handed_over(*ready)
            ready = x, y, decoded
        if ready is not None:
            yield self._handed_over(*ready)

    def _handed_over(self, x: torch.Tensor, y: torch.Tensor, decoded: Optional["torch.cuda.Event"]):
        """The batch, as it goes to the step: only now does the step's stream wait for its decoding."""
        handed_over(decoded, self.device, (x, y))
        return x, y

    @staticmethod
    def _checked(batch):
        if isinstance(batch, BadImage):
            raise UserError(batch.line)
        return batch


def images(path: str, eval_fraction: float, split_seed: int, eval_path: Optional[str] = None, size: int = 224,
           resize: Optional[int] = None, scale: tuple[float, float] = (0.08, 1.0),
           ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = True,
           mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD,
           column: str = "image", label: str = "label", on_bad: str = "error", decode: str = "loader"):
    """Encoded images (JPEG, PNG, ...) from an ImageFolder tree (ROOT/CLASS_NAME/IMAGE, local or a
    URI) or Parquet files with image bytes (the Hugging Face layout, a struct of bytes and path,
    or a binary column `column`) and a label column `label` (class ids or names). Training crops
    a random `scale` share of each image at a random aspect `ratio`, resizes it to `size`, may
    flip it, and normalises it by `mean` and `std`; evaluation resizes the shorter side to
    `resize` (default size / 0.875) and crops the centre. `path` may also be WebDataset tar
    shards (KEY.jpg beside KEY.cls). The eval set is `eval_path`, or else a
    seeded `eval_fraction` of the images. `on_bad`: an image that does not decode stops the run
    with its name (`error`), or is skipped and counted in each epoch's `skipped_images` (`skip`).
    `decode`: `loader` decodes and cuts every image in the DataLoader's processes, on their CPUs;
    `device` leaves JPEGs encoded until the training process decodes each batch of them on its
    device (nvjpeg on a GPU) and cuts them there."""
    if on_bad not in ON_BAD:
        raise UserError(f"data.args.on_bad must be one of {', '.join(ON_BAD)}, got {on_bad!r}")
    if decode not in DECODE:
        raise UserError(f"data.args.decode must be one of {', '.join(DECODE)}, got {decode!r}")
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
    return (EncodedImages(train, transforms, True, on_bad, column, label, decode),
            EncodedImages(evaluated, transforms, False, on_bad, column, label, decode))


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
        self.transforms = transforms_of(recipe)
        self.normalise = ImageNormalise(recipe)

    def forward(self, x) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            x = self.transforms.cut(x)
        else:
            x = torch.stack([self.transforms.cut(pixels(item)) for item in x])
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
