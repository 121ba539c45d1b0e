"""Metrics summed over every rank, never rank 0's alone.

Each rank keeps running sums on its device (one `.item()` per step would stall a GPU every
step) and the epoch's totals are all-reduced once. Losses are sample-weighted: the mean over
all samples seen by all ranks, which is what a single process over the same data would report.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Totals:
    """Running sums of (loss x samples, correct predictions, samples, data wait) on one rank.

    The sample count lives on the host (it is known there), so a training step costs one
    device op here.
    """

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)
        self.samples = 0
        self.data_wait_s = 0.0  # host time spent waiting for batches

    def add(self, mean_loss: torch.Tensor, count: int, correct: torch.Tensor | None = None) -> None:
        self.sums[0].add_(mean_loss.detach(), alpha=count)
        self.samples += count
        if correct is not None:
            self.sums[1].add_(correct)

    def all_reduce(self) -> "Totals":
        """Sum over ranks; afterwards `data_wait_s` is the mean over ranks."""
        self.sums[2], self.sums[3] = self.samples, self.data_wait_s
        world = 1
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.sums)
            world = dist.get_world_size()
        self.samples, self.data_wait_s = int(self.sums[2]), float(self.sums[3]) / world
        return self

    @property
    def count(self) -> int:
        return self.samples

    @property
    def loss(self) -> float:
        return float(self.sums[0]) / self.samples

    @property
    def accuracy(self) -> float:
        return float(self.sums[1]) / self.samples


def global_max(value: float, device: torch.device) -> float:
    """The slowest rank's time: global throughput is total samples over the longest rank's epoch."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)
