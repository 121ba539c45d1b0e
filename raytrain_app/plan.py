"""Config -> plan: everything decided and checked on the driver before Ray starts.

The plan resolves "auto" choices (precision, backend), picks the run directory, and runs the
cheap checks that would otherwise fail minutes later inside a worker: the data loads, the model
accepts it, the labels fit the model, each worker's shard holds a batch; or a script compiles.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

from raytrain_app import registry, storage, tracking
from raytrain_app.config import JobConfig, metric_mode, updated
from raytrain_app.errors import ConfigError, UserError
from raytrain_app.lease import Lease
from raytrain_app.rundir import SNAPSHOT



@dataclass(frozen=True)
class RunPlan:
    config: JobConfig  # resolved: no "auto" left but the strategy's units and replicas, which workers decide
    run_dir: str  # absolute local path or URI
    resume: bool
    warnings: tuple[str, ...] = ()  # what the user should hear before the run starts
    lease: Optional[Lease] = None  # the run directory's, held from the plan to the end of the run

    @property
    def use_gpu(self) -> bool:
        return self.config.scaling.gpus_per_worker > 0

    @property
    def log_dir(self) -> str:
        """Where this process writes the driver's and Ray's logs: RUN_DIR/logs, or for a run
        directory on object storage a local folder uploaded there at the end (`upload_logs`)."""
        if storage.is_local(self.run_dir):
            return os.path.join(self.run_dir, "logs")
        return os.path.join(tempfile.gettempdir(), f"raytrain-{os.getuid()}", "logs", os.path.basename(self.run_dir))

    def upload_logs(self, warn: Callable[[str], None]) -> None:
        """The driver's logs into the run directory on object storage; failing to is a warning."""
        if not storage.is_local(self.run_dir) and os.path.isdir(self.log_dir):
            try:
                storage.upload(self.log_dir, storage.join(self.run_dir, "logs"))
            except Exception as e:  # noqa: BLE001 - pyarrow's and the store's errors alike: never the run's outcome
                warn(f"the driver's logs were not uploaded to {self.run_dir}/logs: {storage.explain(e)}")


def make_plan(config: JobConfig, run_dir: Optional[str] = None, resume: Union[bool, str] = False,
              source: str = "config", warn: Callable[[str], None] = print, sweep_trial: bool = False) -> RunPlan:
    """`resume` "if_any" continues `run_dir` when it holds a checkpoint and starts it otherwise: the
    entrypoint of a job that its scheduler may run again (a retried RayJob, a requeued SLURM job).

    The plan holds the run directory's lease (`plan.lease`): its caller releases it when the run
    ends. `warn` hears of a lease taken over from a holder that is gone."""
    config = resolve_auto(config)
    if resume == "if_any" and not run_dir:
        raise UserError("--resume-if-any needs --run-dir: the run it may continue")
    run_dir = storage.normalize(run_dir or _latest_or_new_run_dir(config.name, resume))
    # Before anything else looks at the directory: a second writer is refused here, in one line.
    held = Lease.acquire(run_dir, "sweep trial" if sweep_trial else "train", warn)
    try:
        storage.check_writable(run_dir)  # a full or read-only volume, now, not at the first checkpoint
        return _checked(config, run_dir, resume, source, held)
    except BaseException:
        held.release()
        raise


def _checked(config: JobConfig, run_dir: str, resume: Union[bool, str], source: str, held: Lease) -> RunPlan:
    """The plan's checks, with the run directory's lease held; nothing in it changes until they pass."""
    # Ray Train writes its index after every checkpoint: something to resume, and no fresh start here.
    has_checkpoint = storage.exists(storage.join(run_dir, SNAPSHOT))
    if resume == "if_any":
        resume = has_checkpoint
    if resume and not has_checkpoint:
        raise UserError(f"--resume: no checkpoint to resume in {run_dir}")
    if not resume and has_checkpoint:
        raise UserError(f"{run_dir} already holds a run: pass --resume to continue it, or choose another --run-dir")
    warnings = []
    try:
        if config.script:
            check_script(config.script.path)
        else:
            model = check_data_and_model(config)
            if resume:
                warnings += check_resumable(config, run_dir, model)
    except ConfigError as e:
        raise ConfigError(*[f"{source}: {line}" for line in e.lines]) from None
    if not config.script:
        tracking.check(config.tracking, run_dir)
        config = absolute_paths(config)
    if config.strategy.sharded and config.scaling.workers == 1:
        warnings.append(f"strategy {config.strategy.name} on one worker has nothing to shard over: training it "
                        "unsharded")
    return RunPlan(config, run_dir, bool(resume), tuple(warnings), held)


# The arguments of built-in datasets that name files; relative ones are relative to the launch directory.
DATA_PATHS = {"parquet": ("path", "eval_path"), "mnist": ("root",), "fashion_mnist": ("root",), "cifar10": ("root",),
              "text": ("path",)}


def absolute_paths(config: JobConfig) -> JobConfig:
    """The built-in datasets' local paths made absolute (URIs as they are), once, where the run
    launches: its config then means the same files to every later command, from any directory
    (`evaluate`, `--resume` of a copied config, a worker elsewhere). Checks ran on the paths as
    written, so their messages show them so."""
    args = dict(config.data.args)
    for key in DATA_PATHS.get(config.data.name if isinstance(config.data.name, str) else "", ()):
        value = args.get(key)
        if isinstance(value, str) and "://" not in value and not (key == "path" and value == "stdlib"):
            args[key] = os.path.abspath(os.path.expanduser(value))
    return updated(config, {"data": {"args": args}}) if args != config.data.args else config


def resolve_auto(config: JobConfig) -> JobConfig:
    """Every `auto` decided: bf16, channels_last and NCCL with GPUs; fp32 and Gloo without, and
    Gloo where workers share GPUs (NCCL refuses two ranks on one device); FSDP's bf16 parameters
    with bf16 training."""
    if config.script:  # Ray Train's own group only starts the workers; the script picks its backend
        return updated(config, {"scaling": {"backend": "gloo"}})
    gpu = config.scaling.gpus_per_worker > 0
    shared = config.scaling.gpus_per_worker < 1 and config.scaling.workers > 1
    train, scaling = {}, {}
    if config.train.precision == "auto":
        train["precision"] = "bf16" if gpu else "fp32"
    if config.train.channels_last == "auto":
        train["channels_last"] = "on" if gpu else "off"
    if config.scaling.backend == "auto":
        scaling["backend"] = "nccl" if gpu and not shared else "gloo"
    ckpt = {}
    if config.checkpoint.metric == "auto":
        names = config.task.metric_names
        ckpt["metric"] = f"eval_{names[0]}" if names else "eval_loss"
    if config.checkpoint.mode == "auto":
        metric = ckpt.get("metric", config.checkpoint.metric)
        ckpt["mode"] = metric_mode(metric)
    early = config.train.early_stopping
    if early and "auto" in (early.metric, early.mode):
        metric = ckpt.get("metric", config.checkpoint.metric) if early.metric == "auto" else early.metric
        same = metric == ckpt.get("metric", config.checkpoint.metric)
        mode = early.mode if early.mode != "auto" else ckpt.get("mode", config.checkpoint.mode) if same else \
            metric_mode(metric)
        train["early_stopping"] = {"metric": metric, "mode": mode}
    strategy = {}
    if config.strategy.mixed_precision == "auto":
        strategy["mixed_precision"] = "bf16" if train.get("precision", config.train.precision) == "bf16" else "off"
    return updated(config, {"train": train, "scaling": scaling, "checkpoint": ckpt, "strategy": strategy})


def check_data_and_model(config: JobConfig):
    """Build the datasets, task and model once on the driver and check that they fit together:
    the builders resolve, their args bind, the model takes the data's inputs, the labels fit the
    task and the model's outputs (a custom step runs once instead), every worker's shard holds a
    batch, and checkpoint.metric is a metric the run reports."""
    import torch

    from raytrain_app.data import build_datasets, class_count, keep_on_device
    from raytrain_app.memory import check_state_fits
    from raytrain_app.models import build_model, places_itself
    from raytrain_app.strategy import shard_units
    from raytrain_app.tasks import Classification, CustomStep, build_task, custom_metric_names, model_outputs

    if config.train.sync_batchnorm and config.scaling.gpus_per_worker == 0 and config.scaling.workers > 1:
        raise UserError("train.sync_batchnorm needs GPU workers: PyTorch's SyncBatchNorm does not run on CPU")
    task = build_task(config.task)
    data = build_datasets(config.data)
    keep_on_device(data, config.data.on_device, torch.device("cpu"))  # `on` needs an in-memory dataset
    workers = config.scaling.workers
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


def check_resumable(config: JobConfig, run_dir: str, model) -> list[str]:
    """The run's latest checkpoint fits the model and strategy the config asks for, or one line
    naming the difference: found here, a mismatch changes nothing and is never called damage.
    Returns warnings: model args that changed without changing any weight's shape (a dropout)."""
    from raytrain_app.checkpoint import parameter_shapes
    from raytrain_app.rundir import kept

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
    if config.strategy.sharded and not saved.get("sharded"):
        raise UserError(f"{where} was written without sharding, and strategy {config.strategy.name} resumes only "
                        f"sharded checkpoints: resume under strategy ddp, or start a new run")
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


def _latest_or_new_run_dir(name: str, resume: bool) -> str:
    if not resume:
        return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    previous = sorted(d for d in os.listdir("runs") if d.startswith(f"{name}-")) if os.path.isdir("runs") else []
    if not previous:
        raise UserError(f"--resume: no earlier run of '{name}' under runs/; name one with --run-dir")
    return os.path.join("runs", previous[-1])
