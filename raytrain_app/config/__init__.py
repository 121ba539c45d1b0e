"""The typed job config: one pydantic model per concern, read from YAML with `--set` overrides.

Everything a run does is decided here, before Ray starts, so a typo costs a second and a clear
message instead of a cluster start and a worker traceback. Each constraint sits beside its field
with the field's description, which the JSON Schema (`raytrain-app config schema`), `config show`
and the docs' config reference (docs/reference/config.md) all read. Every problem in a file is
reported at once, one line each, with the line of the YAML it comes from.

The resolved config is saved into the run directory and shipped to every worker as plain data,
and validated again there.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional, Sequence

from pydantic import Field, field_validator, model_validator

from raytrain_app.config.batching import batching, resize_problems
from raytrain_app.config.files import ConfigDoc, dumps, read_yaml, validated
from raytrain_app.config.sections import (
    SCRIPT_SECTIONS,
    CheckpointConfig,
    DataConfig,
    DDPConfig,
    FailureConfig,
    ModelConfig,
    OptimizerConfig,
    ScalingConfig,
    ScheduleConfig,
    ScriptConfig,
    Section,
    StrategyConfig,
    TaskConfig,
    TrackingConfig,
    TrainConfig,
)


class JobConfig(Section):
    name: str = Field("job", description="run name; the default run directory is runs/NAME-TIMESTAMP")
    seed: int = Field(0, description="model init uses it on every rank; dropout and augmentation use seed + rank")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    strategy: StrategyConfig = Field(default_factory=StrategyConfig)
    ddp: DDPConfig = Field(default_factory=DDPConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    failure: FailureConfig = Field(default_factory=FailureConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    script: Optional[ScriptConfig] = Field(None, description="run this script instead of the built-in loop "
                                                             "(`raytrain-app train SCRIPT.py -- ARGS` sets it)")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not value.strip() or "/" in value:
            raise ValueError("must be a non-empty name without '/'")
        return value

    @model_validator(mode="after")
    def _across_sections(self):
        problems = []
        if self.schedule.warmup_epochs > self.train.epochs:
            problems.append("schedule.warmup_epochs: must be at most train.epochs "
                            f"({self.train.epochs}), got {self.schedule.warmup_epochs:g}")
        several = self.scaling.max_workers > 1
        # torch.compile splits a DDP model's graph at DDP's buckets, the first of them 1 MiB, and
        # refuses smaller ones with an AssertionError deep in the first step.
        if self.train.compile != "off" and several and self.train.ddp_bucket_cap_mb < 1:
            problems.append("train.ddp_bucket_cap_mb: must be >= 1 when train.compile is on with more than one "
                            f"worker, got {self.train.ddp_bucket_cap_mb:g}")
        # torch's DDP with static_graph fails an internal assert on the first backward under
        # no_sync() (pytorch/pytorch#143580), and accumulation runs its micro-batches under no_sync().
        sizes = range(self.scaling.min_workers, self.scaling.max_workers + 1)
        steps = [batching(self.train, self.scaling, w) for w in sizes if w > 1]
        if self.train.ddp_static_graph and any(b and b.accum_steps > 1 for b in steps):
            problems.append("train.ddp_static_graph: must be false with train.grad_accum_steps > 1 and more than "
                            "one worker (torch's DDP cannot accumulate gradients under a static graph: "
                            "pytorch/pytorch#143580)")
        problems += resize_problems(self.train, self.scaling)
        problems += self._strategy_problems() + self._ray_data_problems()
        if self.script is not None:
            problems += [f"{key}: is not used with a script, which trains itself (a script takes "
                         f"{', '.join(SCRIPT_SECTIONS)})" for key in ("seed", "model", "data", "task", "optimizer",
                                                                    "schedule", "train", "strategy", "ddp", "tracking")
                         if getattr(self, key) != JobConfig.model_fields[key].get_default(call_default_factory=True)]
        reported = self.reported_metrics
        watched = [("checkpoint.metric", self.checkpoint.metric)]
        if self.train.early_stopping:
            watched.append(("train.early_stopping.metric", self.train.early_stopping.metric))
        for key, metric in watched:
            if reported is not None and metric not in ("auto", *reported):
                problems.append(f"{key}: {metric} is not a metric of this run (choose from {', '.join(reported)})")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def reported_metrics(self) -> Optional[tuple[str, ...]]:
        """What every epoch reports to rank checkpoints or trials by; None for a custom step."""
        names = self.task.metric_names
        return None if names is None else ("train_loss", "eval_loss", *(f"eval_{m}" for m in names))

    def _ray_data_problems(self) -> list[str]:
        if self.data.engine != "ray_data":
            return []
        problems = []
        if self.data.name != "parquet":
            problems.append(f"data.engine: ray_data reads Parquet only (data.name: parquet), not "
                            f"'{self.data.model_dump(mode='json')['name']}'")
        elif not self.data.args.get("eval_path"):
            problems.append("data.engine: ray_data needs data.args.eval_path: Ray Data reads whole files, so the "
                            "eval split cannot be held out of them")
        if self.checkpoint.every_steps:
            problems.append("checkpoint.every_steps: data.engine: ray_data resumes at epoch boundaries only (Ray "
                            "Data's order cannot be replayed), so it takes no mid-epoch checkpoints; use "
                            "data.engine: native with data.args.streaming: true for those")
        return problems

    def _strategy_problems(self) -> list[str]:
        st, s = self.strategy, self.scaling
        problems = []
        uneven = [w for w in range(s.min_workers, s.max_workers + 1)
                  if st.replicate_degree != "auto" and w % st.replicate_degree]
        if st.name == "hsdp" and uneven:
            problems.append(f"strategy.replicate_degree: {st.replicate_degree} does not divide the "
                            f"{' or '.join(map(str, uneven))} workers into equal shard groups")
        if st.sharded and st.cpu_offload and self.train.compile != "off":
            problems.append("strategy.cpu_offload: cannot be combined with train.compile (FSDP2 offloading moves "
                            "parameters outside the compiled graph): turn one of them off")
        if st.sharded and st.cpu_offload and self.scaling.gpus_per_worker == 0:
            problems.append("strategy.cpu_offload: needs GPU workers (it moves GPU memory to pinned CPU memory; on CPU "
                            "workers everything is in CPU memory already)")
        # Each strategy has its own way to send fewer bytes: the other's would be silently ignored.
        if st.sharded and self.ddp.comm_hook != "none":
            problems.append(f"ddp.comm_hook: applies to strategy ddp, not {st.name}, whose gradients are "
                            "reduce-scattered: set strategy.reduce_dtype instead")
        if not st.sharded and st.reduce_dtype != "auto":
            problems.append("strategy.reduce_dtype: applies to strategy fsdp or hsdp: under ddp set ddp.comm_hook "
                            "instead")
        if st.sharded and self.train.precision == "fp16":
            problems.append(f"train.precision: fp16 is not supported under strategy {st.name} (its loss scaler does "
                            "not see sharded gradients): use bf16")
        return problems

    def to_dict(self) -> dict:
        """Plain data, as a file holds it (builders given as functions become their import paths)."""
        return self.model_dump(mode="json")

    def to_python(self) -> dict:
        """Plain data that keeps builders given as functions: what workers and copies receive."""
        return self.model_dump()

    @classmethod
    def from_dict(cls, raw: Any, source: str = "<config>") -> "JobConfig":
        return validated(cls, ConfigDoc(raw, source))


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    """Read a YAML job file ("-": standard input), apply `key.sub=value` overrides, type-check."""
    return _with_overrides(read_yaml(path), overrides)


def with_overrides(raw: dict, overrides: Sequence[str] = (), source: str = "<config>") -> JobConfig:
    """A config from plain data, with `key.sub=value` overrides applied, type-checked."""
    return _with_overrides(ConfigDoc(copy.deepcopy(raw), source), overrides)


def _with_overrides(doc: ConfigDoc, overrides: Sequence[str]) -> JobConfig:
    defaults = JobConfig().to_dict()
    for expr in overrides:
        doc.override(expr, defaults)
    return validated(JobConfig, doc)


def updated(config: JobConfig, changes: dict, source: str = "<config>") -> JobConfig:
    """A copy with `changes` (nested sections as dicts) merged in, validated again."""
    return validated(JobConfig, ConfigDoc(_merge(config.to_python(), changes), source))


def nested(dotted: dict) -> dict:
    """{"a.b": 1, "a.c": 2} as {"a": {"b": 1, "c": 2}}: settings by dotted key, for `updated`."""
    tree: dict = {}
    for key, value in dotted.items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


FLAG_KEYS = {"workers": "scaling.workers", "gpus_per_worker": "scaling.gpus_per_worker",
             "max_failures": "failure.max_failures", "local": "scaling.local"}


# What --smoke sets, before the user's own --set (which may turn a tracker back on): one epoch of
# a few batches through every path (checkpoint, evaluation, report), no tracker runs to clean up.
SMOKE = ["train.epochs=1", "train.limit_batches=3", "train.limit_eval_batches=2", "checkpoint.every_steps=2",
         "tracking.tensorboard=false", "tracking.mlflow=null", "tracking.wandb=null"]


def flag_overrides(**flags) -> list[str]:
    """The `--set` expressions that the CLI's shortcut flags (--workers, --gpus-per-worker,
    --max-failures, --local/--ray) stand for; flags not given (None) set nothing."""
    return [f"{FLAG_KEYS[flag]}={value}" for flag, value in flags.items() if value is not None]


def dump_yaml(config: JobConfig) -> str:
    """The resolved config as YAML; a script's, only the sections that apply to it (SCRIPT_SECTIONS):
    the built-in loop's defaults say nothing of what a script did."""
    data = config.to_dict()
    if config.script:
        data = {**{key: data[key] for key in ("name", "script", "scaling", "failure")},
                "checkpoint": {"keep": data["checkpoint"]["keep"]}}
    return dumps(data)


def _merge(base: dict, changes: dict) -> dict:
    merged = dict(base)
    for key, value in changes.items():
        nested = isinstance(value, dict) and isinstance(base.get(key), dict)
        merged[key] = _merge(base[key], value) if nested else value
    return merged
