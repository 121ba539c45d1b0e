"""What one optimizer step is at a world size: the only thing an elastic run's resize changes.

A fixed-size run steps as configured. A range (`scaling.workers: {min, max}`) is configured at
`max`; at another size `scaling.on_resize` decides:

- keep_global_batch: the global batch (batch_size x max x grad_accum_steps) and the lr stay. Fewer
  workers accumulate more micro-batches per step, of the configured size where it divides, else
  smaller ones (never larger: memory is sized for it). A size the global batch does not split
  into is refused before anything starts.
- scale_lr: each worker's batch stays, so the global batch follows the world size, and so does
  the lr under `optimizer.scale_lr: linear`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raytrain_app.config.sections import ScalingConfig, TrainConfig


@dataclass(frozen=True)
class Batching:
    batch_size: int  # one worker's micro-batch
    accum_steps: int  # micro-batches per optimizer step
    lr_workers: int  # the world size `optimizer.scale_lr` scales the lr by

    def describe(self, world_size: int) -> str:
        micro = f" ({self.accum_steps} micro-batches of {self.batch_size})" if self.accum_steps > 1 else ""
        return f"global batch {self.batch_size * self.accum_steps * world_size}{micro}"


def batching(train: TrainConfig, scaling: ScalingConfig, world_size: int) -> Optional[Batching]:
    """The step at `world_size`; None where keep_global_batch cannot keep it there."""
    if not scaling.elastic or scaling.on_resize == "scale_lr":
        return Batching(train.batch_size, train.grad_accum_steps, world_size)
    total = global_batch(train, scaling)
    if total % world_size:
        return None
    per_worker = total // world_size
    accum = next(a for a in range(1, per_worker + 1) if per_worker % a == 0 and per_worker // a <= train.batch_size)
    return Batching(per_worker // accum, accum, scaling.max_workers)


def global_batch(train: TrainConfig, scaling: ScalingConfig) -> int:
    return train.batch_size * scaling.max_workers * train.grad_accum_steps


def resize_problems(train: TrainConfig, scaling: ScalingConfig) -> list[str]:
    """A range whose global batch some size cannot keep, said before Ray starts."""
    if not scaling.elastic or scaling.on_resize == "scale_lr":
        return []
    total = global_batch(train, scaling)
    lost = [w for w in range(scaling.min_workers, scaling.max_workers) if total % w]
    if not lost:
        return []
    return [f"scaling.on_resize: keep_global_batch cannot keep the global batch of {total} (train.batch_size "
            f"{train.batch_size} x {scaling.max_workers} workers x {train.grad_accum_steps}) at "
            f"{', '.join(map(str, lost))} worker{'s' if lost != [1] else ''}: it does not split evenly; narrow "
            f"the range, pick a batch_size that does, or use on_resize: scale_lr"]
