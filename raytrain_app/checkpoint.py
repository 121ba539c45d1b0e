"""What a checkpoint holds, how it is written safely, and how a worker restores it.

Rank 0 writes the training state (`state.pt`); every rank writes its own `rank{N}.pt`: its RNG
streams (dropout and augmentation draw from per-rank generators) and, for mid-epoch
checkpoints, its running loss sums. Ray Train merges the ranks' files into one checkpoint
directory on the run's storage and keeps the best K.

Safety: each file is written under a temporary name and renamed, with a `.sha256` beside it, so
a partial or corrupted checkpoint is detected on restore and skipped in favour of the previous
good one. Everything is loaded with `weights_only=True`, so a checkpoint cannot run code.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import posixpath
import random
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import pyarrow.fs as pafs
import torch

from raytrain_app import optim, storage
from raytrain_app.metrics import Totals

STATE_FILE = "state.pt"

# The score a mid-epoch checkpoint reports for `checkpoint.metric`, so that Ray's best-K never
# keeps it for its score. Finite on purpose: Ray's JSON index of checkpoints turns NaN into null,
# and a resumed run's controller then fails sorting it.
WORST_SCORE = {"max": -sys.float_info.max, "min": sys.float_info.max}


@dataclass
class TrainState:
    """The objects a checkpoint captures: `epoch` counts completed epochs, `batch` the
    micro-batches done in the epoch under way (non-zero only for a mid-epoch checkpoint)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: Optional[torch.amp.GradScaler]
    epoch: int = 0
    step: int = 0
    batch: int = 0
    totals: Optional[Totals] = None  # this rank's running train-loss sums in the epoch under way
    train_time: float = 0.0  # seconds of training already spent in the epoch under way


def save(directory: str, state: TrainState, rank: int, config: dict) -> None:
    if rank == 0:
        _write(directory, STATE_FILE, {
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "scaler": state.scaler.state_dict() if state.scaler else None,
            "epoch": state.epoch,
            "step": state.step,
            "batch": state.batch,
            "config": config,
        })
    totals = state.totals if state.batch else None
    _write(directory, f"rank{rank}.pt", {
        "rng": _rng_state(),
        "sums": totals.sums.cpu() if totals else None,
        "samples": totals.samples if totals else 0,
        "data_wait_s": totals.data_wait_s if totals else 0.0,
        "train_time": state.train_time,
    })


def restore_latest_good(latest, state: TrainState, rank: int, device: torch.device, run_dir: str,
                        warn: Callable[[str], None]) -> str:
    """Restore the newest checkpoint that verifies, newest first; returns its URI.

    Every rank walks the same list in the same order, so all ranks agree on the one they load.
    """
    for candidate in [latest, *_older_than(latest)]:
        uri = storage.checkpoint_uri(run_dir, candidate)
        with candidate.as_directory() as directory:
            problem = verify(directory, rank)
            if problem is None:
                try:
                    load_into(directory, state, rank, device)
                    return uri
                except Exception as e:  # weights_only refuses code; a torn file fails to parse
                    problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        warn(f"skipping checkpoint {uri}: {problem}")
    raise RuntimeError(f"no usable checkpoint: every checkpoint in {run_dir} is damaged")


def verify(directory: str, rank: int) -> Optional[str]:
    """None if the checkpoint's files are complete and match their checksums, else what is wrong."""
    for name in (STATE_FILE, f"rank{rank}.pt"):
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            if name == STATE_FILE:
                return "state.pt is missing"
            continue  # a rank that did not exist when it was written keeps its fresh seed
        try:
            expected = open(path + ".sha256").read().split()[0]
        except (OSError, IndexError):
            return f"{name}.sha256 is missing"
        if _sha256(path) != expected:
            return f"{name} does not match its checksum (partial or corrupted write)"
    return None


def load_state(checkpoint_dir: str) -> dict:
    """Rank 0's training state from a checkpoint directory: a local path or a URI."""
    data = storage.read_bytes(storage.join(checkpoint_dir, STATE_FILE))
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def load_into(directory: str, state: TrainState, rank: int, device: torch.device) -> None:
    saved = torch.load(os.path.join(directory, STATE_FILE), map_location="cpu", weights_only=True)
    state.model.load_state_dict(saved["model"])
    optim.load_state(state.optimizer, state.scheduler, saved["optimizer"], saved["scheduler"])
    if state.scaler and saved["scaler"]:
        state.scaler.load_state_dict(saved["scaler"])
    state.epoch, state.step, state.batch = saved["epoch"], saved["step"], saved["batch"]
    rank_file = os.path.join(directory, f"rank{rank}.pt")
    if os.path.exists(rank_file):
        mine = torch.load(rank_file, weights_only=True)
        _set_rng_state(mine["rng"])
        if state.batch:
            state.totals = Totals(device)
            state.totals.sums.copy_(mine["sums"])
            state.totals.samples, state.totals.data_wait_s = mine["samples"], mine["data_wait_s"]
            state.train_time = mine["train_time"]


def _older_than(latest) -> list:
    """The run's earlier checkpoints, newest first (Ray names them by timestamp), on the latest's
    own filesystem: its path is a path inside that filesystem, not a local path or a URI."""
    from ray.train import Checkpoint

    fs = latest.filesystem
    parent, mine = posixpath.split(latest.path.rstrip("/"))
    names = sorted((info.base_name for info in fs.get_file_info(pafs.FileSelector(parent))
                    if info.type == pafs.FileType.Directory and info.base_name.startswith("checkpoint_")
                    and info.base_name < mine), reverse=True)
    return [Checkpoint(posixpath.join(parent, name), filesystem=fs) for name in names]


def _write(directory: str, name: str, obj) -> None:
    """torch.save under a temporary name, then rename: a reader never sees half a file."""
    path = os.path.join(directory, name)
    try:
        torch.save(obj, path + ".tmp")
        os.replace(path + ".tmp", path)
        with open(path + ".sha256.tmp", "w") as f:
            f.write(f"{_sha256(path)}  {name}\n")
        os.replace(path + ".sha256.tmp", path + ".sha256")
    except BaseException:  # a full disk, an interrupt: leave the previous file, not a torn one beside it
        for torn in (path + ".tmp", path + ".sha256.tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(torn)
        raise


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
