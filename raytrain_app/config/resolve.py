"""A config's choices made once, where a run launches: every `auto` decided for the hardware
it asks for, and data paths made absolute so that later commands mean the same files."""

from __future__ import annotations

import os

from raytrain_app.config import JobConfig, updated
from raytrain_app.config.sections import metric_mode

# The arguments of built-in datasets that name files; relative ones are relative to the launch directory.
DATA_PATHS = {"parquet": ("path", "eval_path"), "csv": ("path", "eval_path"), "mnist": ("root",),
              "fashion_mnist": ("root",), "cifar10": ("root",), "text": ("path",)}


# Set for a job whose working_dir Ray uploads (launch/submission.py), to the folder it came from.
SHIPPED_FROM_ENV = "RAYTRAIN_SHIPPED_FROM"


def absolute_paths(config: JobConfig) -> JobConfig:
    """The built-in datasets' local paths made absolute (URIs as they are), once, where the run
    launches: its config then means the same files to every later command, from any directory
    (`evaluate`, `--resume` of a copied config, a worker elsewhere). Checks ran on the paths as
    written, so their messages show them so.

    Not in a job that ships its working_dir: its driver and every worker run in a copy of the
    user's project folder, which Ray deletes with the cluster's session; made absolute, the run
    would name that copy. As written, they mean the project folder, where later commands run."""
    if os.environ.get(SHIPPED_FROM_ENV):
        return config
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
    shared = config.scaling.gpus_per_worker < 1 and config.scaling.max_workers > 1
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
