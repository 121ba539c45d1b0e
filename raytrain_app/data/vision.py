"""MNIST, Fashion-MNIST and CIFAR-10 from a local torchvision root.

The files are the datasets' own formats in torchvision's layout (`ROOT/MNIST/raw/*-ubyte`,
`ROOT/cifar-10-batches-py/data_batch_*`). `download: true` lets torchvision fetch them for
users who are online; otherwise a missing root is a clear error, never a network call.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import torch

from raytrain_app.data.arrays import make_pair
from raytrain_app.errors import UserError


def mnist(root: str, download: bool = False, resize: int = 0):
    return _idx_dataset("MNIST", root, download, resize)


def fashion_mnist(root: str, download: bool = False, resize: int = 0):
    return _idx_dataset("FashionMNIST", root, download, resize)


def _idx_dataset(name: str, root: str, download: bool, resize: int):
    import torchvision.datasets as tvd

    cls = getattr(tvd, name)
    root = os.path.expanduser(root)
    try:
        train, test = cls(root, train=True, download=download), cls(root, train=False, download=download)
    except RuntimeError as e:
        raise UserError(f"{name} not found under {root} (expected {root}/{name}/raw/*-ubyte; "
                        f"set data.args.download=true to fetch it): {e}") from None
    return make_pair(train.data[:, None], train.targets, test.data[:, None], test.targets, resize=resize)


def cifar10(root: str, download: bool = False, augment: bool = True):
    root = os.path.expanduser(root)
    folder = os.path.join(root, "cifar-10-batches-py")
    if download and not os.path.isdir(folder):
        import torchvision.datasets as tvd

        tvd.CIFAR10(root, download=True)
    train = [_cifar_batch(folder, f"data_batch_{i}") for i in range(1, 6)]
    x_test, y_test = _cifar_batch(folder, "test_batch")
    x_train = torch.cat([x for x, _ in train])
    y_train = torch.cat([y for _, y in train])
    return make_pair(x_train, y_train, x_test, y_test, augment=augment)


def _cifar_batch(folder: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        raise UserError(f"CIFAR-10 file not found: {path} (set data.args.download=true to fetch it)")
    with open(path, "rb") as f:
        try:
            batch = pickle.load(f, encoding="latin1")
            x = np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
            y = np.asarray(batch["labels"], dtype=np.int64)
        except Exception as e:
            raise UserError(f"{path}: not a CIFAR-10 python batch file: {type(e).__name__}: {e}") from None
    return torch.from_numpy(x.copy()), torch.from_numpy(y)
