"""Real Gloo process groups without Ray: `spawn(fn, ...)` runs fn(rank, ...) in two processes."""

import os

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.objectstore import free_port


def spawn(fn, *args, world_size: int = 2) -> None:
    mp.spawn(_rank, args=(fn, free_port(), world_size, args), nprocs=world_size, join=True)


def _rank(rank: int, fn, port: int, world_size: int, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()
