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

import inspect
import math
from abc import ABC, abstractmethod
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import default_collate

from raytrain_app.config import registry
from raytrain_app.config.sections import TaskConfig
from raytrain_app.data.arrays import ArrayDataset
from raytrain_app.errors import UserError

Sums = dict[str, torch.Tensor]


class Task(ABC):
    """The interface the loop calls; `move` puts a batch (tensors, or tuples, lists and dicts of
    them, nested) on the device in one go."""

    @abstractmethod
    def train_loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, int, dict]:
        """The mean loss to step on, how many samples it covers, and a custom step's own metrics
        as {name: (sum, count)} (built-in tasks report none while training)."""

    @abstractmethod
    def eval_sums(self, model: nn.Module, batch) -> Sums:
        ...

    @abstractmethod
    def metrics(self, sums: Sums) -> dict[str, float]:
        """From all-reduced sums: {"loss", "samples", and each metric}."""

    def move(self, batch, device: torch.device, memory_format: torch.memory_format):
        return to_device(batch, device)


def to_device(batch, device: torch.device, memory_format: torch.memory_format = torch.contiguous_format):
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 4 and memory_format is not torch.contiguous_format:
            return batch.to(device, non_blocking=True, memory_format=memory_format)
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device, memory_format) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, memory_format) for v in batch)
    return batch


class Supervised(Task):
    """(inputs, labels) batches and a model whose outputs the labels are scored against."""

    def __init__(self, config: TaskConfig):
        self.wanted = config.metric_names

    def move(self, batch, device, memory_format):
        x, y = batch
        return to_device(x, device, memory_format), y.to(device, non_blocking=True)

    def train_loss(self, model, batch):
        x, y = batch
        return self.loss(model(x), y), len(y), {}

    def eval_sums(self, model, batch):
        x, y = batch
        return self.sums(model(x).float(), y)

    @abstractmethod
    def loss(self, out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        ...

    @abstractmethod
    def sums(self, out: torch.Tensor, y: torch.Tensor) -> Sums:
        ...

    @abstractmethod
    def outputs(self, sample_label: torch.Tensor, num_classes: int) -> int:
        """How many outputs the model needs, from one label and the data's class count."""

    @abstractmethod
    def check_label(self, y: torch.Tensor, outputs: int, where: str) -> None:
        """Raise a one-line UserError when labels do not fit this task (checked on the driver)."""

    def check(self, model: nn.Module, train, eval_, model_name: str) -> None:
        """The model takes an input; then every label of in-memory datasets, else each split's
        first, fits: cross_entropy would fail later with a cryptic device assert, a regression
        with a silent broadcast."""
        outputs = call_model(model, eval_[0][0][None], model_name).shape[-1]
        for where, d in (("training", train), ("eval", eval_)):
            y = d.y if isinstance(d, ArrayDataset) else torch.as_tensor(d[0][1])[None]
            self.check_label(y, outputs, where)


class Classification(Supervised):
    """`weight` (task.class_weights, set by the loop once the labels are counted) makes the loss
    the weighted mean sum(w[y] * nll) / sum(w[y]), in training as in evaluation. `confusion`
    adds the confusion matrix to the evaluation sums, for `class_report`."""

    def __init__(self, config: TaskConfig, confusion: bool = False):
        super().__init__(config)
        self.label_smoothing = config.label_smoothing
        self.weight: Optional[torch.Tensor] = None
        self.confusion = confusion

    def loss(self, out, y, reduction="mean"):
        weight = None if self.weight is None else self.weight.to(out.device, out.dtype)
        return F.cross_entropy(out, y, weight=weight, label_smoothing=self.label_smoothing, reduction=reduction)

    def sums(self, out, y):
        s = {"loss": self.loss(out, y, "sum"), "samples": torch.tensor(float(len(y)), device=y.device)}
        if self.weight is not None:
            s["weights"] = self.weight.to(y.device)[y].double().sum()
        pred = out.argmax(1)
        if self.confusion:  # rows: true class, columns: predicted
            classes = out.shape[1]
            s["confusion"] = torch.bincount(y * classes + pred, minlength=classes * classes).reshape(classes, classes)
        if "accuracy" in self.wanted:
            s["correct"] = (pred == y).sum()
        if "top5" in self.wanted:
            s["top5"] = (out.topk(min(5, out.shape[1]), dim=1).indices == y[:, None]).any(1).sum()
        if "f1_macro" in self.wanted:
            s.update(f1_counts(F.one_hot(pred, out.shape[1]).bool(), F.one_hot(y, out.shape[1]).bool()))
        return s

    def metrics(self, s):
        n = float(s["samples"])
        m = {"loss": float(s["loss"]) / float(s.get("weights", n)), "samples": int(n)}
        if "accuracy" in self.wanted:
            m["accuracy"] = float(s["correct"]) / n
        if "top5" in self.wanted:
            m["top5"] = float(s["top5"]) / n
        if "f1_macro" in self.wanted:
            m["f1_macro"] = f1_macro(s)
        return m

    def outputs(self, sample_label, num_classes):
        self._check_type(sample_label[None], "training")  # before a model is built for float labels
        return num_classes

    def check_label(self, y, outputs, where):
        self._check_type(y, where)
        if y.dim() != 1:
            raise UserError(f"{where} labels have shape {tuple(y.shape[1:])} per sample: task classification needs "
                            f"one class id per sample; use task.name: multilabel for several labels")
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= outputs:
            raise UserError(f"{where} labels range over [{lo}, {hi}] but the model has {outputs} outputs")

    @staticmethod
    def _check_type(y: torch.Tensor, where: str) -> None:
        if y.is_floating_point():
            raise UserError(f"{where} labels are floats (e.g. {y.flatten()[0].item():g}): task classification "
                            f"needs integer class ids; use task.name: regression for real-valued targets")


class Regression(Supervised):
    """Real-valued targets, one per sample or a vector; R² is averaged over outputs, as
    scikit-learn's r2_score does by default."""

    def __init__(self, config: TaskConfig):
        super().__init__(config)
        self.kind = "mse" if config.loss == "auto" else config.loss

    def loss(self, out, y, reduction="mean"):
        out = out.reshape(y.shape).float() if out.dim() != y.dim() else out.float()
        fn = {"mse": F.mse_loss, "l1": F.l1_loss, "huber": F.huber_loss}[self.kind]
        return fn(out, y.float(), reduction=reduction)

    def sums(self, out, y):
        y = y.float()
        y2d = y if y.dim() == 2 else y[:, None]
        residual = out.reshape(y2d.shape) - y2d
        return {"loss": self.loss(out, y, "sum"), "samples": torch.tensor(float(len(y)), device=y.device),
                "y": y2d.sum(0, dtype=torch.float64), "y2": y2d.double().pow(2).sum(0),
                "residual2": residual.double().pow(2).sum(0), "abs_residual": residual.double().abs().sum(0)}

    def metrics(self, s):
        n = float(s["samples"])
        k = s["y"].numel()
        m = {"loss": float(s["loss"]) / (n * k), "samples": int(n)}
        if "mse" in self.wanted:
            m["mse"] = float(s["residual2"].sum()) / (n * k)
        if "mae" in self.wanted:
            m["mae"] = float(s["abs_residual"].sum()) / (n * k)
        if "r2" in self.wanted:
            total = s["y2"] - s["y"] ** 2 / n  # n x the variance of each output
            m["r2"] = float((1 - s["residual2"] / total.clamp_min(1e-12)).mean())
        return m

    def outputs(self, sample_label, num_classes):
        return 1 if sample_label.dim() == 0 else sample_label.shape[0]

    def check_label(self, y, outputs, where):
        width = 1 if y.dim() == 1 else y.shape[1]
        if y.dim() > 2 or width != outputs:
            raise UserError(f"{where} targets have {width} values per sample but the model has {outputs} outputs")


class Multilabel(Supervised):
    """Several independent yes/no labels per sample, given as a 0/1 vector; the model's outputs
    are logits. accuracy is the share of label decisions that are right."""

    def loss(self, out, y, reduction="mean"):
        return F.binary_cross_entropy_with_logits(out.float(), y.float(), reduction=reduction)

    def sums(self, out, y):
        pred, truth = out > 0, y > 0.5
        s = {"loss": self.loss(out, y, "sum"), "samples": torch.tensor(float(len(y)), device=y.device),
             "decisions": torch.tensor(float(y.numel()), device=y.device), "correct": (pred == truth).sum()}
        if "f1_macro" in self.wanted:
            s.update(f1_counts(pred, truth))
        return s

    def metrics(self, s):
        decisions = float(s["decisions"])
        m = {"loss": float(s["loss"]) / decisions, "samples": int(s["samples"])}
        if "accuracy" in self.wanted:
            m["accuracy"] = float(s["correct"]) / decisions
        if "f1_macro" in self.wanted:
            m["f1_macro"] = f1_macro(s, every_label=True)
        return m

    def outputs(self, sample_label, num_classes):
        return sample_label.shape[0] if sample_label.dim() == 1 else 1

    def check_label(self, y, outputs, where):
        if y.dim() != 2:
            raise UserError(f"{where} labels have shape {tuple(y.shape[1:])} per sample: task multilabel needs a "
                            f"0/1 vector of labels per sample")
        if y.shape[1] != outputs:
            raise UserError(f"{where} labels have {y.shape[1]} entries per sample but the model has {outputs} "
                            f"outputs")
        if not bool(((y == 0) | (y == 1)).all()):
            raise UserError(f"{where} labels must be 0 or 1 for task multilabel")


class LanguageModel(Task):
    """Batches of (B, T + 1) token ids; the model maps ids to (B, T, vocab) logits and is scored
    on predicting every next token. perplexity is exp of the mean per-token cross-entropy."""

    def __init__(self, config: TaskConfig):
        self.wanted = config.metric_names
        self.label_smoothing = config.label_smoothing

    def _logits(self, model, ids):
        return model(ids[:, :-1]), ids[:, 1:]

    def train_loss(self, model, batch):
        logits, target = self._logits(model, batch)
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), label_smoothing=self.label_smoothing)
        return loss, len(batch), {}

    def eval_sums(self, model, batch):
        logits, target = self._logits(model, batch)
        logits, target = logits.flatten(0, 1).float(), target.flatten()
        s = {"loss": F.cross_entropy(logits, target, label_smoothing=self.label_smoothing, reduction="sum"),
             "nll": F.cross_entropy(logits, target, reduction="sum"),
             "tokens": torch.tensor(float(target.numel()), device=target.device),
             "samples": torch.tensor(float(len(batch)), device=target.device)}
        if "token_accuracy" in self.wanted:
            s["correct"] = (logits.argmax(1) == target).sum()
        return s

    def metrics(self, s):
        tokens = float(s["tokens"])
        m = {"loss": float(s["loss"]) / tokens, "samples": int(s["samples"])}
        if "perplexity" in self.wanted:
            m["perplexity"] = math.exp(float(s["nll"]) / tokens)
        if "token_accuracy" in self.wanted:
            m["token_accuracy"] = float(s["correct"]) / tokens
        return m

    @staticmethod
    def outputs(sample, num_classes: Optional[int]) -> int:
        """The vocabulary, once the sample is known to be 1-D integer token ids at least 2 long."""
        if not (isinstance(sample, torch.Tensor) and sample.dim() == 1 and not sample.is_floating_point()
                and len(sample) >= 2):
            shape = tuple(sample.shape) if isinstance(sample, torch.Tensor) else type(sample).__name__
            raise UserError(f"task language_model needs samples of integer token ids shaped (T + 1,), got {shape}")
        if num_classes is None:
            raise UserError("task language_model needs the vocabulary's size: give the training dataset a "
                            "`num_classes` attribute (data: text has 256)")
        return num_classes

    def check(self, model: nn.Module, train, eval_, model_name: str) -> None:
        """The model maps ids to logits over a vocabulary that holds every token id."""
        sample = train[0]
        logits = call_model(model, torch.zeros_like(sample[None, :-1]), model_name)  # id 0 fits any vocabulary
        if logits.dim() != 3 or logits.shape[:2] != (1, len(sample) - 1):
            raise UserError(f"model '{model_name}' must map (B, T) token ids to (B, T, vocab) logits for task "
                            f"language_model; it returned shape {tuple(logits.shape)}")
        for where, d in (("training", train), ("eval", eval_)):
            ids = getattr(d, "tokens", d[0])
            if int(ids.max()) >= logits.shape[-1] or int(ids.min()) < 0:
                raise UserError(f"{where} token ids range over [{int(ids.min())}, {int(ids.max())}] but the model's "
                                f"vocabulary has {logits.shape[-1]} entries")


def call_model(model: nn.Module, x, model_name: str) -> torch.Tensor:
    """The model's output for one input on the driver, or a one-line error naming the input's shape."""
    model.eval()
    try:
        with torch.no_grad():
            return model(x)
    except Exception as e:  # noqa: BLE001 - the user's model refusing the data is theirs to fix, in one line
        raise UserError(f"model '{model_name}' cannot take the data's inputs shaped {tuple(x.shape[1:])}: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def f1_counts(pred: torch.Tensor, truth: torch.Tensor) -> Sums:
    """Per-class true positives, false positives and false negatives of (samples, classes) booleans."""
    return {"tp": (pred & truth).sum(0), "fp": (pred & ~truth).sum(0), "fn": (~pred & truth).sum(0)}


def f1_macro(s: Sums, every_label: bool = False) -> float:
    """The mean F1 over classes, as scikit-learn's f1_score(average="macro") takes it: for
    classification the classes that occur in the labels or predictions; for multi-label data
    `every_label` column, one never positive nor predicted scoring 0."""
    tp, fp, fn = s["tp"].double(), s["fp"].double(), s["fn"].double()
    denominator = 2 * tp + fp + fn
    f1 = torch.where(denominator > 0, 2 * tp / denominator.clamp_min(1), 0.0)
    scored = f1 if every_label else f1[denominator > 0]
    return float(scored.mean()) if scored.numel() else 0.0


def class_weights(setting, counts: torch.Tensor) -> torch.Tensor:
    """task.class_weights as one weight per class: as given, or for `auto` samples / (classes x the
    class's samples), scikit-learn's "balanced" (0 for a class no training sample has)."""
    if setting != "auto":
        return torch.tensor(setting, dtype=torch.float32)
    counts = counts.double()
    return torch.where(counts > 0, counts.sum() / (len(counts) * counts.clamp_min(1)), 0.0).float()


def class_report(s: Sums) -> dict:
    """Per-class precision, recall, F1 and support, and the confusion matrix (rows: true class,
    columns: predicted), from all-reduced evaluation sums of a Classification(confusion=True)."""
    confusion = s["confusion"].long().cpu()
    tp = confusion.diag().double()
    predicted, support = confusion.sum(0).double(), confusion.sum(1).double()
    precision = torch.where(predicted > 0, tp / predicted.clamp_min(1), 0.0)
    recall = torch.where(support > 0, tp / support.clamp_min(1), 0.0)
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp_min(1e-12), 0.0)
    return {"precision": precision.tolist(), "recall": recall.tolist(), "f1": f1.tolist(),
            "support": support.long().tolist(), "confusion": confusion.tolist()}


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


def batch_size(batch) -> int:
    """The first dimension of the batch's first tensor, however nested."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        n = batch_size(v)
        if n:
            return n
    return 0


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


def model_outputs(task: Task, train, num_classes: Optional[int]) -> Optional[int]:
    """The model's output width: the task's, from a label; otherwise the data's class count (a
    language model's vocabulary; None for a custom step's data that declares none)."""
    if isinstance(task, Supervised):
        return task.outputs(torch.as_tensor(train[0][1]), num_classes)
    if isinstance(task, LanguageModel):
        return task.outputs(train[0], num_classes)
    return num_classes
