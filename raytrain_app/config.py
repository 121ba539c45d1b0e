"""The typed job config: one dataclass per concern, loaded from YAML with `--set` overrides.

Everything a run does is decided here, before Ray starts, so a typo costs a second and a
clear message instead of a cluster start and a worker traceback. The resolved config is
saved into the run directory and shipped to every worker as a plain dict.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from raytrain_app import yamlfile
from raytrain_app.errors import ConfigError


@dataclass
class ModelConfig:
    # A built-in name (lenet, mlp, resnet18) or an import path "pkg.module:build".
    name: str = "lenet"
    # Keyword arguments for the builder; checked against its signature.
    args: dict = field(default_factory=dict)


@dataclass
class DataConfig:
    # A built-in name (digits, mnist, fashion_mnist, cifar10, parquet, synthetic) or "pkg.module:build".
    name: str = "digits"
    args: dict = field(default_factory=dict)
    # Datasets without their own test split are split with this fraction and seed.
    eval_fraction: float = 0.2
    split_seed: int = 0
    # DataLoader worker processes per training worker (0: load in the training process; null:
    # sized to the machine, none for in-memory datasets).
    loader_workers: Optional[int] = None
    # Hold an in-memory dataset on the training device (uint8, normalised and augmented there);
    # auto: on GPUs when it fits in a quarter of the GPU's memory.
    on_device: Literal["auto", "on", "off"] = "auto"


@dataclass
class OptimizerConfig:
    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    # "linear": multiply lr by the world size (the per-worker batch is fixed, so the global batch grows).
    scale_lr: Literal["none", "linear"] = "none"


@dataclass
class ScheduleConfig:
    name: Literal["cosine", "constant"] = "cosine"
    warmup_epochs: float = 0.0
    # The cosine decays to lr * min_lr_ratio.
    min_lr_ratio: float = 0.0


@dataclass
class TrainConfig:
    epochs: int = 10
    # Per-worker batch size; the global batch is batch_size * workers * grad_accum_steps.
    batch_size: int = 64
    eval_batch_size: int = 256
    # auto: bf16 autocast on GPUs, fp32 on CPUs.
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    grad_accum_steps: int = 1
    # Max global gradient norm; null disables clipping.
    grad_clip: Optional[float] = None
    sync_batchnorm: bool = False
    compile: Literal["off", "default", "reduce-overhead", "max-autotune"] = "off"
    # channels_last memory format for conv nets; auto: on for GPU workers.
    channels_last: Literal["auto", "on", "off"] = "auto"
    # DDP gradient buckets (MB); larger buckets mean fewer, bigger all-reduces.
    ddp_bucket_cap_mb: float = 25.0
    # DDP static graph: valid when every step uses the same parameters (no unused branches).
    ddp_static_graph: bool = False
    # Stop at the first non-finite training loss (all ranks at one step, exit code 1), keeping the
    # last good checkpoint as the latest; false trains on.
    stop_on_nonfinite: bool = True


@dataclass
class CheckpointConfig:
    every_epochs: int = 1
    # Also checkpoint every N optimizer steps (0: only at epoch ends); resumes mid-epoch exactly.
    every_steps: int = 0
    # Keep the best `keep` checkpoints by `metric` (the latest is always kept too).
    keep: int = 2
    metric: Literal["eval_accuracy", "eval_loss", "train_loss"] = "eval_accuracy"
    mode: Literal["max", "min"] = "max"


@dataclass
class ScalingConfig:
    workers: int = 2
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0
    # auto: nccl when workers have GPUs, gloo otherwise.
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    # Seconds a collective may wait before the process group gives up.
    timeout_s: int = 600
    # How Ray places workers on nodes: PACK fills nodes in turn, SPREAD deals workers out across them.
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"


@dataclass
class FailureConfig:
    # Worker-group restarts Ray Train may make before the run fails.
    max_failures: int = 0


@dataclass
class JobConfig:
    name: str = "job"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)

    def to_dict(self) -> dict:
        return _plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, raw: Any, source: str = "<config>") -> "JobConfig":
        config = _build(cls, raw, "", source)
        validate(config, _RULES, source)
        return config


# Checks that types alone cannot express. Each is (key, predicate, what the value must be).
_RULES: list[tuple[str, typing.Callable[[Any], bool], str]] = [
    ("name", lambda c: bool(c.name.strip()) and "/" not in c.name, "a non-empty name without '/'"),
    ("data.eval_fraction", lambda c: 0.0 < c.data.eval_fraction < 1.0, "between 0 and 1"),
    ("data.loader_workers", lambda c: c.data.loader_workers is None or c.data.loader_workers >= 0, ">= 0 or null"),
    ("optimizer.lr", lambda c: c.optimizer.lr > 0, "> 0"),
    ("optimizer.momentum", lambda c: 0 <= c.optimizer.momentum < 1, "in [0, 1)"),
    ("optimizer.weight_decay", lambda c: c.optimizer.weight_decay >= 0, ">= 0"),
    ("optimizer.betas", lambda c: all(0 <= b < 1 for b in c.optimizer.betas), "two values in [0, 1)"),
    ("optimizer.nesterov", lambda c: not c.optimizer.nesterov or (c.optimizer.name == "sgd" and c.optimizer.momentum > 0),
     "used only with sgd and momentum > 0"),
    ("train.epochs", lambda c: c.train.epochs >= 1, ">= 1"),
    ("train.batch_size", lambda c: c.train.batch_size >= 1, ">= 1"),
    ("train.eval_batch_size", lambda c: c.train.eval_batch_size >= 1, ">= 1"),
    ("train.grad_accum_steps", lambda c: c.train.grad_accum_steps >= 1, ">= 1"),
    ("train.grad_clip", lambda c: c.train.grad_clip is None or c.train.grad_clip > 0, "> 0 or null"),
    ("train.ddp_bucket_cap_mb", lambda c: c.train.ddp_bucket_cap_mb > 0, "> 0"),
    # torch.compile splits a DDP model's graph at DDP's buckets, the first of them 1 MiB, and
    # refuses smaller buckets with an AssertionError deep in the first step.
    ("train.ddp_bucket_cap_mb",
     lambda c: c.train.compile == "off" or c.scaling.workers == 1 or c.train.ddp_bucket_cap_mb >= 1,
     ">= 1 when train.compile is on with more than one worker"),
    # torch's DDP with static_graph fails an internal assert on the first backward under no_sync()
    # (pytorch/pytorch#143580), and gradient accumulation runs its micro-batches under no_sync().
    ("train.ddp_static_graph",
     lambda c: not c.train.ddp_static_graph or c.train.grad_accum_steps == 1 or c.scaling.workers == 1,
     "false with train.grad_accum_steps > 1 and more than one worker (torch's DDP cannot accumulate "
     "gradients under a static graph: pytorch/pytorch#143580)"),
    ("schedule.warmup_epochs", lambda c: 0 <= c.schedule.warmup_epochs <= c.train.epochs, "in [0, train.epochs]"),
    ("schedule.min_lr_ratio", lambda c: 0 <= c.schedule.min_lr_ratio <= 1, "in [0, 1]"),
    ("checkpoint.every_epochs", lambda c: c.checkpoint.every_epochs >= 1, ">= 1"),
    ("checkpoint.keep", lambda c: c.checkpoint.keep >= 1, ">= 1"),
    ("checkpoint.every_steps", lambda c: c.checkpoint.every_steps >= 0, ">= 0"),
    ("scaling.workers", lambda c: c.scaling.workers >= 1, ">= 1"),
    ("scaling.gpus_per_worker", lambda c: c.scaling.gpus_per_worker >= 0, ">= 0"),
    ("scaling.cpus_per_worker", lambda c: c.scaling.cpus_per_worker > 0, "> 0"),
    ("scaling.backend", lambda c: c.scaling.backend != "nccl" or c.scaling.gpus_per_worker > 0,
     "gloo or auto when scaling.gpus_per_worker is 0 (nccl needs GPUs)"),
    ("scaling.timeout_s", lambda c: c.scaling.timeout_s >= 1, ">= 1"),
    ("failure.max_failures", lambda c: c.failure.max_failures >= -1, ">= 0, or -1 for unlimited"),
]


def validate(config: Any, rules: list, source: str) -> None:
    """Apply (key, predicate, what the value must be) rules; the first that fails is the error."""
    for key, ok, must in rules:
        if not ok(config):
            value = config
            for part in key.split("."):
                value = getattr(value, part)
            raise ConfigError(f"{source}: {key} must be {must}, got {_show(value)}")


def load_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> JobConfig:
    """Read a YAML job file, apply `key.sub=value` overrides, and type-check the result."""
    raw, source = read_yaml(path)
    for expr in overrides:
        apply_override(raw, expr, source)
    return JobConfig.from_dict(raw, source)


def read_yaml(path: str | Path) -> tuple[dict, str]:
    """The top-level mapping of a YAML file ("-": standard input), or a ConfigError naming the file and problem."""
    source = str(path)
    try:
        text = sys.stdin.read() if source == "-" else Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {source}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {source}: {e}") from None
    try:
        raw = yamlfile.loads(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{source}: malformed YAML{where}: {problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {_kind(raw)}")
    return raw, source


def parse(cls: type, raw: dict, source: str):
    """Build dataclass `cls` from a raw mapping with the same checks as the job config."""
    return _build(cls, raw, "", source)


def apply_override(raw: dict, expr: str, source: str) -> None:
    """Apply one `a.b.c=value` to the raw dict; the value is parsed as YAML (`3`, `true`, `[1, 2]`)."""
    key, sep, text = expr.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or not all(p.strip() for p in parts):
        raise ConfigError(f"bad --set expression {expr!r}: expected KEY=VALUE, e.g. train.epochs=5")
    try:
        value = yamlfile.loads(text) if text.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"bad --set expression {expr!r}: the value is not valid YAML") from None
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: --set {key}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def dump_yaml(config: JobConfig) -> str:
    return yamlfile.dumps(config.to_dict())


# ---- typed construction -------------------------------------------------------------------


def _build(cls: type, raw: Any, prefix: str, source: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'config'} must be a mapping, got {_kind(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(f"{source}: unknown key '{prefix}{key}'{hint}")
    values = {name: _coerce(hints[name], raw[name], prefix + name, source) for name in fields if name in raw}
    return cls(**values)


def _coerce(tp: Any, value: Any, key: str, source: str) -> Any:
    """Check `value` against the annotation `tp`, converting only where no information is lost."""
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".", source)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, key, source)
    if origin is Literal:
        if isinstance(value, bool) and {"on", "off"} <= set(args):
            value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as true/false
        if value not in args:
            choices = ", ".join(str(a) for a in args)
            raise ConfigError(f"{source}: {key} must be one of {choices}; got {_show(value)}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{source}: {key} must be a list of {len(args)} values, got {_show(value)}")
        return tuple(_coerce(a, v, f"{key}[{i}]", source) for i, (a, v) in enumerate(zip(args, value)))
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a mapping, got {_kind(value)}")
        return value
    return check_scalar(tp, value, key, source)


def check_scalar(tp: type, value: Any, key: str, source: str) -> Any:
    """bool, int, float and str, strictly: no `True` for an int, no "3" for a float."""
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
        value = float(value) if ok else value
    elif tp is str:
        ok = isinstance(value, str)
    else:
        ok = isinstance(value, tp)
    if not ok:
        where = f"{source}: " if source else ""
        raise ConfigError(f"{where}{key} must be {_TYPE_NAMES.get(tp, tp.__name__)}, got {_show(value)}")
    return value


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "nothing"}.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _plain(value: Any) -> Any:
    """Tuples become lists so the YAML dump stays readable and safe_load can read it back."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
