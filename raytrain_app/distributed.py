"""Collectives that the worker loop and the data both call on every rank, and that work alike
without a process group (one process, or the driver's checks)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def global_max(value: float, device: torch.device) -> float:
    """The slowest rank's time: global throughput is total samples over the longest rank's epoch."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return float(value)  # the one rank's own, as the float64 round trip gave it: no tensor, no device copy
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def gathered(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's `values` (as many on each), in rank order."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if not (dist.is_available() and dist.is_initialized()):
        return [t.tolist()]
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return [p.tolist() for p in parts]
