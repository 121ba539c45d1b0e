"""What a checkpoint holds and how a worker restores it.

Rank 0 writes the training state (`state.pt`); every rank writes its own RNG streams
(`rng-rank{N}.pt`), because dropout and augmentation draw from per-rank generators. Ray Train
merges the ranks' files into one checkpoint directory on the run's storage and keeps the best K.
Everything is saved as tensors and plain containers and loaded with `weights_only=True`, so a
checkpoint file cannot run code when it is opened.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

STATE_FILE = "state.pt"


@dataclass
class TrainState:
    """The objects a checkpoint captures; `epoch` counts completed epochs."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: Optional[torch.amp.GradScaler]
    epoch: int = 0
    step: int = 0


def save(directory: str, state: TrainState, rank: int, config: dict) -> None:
    if rank == 0:
        torch.save(
            {
                "model": state.model.state_dict(),
                "optimizer": state.optimizer.state_dict(),
                "scheduler": state.scheduler.state_dict(),
                "scaler": state.scaler.state_dict() if state.scaler else None,
                "epoch": state.epoch,
                "step": state.step,
                "config": config,
            },
            os.path.join(directory, STATE_FILE),
        )
    torch.save(_rng_state(), os.path.join(directory, f"rng-rank{rank}.pt"))


def restore(directory: str, state: TrainState, rank: int) -> None:
    saved = load_state(directory)
    state.model.load_state_dict(saved["model"])
    state.optimizer.load_state_dict(saved["optimizer"])
    state.scheduler.load_state_dict(saved["scheduler"])
    if state.scaler and saved["scaler"]:
        state.scaler.load_state_dict(saved["scaler"])
    state.epoch, state.step = saved["epoch"], saved["step"]
    rng_file = os.path.join(directory, f"rng-rank{rank}.pt")
    if os.path.exists(rng_file):  # absent when the world size grew: the new rank keeps its fresh seed
        _set_rng_state(torch.load(rng_file, weights_only=True))


def load_state(directory: str) -> dict:
    return torch.load(os.path.join(directory, STATE_FILE), map_location="cpu", weights_only=True)


def _rng_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
    }


def _set_rng_state(saved: dict) -> None:
    torch.set_rng_state(saved["torch"])
    if saved["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
    random.setstate(_tuples(saved["python"]))
    kind, keys, pos, has_gauss, gauss = saved["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def _tuples(value):
    """weights_only loading may hand back lists where tuples were saved; random.setstate needs tuples."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
