"""Stop at the first non-finite training loss, on every rank at the same step.

A loss that turns NaN or inf (too high a learning rate, an fp16 overflow in the forward pass)
poisons the weights through DDP's all-reduce; training on would waste the rest of the run and
overwrite good checkpoints with NaN ones. Keras calls this TerminateOnNaN.

Every rank must stop at the same step, or the others would wait in the next all-reduce until
the collective timeout. So each optimizer step all-reduces one number, the ranks' running loss
sums (finite only if every rank's losses were), asynchronously, and every rank reads the result
`LAG` steps later: by then the collective is long done, so no step waits on it, and on GPUs the
value has reached pinned host memory behind the step's own work. Reading it one step later
would already avoid a wait, but it would hold the host within one step of the GPU, and then any
hiccup on the host (the garbage collector, Ray's threads) leaves the GPU idle; a few steps of
headroom absorb them, as a hand-written loop that never reads a value does. The run stops `LAG`
steps after the bad one, naming the bad one; anything that must not see poisoned weights (a
checkpoint, the end of an epoch) reads every pending answer first with `settle()`.

Under fp16, GradScaler skips steps whose *gradients* overflow and lowers its scale: that is
normal and does not count here, since the loss itself is finite.
"""

from __future__ import annotations

import math
from collections import deque

import torch
import torch.distributed as dist


class NonFiniteLoss(Exception):
    """All ranks agreed that the training loss at `step` was not finite."""

    def __init__(self, step: int, lr: float):
        super().__init__(f"non-finite training loss at step {step} (lr {lr:.3g})")
        self.step, self.lr = step, lr


LAG = 8  # optimizer steps between starting a check and reading its answer


class LossCheck:
    def __init__(self, device: torch.device, enabled: bool = True, lag: int = LAG):
        self.enabled, self.lag = enabled, lag
        self.on_gpu = device.type == "cuda"
        # A slot per check in flight: the ranks' summed running loss, and its value once it lands
        # in (pinned) host memory. Slots are reused in turn, never while their check is pending.
        self.sums = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(lag)]
        self.host = [torch.zeros((), dtype=torch.float64, pin_memory=self.on_gpu) for _ in range(lag)]
        self.pending: deque = deque()  # (slot, collective, event, step, lr), oldest first
        self.started = 0

    def after_step(self, running_loss: torch.Tensor, step: int, lr: float) -> None:
        """Start this step's check and, once `lag` are in flight, read the oldest:
        `running_loss` is this rank's loss sum so far in the epoch, non-finite from the first bad
        micro-batch on."""
        if not self.enabled:
            return
        if len(self.pending) == self.lag:
            self._read(self.pending.popleft())
        slot = self.started % self.lag
        self.started += 1
        self.sums[slot].copy_(running_loss)
        work = dist.all_reduce(self.sums[slot], async_op=True) if _distributed() else None
        event = None
        if self.on_gpu:
            if work:
                work.wait()  # orders the copy after the collective on the GPU; the host does not wait
            self.host[slot].copy_(self.sums[slot], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.pending.append((slot, work, event, step, lr))

    def settle(self) -> None:
        """Read every pending answer now; raise NonFiniteLoss if any rank saw a non-finite loss."""
        while self.pending:
            self._read(self.pending.popleft())

    def _read(self, check: tuple) -> None:
        slot, work, event, step, lr = check
        if event is not None:
            event.synchronize()
            value = self.host[slot].item()
        else:
            if work:
                work.wait()
            value = self.sums[slot].item()
        if not math.isfinite(value):
            self.pending.clear()  # later checks only repeat this one's answer
            raise NonFiniteLoss(step, lr)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
