"""The hand-written DDP loop under torchrun: the baseline `scaling.py` compares raytrain-app to.

    torchrun --standalone --nproc_per_node 2 benchmarks/plain_ddp_scaling.py --batch 64 --steps 100

Each rank trains the model on its own synthetic CIFAR-shaped uint8 data (steps x batch
samples), normalised per batch, with one torch thread, in fp32, wrapped in DDP over Gloo. Rank 0
prints one JSON line: the global samples/s of each epoch (all ranks' samples over the slowest
rank's epoch time), the same definition raytrain-app's metrics use.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from throughput import make_data, make_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lenet")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)  # as Ray gives a 1-CPU worker
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    x, y, mean, std = make_data(args.steps * args.batch)
    model, _ = make_model(args.model, torch.device("cpu"))
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rates = []
    for _ in range(args.epochs):
        perm = torch.randperm(len(y))
        start = time.perf_counter()
        for i in range(args.steps):
            idx = perm[i * args.batch:(i + 1) * args.batch]
            loss = F.cross_entropy(ddp(x[idx].float().sub_(mean).div_(std)), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        slowest = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        rates.append(world * args.steps * args.batch / float(slowest))
    if dist.get_rank() == 0:
        print(json.dumps({"samples_per_s": rates}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
