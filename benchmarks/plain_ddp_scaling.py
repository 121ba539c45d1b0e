"""The hand-written DDP loop under torchrun: the baseline `scaling.py` compares raytrain-app to.

    torchrun --standalone --nproc_per_node 2 benchmarks/plain_ddp_scaling.py --batch 64 --steps 100

Each rank runs `throughput.py`'s hand-written loop (its own synthetic CIFAR-shaped uint8 data,
steps x batch samples, normalised per batch, fp32) with the model wrapped in DDP over Gloo and
one torch thread. Rank 0 prints one JSON line: the global samples/s of each epoch (all ranks'
samples over the slowest rank's epoch), the same definition raytrain-app's metrics use.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from throughput import hand_loop


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
    rates = []
    for rate in hand_loop(args.model, args.batch, args.steps, args.epochs, torch.device("cpu"), "fp32", wrap=DDP):
        slowest = torch.tensor([rate])
        dist.all_reduce(slowest, op=dist.ReduceOp.MIN)  # the slowest rank's rate sets the global one
        rates.append(world * float(slowest))
    if dist.get_rank() == 0:
        print(json.dumps({"samples_per_s": rates}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
