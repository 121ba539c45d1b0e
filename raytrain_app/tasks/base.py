"""What every task is: a batch in, a training loss and evaluation sums out (see `tasks/__init__.py`)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from raytrain_app.errors import UserError

Sums = dict[str, torch.Tensor]


class Task(ABC):
    """The interface the loop calls; `move` puts a batch (tensors, or tuples, lists and dicts of
    them, nested) on the device in one go."""

    @abstractmethod
    def train_loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, int, dict]:
        """The mean loss to step on, how many samples it covers, and a custom step's own metrics
        as {name: (sum, count)} (built-in tasks report none while training)."""

    @abstractmethod
    def eval_sums(self, model: nn.Module, batch) -> Sums:
        ...

    @abstractmethod
    def metrics(self, sums: Sums) -> dict[str, float]:
        """From all-reduced sums: {"loss", "samples", and each metric}."""

    def move(self, batch, device: torch.device, memory_format: torch.memory_format):
        return to_device(batch, device)


def to_device(batch, device: torch.device, memory_format: torch.memory_format = torch.contiguous_format):
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 4 and memory_format is not torch.contiguous_format:
            return batch.to(device, non_blocking=True, memory_format=memory_format)
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device, memory_format) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, memory_format) for v in batch)
    return batch


def call_model(model: nn.Module, x, model_name: str) -> torch.Tensor:
    """The model's output for one input on the driver, or a one-line error naming the input's shape."""
    model.eval()
    try:
        with torch.no_grad():
            return model(x)
    except Exception as e:  # noqa: BLE001 - the user's model refusing the data is theirs to fix, in one line
        raise UserError(f"model '{model_name}' cannot take the data's inputs shaped {tuple(x.shape[1:])}: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def batch_size(batch) -> int:
    """The first dimension of the batch's first tensor, however nested."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        n = batch_size(v)
        if n:
            return n
    return 0
