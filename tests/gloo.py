"""Real Gloo process groups without Ray: `spawn(fn, ...)` runs fn(rank, ...) in two processes."""

import os

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.objectstore import free_port


def spawn(fn, *args, world_size: int = 2) -> None:
    """The ranks fork from the session's fork server (`tests.commands`), which has torch imported
    already: a fresh interpreter per rank would import it again, for seconds of each test. They
    get this process's environment as it is now, not the server's."""
    mp.start_processes(_rank, args=(fn, free_port(), world_size, args, dict(os.environ)), nprocs=world_size,
                       join=True, start_method="forkserver")


def _rank(rank: int, fn, port: int, world_size: int, args: tuple, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()
