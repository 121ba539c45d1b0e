"""What a run carries from step to step, and so what a checkpoint captures.

Each piece says what it holds with `state_dict()` and takes it back with `load_state_dict()`, as
torchtitan's components do; `checkpoint.py` only writes and reads those dicts. A TrainState has
two parts: what every rank shares (weights, optimizer, schedule, loss scale, and the position in
training: completed epochs, optimizer steps, micro-batches done in the epoch under way, which is
also where each rank's sampler restarts), saved by rank 0; and what each rank alone holds (its
random streams, its running loss sums and time within the epoch), saved by every rank.

Under FSDP/HSDP the weights and optimizer state are sharded: `sharded_state_dict()` holds them
as DTensors for `torch.distributed.checkpoint`, and `state_dict()` the rest.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from raytrain_app.worker import optim
from raytrain_app.worker.comm_hook import CommHook
from raytrain_app.worker.early_stopping import EarlyStopping
from raytrain_app.worker.metrics import Totals


class RNG:
    """This process's random streams: Python's, NumPy's, torch's and CUDA's. Dropout and
    augmentation draw from them, so a resumed run must continue each where it stopped."""

    @staticmethod
    def state_dict() -> dict:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        return {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": random.getstate(),
            "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        }

    @staticmethod
    def load_state_dict(saved: dict) -> None:
        torch.set_rng_state(saved["torch"])
        if saved["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda"])
        random.setstate(_tuples(saved["python"]))
        kind, keys, pos, has_gauss, gauss = saved["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


class EpochClock:
    """Seconds of training in the epoch under way, carried over a mid-epoch checkpoint so that a
    resumed epoch reports its whole time."""

    def __init__(self):
        self.spent, self.since = 0.0, None

    def start(self) -> None:
        self.since = time.perf_counter()

    def elapsed(self) -> float:
        return self.spent + (time.perf_counter() - self.since if self.since is not None else 0.0)

    def reset(self) -> None:
        self.spent, self.since = 0.0, None

    def state_dict(self) -> dict:
        return {"spent": self.elapsed()}

    def load_state_dict(self, saved: dict) -> None:
        self.spent, self.since = saved["spent"], None


@dataclass
class TrainState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: Optional[torch.amp.GradScaler]
    epoch: int = 0  # completed epochs
    step: int = 0  # optimizer steps taken
    batch: int = 0  # micro-batches done in the epoch under way (non-zero only mid-epoch)
    samples: Optional[int] = 0  # of the epoch's permutation, over all ranks: where its sampler restarts
    totals: Optional[Totals] = None  # this rank's running train-loss sums in the epoch under way
    clock: EpochClock = field(default_factory=EpochClock)
    sharded: bool = False  # the model is FSDP-sharded: weights and optimizer go through DCP
    early_stopping: Optional[EarlyStopping] = None  # what it has seen so far, when the run watches a metric
    comm_hook: Optional[CommHook] = None  # PowerSGD's factors and error feedback, when DDP sends through it
    # Every finished epoch's metrics row. The driver writes metrics.jsonl when a row reaches it,
    # after the epoch's checkpoint: a driver killed in between left a checkpoint whose epochs the
    # file lacked, and a resume from it a gap. The checkpoint carries them, and a resume sends them.
    rows: list = field(default_factory=list)

    def finish_epoch(self) -> None:
        self.epoch, self.batch, self.samples, self.totals = self.epoch + 1, 0, 0, None
        self.clock.reset()

    def state_dict(self) -> dict:
        """What every rank shares, saved once (by rank 0); sharded weights and optimizer state
        are in `sharded_state_dict` instead."""
        weights = {} if self.sharded else {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        return {
            **weights,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "epoch": self.epoch,
            "step": self.step,
            "batch": self.batch,
            "samples": self.samples,
            "early_stopping": self.early_stopping.state_dict() if self.early_stopping else None,
            "comm_hook": self.comm_hook.state_dict() if self.comm_hook else None,
            "rows": self.rows,
        }

    def load_state_dict(self, saved: dict, shards: Optional[str] = None) -> None:
        """What `state_dict` gave, with the weights and optimizer state read from the DCP
        directory `shards` when they were saved sharded."""
        with optim.configured_hyperparameters(self.optimizer, self.scheduler):
            if shards:
                self._load_sharded(shards)
            elif self.sharded:
                self._shard_full(saved["model"], saved["optimizer"])
            else:
                self.model.load_state_dict(saved["model"])
                self.optimizer.load_state_dict(saved["optimizer"])
            self.scheduler.load_state_dict(saved["scheduler"])
        if self.scaler and saved["scaler"]:
            self.scaler.load_state_dict(saved["scaler"])
        self.epoch, self.step, self.batch = saved["epoch"], saved["step"], saved["batch"]
        self.samples = saved.get("samples")  # None from a checkpoint that predates it: see the loop
        if self.early_stopping and saved.get("early_stopping"):  # else: watched from this resume on
            self.early_stopping.load_state_dict(saved["early_stopping"])
        if self.comm_hook:
            self.comm_hook.load_state_dict(saved.get("comm_hook"))
        self.rows = list(saved.get("rows", []))  # none from a checkpoint that predates them

    def sharded_state_dict(self) -> dict:
        """Weights and optimizer state keyed by parameter name, as this rank's DTensor shards."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def _load_sharded(self, path: str) -> None:
        """Weights and optimizer state from a DCP directory written under any mesh: each rank
        reads the pieces of the saved shards that its own shards (or a plain model's full
        tensors) cover."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        wanted = self.sharded_state_dict()
        dcp.load(wanted, checkpoint_id=path)
        set_state_dict(self.model, self.optimizer, model_state_dict=wanted["model"],
                       optim_state_dict=wanted["optimizer"])

    def _shard_full(self, model: dict, optimizer: dict) -> None:
        """An unsharded checkpoint's full weights and optimizer state, of which each rank keeps its
        own shards: a run that went on unsharded (on one worker) grows back into FSDP or HSDP.

        The plain optimizer state is keyed by parameter position; DCP's full state by name. The
        positions are those of this optimizer's groups, built from the same model the same way."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        names = {param: name for name, param in self.model.named_parameters()}
        by_position = dict(zip((i for group in optimizer["param_groups"] for i in group["params"]),
                               (names[p] for group in self.optimizer.param_groups for p in group["params"])))
        by_name = {"state": {by_position[i]: s for i, s in optimizer["state"].items()},
                   "param_groups": [{**group, "params": [by_position[i] for i in group["params"]]}
                                    for group in optimizer["param_groups"]]}
        set_state_dict(self.model, self.optimizer, model_state_dict=model, optim_state_dict=by_name,
                       options=StateDictOptions(full_state_dict=True))

    def rank_state_dict(self) -> dict:
        """What this rank alone holds, saved by every rank."""
        mid_epoch = self.batch and self.totals is not None
        return {"rng": RNG.state_dict(), "totals": self.totals.state_dict() if mid_epoch else None,
                "clock": self.clock.state_dict(),
                "comm_hook": self.comm_hook.rank_state_dict() if self.comm_hook else None}

    def load_rank_state_dict(self, saved: Optional[dict], device: torch.device, gone: Sequence[dict] = ()) -> None:
        """This rank's saved part (None: a rank that did not exist then keeps its fresh seed), and
        `gone`, the parts of ranks that a smaller world no longer has, whose running sums this
        rank carries on through the epoch under way."""
        if saved is not None:
            RNG.load_state_dict(saved["rng"])
        if self.comm_hook:
            self.comm_hook.load_rank_state_dict(saved.get("comm_hook") if saved else None)
        parts = [part for part in (saved, *gone) if part is not None and part["totals"] is not None]
        if self.batch and parts:
            self.totals = Totals(device)
            self.totals.load_state_dict(parts[0]["totals"])
            for part in parts[1:]:
                self.totals.merge(part["totals"])
            self.clock.load_state_dict(max((part["clock"] for part in parts), key=lambda clock: clock["spent"]))


def _tuples(value):
    """weights_only loading may hand back lists where tuples were saved; random.setstate needs tuples."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
