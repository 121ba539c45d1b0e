"""Use a trained checkpoint on the cluster: `evaluate` it again, or `predict` new rows with it.

`evaluate` is the training loop's own exact evaluation (every sample once, sums all-reduced over
the ranks), run by Ray Train on any number of workers, so its numbers are the ones training
reported, and a checkpoint can be scored on the train split or with fewer workers than it was
trained on. `predict` needs no process group: each Ray task streams its share of the input's row
groups through the model and writes one small Parquet part per row group, which the driver joins
in row order, so memory stays bounded by a row group whatever the input's size.
"""

from __future__ import annotations

import copy
import functools
import io
import json
import os
import posixpath
import tempfile
from dataclasses import dataclass
from typing import Callable, Optional, Union

from raytrain_app import checkpoint, storage
from raytrain_app.config import JobConfig, updated
from raytrain_app.errors import TrainingFailed, UserError, last_line
from raytrain_app.session import cluster_for

DATA_SETS = ("eval", "train")
# Ray's logs of an evaluate or predict (which has no run directory of its own to put them in)
LOG_DIR = os.path.join(tempfile.gettempdir(), f"raytrain-{os.getuid()}", "inference-logs")


@dataclass(frozen=True)
class Loaded:
    """A checkpoint chosen in a run directory, and the config it was trained with (workers as asked)."""

    directory: str
    job: JobConfig
    input_shape: tuple[int, ...]

    @classmethod
    def find(cls, run_dir: str, which: str, workers: Optional[int]) -> "Loaded":
        directory = checkpoint.choose(storage.normalize(run_dir), which)
        saved = checkpoint.loop_state(directory)
        job = JobConfig.from_dict(saved["config"], source=directory)
        return cls(directory, updated(job, {"scaling": {"workers": workers}}) if workers else job,
                   tuple(saved["input_shape"]))


def evaluate(run_dir: str, checkpoint_name: str = "best", data_set: str = "eval", workers: Optional[int] = None,
             address: Optional[str] = None, verbose: bool = False, echo: Callable[[str], None] = print) -> dict:
    """The task's metrics of a run's checkpoint over a whole split, computed as training does;
    also written to RUN_DIR/evaluations/CHECKPOINT-SPLIT.json."""
    if data_set not in DATA_SETS:
        raise UserError(f"--data-set must be one of {', '.join(DATA_SETS)}, got {data_set}")
    loaded = Loaded.find(run_dir, checkpoint_name, workers)
    import ray.train  # after the checks: a wrong directory is reported without loading Ray
    from ray.train.torch import TorchConfig, TorchTrainer

    s = loaded.job.scaling
    run, name = posixpath.split(loaded.directory.rstrip("/"))  # Ray keeps checkpoints in the run directory
    out = storage.join(run, "evaluations", f"{name}-{data_set}.json")
    echo(f"evaluating {loaded.directory} on the {data_set} split: {s.workers} workers")
    with cluster_for(loaded.job.scaling, address, LOG_DIR, verbose, echo), tempfile.TemporaryDirectory() as scratch:
        trainer = TorchTrainer(
            functools.partial(evaluate_per_worker, loaded.job.to_python(), loaded.directory, data_set, out),
            scaling_config=ray.train.ScalingConfig(num_workers=s.workers, use_gpu=s.gpus_per_worker > 0,
                                                   resources_per_worker=s.resources),
            torch_config=TorchConfig(backend=s.backend, timeout_s=s.timeout_s),
            run_config=ray.train.RunConfig(name="evaluate", storage_path=scratch),
        )
        try:
            trainer.fit()
        except ray.train.TrainingFailedError as e:
            from raytrain_app.trainer import explain_failure

            raise explain_failure(e, loaded.job) from None
    return json.loads(storage.read_text(out))["metrics"]


def evaluate_per_worker(job_data: dict, directory: str, data_set: str, out: str) -> None:
    """Every rank evaluates its shard; rank 0 writes the all-reduced metrics to `out` (Train V2
    keeps reported metrics only beside checkpoints, and this writes none)."""
    import ray.train
    import ray.train.torch

    from raytrain_app.data import build_datasets, eval_loader
    from raytrain_app.loop import Precision, Step, evaluate
    from raytrain_app.tasks import build_task

    ctx = ray.train.get_context()
    device = ray.train.torch.get_device()
    job = JobConfig.from_dict(job_data)
    data = build_datasets(job.data)
    if data_set == "train":  # the train split as evaluation sees it: unaugmented, every sample once
        data = copy.copy(data)
        data.eval = copy.copy(data.train)
        if hasattr(data.eval, "augment"):
            data.eval.augment = False
    task = build_task(job.task)
    model = _model_on(directory, job, ray.train.torch.get_devices())
    loader = eval_loader(data, job.train.eval_batch_size, ctx.get_world_rank(), ctx.get_world_size(), 0,
                         device.type == "cuda")
    metrics = evaluate(model, loader, Step(model, Precision(job.train.precision, device), device=device, task=task))
    if ctx.get_world_rank() == 0:
        storage.write_text(out, json.dumps({"checkpoint": directory, "data_set": data_set, "workers":
                                            ctx.get_world_size(), "metrics": {f"{data_set}_{k}": v for k, v in
                                                                               metrics.items()}}, indent=1) + "\n")


def predict(run_dir: str, input_path: str, output: str, checkpoint_name: str = "best", workers: Optional[int] = None,
            batch_size: int = 1024, address: Optional[str] = None, verbose: bool = False,
            echo: Callable[[str], None] = print) -> int:
    """Write the model's predictions for every row of a Parquet file to `output`, in the input's
    order, with the row number (and the input's `id` column, if it has one); returns the row count.
    Classification: `prediction` (the class) and `probability`; regression: `prediction` (the
    value, or a list for several targets)."""
    import pyarrow.parquet as pq
    import ray

    from raytrain_app.data import normalization

    loaded = Loaded.find(run_dir, checkpoint_name, workers)
    spec = _input_spec(loaded, input_path)
    storage.check_writable(posixpath.dirname(storage.normalize(output)) or ".")
    fs, path = storage.filesystem_for(input_path)
    groups = pq.ParquetFile(fs.open_input_file(path)).metadata.num_row_groups
    s = loaded.job.scaling
    parts = storage.join(posixpath.dirname(storage.normalize(output)) or ".",
                         f".{posixpath.basename(output)}.parts")
    echo(f"predicting {input_path} with {loaded.directory}: {groups} row groups over {s.workers} workers")
    with cluster_for(loaded.job.scaling, address, LOG_DIR, verbose, echo):
        mean_std = normalization(loaded.job.data)
        task = ray.remote(predict_row_groups).options(num_cpus=s.cpus_per_worker, num_gpus=s.gpus_per_worker)
        try:
            ray.get([task.remote(loaded.job.to_python(), loaded.directory, input_path, spec, mean_std,
                                 list(range(rank, groups, s.workers)), parts, batch_size) for rank in range(s.workers)])
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            raise (cause if isinstance(cause, UserError) else TrainingFailed(f"predict failed: {last_line(e)}")) from None
    return _join(parts, groups, output)


def predict_row_groups(job_data: dict, directory: str, input_path: str, spec: "InputSpec", mean_std,
                       groups: list[int], parts: str, batch_size: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    job = JobConfig.from_dict(job_data)
    # Ray hides the GPUs from a task that asked for none, so these are the task's own GPUs or the CPU.
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] or [torch.device("cpu")]
    device = devices[0]
    model = _model_on(directory, job, devices)
    fs, path = storage.filesystem_for(input_path)
    source = pq.ParquetFile(fs.open_input_file(path))
    starts = np.cumsum([0] + [source.metadata.row_group(g).num_rows for g in range(source.metadata.num_row_groups)])
    keep_id = "id" in source.schema_arrow.names
    for g in groups:
        pieces, row = [], int(starts[g])
        for batch in source.iter_batches(batch_size=batch_size, row_groups=[g], columns=spec.columns + ["id"] * keep_id):
            x = spec.decode(batch, input_path)
            if mean_std is not None:
                x = (x - mean_std[0]) / mean_std[1]
            with torch.no_grad():
                out = model(x.to(device)).cpu()
            piece = {"row": pa.array(np.arange(row, row + batch.num_rows))}
            if keep_id:
                piece["id"] = batch.column("id")
            if job.task.name == "classification":
                probability, label = torch.softmax(out.float(), dim=1).max(dim=1)
                piece.update(prediction=pa.array(label.numpy()), probability=pa.array(probability.numpy()))
            else:
                values = out.float().numpy()
                piece["prediction"] = pa.array(values[:, 0] if values.shape[1] == 1 else list(values))
            pieces.append(pa.table(piece))
            row += batch.num_rows
        buffer = io.BytesIO()
        pq.write_table(pa.concat_tables(pieces), buffer)
        storage.write_bytes(storage.join(parts, f"{g:06d}.parquet"), buffer.getvalue())


def _model_on(directory: str, job: JobConfig, devices: list):
    """The checkpoint's model, in eval mode, on this worker's devices: a model that places its own
    layers gets them all, as in training; any other goes whole to the first."""
    from raytrain_app.api import load_model
    from raytrain_app.models import places_itself

    model = load_model(directory, _builder(job), devices)
    return model if places_itself(job.model) else model.to(devices[0])


def _builder(job: JobConfig):
    """A model builder given as a function (a notebook's), which the checkpoint names only."""
    return job.model.name if callable(job.model.name) else None


@dataclass(frozen=True)
class InputSpec:
    """How a row of the input becomes the model's input, as training read its data: the feature
    column(s), reshaped to the stored shape, resized as `data.args.resize` did."""

    features: Union[str, tuple[str, ...]]
    shape: tuple[int, ...]
    resize: int

    @property
    def columns(self) -> list[str]:
        return [self.features] if isinstance(self.features, str) else list(self.features)

    def decode(self, batch, input_path: str):
        import numpy as np
        import torch

        from raytrain_app.data.arrays import resize_images
        from raytrain_app.data.parquet import feature_matrix

        x = feature_matrix(batch, self.features if isinstance(self.features, str) else list(self.features), input_path)
        if x.shape[1] != int(np.prod(self.shape)):
            raise UserError(f"--input {input_path}: {x.shape[1]} values per row, but the model was trained on "
                            f"samples shaped {list(self.shape)} (a file may store its shape as raytrain.shape metadata)")
        x = torch.from_numpy(np.array(x, dtype=np.float32)).reshape(len(x), *self.shape)
        return resize_images(x, self.resize) if self.resize else x


def _input_spec(loaded: Loaded, input_path: str) -> InputSpec:
    """The input's columns and shapes checked against the model's, on its first row, before Ray starts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    job = loaded.job
    if job.task.name not in ("classification", "regression"):
        raise UserError(f"predict writes classification and regression outputs; this run's task is {job.task.name}")
    if not storage.exists(input_path):
        raise UserError(f"--input {input_path} does not exist")
    fs, path = storage.filesystem_for(input_path)
    try:
        source = pq.ParquetFile(fs.open_input_file(path))
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"--input {input_path} is not a readable Parquet file: {storage.explain(e)}") from None
    meta = source.schema_arrow.metadata or {}
    features = job.data.args.get("features") or (json.loads(meta[b"raytrain.features"]) if b"raytrain.features" in meta
                                                 else "image")
    names = source.schema_arrow.names
    missing = [c for c in ([features] if isinstance(features, str) else features) if c not in names]
    if missing:
        raise UserError(f"--input {input_path} has no column '{missing[0]}', which the model was trained on "
                        f"(columns: {', '.join(names)})")
    input_shape = loaded.input_shape
    stored = meta.get(b"raytrain.shape")
    shape = job.data.args.get("shape") or (json.loads(stored) if stored else input_shape)
    spec = InputSpec(features if isinstance(features, str) else tuple(features), tuple(shape),
                     job.data.args.get("resize", 0))
    sample = tuple(spec.decode(next(source.iter_batches(batch_size=1, columns=spec.columns)), input_path).shape[1:])
    if sample != input_shape:
        raise UserError(f"--input {input_path}: rows become samples shaped {list(sample)}, but the model takes "
                        f"{list(input_shape)}")
    return spec


def _join(parts: str, groups: int, output: str) -> int:
    """The parts, in row-group order, into one Parquet file, one part in memory at a time."""
    import pyarrow.parquet as pq

    fs, path = storage.filesystem_for(output)
    parts_fs, parts_path = storage.filesystem_for(parts)
    rows, writer = 0, None
    with fs.open_output_stream(path) as f:
        for g in range(groups):
            table = pq.read_table(posixpath.join(parts_path, f"{g:06d}.parquet"), filesystem=parts_fs)
            writer = writer or pq.ParquetWriter(f, table.schema)
            writer.write_table(table)
            rows += table.num_rows
        if writer:
            writer.close()
    parts_fs.delete_dir(parts_path)
    return rows
