"""In-memory datasets as tensors, fetched a whole batch at a time.

Every built-in dataset is small enough to hold in memory, so a batch is one indexing operation
(`x[idx]`) rather than `batch_size` Python calls and a collate: this is what keeps the loop's
step time at the hand-written loop's. Pixels stay uint8 until a batch is taken, then are
normalised with statistics of the training split.
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from raytrain_app.data.preprocess import Stored
from raytrain_app.errors import UserError


class ArrayDataset(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, augment: bool = False,
                 stored: Optional[Stored] = None):
        self.x, self.y = x, y
        self.mean, self.std = mean, std
        self.augment = augment
        self.stored = stored or Stored(tuple(x.shape[1:]))  # how the samples were before resize and normalisation

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        x, y = self.__getitems__([i])
        return x[0], y[0]

    def __getitems__(self, idx: Sequence[int]):
        idx = torch.as_tensor(idx)
        x = self.x[idx].float().sub_(self.mean).div_(self.std)  # in place: one fresh buffer per batch
        if self.augment:
            x = flip_and_crop(x)
        return x, self.y[idx]

    @property
    def num_classes(self) -> Optional[int]:
        """Where labels were names, how many there are (a class may be missing from a split); else
        None, and the labels say (`data.class_count`)."""
        return len(self.stored.classes) if self.stored.classes else None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    @property
    def nbytes(self) -> int:
        return self.x.nbytes + self.y.nbytes

    def to(self, device: torch.device) -> "ArrayDataset":
        """The same samples held on `device`: pixels stay uint8 there (4x less memory than float)."""
        moved = copy.copy(self)  # a subclass keeps its own batching
        moved.x, moved.y, moved.mean, moved.std = (t.to(device) for t in (self.x, self.y, self.mean, self.std))
        return moved


class DeviceBatches:
    """Batches cut from a dataset held on the training device: no DataLoader, no host-to-device copy.

    The sampler is the one the DataLoader path uses (`TrainShard` or `EvalShard`), so each rank
    sees exactly the samples, in exactly the order, that `DistributedSampler` deals it; only the
    indexing, normalisation and augmentation move onto the device.
    """

    def __init__(self, dataset: ArrayDataset, sampler, batch_size: int):
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size

    def __iter__(self):
        # Through numpy: half the host time of a list of Python ints (~3 ms an epoch of 50k samples).
        order = torch.from_numpy(np.fromiter(self.sampler, np.int64, len(self.sampler))).to(self.dataset.x.device)
        for start in range(0, len(order), self.batch_size):
            yield self.dataset.__getitems__(order[start:start + self.batch_size])

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)


def flip_and_crop(x: torch.Tensor, pad: int = 4) -> torch.Tensor:
    """The standard CIFAR augmentation on a whole batch: random horizontal flip, random crop after padding."""
    n, _, h, w = x.shape
    on = {"device": x.device}  # runs where the batch is: on the GPU for device-resident data
    flip = torch.rand(n, **on) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(3), x)
    padded = F.pad(x, (pad, pad, pad, pad)).permute(0, 2, 3, 1)  # N, H, W, C for one gather
    dy, dx = torch.randint(0, 2 * pad + 1, (2, n), **on)
    rows = (dy[:, None] + torch.arange(h, **on))[:, :, None]
    cols = (dx[:, None] + torch.arange(w, **on))[:, None, :]
    return padded[torch.arange(n, **on)[:, None, None], rows, cols].permute(0, 3, 1, 2)


def make_pair(
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_eval: torch.Tensor,
    y_eval: torch.Tensor,
    resize: int = 0,
    augment: bool = False,
    features: Union[str, tuple[str, ...], None] = None,
    label: Optional[str] = None,
    classes: Optional[Sequence[str]] = None,
) -> tuple[ArrayDataset, ArrayDataset]:
    """Train and eval datasets that share the training split's per-channel mean and std; `features`
    and `label` name the table columns the samples came from, if any, and `classes` the names of
    the class ids, where the labels were names."""
    if len(y_train) == 0 or len(y_eval) == 0:
        raise UserError(f"dataset is empty: {len(y_train)} training and {len(y_eval)} eval samples")
    stored = Stored(tuple(x_train.shape[1:]), resize, features, label, tuple(classes) if classes else None)
    if resize:
        x_train, x_eval = resize_images(x_train, resize), resize_images(x_eval, resize)
    mean, std = channel_stats(x_train[: 50_000])
    # Integer labels are class ids (int64, as cross_entropy wants); real-valued ones stay float32.
    y_train, y_eval = ((y.float() if y.is_floating_point() else y.long()) for y in (y_train, y_eval))
    return (ArrayDataset(x_train, y_train, mean, std, augment, stored),
            ArrayDataset(x_eval, y_eval, mean, std, stored=stored))


def channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std of images (N, C, ...), per-feature of vectors (N, F)."""
    dims = [0] + list(range(2, x.dim())) if x.dim() > 2 else [0]
    x = x.float()
    return x.mean(dim=dims, keepdim=True)[0], x.std(dim=dims, keepdim=True)[0].clamp_min(1e-6)


def split(x: torch.Tensor, y: torch.Tensor, eval_fraction: float, seed: int):
    """A fixed random split, for datasets that ship without a test set."""
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_eval = max(1, round(len(y) * eval_fraction))
    ev, tr = order[:n_eval], order[n_eval:]
    return x[tr], y[tr], x[ev], y[ev]


def resize_images(x: torch.Tensor, size: int) -> torch.Tensor:
    if x.dim() != 4:
        raise UserError(f"data.args.resize needs images shaped (C, H, W), got samples shaped {tuple(x.shape[1:])}")
    return F.interpolate(x.float(), size=(size, size), mode="bilinear", align_corners=False)
