"""Tasks with a label per sample: classification (accuracy, top-5, macro F1, per-class scores),
regression (MSE, MAE, R²) and multi-label (per-label F1), each from all-reduced sums."""

from __future__ import annotations

from abc import abstractmethod
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from raytrain_app.config.sections import TaskConfig
from raytrain_app.data.arrays import ArrayDataset
from raytrain_app.errors import UserError
from raytrain_app.tasks.base import Sums, Task, call_model, to_device


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


def class_report(s: Sums, names: Optional[list[str]] = None) -> dict:
    """Per-class precision, recall, F1 and support, and the confusion matrix (rows: true class,
    columns: predicted), from all-reduced evaluation sums of a Classification(confusion=True);
    with the classes' `names` first, where the labels were names."""
    confusion = s["confusion"].long().cpu()
    tp = confusion.diag().double()
    predicted, support = confusion.sum(0).double(), confusion.sum(1).double()
    precision = torch.where(predicted > 0, tp / predicted.clamp_min(1), 0.0)
    recall = torch.where(support > 0, tp / support.clamp_min(1), 0.0)
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp_min(1e-12), 0.0)
    return {**({"names": list(names)} if names else {}), "precision": precision.tolist(),
            "recall": recall.tolist(), "f1": f1.tolist(), "support": support.long().tolist(),
            "confusion": confusion.tolist()}
