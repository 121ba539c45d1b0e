"""Collectives that the worker loop and the data both call on every rank, and that work alike
without a process group (one process, or the driver's checks)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def global_max(value: float, device: torch.device) -> float:
    """The slowest rank's time: global throughput is total samples over the longest rank's epoch."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)
