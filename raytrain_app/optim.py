"""Optimizer and per-step LR schedule (linear warmup, then cosine or constant)."""

from __future__ import annotations

import contextlib
import math

import torch

from raytrain_app.config import OptimizerConfig, ScheduleConfig


def build_optimizer(params, config: OptimizerConfig, world_size: int) -> torch.optim.Optimizer:
    # Linear scaling (Goyal et al.): with the per-worker batch fixed, W workers take W times
    # larger global steps, so the LR grows with them.
    lr = config.lr * (world_size if config.scale_lr == "linear" else 1)
    if config.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=config.momentum, nesterov=config.nesterov,
                               weight_decay=config.weight_decay)
    cls = torch.optim.Adam if config.name == "adam" else torch.optim.AdamW
    return cls(params, lr=lr, betas=config.betas, weight_decay=config.weight_decay)


def build_schedule(optimizer, config: ScheduleConfig, steps_per_epoch: int, epochs: int):
    """A LambdaLR stepped once per optimizer step, so warmup and decay are smooth within epochs."""
    total = max(1, steps_per_epoch * epochs)
    warmup = round(config.warmup_epochs * steps_per_epoch)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if config.name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@contextlib.contextmanager
def configured_hyperparameters(optimizer: torch.optim.Optimizer, scheduler):
    """Restore saved optimizer and schedule state inside this block (momentum buffers, step
    counts, position in the schedule); the config's hyper-parameters win afterwards: a resumed
    run reads its config again, so `--set optimizer.lr=...` applies from the restored step on,
    e.g. to continue below the lr at which a loss went NaN."""
    configured = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    base_lrs = list(scheduler.base_lrs)
    try:
        yield
    finally:  # also after a load that failed midway: the next checkpoint tried must see the config's values
        scheduler.base_lrs = base_lrs
        for group, hyper, factor in zip(optimizer.param_groups, configured, scheduler.lr_lambdas):
            group.update(hyper)
            group["lr"] = group["initial_lr"] * factor(scheduler.last_epoch)
