"""The job config's sections, one pydantic model each: what a job file may say, with its
defaults, bounds and descriptions (the schema `config schema` prints and the docs' reference
is generated from). `JobConfig` (in `config/__init__.py`) puts them together."""

from __future__ import annotations

import re
from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from raytrain_app.config import registry
from raytrain_app.config.files import NUMBER, RANGE


class Section(BaseModel):
    # Strict: a wrong type is an error, not a guess (no "3" for 3, no 2.5 for an integer, no true
    # for a number); an integer is still a fine float. Frozen: a changed copy goes through
    # `updated`, which validates it again.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, serialize_by_alias=True)


Fraction = Annotated[float, Field(ge=0, lt=1)]


# A builder is named in YAML; from Python (`raytrain_app.fit`) it may also be the function itself,
# which the workers receive by value, as a notebook's functions must be. Files and schemas name it.
Builder = Union[str, SkipJsonSchema[Callable[..., Any]]]


class BuilderSection(Section):
    @field_serializer("name", when_used="json", check_fields=False)
    def _named(self, value: Builder) -> str:
        return registry.label(value)


class ModelConfig(BuilderSection):
    name: Builder = Field("lenet", description='lenet | mlp | resnet18 | resnet50 | gpt | "pkg.module:build"')
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the builder, checked "
                                                                   "against its signature before anything starts")


class DataConfig(BuilderSection):
    name: Builder = Field("digits", description='digits | mnist | fashion_mnist | cifar10 | parquet | csv | '
                                                'images | synthetic | text | "pkg.module:build"')
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the builder (see Datasets)")
    eval_fraction: float = Field(0.2, gt=0, lt=1, description="held-out share for datasets without a test split")
    split_seed: int = Field(0, description="that split is fixed by this seed")
    loader_workers: Optional[int] = Field(None, ge=0, description="DataLoader processes per training worker; null: "
                                                                  "0 for in-memory datasets, else "
                                                                  "min(4, cpus_per_worker - 1)")
    on_device: Literal["auto", "on", "off"] = Field("auto", description="hold an in-memory dataset on the training "
                                                                        "device (auto: on GPUs, when it fits in a "
                                                                        "quarter of the GPU's memory)")
    engine: Literal["native", "ray_data"] = Field("native", description="who reads the training data: native (every "
                                                                        "dataset; exact mid-epoch resume) or ray_data "
                                                                        "(parquet through ray.data.read_parquet on the "
                                                                        "cluster's spare CPUs; needs "
                                                                        "data.args.eval_path; resumes at epoch "
                                                                        "boundaries only, in no fixed order)")


# What each built-in task can optimise and report: (losses, metrics, default metrics). The first
# loss is `auto`'s choice. Kept here, free of torch, so the CLI checks a config in a second.
TASKS = {
    "classification": (("cross_entropy",), ("accuracy", "top5", "f1_macro"), ("accuracy",)),
    "regression": (("mse", "l1", "huber"), ("mse", "mae", "r2"), ("mse", "r2")),
    "multilabel": (("bce",), ("accuracy", "f1_macro"), ("accuracy", "f1_macro")),
    "language_model": (("cross_entropy",), ("perplexity", "token_accuracy"), ("perplexity", "token_accuracy")),
}
# every other metric, and every loss, is lower-better
HIGHER_IS_BETTER = {"accuracy", "top5", "f1_macro", "r2", "token_accuracy"}


def metric_mode(metric: str) -> str:
    """Whether a larger value of a reported metric (eval_accuracy, train_loss, ...) is better."""
    return "max" if metric.removeprefix("eval_") in HIGHER_IS_BETTER else "min"


class TaskConfig(BuilderSection):
    name: Builder = Field("classification", description='classification | regression | multilabel | '
                                                        'language_model | "pkg.module:step", a custom step '
                                                        'called as step(model, batch) -> loss or '
                                                        '(loss, {name: (sum, count)})')
    loss: Literal["auto", "cross_entropy", "mse", "l1", "huber", "bce"] = Field(
        "auto", description="auto: cross_entropy, mse, bce by task; a custom step computes its own")
    label_smoothing: Fraction = Field(0.0, description="cross_entropy (classification)")
    metrics: Optional[list[str]] = Field(None, description="evaluation metrics, reported as eval_NAME; null: the "
                                                           "task's default. classification: accuracy, top5, "
                                                           "f1_macro; regression: mse, mae, r2; multilabel: "
                                                           "accuracy, f1_macro; language_model: perplexity, "
                                                           "token_accuracy; a custom step: the names it returns")
    eval_step: Optional[Builder] = Field(None, description='"pkg.module:eval_step" for a custom step\'s evaluation '
                                                           '(default: the step itself, without gradients)')
    class_weights: Union[None, Literal["auto"], list[Annotated[float, Field(gt=0, allow_inf_nan=False)]]] = Field(
        None, description="classification: a weight per class in cross_entropy, for imbalanced data (auto: "
                          "samples / (classes x the class's samples), from the training labels of every rank)")

    @field_serializer("eval_step", when_used="json")
    def _named_eval_step(self, value: Optional[Builder]) -> Optional[str]:
        return None if value is None else registry.label(value)

    @property
    def custom(self) -> bool:
        return callable(self.name) or ":" in self.name

    @property
    def metric_names(self) -> Optional[tuple[str, ...]]:
        """The eval metrics a built-in task reports; None for a custom step (known once it runs)."""
        return None if self.custom else tuple(self.metrics or TASKS[self.name][2])

    @model_validator(mode="after")
    def _fits_the_task(self):
        if self.custom:
            given = [k for k, default in (("loss", "auto"), ("label_smoothing", 0.0), ("metrics", None),
                                          ("class_weights", None)) if getattr(self, k) != default]
            if given:
                raise ValueError(f"{', '.join(given)}: a custom step computes its own loss and metrics")
            return self
        if self.name not in TASKS:
            raise ValueError(f"name: unknown task '{self.name}' (built-ins: {', '.join(TASKS)}; or a custom step "
                             f"'pkg.module:step')")
        losses, metrics, _ = TASKS[self.name]
        problems = []
        if self.loss not in ("auto", *losses):
            problems.append(f"loss: {self.loss} does not fit task {self.name} (choose from {', '.join(losses)})")
        if self.label_smoothing and self.loss not in ("auto", "cross_entropy"):
            problems.append("label_smoothing: is used only with cross_entropy")
        for m in self.metrics or []:
            if m not in metrics:
                problems.append(f"metrics: {m} is not a {self.name} metric (choose from {', '.join(metrics)})")
        if self.eval_step is not None:
            problems.append("eval_step: is used only with a custom step")
        if self.class_weights is not None and self.name != "classification":
            problems.append(f"class_weights: are used only with task classification, not {self.name}")
        if problems:
            raise ValueError("\n".join(problems))
        return self


class OptimizerConfig(Section):
    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = Field(0.01, gt=0, allow_inf_nan=False, description="learning rate (per step, before scale_lr)")
    momentum: Fraction = Field(0.9, description="sgd")
    nesterov: bool = Field(False, description="sgd with momentum > 0")
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    betas: Annotated[list[Fraction], Field(min_length=2, max_length=2)] = Field(
        default_factory=lambda: [0.9, 0.999], description="adam, adamw")
    scale_lr: Literal["none", "linear"] = Field("none", description="linear: lr x number of workers (the "
                                                                    "per-worker batch is fixed, so the global "
                                                                    "batch grows)")

    @model_validator(mode="after")
    def _nesterov(self):
        if self.nesterov and not (self.name == "sgd" and self.momentum > 0):
            raise ValueError("nesterov: true is used only with sgd and momentum > 0")
        return self


class ScheduleConfig(Section):
    name: Literal["cosine", "constant"] = Field("cosine", description="stepped every optimizer step")
    warmup_epochs: float = Field(0.0, ge=0, allow_inf_nan=False, description="linear warmup from 0 (fractions "
                                                                             "allowed), at most train.epochs")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine decays to lr x min_lr_ratio")
    on_extend: Literal["continue", "restart"] = Field("continue", description="when a resumed run plans more (or "
                                                                              "fewer) steps: continue follows the "
                                                                              "curve planned over the new total from "
                                                                              "the step the run is at; restart runs "
                                                                              "warmup and decay again")


class EarlyStoppingConfig(Section):
    metric: str = Field("auto", description="the epoch metric watched (auto: checkpoint.metric)")
    patience: int = Field(3, ge=1, description="epochs without improvement before every rank stops")
    min_delta: float = Field(0.0, ge=0, allow_inf_nan=False, description="an improvement is a change beyond this, "
                                                                         "in the metric's better direction")
    mode: Literal["auto", "max", "min"] = Field("auto", description="auto: checkpoint.mode for its metric, else by "
                                                                    "the metric's name")


class TrainConfig(Section):
    epochs: int = Field(10, ge=1)
    batch_size: int = Field(64, ge=1, description="per worker; global batch = batch_size x workers x "
                                                  "grad_accum_steps")
    eval_batch_size: int = Field(256, ge=1)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field("auto", description="auto: bf16 on GPU, fp32 on "
                                                                                   "CPU; fp16 with GradScaler")
    grad_accum_steps: int = Field(1, ge=1)
    grad_clip: Optional[float] = Field(None, gt=0, allow_inf_nan=False, description="max global gradient norm")
    sync_batchnorm: bool = Field(False, description="convert BatchNorm to SyncBatchNorm (GPU workers only)")
    compile: Literal["off", "default", "reduce-overhead", "max-autotune"] = Field(
        "off", description="torch.compile; the last two use CUDA graphs at 1 GPU worker, graph-free variants "
                           "under DDP")
    channels_last: Literal["auto", "on", "off"] = Field("auto", description="channels_last memory format for "
                                                                            "conv nets (auto: on GPU workers)")
    ddp_bucket_cap_mb: float = Field(25.0, gt=0, allow_inf_nan=False,
                                     description="DDP gradient bucket size in MiB (gradients are bucket views: "
                                                 "no copy); at least 1 with compile and several workers")
    ddp_static_graph: bool = Field(False, description="DDP static graph, for models that use every parameter every "
                                                      "step (not with grad_accum_steps > 1 on several workers: "
                                                      "pytorch/pytorch#143580)")
    stop_on_nonfinite: bool = Field(True, description="stop every rank at the first NaN/inf training loss (exit 1), "
                                                      "keeping the last good checkpoint as the latest; false trains "
                                                      "on")
    early_stopping: Optional[EarlyStoppingConfig] = Field(None, description="stop every rank when a metric has "
                                                                            "not improved for `patience` epochs "
                                                                            "(null: train every epoch)")
    limit_batches: Optional[int] = Field(None, ge=1, description="train on at most this many batches per epoch "
                                                                 "and worker (a smoke run; null: all)")
    limit_eval_batches: Optional[int] = Field(None, ge=1, description="evaluate at most this many batches per "
                                                                      "worker (a smoke run; null: all)")


class StrategyConfig(Section):
    name: Literal["ddp", "fsdp", "hsdp"] = Field("ddp", description="ddp: a full replica per worker; fsdp: "
                                                                  "parameters, gradients and optimizer state sharded "
                                                                  "over all workers (FSDP2); hsdp: replicated across "
                                                                  "nodes, sharded within each")
    shard_modules: Union[Literal["auto"], list[str]] = Field(
        "auto", description="module class names sharded as units, the root last (auto: the model's repeated "
                            "blocks, such as transformer layers)")
    reshard_after_forward: bool = Field(True, description="free gathered parameters after forward (less memory, "
                                                          "one more all-gather in backward)")
    mixed_precision: Literal["auto", "off", "bf16"] = Field("auto", description="bf16 parameters with fp32 "
                                                                               "gradient reduction (auto: bf16 "
                                                                               "when train.precision is bf16)")
    cpu_offload: bool = Field(False, description="keep sharded parameters and optimizer state in CPU memory")
    replicate_degree: Union[Literal["auto"], Annotated[int, Field(ge=1)]] = Field(
        "auto", description="hsdp: replicas (auto: one per node); each shards over workers / replicate_degree")
    reduce_dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="the dtype gradients are reduce-scattered in (auto: fp32); bf16 or fp16 halves the "
                            "bytes sent, each worker keeping fp32 gradient shards (FSDP2's MixedPrecisionPolicy)")

    @property
    def sharded(self) -> bool:
        return self.name != "ddp"


class PowerSGDConfig(Section):
    rank: int = Field(4, ge=1, description="the rank of each gradient matrix's approximation: higher sends more, "
                                           "closer to the gradient")
    start_iter: int = Field(10, ge=2, description="optimizer steps of plain all-reduce before compression starts "
                                                  "(DDP settles its buckets in the first ones)")
    warm_start: bool = Field(True, description="start each step's factors from the last step's: a closer "
                                               "approximation for the same bytes, at the cost of memory")


class DDPConfig(Section):
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        "none", description="what DDP's gradient all-reduce sends: fp16 or bf16 halves it; powersgd sends a "
                            "low-rank approximation of each gradient matrix, with error feedback")
    powersgd: PowerSGDConfig = Field(default_factory=PowerSGDConfig)


class CheckpointConfig(Section):
    every_epochs: int = Field(1, ge=1, description="the last epoch is always checkpointed")
    every_steps: int = Field(0, ge=0, description="also every N optimizer steps, recording the sampler position "
                                                  "(0: off)")
    keep: int = Field(2, ge=1, description="best K by metric; the latest is always kept too")
    metric: str = Field("auto", description="which metric ranks checkpoints: train_loss, eval_loss or eval_NAME "
                                            "for a task metric (auto: eval_ + the task's first metric)")
    mode: Literal["auto", "max", "min"] = Field("auto", description="auto: max for accuracy, top5, f1_macro and "
                                                                    "r2; min for losses and errors")
    # `async` in files and --set; a Python keyword, so `async_` as an attribute.
    async_: bool = Field(False, alias="async", description="the loop pauses only to copy the state to host memory; "
                                                           "writing, uploading and committing go on in the background, "
                                                           "one checkpoint at a time (a second copy of the state in "
                                                           "host memory; on CPU workers the write takes cores from "
                                                           "the steps)")


class WorkerRange(Section):
    """An elastic run's bounds: Ray Train starts the group once `min` workers fit, grows it toward
    `max` as room appears and shrinks it when nodes go, restarting from the latest checkpoint."""

    min: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self):
        if self.min >= self.max:
            raise ValueError(f"min ({self.min}) must be below max ({self.max}); a fixed size is a number")
        return self


# A number or a range, told apart before validation: an error then names what was wrong with the
# one meant, not with both.
Workers = Annotated[Union[Annotated[int, Field(ge=1), Tag(NUMBER)], Annotated[WorkerRange, Tag(RANGE)]],
                    Discriminator(lambda v: RANGE if isinstance(v, (dict, WorkerRange)) else NUMBER)]


class ScalingConfig(Section):
    workers: Workers = Field(
        2, description="a number, or a range `{min: 2, max: 8}` (`2:8`, `--workers 2:8`): an elastic run, which "
                       "starts once min fit and resizes as nodes come and go")
    on_resize: Literal["keep_global_batch", "scale_lr"] = Field(
        "keep_global_batch", description="what a range's resize does: keep_global_batch keeps batch_size x "
                                         "max workers x grad_accum_steps and the lr, with more micro-batches "
                                         "per step (or smaller ones) on fewer workers; scale_lr keeps the "
                                         "per-worker batch, and the lr follows optimizer.scale_lr")
    resize_interval_s: float = Field(60.0, gt=0, allow_inf_nan=False,
                                     description="how often a range's run looks for room to grow (Ray Train's "
                                                 "elastic_resize_monitor_interval_s)")
    gpus_per_worker: float = Field(0.0, ge=0, allow_inf_nan=False, description="a share of one GPU (workers share "
                                                                             "it), or whole GPUs: a model builder "
                                                                             "taking `devices` gets them all")
    cpus_per_worker: float = Field(1.0, gt=0, allow_inf_nan=False)
    memory_per_worker_gb: Optional[float] = Field(None, gt=0, allow_inf_nan=False,
                                                  description="memory Ray reserves for each worker (its `memory` "
                                                              "resource: for placement, not enforced); the plan "
                                                              "refuses a model whose parameters, gradients and "
                                                              "optimizer state alone exceed it under the strategy")
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: nccl with a whole GPU per worker, "
                                                                         "gloo with shared GPUs or none")
    timeout_s: int = Field(600, ge=1, description="collective timeout: torch's process group and Ray Train's own "
                                                  "barriers")
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="how Ray places workers on nodes (submit sets it from the profile)")
    local: Union[Literal["auto"], bool] = Field("auto", description="run without a Ray cluster, through Ray Train's "
                                                                    "local mode and torch's launcher (auto: where "
                                                                    "nothing is lost: train on this machine, no "
                                                                    "--address, no Ray Data, no script)")

    @field_validator("workers", mode="before")
    @classmethod
    def _range_text(cls, value):
        """`2:8`, as YAML and the --workers flag give a range."""
        if isinstance(value, str) and re.fullmatch(r"\s*\d+\s*:\s*\d+\s*", value):
            low, high = value.split(":")
            return {"min": int(low), "max": int(high)}
        return value

    @property
    def elastic(self) -> bool:
        return isinstance(self.workers, WorkerRange)

    @property
    def min_workers(self) -> int:
        return self.workers.min if self.elastic else self.workers

    @property
    def max_workers(self) -> int:
        """The size the run asks for; what a range's global batch is configured at."""
        return self.workers.max if self.elastic else self.workers

    def describe_workers(self) -> str:
        return f"{self.workers.min} to {self.workers.max} workers" if self.elastic else \
            f"{self.workers} worker{'s' if self.workers != 1 else ''}"

    @property
    def resources(self) -> dict:
        """One worker's Ray resources."""
        return {"CPU": self.cpus_per_worker, **({"GPU": self.gpus_per_worker} if self.gpus_per_worker else {}),
                **({"memory": self.memory_per_worker_gb * 2**30} if self.memory_per_worker_gb else {})}

    @model_validator(mode="after")
    def _nccl_needs_gpus(self):
        if self.gpus_per_worker > 1 and self.gpus_per_worker != int(self.gpus_per_worker):
            raise ValueError(f"gpus_per_worker: {self.gpus_per_worker:g} GPUs cannot be given to one worker: a share "
                             "below 1, or whole GPUs")
        if self.backend == "nccl" and self.gpus_per_worker == 0:
            raise ValueError("backend: nccl needs GPUs (gpus_per_worker is 0): use gloo or auto")
        # Ray packs fractional GPUs, so workers share a device, and NCCL refuses two ranks on one
        # ("Duplicate GPU detected"), which it says only after the worker group has started.
        if self.backend == "nccl" and self.gpus_per_worker < 1 and self.max_workers > 1:
            raise ValueError(f"backend: nccl cannot run two ranks on one GPU, and gpus_per_worker "
                             f"{self.gpus_per_worker:g} makes workers share GPUs: use gloo or auto, or whole GPUs")
        return self


class FailureConfig(Section):
    max_failures: int = Field(0, ge=-1, description="worker-group restarts before the run fails (-1: unlimited)")
    max_preemption_failures: int = Field(-1, ge=-1, description="restarts after a node's preemption (a drain with a "
                                                                "deadline), counted apart from max_failures "
                                                                "(-1: unlimited)")
    preemption_grace_s: float = Field(0.0, ge=0, allow_inf_nan=False,
                                      description="how long the workers left may run past a preemption's deadline, "
                                                  "to finish writing its checkpoint without the preempted ones")
    placement_timeout_s: float = Field(300.0, gt=0, allow_inf_nan=False,
                                       description="how long a starting or restarting worker group may wait for the "
                                                   "cluster to place it (over two tries); then the run fails, naming "
                                                   "what is missing (raise it for a cluster that autoscales)")
    hang_timeout_s: Union[Literal["auto"], float] = Field(
        "auto", description="a rank that makes no progress this long is hung: every rank's stack goes to "
                            "RUN_DIR/logs/hang-STEP.txt, the rank that stopped first is named and the group "
                            "restarts from the latest checkpoint, as a failure (auto: the larger of 60 s and 20x "
                            "the run's p99 step; 0: off). Compiling, evaluating and checkpointing are not counted")
    straggler_factor: float = Field(2.0, gt=1, allow_inf_nan=False,
                                    description="the epoch line names a rank whose time per step outside "
                                                "collectives (data wait and forward) is this many times the "
                                                "median rank's")

    @field_validator("hang_timeout_s")
    @classmethod
    def _not_negative(cls, v):
        if v != "auto" and not (0 <= v < float("inf")):
            raise ValueError("must be auto, 0 (off) or a number of seconds")
        return v


class MlflowConfig(Section):
    tracking_uri: Optional[str] = Field(None, description="an http(s):// MLflow server, sqlite:///FILE or a databricks "
                                                          "URI (null: $MLFLOW_TRACKING_URI, else sqlite:///RUN_DIR/"
                                                          "mlflow.db); credentials from the environment only")
    experiment: Optional[str] = Field(None, description="experiment name (null: the job's name)")
    run_name: Optional[str] = Field(None, description="null: the run directory's name")
    log_checkpoint: bool = Field(False, description="copy the best checkpoint's files into the MLflow run (default: "
                                                    "its URI only, as a tag and best_checkpoint.json)")

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, value: Optional[str]) -> Optional[str]:
        if value and re.match(r"^[a-z+]+://[^/@]+:[^/@]*@", value):
            raise ValueError("must not carry a password: set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
                             "in the environment (or the profile's runtime_env.env_vars) instead")
        return value


class WandbConfig(Section):
    project: str = Field(description="W&B project")
    entity: Optional[str] = Field(None, description="team or user (null: the API key's default)")
    mode: Literal["online", "offline"] = Field("online", description="offline writes RUN_DIR/wandb for `wandb "
                                                                     "sync`; online needs WANDB_API_KEY")


class TrackingConfig(Section):
    tensorboard: bool = Field(True, description="event files under RUN_DIR/tensorboard")
    mlflow: Optional[MlflowConfig] = Field(None, description="log to MLflow (pip install 'raytrain-app[mlflow]')")
    wandb: Optional[WandbConfig] = Field(None, description="log to Weights & Biases (pip install "
                                                          "'raytrain-app[wandb]')")
    log_every_steps: int = Field(50, ge=0, description="step-level train loss, lr and samples/s every N optimizer "
                                                       "steps (0: epoch-level only)")
    report_png: bool = Field(True, description="draw RUN_DIR/report.png when the run ends (pip install "
                                               "'raytrain-app[report]'); `raytrain-app report` draws it any time")


class ScriptConfig(Section):
    path: str = Field(description="a torchrun-style Python script, run unchanged as __main__ on every worker "
                                  "(relative to the launch directory, or to the job's working_dir)")
    args: list[str] = Field(default_factory=list, description="the script's sys.argv[1:]")
    stop_signal: Literal["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP"] = Field(
        "SIGTERM", description="sent to every rank's script process on a stop request or a preemption notice")
    stop_grace_s: float = Field(60.0, ge=0, description="how long the script may take to checkpoint and exit after "
                                                        "stop_signal, before it is killed")


# What a script leaves to raytrain-app; the other sections configure the built-in loop, which a
# script replaces.
SCRIPT_SECTIONS = ("name", "script", "scaling", "failure", "checkpoint.keep")
