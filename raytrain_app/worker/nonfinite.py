"""Stop at the first non-finite training loss, on every rank at the same step.

A loss that turns NaN or inf (too high a learning rate, an fp16 overflow in the forward pass)
poisons the weights through DDP's all-reduce; training on would waste the rest of the run and
overwrite good checkpoints with NaN ones. Keras calls this TerminateOnNaN.

Every rank must stop at the same step, or the others would wait in the next all-reduce until
the collective timeout. So after each optimizer step every rank notes its running loss sum
(finite only if all its losses were) in a small device buffer, and every `LAG` steps it starts
one check of the whole buffer: an asynchronous all-reduce (finite only if every rank's sums
were) and, on GPUs, a copy to pinned host memory. Every rank reads the answer `LAG` steps later:
by then the collective is long done, so no step waits on it, and the host stays a few steps
ahead of the GPU, as a hand-written loop that never reads a value does (a hiccup on the host,
the garbage collector or Ray's threads, then leaves the GPU busy rather than idle). A check
per `LAG` steps, not per step: a per-step copy, event and read cost LeNet on an H100 a tenth of
its step. The run stops at most `2 x LAG` steps after the bad one, naming the bad one; anything
that must not see poisoned weights (a checkpoint, the end of an epoch) reads every pending
answer first with `settle()`.

Under fp16, GradScaler skips steps whose *gradients* overflow and lowers its scale: that is
normal and does not count here, since the loss itself is finite.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


class NonFiniteLoss(Exception):
    """All ranks agreed that the training loss at `step` was not finite."""

    def __init__(self, step: int, lr: float):
        super().__init__(f"non-finite training loss at step {step} (lr {lr:.3g})")
        self.step, self.lr = step, lr


LAG = 8  # optimizer steps per check, and between starting a check and reading its answer


class LossCheck:
    def __init__(self, device: torch.device, enabled: bool = True, lag: int = LAG):
        self.enabled, self.lag = enabled, lag
        self.on_gpu = device.type == "cuda"
        # Two buffers in turn: one fills, step by step, while the other's check is in flight.
        self.sums = [torch.zeros(lag, dtype=torch.float64, device=device) for _ in range(2)]
        self.host = [torch.zeros(lag, dtype=torch.float64, pin_memory=self.on_gpu) for _ in range(2)]
        # Each buffer's entries as views made once: indexing at every step makes a new tensor.
        self.slots = [[sums[i] for i in range(lag)] for sums in self.sums]
        self.filling, self.steps = 0, []  # the buffer being filled, and its entries' (step, lr)
        self.pending = None  # the check in flight: (buffer, collective, event, [(step, lr)])

    def after_step(self, running_loss: torch.Tensor, step: int, lr: float) -> None:
        """Note this step's `running_loss` (this rank's loss sum so far in the epoch, non-finite
        from the first bad micro-batch on); every `lag` steps, read the check in flight and start
        the next."""
        if not self.enabled:
            return
        self.slots[self.filling][len(self.steps)].copy_(running_loss)
        self.steps.append((step, lr))
        if len(self.steps) == self.lag:
            self._read()
            self._start()

    def settle(self) -> None:
        """Read every pending answer now; raise NonFiniteLoss if any rank saw a non-finite loss."""
        self._read()
        if self.steps:
            self._start()
            self._read()

    def _start(self) -> None:
        sums = self.sums[self.filling]
        work = dist.all_reduce(sums, async_op=True) if _distributed() else None
        event = None
        if self.on_gpu:
            if work:
                work.wait()  # orders the copy after the collective on the GPU; the host does not wait
            self.host[self.filling].copy_(sums, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.pending = (self.filling, work, event, self.steps)
        self.filling, self.steps = 1 - self.filling, []

    def _read(self) -> None:
        if self.pending is None:
            return
        buffer, work, event, steps = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
            values = self.host[buffer].tolist()
        else:
            if work:
                work.wait()
            values = self.sums[buffer].tolist()
        for (step, lr), value in zip(steps, values):
            if not math.isfinite(value):
                self.steps = []  # later checks only repeat this one's answer
                raise NonFiniteLoss(step, lr)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
