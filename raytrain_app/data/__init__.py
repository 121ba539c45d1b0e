"""The `data:` config entry: build train/eval datasets and shard them across workers.

Training uses `DistributedSampler` (shuffled, seeded, `set_epoch` every epoch), able to start
partway through an epoch. Evaluation uses
`EvalShard`, which gives rank r the samples r, r+W, r+2W, ... with no padding, so that summed
over ranks every eval sample counts exactly once whatever the dataset size.

Batches come either from a DataLoader (host memory, optional worker processes, pinned copies)
or, for in-memory datasets that fit, straight from the device (`DeviceBatches`): on a GPU a
small model's step is shorter than the DataLoader's per-batch overhead, so the data moves once.
Encoded images (`images`, in images.py) are decoded and augmented per sample in the DataLoader's
worker processes, or with `decode: device` read there and decoded a batch at a time on the
device. Parquet read with `streaming: true` comes a window at a time (`StreamBatches`, in
stream.py), which shards, shuffles and resumes by itself; with `engine: ray_data`, from Ray Data
(raydata.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from raytrain_app.config import registry
from raytrain_app.config.sections import DataConfig
from raytrain_app.data.arrays import ArrayDataset, DeviceBatches, resize_images
from raytrain_app.data.images import CheckedBatches, EncodedImages, decode_processes, images
from raytrain_app.data.parquet import csv, digits, parquet
from raytrain_app.data.parquet_files import ParquetFiles, is_text
from raytrain_app.data.preprocess import feature_columns
from raytrain_app.data.raydata import RayDataBatches
from raytrain_app.data.stream import ParquetStream, StreamBatches
from raytrain_app.data.synthetic import synthetic
from raytrain_app.data.text import TokenBlocks, text
from raytrain_app.data.vision import cifar10, fashion_mnist, mnist
from raytrain_app.distributed import global_max
from raytrain_app.errors import UserError

BUILTINS = {
    "digits": digits,
    "parquet": parquet,
    "csv": csv,
    "mnist": mnist,
    "fashion_mnist": fashion_mnist,
    "cifar10": cifar10,
    "synthetic": synthetic,
    "text": text,
    "images": images,
}
# Datasets whose __getitems__ returns a whole collated batch: one indexing op per batch.
BATCHED = (ArrayDataset, TokenBlocks)


@dataclass
class Datasets:
    train: Dataset
    eval: Dataset
    input_shape: tuple[int, ...]
    num_classes: Optional[int]  # None: the dataset does not say (see `class_count`)


def build_datasets(config: DataConfig) -> Datasets:
    """Call the builder; it returns (train, eval) map-style datasets yielding (input, label)."""
    context = {"eval_fraction": config.eval_fraction, "split_seed": config.split_seed}
    # Under Ray Data the native stream still decodes rows, normalises them and reads the eval files.
    args = {**config.args, "streaming": True} if config.engine == "ray_data" else config.args
    built = registry.build(config.name, args, BUILTINS, "data", context)
    if not (isinstance(built, tuple) and len(built) == 2):
        raise UserError(f"data: '{registry.label(config.name)}' must return a (train, eval) pair of datasets, "
                        f"got {type(built).__name__}")
    train, eval_ = built
    for split_name, ds in (("training", train), ("eval", eval_)):
        if len(ds) == 0:
            raise UserError(f"data: '{registry.label(config.name)}' gave an empty {split_name} set")
    sample = train[0]
    # (input, label) pairs give the model its input shape, token blocks their length; a custom
    # step's samples may be anything.
    first = sample[0] if isinstance(sample, (tuple, list)) and sample else sample
    shape = tuple(first.shape) if isinstance(first, torch.Tensor) else ()
    return Datasets(train, eval_, shape, _num_classes(train, eval_))


def _num_classes(*datasets: Dataset) -> Optional[int]:
    """What the dataset declares as `num_classes` (its named classes, a stream's metadata), if
    anything; else for integer labels of array datasets, the largest + 1."""
    declared = getattr(datasets[0], "num_classes", None)
    if declared is not None:
        return int(declared)
    if all(isinstance(d, ArrayDataset) and not d.y.is_floating_point() for d in datasets):
        return int(max(int(d.y.max()) for d in datasets)) + 1
    return None


def class_count(ds: Datasets, rank: int = 0, world_size: int = 1, device: torch.device = torch.device("cpu")) -> int:
    """Classes of a classification dataset: as declared, else the largest training label + 1,
    every rank reading its share of the labels and the largest all-reduced (one process: all)."""
    if ds.num_classes is not None:
        return ds.num_classes
    mine = labels(ds.train, range(rank, len(ds.train), world_size))
    return int(global_max(float(mine.max()) if len(mine) else 0.0, device)) + 1


def label_counts(ds: Datasets, classes: int, rank: int = 0, world_size: int = 1,
                 device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """How many training samples each class has, every rank counting its share (r, r + W, ...),
    the counts all-reduced: exact, unlike DistributedSampler's padded shards."""
    mine = labels(ds.train, range(rank, len(ds.train), world_size)).long()
    counts = torch.bincount(mine, minlength=classes).double().to(device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
    return counts.cpu()


def labels(dataset: Dataset, indices: range) -> torch.Tensor:
    """The labels of samples `indices` of an (input, label) dataset, without decoding inputs where
    the dataset can (in-memory arrays, a Parquet stream's label column)."""
    if isinstance(dataset, ArrayDataset):
        return dataset.y[indices.start:indices.stop:indices.step]
    if isinstance(dataset, ParquetStream):
        return dataset.labels()[indices.start:indices.stop:indices.step]
    if isinstance(dataset, EncodedImages):
        return torch.from_numpy(dataset.source.labels[indices.start:indices.stop:indices.step])
    return torch.stack([torch.as_tensor(dataset[i][1]) for i in indices])


def labelled_files(path: str, recipe: dict, format: str = "parquet") -> ParquetFiles:
    """A labelled Parquet or CSV file as the trained model reads it: its columns, its shape and
    its class names (the model's, never the file's own: it may lack some, and ids follow names)."""
    classes = recipe.get("classes")
    files = ParquetFiles.find(path, feature_columns(recipe), recipe.get("label") or "label", recipe["shape"],
                              format=format, classes=classes)
    if not classes and is_text(files.types[files.label]):
        raise UserError(f"{path}: label column '{files.label}' holds names, but the model was trained on class ids")
    return files


def labelled_file(path: str, recipe: dict) -> Dataset:
    """The rows of a labelled Parquet file as the trained model's eval data: read, resized and
    normalised as its training data was, with the training split's statistics (not the file's);
    for a model trained on encoded images, labelled images transformed as its eval set was."""
    if recipe.get("kind") == "images":
        from raytrain_app.data.images import labelled

        return labelled(path, recipe)
    x, y = labelled_files(path, recipe).read()
    if recipe["resize"]:
        x = resize_images(x, recipe["resize"])
    mean, std = (torch.tensor(recipe[k], dtype=torch.float32).reshape(recipe["stats_shape"]) for k in ("mean", "std"))
    return ArrayDataset(x, y.float() if y.is_floating_point() else y.long(), mean, std)


class TrainShard(DistributedSampler):
    """DistributedSampler that can start `start` samples into the epoch's permutation, to resume
    mid-epoch at any world size without repeating or skipping a sample.

    The permutation is DistributedSampler's own (seeded by seed + epoch, the same at every world
    size); what is left of it from `start` is dealt to this world's ranks as DistributedSampler
    deals a whole one: padded with its first samples to a multiple of the world size, then every
    world-size-th sample from the rank's own. From 0 it is DistributedSampler's order, and at an
    unchanged world size a resumed rank sees exactly the samples it would have seen."""

    start = 0  # samples of the epoch's permutation already trained, over all ranks

    def __iter__(self):
        if not self.start:
            return super().__iter__()
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        order = order.tolist()
        rest = order[self.start:]
        while len(rest) % self.num_replicas:
            rest += order[:self.num_replicas - len(rest) % self.num_replicas]
        return iter(rest[self.rank::self.num_replicas])

    def __len__(self) -> int:
        return -(-(len(self.dataset) - self.start) // self.num_replicas)


class DrawnShard(TrainShard):
    """TrainShard's samples as (sample, seed, epoch) keys, from which a dataset that augments
    (EncodedImages) draws each sample's randomness: the same whichever rank, loader process or
    resume reads it."""

    def __iter__(self):
        return ((i, self.seed, self.epoch) for i in super().__iter__())


def skipped(dataset: Dataset) -> Optional[int]:
    """Bad samples a dataset has skipped so far on this rank; None where it skips none (only
    encoded images with `data.args.on_bad: skip` do)."""
    return dataset.skipped() if isinstance(dataset, EncodedImages) and dataset.on_bad == "skip" else None


class EvalShard(Sampler[int]):
    """Rank r's slice r::world of the eval set: disjoint, complete, never padded."""

    def __init__(self, size: int, rank: int, world_size: int):
        self.indices = range(rank, size, world_size)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


# Device-resident data may take this share of the GPU's memory; the rest is for the model, its
# activations and the caching allocator. Measured against the total, not what is free now, so
# that every rank, and a resumed run, makes the same choice.
DEVICE_MEMORY_SHARE = 0.25


def keep_on_device(ds: Datasets, mode: str, device: torch.device) -> bool:
    """Whether the data lives on the device (`data.on_device`): `on` forces it, `auto` picks it
    for in-memory datasets that fit on a GPU, `off` keeps the DataLoader."""
    if mode == "off":
        return False
    arrays = isinstance(ds.train, ArrayDataset) and isinstance(ds.eval, ArrayDataset)
    if mode == "on" and not arrays:
        raise UserError(f"data.on_device: on needs an in-memory dataset (a built-in, or a builder returning "
                        f"ArrayDataset); this one is {type(ds.train).__name__}")
    if mode == "on":
        return True
    if not arrays or device.type != "cuda":
        return False
    total = torch.cuda.get_device_properties(device).total_memory
    return ds.train.nbytes + ds.eval.nbytes <= DEVICE_MEMORY_SHARE * total


def to_device(ds: Datasets, device: torch.device) -> Datasets:
    """Both splits on `device`, or a one-line error when they do not fit (only `on` can ask for that)."""
    try:
        return Datasets(ds.train.to(device), ds.eval.to(device), ds.input_shape, ds.num_classes)
    except torch.cuda.OutOfMemoryError:
        raise UserError(f"data.on_device: the dataset ({(ds.train.nbytes + ds.eval.nbytes) / 2**30:.1f} GiB) does "
                        f"not fit in {device}'s memory; set data.on_device: auto or off") from None


def loader_workers(setting: Optional[int], ds: Datasets, cpus_per_worker: float) -> int:
    """DataLoader processes per training worker; null sizes them to the machine: none for
    in-memory datasets (a batch is one indexing op), else one per spare CPU, at most 4."""
    if setting is not None:
        return setting
    if isinstance(ds.train, (*BATCHED, ParquetStream)):  # a stream reads ahead in a thread of its own
        return 0
    if isinstance(ds.train, EncodedImages):
        return decode_processes(cpus_per_worker)
    return max(0, min(4, int(cpus_per_worker) - 1))


def _loader(dataset: Dataset, sampler: Sampler, batch_size: int, workers: int, pin: bool, seed: int = 0,
            resident: bool = False, device: Optional[torch.device] = None):
    if resident:
        return DeviceBatches(dataset, sampler, batch_size)
    collate = _as_is if isinstance(dataset, BATCHED) else EncodedImages.collate if isinstance(
        dataset, EncodedImages) else None
    # The loader's own generator: starting an epoch's iterator must not draw from the global RNG,
    # or a run resumed mid-epoch would see different dropout and augmentation than the original.
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                        collate_fn=collate, pin_memory=pin, persistent_workers=workers > 0,
                        generator=torch.Generator().manual_seed(seed))
    if isinstance(dataset, EncodedImages):
        return CheckedBatches(loader, device)
    return loader


def _as_is(batch):
    return batch


def train_loader(ds: Datasets, batch_size: int, rank: int, world_size: int, seed: int, workers: int, pin: bool,
                 resident: bool = False, engine: str = "native", device: Optional[torch.device] = None):
    """This rank's training batches and their sampler (for `set_epoch` and a mid-epoch `start`);
    `resident`: `ds` is already on the device (`to_device`) and batches are cut there; `engine`
    ray_data: from this worker's Ray Data shard. A Parquet stream moves each window to a CUDA
    `device` as it reads it, and cuts the batches there; encoded images with `decode: device` are
    decoded on `device`."""
    if engine == "ray_data":
        import ray.train

        batches = RayDataBatches(ray.train.get_dataset_shard("train"), ds.train, batch_size, rank, world_size, seed)
        return batches, batches
    if isinstance(ds.train, ParquetStream):
        batches = StreamBatches(ds.train, batch_size, rank, world_size, seed, train=True, device=device)
        return batches, batches
    shard = DrawnShard if isinstance(ds.train, EncodedImages) else TrainShard
    sampler = shard(ds.train, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    return _loader(ds.train, sampler, batch_size, workers, pin, seed + rank, resident, device), sampler


class FirstBatches:
    """A loader cut to its first `limit` batches: a smoke run's (`train.limit_batches`)."""

    def __init__(self, loader, limit: Optional[int]):
        self.loader, self.limit = loader, limit

    def __len__(self) -> int:
        return len(self.loader) if self.limit is None else min(len(self.loader), self.limit)

    def __iter__(self):
        return itertools.islice(iter(self.loader), len(self))


def eval_loader(ds: Datasets, batch_size: int, rank: int, world_size: int, workers: int, pin: bool,
                resident: bool = False, device: Optional[torch.device] = None):
    if isinstance(ds.eval, ParquetStream):
        return StreamBatches(ds.eval, batch_size, rank, world_size, 0, train=False, device=device)
    return _loader(ds.eval, EvalShard(len(ds.eval), rank, world_size), batch_size, workers, pin, 0, resident,
                   device)
