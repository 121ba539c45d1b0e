"""Stop at the first non-finite training loss, on every rank at the same step.

A loss that turns NaN or inf (too high a learning rate, an fp16 overflow in the forward pass)
poisons the weights through DDP's all-reduce; training on would waste the rest of the run and
overwrite good checkpoints with NaN ones. Keras calls this TerminateOnNaN.

Every rank must stop at the same step, or the others would wait in the next all-reduce until
the collective timeout. So each optimizer step all-reduces one number, the ranks' running loss
sums (finite only if every rank's losses were), asynchronously, and every rank reads the result
one step later: by then the collective is long done, so no step waits on it, and on GPUs the
host never waits for the GPU to catch up (the value reaches pinned host memory behind the step's
own work). The run stops one step after the bad one, naming the bad one; anything that must not
see poisoned weights (a checkpoint, the end of an epoch) reads the answer first with `settle()`.

Under fp16, GradScaler skips steps whose *gradients* overflow and lowers its scale: that is
normal and does not count here, since the loss itself is finite.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist


class NonFiniteLoss(Exception):
    """All ranks agreed that the training loss at `step` was not finite."""

    def __init__(self, step: int, lr: float):
        super().__init__(f"non-finite training loss at step {step} (lr {lr:.3g})")
        self.step, self.lr = step, lr


class LossCheck:
    def __init__(self, device: torch.device, enabled: bool = True):
        self.enabled = enabled
        # A copy of the running loss sum: summed over ranks it stays finite only if every rank's was.
        self.sums = torch.zeros((), dtype=torch.float64, device=device)
        self.on_gpu = device.type == "cuda"
        self.host = torch.zeros((), dtype=torch.float64, pin_memory=self.on_gpu)  # its value, once it lands
        self.pending: Optional[tuple] = None  # (collective, event, step, lr) awaiting their read

    def after_step(self, running_loss: torch.Tensor, step: int, lr: float) -> None:
        """Settle the previous step's answer, then start this step's: `running_loss` is this rank's
        loss sum so far in the epoch, non-finite from the first bad micro-batch on."""
        if not self.enabled:
            return
        self.settle()
        self.sums.copy_(running_loss)
        work = dist.all_reduce(self.sums, async_op=True) if _distributed() else None
        event = None
        if self.on_gpu:
            if work:
                work.wait()  # orders the copy after the collective on the GPU; the host does not wait
            self.host.copy_(self.sums, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.pending = (work, event, step, lr)

    def settle(self) -> None:
        """Read the pending answer now; raise NonFiniteLoss if any rank saw a non-finite loss."""
        if not self.pending:
            return
        work, event, step, lr = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
            value = self.host.item()
        else:
            if work:
                work.wait()
            value = self.sums.item()
        if not math.isfinite(value):
            raise NonFiniteLoss(step, lr)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
