"""`data.engine: ray_data`: training batches read by Ray Data instead of by each worker.

The driver hands Ray Train `ray.data.read_parquet` over the training files; Ray Train splits it
into one equal stream per worker (`streaming_split(equal=True)`), and Ray Data's read tasks run
on the cluster's spare CPUs, ahead of the workers. That is what Ray Data is for: reading and
decoding scale with the cluster rather than with the training workers' own CPUs.

What it gives up, against the native stream (`stream.py`):
- Ray Data decides which rows reach which worker, in an order that is not deterministic: two
  runs with the same seed see different batches, and so end at different weights.
- A position within an epoch cannot be replayed, so runs resume at epoch boundaries only
  (`checkpoint.every_steps` is refused).
- Evaluation needs `data.args.eval_path`; it is read by the native stream, every row once, as
  evaluation must be exact.

The native training stream is still built on every worker, for what it knows without reading
the data: the normalisation statistics, the class count, the input shape, and how a row decodes.
"""

from __future__ import annotations

import numpy as np

from raytrain_app.config.sections import DataConfig
from raytrain_app.data.parquet_files import ParquetFiles
from raytrain_app.data.stream import ParquetStream
from raytrain_app.errors import UserError


def read_train(config: DataConfig):
    """On the driver: the training files as a Ray Dataset, which Ray Train splits among the workers."""
    import ray.data

    a = config.args
    files = ParquetFiles.find(a["path"], a.get("features"), a.get("label"), a.get("shape"))
    return ray.data.read_parquet(files.files, filesystem=files.fs, file_extensions=None).select_columns(files.columns)


class RayDataBatches:
    """One worker's training batches from its Ray Data shard: the loop's loader and sampler in one.

    Every rank takes the same number of batches, `len(stream) // world_size // batch_size`: Ray
    Train's equal split gives each rank `len // world_size` rows, and the last partial batch is dropped.
    """

    def __init__(self, shard, stream: ParquetStream, batch_size: int, rank: int, world_size: int, seed: int):
        self.shard = shard  # a ray.data.DataIterator
        self.stream, self.batch_size, self.rank, self.seed = stream, batch_size, rank, seed
        self.batches = len(stream) // world_size // batch_size
        self.epoch, self.start = 0, 0  # start: samples of the epoch done (a resume inside it)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        if self.start:
            raise UserError("data.engine: ray_data resumes at epoch boundaries only, and this checkpoint is from "
                            "within an epoch: resume it with data.engine: native")
        seed = int(np.random.default_rng([self.seed, self.epoch, self.rank]).integers(2**31))
        tables = self.shard.iter_batches(batch_size=self.batch_size, batch_format="pyarrow", drop_last=True,
                                         local_shuffle_buffer_size=self.stream.buffer_rows, local_shuffle_seed=seed)
        taken = 0
        for table in tables:
            data = self.stream.decode(table.to_batches())
            yield data.__getitems__(range(len(data)))
            taken += 1
        if taken != self.batches:  # the other ranks would wait for this one's collectives forever
            raise RuntimeError(f"Ray Data gave rank {self.rank} {taken} batches, not the {self.batches} expected")
