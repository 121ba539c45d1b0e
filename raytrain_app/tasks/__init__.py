"""Tasks: what a training step optimises and what evaluation measures (the job's `task:`).

A task turns a batch into a training loss, and into *sums* for evaluation: correct predictions,
per-class true and false positives and false negatives, the sums of y, y² and squared residuals.
The loop adds the sums over this rank's eval shard, all-reduces them once and only then divides,
so every metric is exact over all ranks and every eval sample once. An average of per-rank
averages is not (ranks hold different numbers of samples), and F1 and R² are no averages at all.

A custom step (`task.name: "pkg.module:step"`) is called as `step(model, batch)` and returns the
loss, or `(loss, {name: (sum, count)})`: its metrics are sums too, reported as sum / count.
"""

from __future__ import annotations

from typing import Optional

import torch

from raytrain_app.config import registry
from raytrain_app.config.sections import TaskConfig
from raytrain_app.tasks.base import Task
from raytrain_app.tasks.custom import CustomStep, check_step_signature
from raytrain_app.tasks.language import LanguageModel
from raytrain_app.tasks.supervised import Classification, Multilabel, Regression, Supervised


def build_task(config: TaskConfig) -> Task:
    if not config.custom:
        return {"classification": Classification, "regression": Regression, "multilabel": Multilabel,
                "language_model": LanguageModel}[config.name](config)
    step = registry.resolve(config.name, {}, "task.name")
    eval_step = registry.resolve(config.eval_step, {}, "task.eval_step") if config.eval_step is not None else None
    for key, fn in (("task.name", step), ("task.eval_step", eval_step)):
        if fn is not None:
            check_step_signature(fn, key)
    return CustomStep(step, eval_step)


def model_outputs(task: Task, train, num_classes: Optional[int]) -> Optional[int]:
    """The model's output width: the task's, from a label; otherwise the data's class count (a
    language model's vocabulary; None for a custom step's data that declares none)."""
    if isinstance(task, Supervised):
        return task.outputs(torch.as_tensor(train[0][1]), num_classes)
    if isinstance(task, LanguageModel):
        return task.outputs(train[0], num_classes)
    return num_classes
