"""What `train` and `submit` check on this machine before any cluster starts: the builders
resolve and fit together, the training state fits the workers' memory, a resumed run's
checkpoints fit the model, a script exists. Each failure is one line, in seconds."""

from __future__ import annotations

import os

from raytrain_app.config import JobConfig, registry
from raytrain_app.errors import UserError


def check_data_and_model(config: JobConfig):
    """Build the datasets, task and model once on the driver and check that they fit together:
    the builders resolve, their args bind, the model takes the data's inputs, the labels fit the
    task and the model's outputs (a custom step runs once instead), every worker's shard holds a
    batch, and checkpoint.metric is a metric the run reports."""
    import torch

    from raytrain_app.data import build_datasets, class_count, keep_on_device
    from raytrain_app.models import build_model, places_itself
    from raytrain_app.tasks import build_task, model_outputs
    from raytrain_app.tasks.custom import CustomStep, custom_metric_names
    from raytrain_app.tasks.supervised import Classification
    from raytrain_app.worker.memory import check_state_fits
    from raytrain_app.worker.strategy import shard_units

    if config.train.sync_batchnorm and config.scaling.gpus_per_worker == 0 and config.scaling.max_workers > 1:
        raise UserError("train.sync_batchnorm needs GPU workers: PyTorch's SyncBatchNorm does not run on CPU")
    task = build_task(config.task)
    data = build_datasets(config.data)
    keep_on_device(data, config.data.on_device, torch.device("cpu"))  # `on` needs an in-memory dataset
    workers = config.scaling.max_workers  # the smallest shards
    buffer = getattr(data.train, "buffer_rows", None)  # a stream's
    if buffer is not None and buffer < config.train.batch_size:
        raise UserError(f"data.args.buffer_rows ({buffer}) is smaller than train.batch_size "
                        f"({config.train.batch_size}): the stream shuffles whole batches within its buffer")
    shard = len(data.train) // workers
    if config.train.batch_size > shard:
        raise UserError(f"train.batch_size {config.train.batch_size} is larger than a worker's shard "
                        f"({len(data.train)} training samples over {workers} workers = {shard})")
    if len(data.eval) < workers:  # a rank without eval samples would have no sums to all-reduce
        raise UserError(f"the eval set ({len(data.eval)} samples) is smaller than the number of workers ({workers})")
    classification = isinstance(task, Classification)
    outputs = model_outputs(task, data.train, class_count(data) if classification else data.num_classes)
    weights = config.task.class_weights
    if classification and isinstance(weights, list) and len(weights) != outputs:
        raise UserError(f"task.class_weights: {len(weights)} weights for {outputs} classes")
    model = build_model(config.model, data.input_shape, outputs)
    check_state_fits(model, config)
    if config.strategy.sharded:
        if places_itself(config.model):
            raise UserError(f"strategy {config.strategy.name}: the model places its own layers (its builder takes "
                            "`devices`), which only strategy ddp supports")
        shard_units(model, config.strategy.shard_modules)  # every name a module class of this model
    if isinstance(task, CustomStep):
        names = custom_metric_names(task, model, data.train)
        metric = config.checkpoint.metric
        reported = [f"{split}_{n}" for n in names for split in ("eval", "train")]
        if metric not in ("auto", "train_loss", "eval_loss", *reported):
            raise UserError(f"checkpoint.metric: {metric} is not a metric of this run (the step reports "
                            f"{', '.join(reported) or 'no metrics of its own'}; or train_loss, eval_loss)")
        return model
    task.check(model, data.train, data.eval, registry.label(config.model.name))
    return model


def check_resumable(config: JobConfig, run_dir: str, model, if_any: bool = False) -> list[str]:
    """The run's latest checkpoint fits the model and strategy the config asks for, and leaves
    epochs to train, or one line naming the difference: found here, a mismatch changes nothing and
    is never called damage. `if_any` (`--resume-if-any`, a sweep's trial) lets a run that has
    trained all its epochs end at once: a requeued job whose run finished has nothing left to do.
    Returns warnings: model args that changed without changing any weight's shape (a dropout)."""
    from raytrain_app.rundir import kept, read_metrics
    from raytrain_app.rundir.checkpoints import parameter_shapes

    checkpoints = kept(run_dir)
    if not checkpoints:
        raise UserError(f"--resume: no checkpoint to resume in {run_dir}")
    for latest in reversed(checkpoints):  # the newest that reads, as the workers will restore it
        try:
            saved, shapes = parameter_shapes(latest.path)
            break
        except Exception:  # noqa: BLE001 - torn or damaged: the workers say so, and skip it as well
            continue
    else:
        return []  # none reads: the workers report each, and that none is usable
    was = saved["config"]
    then, now = was["model"], config.to_dict()["model"]
    where = f"--resume: {latest.name}"
    if then["name"] != now["name"]:
        raise UserError(f"{where} has model {then['name']}, the config says {now['name']}: resume with the model it "
                        "was trained with, or start a new run")
    changed = [f"model.args.{key} {then['args'].get(key)!r}, the config says {now['args'].get(key)!r}"
               for key in sorted(set(then["args"]) | set(now["args"])) if then["args"].get(key) != now["args"].get(key)]
    built = {name: list(t.shape) for name, t in model.state_dict().items()}
    for name in sorted(set(shapes) | set(built)):
        if shapes.get(name) != built.get(name):
            if changed:  # the likely cause, in the user's own terms
                raise UserError(f"{where} has {changed[0]}")
            raise UserError(f"{where} has parameter {name} shaped {shapes.get(name)}, the config's model has "
                            f"{built.get(name)} (the data's inputs or classes changed?)")
    asked = config.train.epochs
    if latest.epoch > asked or latest.epoch == asked and not if_any:  # it would end at once, "14 of 12 epochs"
        trained = max([latest.epoch, *(row["epoch"] for row in read_metrics(run_dir) if "epoch" in row)])
        at = "" if trained == latest.epoch else f", its latest checkpoint at epoch {latest.epoch}"
        raise UserError(f"--resume: the run has trained {trained} epochs ({latest.name}{at}) and train.epochs is "
                        f"{asked}: nothing left to train; --set train.epochs=N with N above {latest.epoch} trains on")
    return [f"{where} has {change}: the weights fit, so the run resumes with the config's" for change in changed]


def check_script(path: str) -> None:
    """The script exists and is Python that compiles: a typo should not cost a cluster start."""
    if not os.path.isfile(path):
        raise UserError(f"script not found: {path}")
    if not path.endswith(".py"):
        raise UserError(f"script {path} is not a Python file (.py)")
    try:
        with open(path, "rb") as f:
            compile(f.read(), path, "exec")
    except (SyntaxError, ValueError) as e:
        raise UserError(f"script {path} is not valid Python: {type(e).__name__}: {e}") from None
