"""The tiny job as a hand-written DDP script, for `torchrun --standalone --nproc_per_node 2`.

One epoch of the tutorials' LeNet on the bundled digits (upsampled to 28x28), Gloo, batch 32 per
rank: the same work as `raytrain-app train examples/digits.yaml --set train.epochs=1`.
"""

import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

DIGITS = os.path.join(os.path.dirname(__file__), "..", "raytrain_app", "data", "digits.parquet")


def lenet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                         nn.Linear(84, 10))


def digits() -> TensorDataset:
    table = pq.read_table(DIGITS)
    x = torch.from_numpy(np.stack(table.column("image").to_numpy(zero_copy_only=False)).astype(np.float32))
    x = F.interpolate(x.reshape(-1, 1, 8, 8), size=(28, 28), mode="bilinear")
    x = (x - x.mean()) / x.std()
    return TensorDataset(x, torch.from_numpy(table.column("label").to_numpy()))


def train(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = DDP(lenet())
    data = digits()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    first_step_file = os.environ.get("FIRST_STEP_FILE") if rank == 0 else None  # startup.py's clock
    for x, y in DataLoader(data, batch_size=32, sampler=sampler):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if first_step_file:
            with open(first_step_file, "w") as f:
                f.write(str(time.time()))
            first_step_file = None


if __name__ == "__main__":
    dist.init_process_group("gloo")
    train(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()
