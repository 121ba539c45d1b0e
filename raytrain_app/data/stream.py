"""Parquet streamed a window of rows at a time (`data.args.streaming: true`), for datasets larger
than a worker's memory.

The unit of sharding is the row group. Every epoch all ranks shuffle the training row groups with
the same seed and lay their rows end to end; rank r takes the r-th of `world_size` equal stretches
of that sequence. A rank opens only the row groups its stretch covers (the two at its ends it
shares with its neighbours, each reading its part), and every rank takes the same number of
batches, so none waits for another at the end of an epoch. Rows that do not fill a last batch are
dropped: fewer than `world_size x batch_size` an epoch, and different ones each epoch.

Within its stretch a rank reads windows of `buffer_rows` rows (whole batches), shuffles each with
a seed of its own and cuts it into batches. A thread reads the next window while the loop trains
on this one: two windows are in memory, never the dataset. On a GPU that thread also copies the
window there (pinned, on a stream of its own, as uint8 pixels), and the batches are cut,
normalised and augmented on the GPU, as for data held there (`arrays.DeviceBatches`): the step
never waits for a host-to-device copy or a normalisation on the CPU.

All of it is a function of (seed, epoch, world size, rank), so the position in an epoch is the
batch index that the loop's checkpoints hold already. Resuming at batch b reads only from the
window b falls in, skipping the row groups before it by the row counts in the files' footers.

Evaluation reads the eval row groups in file order, rank r its r-th stretch, in batches with no
row dropped or counted twice.
"""

from __future__ import annotations

import bisect
import copy
import queue
import threading
from dataclasses import replace
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from raytrain_app.data.arrays import ArrayDataset, channel_stats, resize_images
from raytrain_app.data.cuda_streams import handed_over
from raytrain_app.data.parquet_files import ParquetFiles, RowGroup, label_tensor
from raytrain_app.data.preprocess import Stored
from raytrain_app.errors import UserError
from raytrain_app.storage import explain

NORM_ROWS = 4096  # the first training rows, in file order, that the normalisation statistics come from
READ_ROWS = 512  # rows pyarrow decodes at a time within a row group


def stream_pair(files: ParquetFiles, eval_files: Optional[ParquetFiles], eval_fraction: float, split_seed: int,
                buffer_rows: int, resize: int, augment: bool) -> tuple["ParquetStream", "ParquetStream"]:
    """Train and eval streams: the eval files, or else a seeded `eval_fraction` of the row groups."""
    if buffer_rows < 1:
        raise UserError(f"data.args.buffer_rows must be a positive number of rows, got {buffer_rows}")
    if eval_files:
        train_groups, eval_groups = files.row_groups, eval_files.row_groups
    else:
        groups = files.row_groups
        if len(groups) < 2:
            raise UserError(f"data.args.streaming: {files.path} is a single row group, which cannot be split into "
                            "training and eval data: give data.args.eval_path, or write it in several row groups "
                            "(raytrain-app convert does)")
        order = np.random.default_rng(split_seed).permutation(len(groups))
        n_eval = min(len(groups) - 1, max(1, round(len(groups) * eval_fraction)))
        eval_groups = [groups[i] for i in sorted(order[:n_eval])]
        train_groups = [groups[i] for i in sorted(order[n_eval:])]
    train = ParquetStream(files, train_groups, None, None, buffer_rows, resize, augment)
    first = train.decode(train.read_rows(range(len(train_groups)), 0, min(NORM_ROWS, len(train))))
    train.mean, train.std = first.mean, first.std
    features = files.features if isinstance(files.features, str) else tuple(files.features)
    train.stored = replace(first.stored, resize=resize, features=features, label=files.label,
                           classes=tuple(files.classes) if files.classes else None)
    return train, ParquetStream(eval_files or files, eval_groups, train.mean, train.std, buffer_rows, resize, False)


class ParquetStream(Dataset):
    """One split's row groups, read a window at a time by `StreamBatches`. Indexing reads the row
    group that holds the row: for the driver's checks of a sample or two, not for training."""

    def __init__(self, files: ParquetFiles, groups: list[RowGroup], mean: Optional[torch.Tensor],
                 std: Optional[torch.Tensor], buffer_rows: int, resize: int, augment: bool):
        self.files, self.groups = files, groups
        self.mean, self.std = mean, std
        self.stored: Optional[Stored] = None  # the training stream's, set by stream_pair
        self.buffer_rows, self.resize, self.augment = buffer_rows, resize, augment
        self.starts = np.cumsum([0] + [g.rows for g in groups]).tolist()
        self._peeked: tuple[int, Optional[ArrayDataset]] = (-1, None)

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int):
        k = bisect.bisect_right(self.starts, i) - 1
        if self._peeked[0] != k:
            self._peeked = (k, self.decode(self.read_rows([k], 0, self.groups[k].rows)))
        return self._peeked[1][i - self.starts[k]]

    @property
    def num_classes(self) -> Optional[int]:
        """The named classes, the files' metadata, or the largest integer label in the footers' statistics."""
        if self.files.classes:
            return len(self.files.classes)
        stored = self.files.metadata.get("raytrain.num_classes")
        if stored:
            return int(stored)
        highest = [g.label_max for g in self.groups]
        return int(max(highest)) + 1 if highest and None not in highest else None

    @property
    def fingerprint(self) -> str:
        return self.files.fingerprint_of(self.groups)

    def labels(self) -> torch.Tensor:
        """Every label of the split in row order, reading the label column alone."""
        columns = []
        for group in self.groups:
            try:
                with self.files.fs.open_input_file(group.path) as f:
                    columns.append(pq.ParquetFile(f).read_row_group(group.index, columns=[self.files.label]).column(0))
            except (pa.ArrowException, OSError) as e:
                raise UserError(f"{group.path}: row group {group.index} is not readable: {explain(e)}") from None
        return label_tensor(pa.chunked_array([c for column in columns for c in column.chunks]).combine_chunks(),
                            self.files.path, self.files.label, self.files.classes)

    def read_rows(self, order, lo: int, hi: int) -> Iterator[pa.RecordBatch]:
        """Rows [lo, hi) of the row groups laid end to end in `order`, decoding only those."""
        start = 0
        for k in order:
            group = self.groups[k]
            a, b = max(lo - start, 0), min(hi - start, group.rows)
            start += group.rows
            if a < b:
                yield from self._group_rows(group, a, b)
            if start >= hi:
                return

    def _group_rows(self, group: RowGroup, a: int, b: int) -> Iterator[pa.RecordBatch]:
        """Rows [a, b) of a row group, decoded `READ_ROWS` at a time. (A dataset fragment's
        `to_batches` decodes list columns a whole row group at once, at about 20x its pixel bytes.)"""
        seen = 0
        try:
            with self.files.fs.open_input_file(group.path) as f:
                reader = pq.ParquetFile(f, buffer_size=1 << 20)
                for batch in reader.iter_batches(READ_ROWS, row_groups=[group.index], columns=self.files.columns,
                                                 use_threads=False):
                    s, e = max(a - seen, 0), min(b - seen, batch.num_rows)
                    seen += batch.num_rows
                    if s < e:
                        yield batch.slice(s, e - s)
                    if seen >= b:
                        return
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{group.path}: row group {group.index} is not readable: {explain(e)}") from None

    def decode(self, batches) -> ArrayDataset:
        """Record batches as a dataset of normalised samples, as the in-memory reader makes them."""
        x, y = self.files.tensors(pa.Table.from_batches(list(batches)))
        stored = Stored(tuple(x.shape[1:]))
        if self.resize:
            x = resize_images(x, self.resize)
        y = y.float() if y.is_floating_point() else y.long()
        mean, std = (self.mean, self.std) if self.mean is not None else channel_stats(x)
        return ArrayDataset(x, y, mean, std, self.augment, stored)


class StreamBatches:
    """One rank's batches of a `ParquetStream`: the training loop's loader and sampler in one
    (`set_epoch`, and `start` samples of the epoch, over all ranks, done when resuming; each rank
    reads a stretch of its own, so a resume inside an epoch is exact at the same world size)."""

    def __init__(self, stream: ParquetStream, batch_size: int, rank: int, world_size: int, seed: int, train: bool,
                 device: Optional[torch.device] = None):
        self.stream, self.batch_size, self.seed, self.train = stream, batch_size, seed, train
        self.device = device if device is not None and device.type == "cuda" else None  # else batches stay on the host
        self.epoch, self.start, self.world_size = 0, 0, world_size
        n = len(stream)
        if train:  # equal stretches of whole batches
            self.lo = rank * (n // world_size)
            self.batches = n // world_size // batch_size
            self.hi = self.lo + self.batches * batch_size
        else:  # every row, once
            self.lo, self.hi = rank * n // world_size, (rank + 1) * n // world_size
            self.batches = -(-(self.hi - self.lo) // batch_size)
        self.window = max(batch_size, stream.buffer_rows // batch_size * batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.batches - self._done()

    def _done(self) -> int:
        """This rank's batches of the epoch already trained."""
        return self.start // self.world_size // self.batch_size

    def __iter__(self):
        per_window = self.window // self.batch_size
        first, offset = divmod(self._done(), per_window)
        copies = torch.cuda.Stream(self.device) if self.device is not None else None
        for data, order, copied in read_ahead(self._on_device(window, copies) for window in self._windows(first)):
            handed_over(copied, self.device, (data.x, data.y, data.mean, data.std, order))
            for s in range(offset * self.batch_size, len(order), self.batch_size):
                yield data.__getitems__(order[s:s + self.batch_size])
            offset = 0

    def _on_device(self, window: tuple[ArrayDataset, torch.Tensor], copies: Optional["torch.cuda.Stream"]):
        """A window and its order, with the event its copy to the GPU records (None: on the host).
        Runs on the reading thread: pinning and copying overlap the step."""
        data, order = window
        if copies is None:
            return data, order, None
        with torch.cuda.stream(copies):
            moved = copy.copy(data)  # pixels stay uint8 on the GPU, as data held there
            moved.x, moved.y, moved.mean, moved.std, order = (
                t.pin_memory().to(self.device, non_blocking=True) for t in (data.x, data.y, data.mean, data.std, order))
            copied = torch.cuda.Event()
            copied.record(copies)
        return moved, order, copied

    def _windows(self, first: int) -> Iterator[tuple[ArrayDataset, torch.Tensor]]:
        """The epoch's windows from the `first`-th on, each decoded with its shuffled order."""
        groups = len(self.stream.groups)
        order = np.random.default_rng([self.seed, self.epoch]).permutation(groups) if self.train else range(groups)
        start = self.lo + first * self.window
        pending, count = [], 0
        for batch in self.stream.read_rows(order, start, self.hi):
            while batch.num_rows:
                take = min(batch.num_rows, self.window - count)
                pending.append(batch.slice(0, take))
                batch, count = batch.slice(take), count + take
                if count == self.window:
                    yield self._window(pending, start)
                    start, pending, count = start + count, [], 0
        if pending:
            yield self._window(pending, start)

    def _window(self, batches: list[pa.RecordBatch], start: int) -> tuple[ArrayDataset, torch.Tensor]:
        data = self.stream.decode(batches)
        n = len(data)
        order = np.random.default_rng([self.seed, self.epoch, start]).permutation(n) if self.train else np.arange(n)
        return data, torch.from_numpy(order)


def read_ahead(items: Iterator, ahead: int = 1) -> Iterator:
    """`items`, each made by a thread while the consumer works on the one before: at most
    `ahead + 1` exist at once. pyarrow's decoding releases the GIL, so reading overlaps training."""
    made, room, stop = queue.Queue(), threading.Semaphore(ahead + 1), threading.Event()
    end = object()

    def make():
        while True:
            room.acquire()
            if stop.is_set():
                return
            try:
                made.put(next(items))
            except StopIteration:
                made.put(end)
                return
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, who raises it
                made.put(_Failed(e))
                return

    threading.Thread(target=make, daemon=True, name="parquet-read-ahead").start()
    try:
        while (item := made.get()) is not end:
            if isinstance(item, _Failed):
                raise item.error
            yield item
            room.release()
    finally:
        stop.set()
        room.release()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error
