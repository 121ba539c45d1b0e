"""Optimizer and per-step LR schedule (linear warmup, then cosine or constant)."""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch

from raytrain_app.config.sections import OptimizerConfig, ScheduleConfig


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
    return torch.optim.lr_scheduler.LambdaLR(optimizer, Schedule(config, steps_per_epoch, epochs))


class Schedule:
    """The LR factor per optimizer step: linear warmup, then cosine (or constant) to the planned
    last step. A run resumed with more (or fewer) steps planned moves that last step (`extend`).
    Its attributes are plain numbers, which LambdaLR saves in its state_dict and restores, so the
    curve a run was on comes back with its checkpoint."""

    CONFIGURED = ("name", "min_ratio", "warmup")  # the config's, also after a restore: --set applies on resume

    def __init__(self, config: ScheduleConfig, steps_per_epoch: int, epochs: int):
        self.name, self.min_ratio = config.name, config.min_lr_ratio
        self.warmup = round(config.warmup_epochs * steps_per_epoch)
        self.total = max(1, steps_per_epoch * epochs)
        # The last extension: the scheduler's step it came at, the planned curve's step minus the
        # scheduler's (they part when the steps per epoch change), and whether it restarted.
        self.since, self.offset, self.restarted = 0, 0, False

    def __call__(self, step: int) -> float:
        if self.restarted and step >= self.since:  # warmup and decay again, over the steps left after `since`
            return self._curve(step - self.since, self.total - self.since - self.offset)
        return self._curve(step + self.offset, self.total)

    def _curve(self, step: int, total: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.name == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def extend(self, step: int, at: int, total: int, how: str) -> str:
        """Plan `total` steps, the run being at step `at` of them (the scheduler at `step`):
        `continue` follows the curve planned over the new total from `at` on, as if the run had
        planned it from the start (a finished cosine, at its floor, goes on from where the new
        total puts it); `restart` runs warmup and decay again over the steps left. Returns what
        was done, for the console."""
        was = self.total
        self.since, self.offset, self.total, self.restarted = step, at - step, max(total, at + 1), how == "restart"
        what = ("restarts: warmup and decay again over the steps left" if self.restarted else
                "follows the curve planned over the new total from the step it is at")
        return f"the learning rate schedule's last step moves from {was} to {self.total}: it {what}"


@contextlib.contextmanager
def configured_hyperparameters(optimizer: torch.optim.Optimizer, scheduler):
    """Restore saved optimizer and schedule state inside this block (momentum buffers, step
    counts, position in the schedule); the config's hyper-parameters win afterwards: a resumed
    run reads its config again, so `--set optimizer.lr=...` applies from the restored step on,
    e.g. to continue below the lr at which a loss went NaN."""
    configured = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    base_lrs = list(scheduler.base_lrs)
    shapes = [{k: getattr(f, k) for k in Schedule.CONFIGURED} for f in scheduler.lr_lambdas]
    try:
        yield
    finally:  # also after a load that failed midway: the next checkpoint tried must see the config's values
        scheduler.base_lrs = base_lrs
        for group, hyper in zip(optimizer.param_groups, configured):
            group.update(hyper)
        for schedule, shape in zip(scheduler.lr_lambdas, shapes):  # the curve's kind, warmup and floor
            schedule.__dict__.update(shape)
        set_lr(optimizer, scheduler)


def extend_schedule(optimizer, scheduler, at: int, steps_per_epoch: int, epochs: int, how: str) -> Optional[str]:
    """After a resume at step `at` of this plan (its steps per epoch): when the config plans another
    number of steps than the restored schedule (more epochs, another world size), move its end as
    `schedule.on_extend` says; what was done, or None."""
    planned = max(1, steps_per_epoch * epochs)
    lines = {schedule.extend(scheduler.last_epoch, at, planned, how) for schedule in scheduler.lr_lambdas
             if isinstance(schedule, Schedule) and schedule.total != planned}
    set_lr(optimizer, scheduler)
    return f"{lines.pop()} (schedule.on_extend: {how})" if lines else None


def set_lr(optimizer, scheduler) -> None:
    """Each group's LR as the schedule gives it at the scheduler's step."""
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = group["initial_lr"] * factor(scheduler.last_epoch)
