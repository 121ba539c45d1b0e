"""Use a trained checkpoint: `evaluate` it again, or `predict` new rows with it, in this process
(Ray Train's local mode, the default where nothing is lost) or on a Ray cluster.

`evaluate` is the training loop's own exact evaluation (every sample once, sums all-reduced over
the ranks), run by Ray Train on any number of workers, so its numbers are the ones training
reported, and a checkpoint can be scored on the train split, with fewer workers than it was
trained on, or on any labelled file. `predict` needs no process group: each Ray task streams its
share of the input's row groups through the model and writes one small Parquet part per row
group, which the driver joins in row order, so memory stays bounded by a row group whatever the
input's size.

Neither needs the training data for new rows: the checkpoint records how raw inputs were
preprocessed, and the model applies it (`models.TrainedModel`).
"""

from __future__ import annotations

import copy
import functools
import io
import json
import os
import posixpath
import tempfile
from dataclasses import dataclass, replace
from typing import Callable, Optional

from raytrain_app import rundir, storage
from raytrain_app.cluster.session import cluster_for
from raytrain_app.config import JobConfig, registry, updated
from raytrain_app.config.resolve import absolute_paths
from raytrain_app.console import count
from raytrain_app.data import labelled_files, tables
from raytrain_app.data.image_sources import Encoded, find
from raytrain_app.data.images import labelled
from raytrain_app.data.parquet_files import is_csv
from raytrain_app.data.preprocess import feature_columns
from raytrain_app.errors import TrainingFailed, UserError, last_line
from raytrain_app.rundir import checkpoints
from raytrain_app.rundir.lease import Lease

DATA_SETS = ("eval", "train")
MAX_CLASS_LINES = 20  # classes that evaluate's console lists one per line (all of them are in the JSON)
# Ray's logs of an evaluate or predict (which has no run directory of its own to put them in)
LOG_DIR = os.path.join(tempfile.gettempdir(), f"raytrain-{os.getuid()}", "inference-logs")


@dataclass(frozen=True)
class Loaded:
    """A checkpoint chosen in a run directory, and what it records: the config it was trained with
    (workers as asked), the model's input shape and how raw inputs become it."""

    chosen: rundir.Chosen
    job: JobConfig
    input_shape: tuple[int, ...]
    recipe: Optional[dict]  # data.preprocess.recipe: None where the data was not normalised
    class_weights: Optional[list[float]]

    @classmethod
    def find(cls, run_dir: str, which: Optional[str], workers: Optional[int]) -> "Loaded":
        chosen = rundir.choose(run_dir, which)
        saved = checkpoints.for_inference(chosen.path, weights=False)
        # Data paths as a shipped working_dir's run records them (relative) mean this folder, the
        # project's: absolute, they mean it to workers too, on a cluster that runs them elsewhere.
        job = absolute_paths(JobConfig.from_dict(saved["config"], source=chosen.path))
        loaded = cls(chosen, job, tuple(saved["input_shape"]), saved["preprocess"], saved.get("class_weights"))
        # A training range is not an evaluation's: it runs at a size, the range's largest unless asked.
        size = workers or job.scaling.max_workers
        return loaded.sized(size) if size != job.scaling.workers else loaded

    def sized(self, workers: int) -> "Loaded":
        return replace(self, job=updated(self.job, {"scaling": {"workers": workers}}))

    @property
    def directory(self) -> str:
        return self.chosen.path

    def check_builders(self, with_data: bool) -> None:
        """The user's modules that the workers import (the model's, a custom task's, and the data's
        where a split of the run's data is read) are found here: a run from another directory
        where they are not gets the one line before any worker starts."""
        job = self.job
        for name, key in ((job.model.name, "model.name"), (job.task.name, "task.name"),
                          (job.task.eval_step, "task.eval_step"), (job.data.name if with_data else None, "data.name")):
            registry.check_findable(name, key)

    def features(self) -> list[str]:
        """The input columns the model reads, in order."""
        features = feature_columns(self.recipe, self.job.data.args.get("features"))
        return [features] if isinstance(features, str) else features

    @property
    def classes(self) -> Optional[list[str]]:
        """The names of the class ids, where the training labels were names."""
        return (self.recipe or {}).get("classes")


def evaluate(run_dir: str, checkpoint_name: Optional[str] = None, data_set: str = "eval",
             workers: Optional[int] = None, address: Optional[str] = None, verbose: bool = False,
             echo: Callable[[str], None] = print, data: Optional[str] = None, local: Optional[bool] = None) -> dict:
    """The task's metrics of a run's checkpoint over a whole split of the run's data, or over
    the labelled Parquet or CSV file `data`, computed as training does. Written to
    RUN_DIR/evaluations/CHECKPOINT-SPLIT.json (SPLIT: eval, train, or file-NAME), for
    classification with per-class precision, recall, F1 and the confusion matrix (also as a PNG).
    `local`: one worker in this process, through Ray Train's local mode (no cluster), or on Ray
    (False); None chooses (see `_placed`)."""
    if data_set not in DATA_SETS:
        raise UserError(f"--data-set must be one of {', '.join(DATA_SETS)}, got {data_set}")
    loaded, local = _placed(run_dir, checkpoint_name, workers, address, local)
    loaded.check_builders(with_data=data is None)
    evaluations = storage.join(storage.parent(loaded.directory), "evaluations")  # checkpoints are in the run dir
    split = f"file-{posixpath.basename(data).split('.')[0]}" if data else data_set
    copies = storage.join(evaluations, f".{split}")  # a CSV's rows as Parquet, for the workers
    held = Lease.acquire(storage.parent(loaded.directory), "evaluate",  # it writes evaluations/
                         lambda line: echo(f"warning: {line}"))
    try:
        return _scored(loaded, storage.join(evaluations, f"{loaded.chosen.name}-{split}.json"), split, data_set,
                       address, verbose, echo, data, copies, local)
    finally:
        storage.remove(copies)  # however it ended
        held.release()


def _placed(run_dir: str, which: Optional[str], workers: Optional[int], address: Optional[str],
            local: Optional[bool]) -> tuple[Loaded, bool]:
    """The chosen checkpoint, sized for where it runs, and whether that is local mode: as `local`
    says (True: --local, False: --ray), else as `local_by_default` decides."""
    if local and (address or (workers or 1) > 1):
        raise UserError("--local runs one worker in this process: drop --workers and --address, or --local")
    loaded = Loaded.find(run_dir, which, 1 if local else workers)
    if local is None:
        from raytrain_app.cluster.session import ray_connected

        local = local_by_default(loaded.job, workers, address, ray_connected())
        if local and loaded.job.scaling.workers != 1:
            loaded = loaded.sized(1)
    return loaded, local


def local_by_default(job: JobConfig, workers: Optional[int], address: Optional[str], ray_connected: bool) -> bool:
    """Whether `evaluate` and `predict` run without a cluster by default: where nothing is lost,
    as `train` chooses (driver/local.choose): no --workers or --address, no cluster joined or up
    to use, a job that needs nothing of Ray, and workers without GPUs, whose N GPUs one process
    would not use. How the run itself trained does not matter: a checkpoint scores the same."""
    from raytrain_app.driver import local as local_mode

    return not (workers or address or job.scaling.gpus_per_worker) and local_mode.choose(
        updated(job, {"scaling": {"local": "auto"}}), None, 1, ray_connected)


def _scored(loaded: "Loaded", out: str, split: str, data_set: str, address: Optional[str], verbose: bool,
            echo: Callable[[str], None], data: Optional[str], copies: str, local: bool) -> dict:
    rows = _labelled_input(loaded, data, copies) if data else None
    shown, data = data, storage.normalize(data) if data else None
    s = loaded.job.scaling
    echo(f"evaluating {loaded.chosen.name} ({loaded.chosen.why}) on {shown or f'the {data_set} split'}: "
         f"{count(s.workers, 'worker')}{', local mode' if local else ''}")
    evaluating = functools.partial(evaluate_per_worker, loaded, data_set, rows, out)
    if local:
        _in_this_process(evaluating, loaded.job.scaling)
    else:
        _on_ray(evaluating, loaded, address, verbose, echo)
    result = json.loads(storage.read_text(out))
    if "classes" in result:
        from raytrain_app.rundir import plots

        classes = result["classes"]
        names = classes.get("names") or [str(c) for c in range(len(classes["support"]))]
        if len(names) <= MAX_CLASS_LINES:
            width = max(5, *map(len, names))
            echo(f"{'class':>{width}}  {'precision':>9}  {'recall':>6}  {'f1':>6}  {'support':>7}")
            for name, *values in zip(names, *(classes[k] for k in ("precision", "recall", "f1", "support"))):
                echo(f"{name:>{width}}  {values[0]:>9.4f}  {values[1]:>6.4f}  {values[2]:>6.4f}  {values[3]:>7}")

        try:
            picture = plots.confusion(classes["confusion"], f"{loaded.chosen.name} on {split}",
                                      out.removesuffix(".json") + "-confusion.png", classes.get("names"))
            echo(f"confusion matrix: {picture}")
        except UserError as e:  # no matplotlib: the numbers are in the JSON
            echo(f"warning: no confusion matrix picture: {e}")
    echo(f"written to {out}")
    return result["metrics"]


def _on_ray(evaluating: Callable[[], None], loaded: "Loaded", address: Optional[str], verbose: bool,
           echo: Callable[[str], None]) -> None:
    import ray.train  # after the checks: a wrong directory or file is reported without loading Ray

    from raytrain_app.driver.on_ray import explain_failure, ray_trainer

    with cluster_for(loaded.job.scaling, address, LOG_DIR, verbose, echo), tempfile.TemporaryDirectory() as scratch:
        trainer = ray_trainer(evaluating, loaded.job.scaling,
                                run_config=ray.train.RunConfig(name="evaluate", storage_path=scratch))
        try:
            trainer.fit()
        except ray.train.TrainingFailedError as e:
            raise explain_failure(e, loaded.job) from None


def _in_this_process(evaluating: Callable[[], None], scaling) -> None:
    """Ray Train's local mode: the same function, one rank, no cluster, on the threads (and GPU
    or none) a Ray worker would have: the same numbers."""
    from raytrain_app.driver.local import worker_environment
    from raytrain_app.worker.local import in_local_mode

    with worker_environment(scaling):
        in_local_mode(evaluating)


def evaluate_per_worker(loaded: Loaded, data_set: str, data: Optional[str], out: str) -> None:
    """Every rank evaluates its shard; rank 0 writes the all-reduced metrics to `out` (Train V2
    keeps reported metrics only beside checkpoints, and this writes none)."""
    import ray.train
    import ray.train.torch
    import torch

    from raytrain_app.data import Datasets, build_datasets, eval_loader, labelled_file, loader_workers
    from raytrain_app.tasks import build_task
    from raytrain_app.tasks.supervised import Classification, class_report
    from raytrain_app.worker.loop import Precision, Step, evaluation_sums

    ctx = ray.train.get_context()
    device = ray.train.torch.get_device()
    job = loaded.job
    if data:
        scored = labelled_file(data, loaded.recipe)
        datasets = Datasets(scored, scored, loaded.input_shape, None)
    else:
        datasets = build_datasets(job.data)
        if data_set == "train":  # the train split as evaluation sees it: unaugmented, every sample once
            datasets = copy.copy(datasets)
            datasets.eval = copy.copy(datasets.train)
            if hasattr(datasets.eval, "augment"):
                datasets.eval.augment = False
    task = build_task(job.task)
    if isinstance(task, Classification):
        task.confusion = True
        if loaded.class_weights is not None:  # the loss training reported
            task.weight = torch.tensor(loaded.class_weights)
    model = _model_on(loaded.directory, job, ray.train.torch.get_devices()).model  # the inputs come normalised
    workers = loader_workers(job.data.loader_workers, datasets, job.scaling.cpus_per_worker)
    loader = eval_loader(datasets, job.train.eval_batch_size, ctx.get_world_rank(), ctx.get_world_size(), workers,
                         device.type == "cuda", device=device)
    sums = evaluation_sums(model, loader, Step(model, Precision(job.train.precision, device), device=device,
                                               task=task))
    if ctx.get_world_rank() == 0:
        prefix = "eval" if data else data_set
        result = {"checkpoint": loaded.directory, "data_set": data or data_set, "workers": ctx.get_world_size(),
                  "metrics": {f"{prefix}_{k}": v for k, v in task.metrics(sums).items()}}
        if isinstance(task, Classification):
            result["classes"] = class_report(sums, loaded.classes)
        storage.write_text(out, json.dumps(result, indent=1) + "\n")


def _labelled_input(loaded: Loaded, path: str, scratch: str) -> str:
    """`evaluate --data`: the file checked against the model's columns (and a CSV rewritten as
    Parquet in `scratch`), before Ray starts."""
    if loaded.recipe is None:
        raise UserError(f"--data: {loaded.directory} was trained on data "
                        f"('{loaded.job.data.model_dump(mode='json')['name']}') "
                        "that is not read from a table, so a file cannot be read as it was; evaluate its splits "
                        "(--data-set), or score it with load_model in Python")
    if loaded.recipe.get("kind") == "images":  # listed (and its classes checked) before Ray starts
        labelled(path, loaded.recipe)
        return storage.normalize(path)
    present = tables.columns_of(path, "--data")
    label = loaded.recipe.get("label") or "label"
    tables.require(path, present, loaded.features(), "--data", "an input")
    tables.require(path, present, [label], "--data", "the label")
    # Every label a class the model knows, by the checkpoint's names: read alone, before Ray starts.
    labelled_files(path, loaded.recipe, "csv" if is_csv(path) else "parquet").labels()
    return tables.as_parquet(storage.normalize(path), scratch, "--data")  # the workers run elsewhere


def predict(run_dir: str, input_path: str, output: str, checkpoint_name: Optional[str] = None,
            workers: Optional[int] = None, batch_size: int = 1024, address: Optional[str] = None,
            verbose: bool = False, echo: Callable[[str], None] = print, local: Optional[bool] = None) -> int:
    """Write the model's predictions for every row of a Parquet or CSV file to `output`, in the
    input's order, with the row number (and the input's `id` column, if it has one); returns the
    row count. The input holds the training data's feature columns by name (in any order, other
    columns ignored) or the one packed column it had, with raw values: the model preprocesses
    them as training did. Classification: `prediction` (the class id), `label` (its name, where
    the training labels were names: the checkpoint's, as training numbered them) and
    `probability`; regression: `prediction` (the value, or a list for several targets). `local`:
    in this process, with no Ray cluster, or on Ray (False); None chooses (see `_placed`)."""
    output_format(output)
    loaded, local = _placed(run_dir, checkpoint_name, workers, address, local)
    loaded.check_builders(with_data=False)
    if loaded.job.task.name not in ("classification", "regression"):
        raise UserError(f"predict writes classification and regression outputs; this run's task is "
                        f"{loaded.job.task.name}")
    features = loaded.features()
    if (loaded.recipe or {}).get("kind") == "images":  # listed before Ray starts: a missing file is one line
        source = find(input_path, labelled=False, column=features[0])
    else:
        tables.require(input_path, tables.columns_of(input_path, "--input"), features, "--input", "an input")
        source = None
    out_dir = posixpath.dirname(storage.normalize(output)) or "."
    storage.check_writable(out_dir)
    parts = storage.join(out_dir, f".{posixpath.basename(output)}.parts")
    try:
        return _predict(loaded, input_path, source, output, parts, features, batch_size, address, verbose, echo,
                        local)
    finally:
        storage.remove(parts)  # the CSV's copy and the parts, however it ended


def _predict(loaded: "Loaded", input_path: str, images: Optional[Encoded], output: str, parts: str,
             features: list[str], batch_size: int, address: Optional[str], verbose: bool,
             echo: Callable[[str], None], local: bool) -> int:
    """Every part of the input (a Parquet row group, or a chunk of images) predicted, in this
    process or spread over Ray tasks, then joined in order."""
    import pyarrow.parquet as pq
    import ray

    if images is not None:
        groups, unit = -(-len(images) // IMAGE_CHUNK), "chunk"
        work = functools.partial(predict_images, loaded, images)
    else:
        source = tables.as_parquet(storage.normalize(input_path), parts, "--input")  # the tasks run elsewhere
        _check_width(loaded, source, input_path, features)
        fs, path = storage.filesystem_for(source)
        groups, unit = pq.ParquetFile(fs.open_input_file(path)).metadata.num_row_groups, "row group"
        work = functools.partial(predict_row_groups, loaded, source, features)
    s = loaded.job.scaling
    shown = f"{count(len(images), 'image')} in {count(groups, unit)}" if images is not None else count(groups, unit)
    echo(f"predicting {input_path} with {loaded.chosen.name} ({loaded.chosen.why}): {shown} over "
         f"{count(s.workers, 'worker')}{', in this process' if local else ''}")
    if local:
        work(list(range(groups)), parts, batch_size)
        return _join(parts, groups, output)
    with cluster_for(loaded.job.scaling, address, LOG_DIR, verbose, echo):
        task = ray.remote(_run).options(num_cpus=s.cpus_per_worker, num_gpus=s.gpus_per_worker)
        try:
            ray.get([task.remote(work, list(range(rank, groups, s.workers)), parts, batch_size)
                     for rank in range(s.workers)])
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            raise (cause if isinstance(cause, UserError)
                   else TrainingFailed(f"predict failed: {last_line(e)}")) from None
    return _join(parts, groups, output)


def _run(work: Callable, groups: list[int], parts: str, batch_size: int) -> None:
    """A Ray task's share of a prediction."""
    work(groups, parts, batch_size)


def _task_devices() -> list:
    """Ray hides the GPUs from a task that asked for none, so these are the task's own GPUs or the CPU."""
    import torch

    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())] or [torch.device("cpu")]


def _outputs(loaded: Loaded, out) -> dict:
    """Prediction columns for a batch of model outputs: classification's class id, its name where
    the labels were names, and its probability; regression's value(s)."""
    import pyarrow as pa
    import torch

    piece = {}
    if loaded.job.task.name == "classification":
        probability, label = torch.softmax(out.float(), dim=1).max(dim=1)
        piece["prediction"] = pa.array(label.numpy())
        if loaded.classes:
            piece["label"] = pa.array(loaded.classes, pa.string()).take(piece["prediction"])
        piece["probability"] = pa.array(probability.numpy())
    else:
        values = out.float().numpy()
        piece["prediction"] = pa.array(values[:, 0] if values.shape[1] == 1 else list(values))
    return piece


def _write_part(parts: str, index: int, pieces: list) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.concat_tables(pieces), buffer)
    storage.write_bytes(storage.join(parts, f"{index:06d}.parquet"), buffer.getvalue())


# Images per part of a prediction over image files: a task's unit of work and of output.
IMAGE_CHUNK = 256


def predict_images(loaded: Loaded, images: Encoded, chunks: list[int], parts: str, batch_size: int) -> None:
    """Chunks of IMAGE_CHUNK images, decoded in loader processes, through the eval transform the
    checkpoint records; each image named by its file (or row of its Parquet file)."""
    import numpy as np
    import pyarrow as pa
    import torch
    from torch.utils.data import DataLoader

    from raytrain_app.data.images import CheckedBatches, EncodedImages, decode_processes, transforms_of

    devices = _task_devices()
    model = _model_on(loaded.directory, loaded.job, devices).model  # the loader transforms the images
    transforms = transforms_of(loaded.recipe)
    for c in chunks:
        idx = np.arange(c * IMAGE_CHUNK, min((c + 1) * IMAGE_CHUNK, len(images)))
        chunk = images.take(idx)
        dataset = EncodedImages(chunk, transforms, train=False)
        workers = decode_processes(loaded.job.scaling.cpus_per_worker)
        batches = CheckedBatches(DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                                            collate_fn=EncodedImages.collate))
        pieces, at = [], 0
        for x, _ in batches:
            with torch.no_grad():
                out = model(x.to(devices[0])).cpu()
            named = [chunk.name(i) for i in range(at, at + len(x))]
            pieces.append(pa.table({"image": pa.array(named, pa.string()), **_outputs(loaded, out)}))
            at += len(x)
        _write_part(parts, c, pieces)


def predict_row_groups(loaded: Loaded, input_path: str, features: list[str], groups: list[int], parts: str,
                       batch_size: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from raytrain_app.data.parquet_files import feature_matrix

    devices = _task_devices()
    model = _model_on(loaded.directory, loaded.job, devices)
    fs, path = storage.filesystem_for(input_path)
    source = pq.ParquetFile(fs.open_input_file(path))
    starts = np.cumsum([0] + [source.metadata.row_group(g).num_rows for g in range(source.metadata.num_row_groups)])
    keep_id = "id" in source.schema_arrow.names
    packed = features[0] if len(features) == 1 else features  # one list column, or scalar columns side by side
    for g in groups:
        pieces, row = [], int(starts[g])
        for batch in source.iter_batches(batch_size=batch_size, row_groups=[g], columns=features + ["id"] * keep_id):
            x = torch.tensor(feature_matrix(batch, packed, input_path))  # a copy: Arrow's buffers are read-only
            if loaded.recipe is None:  # a builder's own data: its rows are the model's inputs, as float32
                x = x.reshape(len(x), *loaded.input_shape).float()
            with torch.no_grad():
                out = model(x.to(devices[0])).cpu()
            piece = {"row": pa.array(np.arange(row, row + batch.num_rows))}
            if keep_id:
                piece["id"] = batch.column("id")
            pieces.append(pa.table({**piece, **_outputs(loaded, out)}))
            row += batch.num_rows
        _write_part(parts, g, pieces)


def _check_width(loaded: Loaded, source: str, input_path: str, features: list[str]) -> None:
    """The input's first row holds as many values as a sample the model was trained on."""
    import numpy as np
    import pyarrow.parquet as pq

    from raytrain_app.data.parquet_files import feature_matrix

    fs, path = storage.filesystem_for(source)
    first = next(pq.ParquetFile(fs.open_input_file(path)).iter_batches(batch_size=1, columns=features), None)
    if first is None:
        raise UserError(f"--input {input_path} has no rows")
    shape = loaded.recipe["shape"] if loaded.recipe else list(loaded.input_shape)
    width = feature_matrix(first, features[0] if len(features) == 1 else features, input_path).shape[1]
    if width != int(np.prod(shape)):
        raise UserError(f"--input {input_path}: {width} values per row, but the model was trained on samples of "
                        f"{int(np.prod(shape))} values shaped {list(shape)}")


def _model_on(directory: str, job: JobConfig, devices: list):
    """The checkpoint's trained model, in eval mode, on this worker's devices: a model that places
    its own layers gets them all, as in training; any other goes whole to the first."""
    from raytrain_app.inference.load import load_model
    from raytrain_app.models import places_itself

    model = load_model(directory, job.model.name if callable(job.model.name) else None, devices)
    return model if places_itself(job.model) else model.to(devices[0])


# What predict writes, by the output's suffix (none: Parquet).
OUTPUT_FORMATS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet", "": "parquet"}


def output_format(output: str) -> str:
    """CSV or Parquet, as the output's name says: another suffix (preds.json) is refused, not
    written as Parquet under a name that says otherwise."""
    suffix = posixpath.splitext(posixpath.basename(output.rstrip("/")))[1].lower()
    if suffix not in OUTPUT_FORMATS:
        raise UserError(f"--output {output}: predictions are written as Parquet (.parquet, .pq, or no suffix) or CSV "
                        f"(.csv), not {suffix}")
    return OUTPUT_FORMATS[suffix]


def _join(parts: str, groups: int, output: str) -> int:
    """The parts, in row-group order, into one file, one part in memory at a time, as
    `output_format` says (several targets' predictions in CSV as `prediction_0`, `prediction_1`,
    ...: CSV has no lists)."""
    import pyarrow.csv
    import pyarrow.parquet as pq

    as_csv = output_format(output) == "csv"
    fs, path = storage.filesystem_for(output)
    parts_fs, parts_path = storage.filesystem_for(parts)
    rows, writer = 0, None
    with fs.open_output_stream(path) as f:
        for g in range(groups):
            table = pq.read_table(posixpath.join(parts_path, f"{g:06d}.parquet"), filesystem=parts_fs)
            if as_csv:
                table = _flat(table)
            writer = writer or (pyarrow.csv.CSVWriter if as_csv else pq.ParquetWriter)(f, table.schema)
            writer.write_table(table)
            rows += table.num_rows
        if writer:
            writer.close()
    return rows


def _flat(table):
    """A list column as one column per element, named by its index."""
    import pyarrow as pa
    import pyarrow.compute as pc

    columns = {}
    for name, column in zip(table.column_names, table.columns):
        if pa.types.is_list(column.type) or pa.types.is_fixed_size_list(column.type):
            width = len(column[0].as_py()) if len(column) else 0
            columns.update({f"{name}_{i}": pc.list_element(column, i) for i in range(width)})
        else:
            columns[name] = column
    return pa.table(columns)
