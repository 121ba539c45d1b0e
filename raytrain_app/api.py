"""The library's entry points: `fit` trains a job the way `raytrain-app train` does, and
`load_model` gives back a trained model for inference.

config -> plan (auto choices, run directory, checks on this machine) -> a Ray cluster (embedded,
joined, or at an address) -> Ray Train -> the result. The CLI is a thin layer over this.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from raytrain_app.config import JobConfig, load_config, with_overrides
from raytrain_app.errors import UserError


def fit(config: Union[str, Path, dict, JobConfig], *, overrides: Optional[Sequence[str]] = None,
        workers: Optional[int] = None, gpus_per_worker: Optional[float] = None, run_dir: Optional[str] = None,
        address: Optional[str] = None, resume: bool = False, verbose: bool = False, progress: bool = False,
        echo: Callable[[str], None] = print, started: Optional[float] = None):
    """Train `config` (a YAML path, "-" for standard input, a dict, or a JobConfig) and return the
    run's `Result` (run_dir, metrics per epoch, best and final checkpoint, wall time).

    In a dict or JobConfig, `model.name` and `data.name` may be the builder functions themselves
    (a notebook's, say). `overrides` are `--set` expressions; `workers`/`gpus_per_worker` set the
    scaling; `address` picks the cluster as `--address` does, and a process already connected to
    Ray (`ray.init()` done) trains there; `echo` receives the console lines. Raises UserError
    (ConfigError) for anything the user can fix, TrainingFailed when training started and did not
    finish.
    """
    marks = {"start": started or time.time()}
    scaling = {k: v for k, v in (("workers", workers), ("gpus_per_worker", gpus_per_worker)) if v is not None}
    sets = [*(overrides or ()), *(f"scaling.{key}={value}" for key, value in scaling.items())]
    if isinstance(config, (str, Path)):
        source, job = str(config), load_config(config, sets)
    else:
        raw = config.to_python() if isinstance(config, JobConfig) else config
        source, job = "<config>", with_overrides(raw, sets)
    # torch and Ray load only now: a config error is reported in a fraction of a second, and
    # Ray reads its auth settings when it loads, after the cluster choice has set them.
    from raytrain_app.plan import make_plan
    from raytrain_app.session import choose_cluster, ray_session

    plan = make_plan(job, run_dir=run_dir, resume=resume, source=source)
    marks["planned"] = time.time()
    s = plan.config.scaling
    echo(f"run {plan.run_dir}: {s.workers} workers, {s.backend}, {plan.config.train.precision}")
    choice = choose_cluster(address, s.workers, s.cpus_per_worker, s.gpus_per_worker)
    if choice.note:
        echo(choice.note)
    try:
        with ray_session(choice, max(os.cpu_count() or 1, int(s.workers * s.cpus_per_worker + 0.999)),
                         plan.log_dir, verbose):
            from raytrain_app.trainer import run_training

            marks["cluster"] = time.time()
            return run_training(plan, progress=progress, echo=echo, marks=marks)
    finally:
        plan.upload_logs()


def load_model(checkpoint_or_run_dir: str, model: Optional[Callable] = None):
    """The trained model, weights loaded and in eval mode, from a checkpoint directory or a run
    directory (its newest checkpoint); local paths or URIs.

    The model is rebuilt from the config and input shape saved in the checkpoint; `model` is the
    builder to use instead of the saved name (needed when training was given a notebook's function).
    """
    from raytrain_app import checkpoint
    from raytrain_app.models import build_model

    directory = checkpoint.find(str(checkpoint_or_run_dir))
    saved = checkpoint.load_state(directory)
    if "input_shape" not in saved:
        raise UserError(f"{directory} was written by an older raytrain-app that did not record the model's inputs")
    config = JobConfig.from_dict(saved["config"], source=directory).model
    built = build_model(config.model_copy(update={"name": model}) if model else config, saved["input_shape"],
                        saved["num_classes"])
    built.load_state_dict(saved["model"])
    return built.eval()
