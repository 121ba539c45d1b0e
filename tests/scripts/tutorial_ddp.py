"""A DDP training script written the way the PyTorch tutorials write them, and nothing else:
launched by `torchrun --nproc_per_node 2`, or unchanged by `raytrain-app train`/`submit`.

It reads its rank from the environment (env:// rendezvous), shards the data with
DistributedSampler and set_epoch, all-reduces the eval accuracy, prints on rank 0 only and saves
a checkpoint from rank 0.
"""

import argparse
import os

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def load(path):
    table = pq.read_table(path)
    x = torch.tensor(np.stack(table["image"].to_numpy(zero_copy_only=False)), dtype=torch.float32) / 16
    y = torch.tensor(table["label"].to_numpy())
    return TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:1796], y[1500:1796])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--checkpoint", default="model.pt")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    train_set, test_set = load(args.data)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=100,
                             sampler=DistributedSampler(test_set, num_replicas=world_size, rank=rank, shuffle=False))

    model = DDP(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world_size, momentum=0.9)  # LR scaled with world size

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()

        model.eval()
        correct = torch.zeros(2)
        with torch.no_grad():
            for x, y in test_loader:
                correct += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)])
        dist.all_reduce(correct)
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.6f} accuracy {correct[0] / correct[1]:.6f} "
                  f"world {world_size} local_rank {os.environ['LOCAL_RANK']}")

    if rank == 0:
        torch.save(model.module.state_dict(), args.checkpoint)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
