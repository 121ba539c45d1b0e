"""Random tensors of a fixed shape: measures the machinery, not the learning."""

import torch

from raytrain_app.data.arrays import ArrayDataset


def synthetic(shape: list = (3, 32, 32), num_classes: int = 10, train_size: int = 4096, eval_size: int = 512,
              seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = train_size + eval_size
    x = torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8)
    y = torch.randint(0, num_classes, (n,), generator=g)
    mean, std = torch.tensor(127.5), torch.tensor(73.9)
    return (ArrayDataset(x[:train_size], y[:train_size], mean, std),
            ArrayDataset(x[train_size:], y[train_size:], mean, std))
