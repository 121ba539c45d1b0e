"""Character-level language modelling: next-token cross-entropy, perplexity and token accuracy."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from raytrain_app.config.sections import TaskConfig
from raytrain_app.errors import UserError
from raytrain_app.tasks.base import Task, call_model


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
