"""A user's own training step (`task.name: "pkg.module:step"`), its metrics as (sum, count) pairs."""

from __future__ import annotations

import inspect
from typing import Callable, Optional

import torch
from torch import nn
from torch.utils.data import default_collate

from raytrain_app.config import registry
from raytrain_app.errors import UserError
from raytrain_app.tasks.base import Task, batch_size


class CustomStep(Task):
    """The user's `step(model, batch)`, inside the loop's AMP, accumulation, clipping and
    checkpointing; `eval_step` (or the step itself, without gradients) for evaluation."""

    def __init__(self, step: Callable, eval_step: Optional[Callable] = None):
        self.step, self.eval_step = step, eval_step or step

    def train_loss(self, model, batch):
        loss, named = self._call(self.step, model, batch)
        return loss, batch_size(batch), named

    def eval_sums(self, model, batch):
        loss, named = self._call(self.eval_step, model, batch)
        n = batch_size(batch)
        device = loss.device
        s = {"loss": loss.detach().double() * n, "samples": torch.tensor(float(n), device=device)}
        for name, (total, count) in named.items():
            s[f"{name}.sum"] = torch.as_tensor(total, dtype=torch.float64, device=device).detach()
            s[f"{name}.count"] = torch.as_tensor(count, dtype=torch.float64, device=device)
        return s

    def metrics(self, s):
        n = float(s["samples"])
        m = {"loss": float(s["loss"]) / n, "samples": int(n)}
        for key in s:
            if key.endswith(".sum"):
                name = key[: -len(".sum")]
                m[name] = float(s[key]) / max(float(s[f"{name}.count"]), 1e-12)
        return m

    @staticmethod
    def _call(fn: Callable, model, batch) -> tuple[torch.Tensor, dict]:
        out = fn(model, batch)
        loss, named = (out[0], out[1]) if isinstance(out, tuple) else (out, {})
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise UserError(f"task: '{registry.label(fn)}' must return a scalar loss tensor, or (loss, "
                            f"{{name: (sum, count)}}); got {type(loss).__name__}")
        if not (isinstance(named, dict) and all(isinstance(v, tuple) and len(v) == 2 for v in named.values())):
            raise UserError(f"task: '{registry.label(fn)}' must return its metrics as {{name: (sum, count)}}")
        return loss, named


def check_step_signature(fn: Callable, key: str) -> None:
    try:
        signature = inspect.signature(fn)
    except ValueError:  # no signature to read (a builtin): the driver's trial call decides
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise UserError(f"{key}: '{registry.label(fn)}' must take (model, batch), its signature is "
                        f"{signature}") from None


def custom_metric_names(task: CustomStep, model: nn.Module, train) -> list[str]:
    """Run the custom step's evaluation once on two training samples, on the driver: it fails
    here in one line rather than on every worker, and its metric names are known before start."""
    batch = default_collate([train[i] for i in range(min(2, len(train)))])
    try:
        with torch.no_grad():
            sums = task.eval_sums(model, batch)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's step failing is theirs to fix, in one line
        raise UserError(f"task: '{registry.label(task.eval_step)}' failed on a batch of 2 training samples: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    return [k[: -len(".sum")] for k in sums if k.endswith(".sum")]
