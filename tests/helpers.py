"""User-style builders that tests name by import path ("tests.helpers:NAME"), as users name theirs.

They run inside real Ray Train workers, so what they record goes to files the test reads back.
"""

import math
import os
import signal
import threading
import time
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray.train
import torch
from torch import nn
from torch.utils.data import Dataset

from raytrain_app.config import JobConfig
from raytrain_app.data import build_datasets
from raytrain_app.data.arrays import ArrayDataset
from raytrain_app.data.preprocess import recipe
from raytrain_app.models import build_model, mlp
from raytrain_app.worker import checkpoint
from raytrain_app.worker.optim import build_optimizer, build_schedule
from raytrain_app.worker.state import TrainState


def write_parquet(path, n: int, features: int = 8, classes: int = 3, seed: int = 0) -> None:
    """A learnable classification table: label = argmax of a fixed linear map of the features."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    y = (x @ rng.normal(size=(features, classes))).argmax(1)
    table = pa.table({"image": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), features),
                      "label": pa.array(y.astype(np.int64))})
    pq.write_table(table, path)


class IndexDataset(Dataset):
    """Sample i is the number i itself, so a model can see which samples it was given."""

    num_classes = 2

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)]), i % 2


def index_data(train_size: int = 20, eval_size: int = 5):
    return IndexDataset(train_size), IndexDataset(eval_size)


class Recorder(nn.Module):
    """Appends every training batch's sample indices to out_dir/rank-R.txt (rank-R-PID.txt
    `per_process`: a restarted group's apart), one line per batch, and the dropout mask the batch
    drew to out_dir/dropout-R.txt. While the file `hold` exists, each training batch takes `hold_s`
    longer: a test paces the run while it changes the cluster under it."""

    def __init__(self, out_dir: str, per_process: bool = False, hold: Optional[str] = None, hold_s: float = 0.02):
        super().__init__()
        self.out_dir, self.per_process, self.hold, self.hold_s = out_dir, per_process, hold, hold_s
        self.linear = nn.Linear(1, 2)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x):
        if self.training and self.hold and os.path.exists(self.hold):
            time.sleep(self.hold_s)
        if self.training and x.shape[0] > 1:
            rank = ray.train.get_context().get_world_rank()
            name = f"rank-{rank}-{os.getpid()}" if self.per_process else f"rank-{rank}"
            with open(os.path.join(self.out_dir, f"{name}.txt"), "a") as f:
                f.write(" ".join(str(int(v)) for v in x[:, 0]) + "\n")
            with open(os.path.join(self.out_dir, f"dropout-{rank}.txt"), "a") as f:
                f.write("".join("1" if v else "0" for v in self.dropout(torch.ones(32))) + "\n")
        return self.linear(x * 0.01)


def recorder(out_dir: str, per_process: bool = False, hold: Optional[str] = None, hold_s: float = 0.02) -> nn.Module:
    return Recorder(out_dir, per_process, hold, hold_s)


class Paced(nn.Module):
    """A linear classifier whose every training batch sleeps `seconds` first: a long job that holds
    its workers, as a real one does, without taking the CPUs that the test watching it needs.
    With a `rank`, only that rank sleeps: a straggler."""

    def __init__(self, input_shape: tuple, num_classes: int, seconds: float, rank: int = -1):
        super().__init__()
        self.seconds, self.rank = seconds, rank
        self.linear = nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, x):
        if self.training and (self.rank < 0 or ray.train.get_context().get_world_rank() == self.rank):
            time.sleep(self.seconds)
        return self.linear(x.flatten(1))


def paced(input_shape: tuple, num_classes: int, seconds: float = 0.2, rank: int = -1) -> nn.Module:
    return Paced(input_shape, num_classes, seconds, rank)


def stopped(marker: str) -> None:
    """Note when a fault began (wall clock), in MARKER.at: what a test times a detection from."""
    with open(f"{marker}.at", "w") as f:
        f.write(repr(time.time()))


def faulty_recorder(input_shape: tuple, num_classes: int, out_dir: str, marker: str, at: int, rank: int = 1):
    """A Recorder whose rank `rank` crashes on its training call `at` (see Fault)."""
    return Fault(Recorder(out_dir), marker, at, rank, "crash")


class Fault(nn.Module):
    """Injects a real fault on training forward call `at` of rank `rank`, once (while `marker` exists):

    crash: raise an exception; kill: SIGKILL this worker process; stall: sleep for an hour;
    deadlock: take a lock it holds already (a Python-level deadlock); nan: return NaN outputs (a
    loss that goes NaN on this rank alone).
    """

    def __init__(self, inner: nn.Module, marker: str, at: int, rank: int, fault: str):
        super().__init__()
        self.inner, self.marker, self.at, self.rank, self.fault, self.calls = inner, marker, at, rank, fault, 0

    def forward(self, x):
        if self.training and x.shape[0] > 1:
            self.calls += 1
            if self.calls == self.at and os.path.exists(self.marker) and (
                    self.rank < 0 or ray.train.get_context().get_world_rank() == self.rank):  # (not the driver's trial)
                if self.fault == "crash":
                    raise RuntimeError("injected crash")
                os.unlink(self.marker)  # once: the restarted worker must not fault again
                stopped(self.marker)
                if self.fault == "nan":
                    return self.inner(x) * float("nan")
                if self.fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.fault == "deadlock":
                    held = threading.Lock()
                    held.acquire()
                    held.acquire()
                time.sleep(3600)
        return self.inner(x)


def faulty_mlp(input_shape: tuple, num_classes: int, marker: str, at: int, rank: int = -1,
               fault: str = "crash", hidden: list = (32,)) -> nn.Module:
    return Fault(mlp(input_shape, num_classes, hidden=list(hidden), dropout=0.2), marker, at, rank, fault)


def faulty_gpt(input_shape: tuple, num_classes: int, marker: str, at: int, rank: int = -1, fault: str = "kill",
               **args) -> nn.Module:
    """The built-in gpt with a fault, for sharded runs (benchmarks/gpu_check.sh kills one on a GPU)."""
    from raytrain_app.models.gpt import gpt

    return Fault(gpt(input_shape, num_classes, **args), marker, at, rank, fault)


def augmented_digits(eval_fraction: float, split_seed: int):
    """The real digits at 16x16 with the CIFAR flip-and-crop on the training split."""
    from raytrain_app.data.parquet import digits

    train, eval_ = digits(eval_fraction, split_seed, resize=16)
    train.augment = True
    return train, eval_


class Stalling(ArrayDataset):
    """In-memory data whose rank `rank` stops for an hour at its batch read `at`, once (while
    `marker` exists): a rank stuck in a data read, as on a dead network filesystem."""

    def __getitems__(self, idx):
        self.reads += 1
        if (self.reads == self.at and os.path.exists(self.marker) and torch.distributed.is_initialized()
                and torch.distributed.get_rank() == self.rank):
            os.unlink(self.marker)
            stopped(self.marker)
            time.sleep(3600)
        return super().__getitems__(idx)


def stalling_digits(marker: str, at: int, rank: int = 1):
    """The real digits at 28x28, whose training split stalls on rank `rank` (see Stalling)."""
    from raytrain_app.data.parquet import digits

    train, eval_ = digits(0.2, 0, resize=28)
    stalling = Stalling.__new__(Stalling)
    stalling.__dict__.update(train.__dict__, marker=marker, at=at, rank=rank, reads=0)
    return stalling, eval_


class DictDataset(Dataset):
    """Nested samples, as a custom step may take them: {"x": 4 features, "target": {"y": a value}}."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(n, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "target": {"y": self.y[i]}}


def dict_data(train_size: int = 40, eval_size: int = 9):
    return DictDataset(train_size, seed=1), DictDataset(eval_size, seed=2)


def dict_step(model, batch):
    """A custom step: squared error to train on, and its own metric, the mean absolute error."""
    error = model(batch["x"]).squeeze(1) - batch["target"]["y"]
    return error.pow(2).mean(), {"abs_error": (error.abs().sum(), len(error))}


def one_argument_step(model):
    return model


class Undeclared(Dataset):
    """A user's dataset that does not say how many classes it has: labels 1, 4, 0, 2, 3, ... (the
    first sample's label is not the largest)."""

    def __init__(self, n: int):
        self.x = torch.randn(n, 3, generator=torch.Generator().manual_seed(n))
        self.y = [(1, 4, 0, 2, 3)[i % 5] for i in range(n)]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def undeclared_data(train_size: int = 40, eval_size: int = 10):
    return Undeclared(train_size), Undeclared(eval_size)


def needs_classes(input_shape, num_classes: int):
    return nn.Linear(input_shape[0] if input_shape else 4, num_classes)


def defaults_classes(input_shape, num_classes: int = 1):  # a custom step's dict samples have no shape
    return nn.Linear(input_shape[0] if input_shape else 4, num_classes)


def save_checkpoint(directory, job: JobConfig, epoch: int = 1, seed: int = 0, batch: int = 0,
                    input_shape=None, num_classes=None) -> nn.Module:
    """A checkpoint as the loop writes it: rank 0's state, and the config, input shape, outputs
    and preprocessing it records (the real data module's); returns its model in eval mode."""
    data = build_datasets(job.data)
    input_shape, num_classes = input_shape or data.input_shape, num_classes or data.num_classes
    torch.manual_seed(seed)
    model = build_model(job.model, input_shape, num_classes)
    optimizer = build_optimizer(model.parameters(), job.optimizer, 1)
    schedule = build_schedule(optimizer, job.schedule, 10, job.train.epochs)
    state = TrainState(model, optimizer, schedule, None, epoch=epoch, step=10 * epoch, batch=batch)
    os.makedirs(directory)
    checkpoint.save(str(directory), 0, state, {"config": job.to_dict(), "input_shape": list(input_shape),
                                               "num_classes": num_classes, "preprocess": recipe(data.train)})
    return model.eval()


class LabelRecorder(nn.Module):
    """A linear model that carries where `record_labels` writes what it trains on:
    OUT_DIR/rank-R-PID.txt (a restarted rank writes a file of its own)."""

    def __init__(self, out_dir: str):
        super().__init__()
        self.out_dir = out_dir
        self.linear = nn.Linear(2, 1)

    def forward(self, x):
        return self.linear(x)


def faulty_label_recorder(out_dir: str, marker: str, at: int, rank: int = 1) -> nn.Module:
    """A LabelRecorder whose rank `rank` is SIGKILLed on its training call `at` (see Fault)."""
    return Fault(LabelRecorder(out_dir), marker, at, rank, "kill")


def record_labels(model, batch):
    """A custom step over rows numbered by their label: each training batch's labels, as the rank
    received them, go to the LabelRecorder's file, one line a batch."""
    x, y = batch
    if model.training and torch.is_grad_enabled():  # a training step (not evaluation, nor the driver's trial)
        inner = getattr(model, "module", model)
        inner = getattr(inner, "inner", inner)  # under a Fault
        name = f"rank-{ray.train.get_context().get_world_rank()}-{os.getpid()}.txt"
        with open(os.path.join(inner.out_dir, name), "a") as f:
            f.write(" ".join(str(int(v)) for v in y) + "\n")
    return (model(x).squeeze(1) - y * 0).pow(2).mean()
