"""How much memory a worker's training state takes, known before anything runs, and how much a
worker used, measured while it runs.

The state is what a strategy decides: every parameter, its gradient and the optimizer's state
for it (SGD with momentum one buffer, Adam and AdamW two). Under `ddp` each worker holds all of
it; under `fsdp` each holds 1/N of each; under `hsdp` 1/(its shard group). Activations, the
gathered parameters of the unit being computed and the allocator's slack come on top, which is
why a measured peak is reported beside the estimate (`benchmarks/fsdp_memory.py`).

`scaling.memory_per_worker_gb` is Ray's `memory` resource for each worker: Ray places workers
only where that much is unreserved, but does not stop a worker from using more. The plan
therefore refuses a run whose state alone would not fit, which is a floor, not a promise; a GPU
worker checks the same floor against its GPU's free memory before the model moves there. Here,
in the worker's package, because both the plan (`preflight`) and the worker use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from raytrain_app.config import JobConfig
from raytrain_app.config.sections import OptimizerConfig
from raytrain_app.errors import UserError

GiB = 2**30


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def describe(self) -> str:
        return (f"{self.total / GiB:.2f} GiB (parameters {self.params / GiB:.2f}, gradients {self.grads / GiB:.2f}, "
                f"optimizer {self.optimizer / GiB:.2f})")


def optimizer_copies(config: OptimizerConfig) -> int:
    """Tensors the optimizer keeps per parameter."""
    if config.name == "sgd":
        return 1 if config.momentum > 0 else 0
    return 2  # Adam's and AdamW's first and second moments


def state_bytes(model: nn.Module, optimizer: OptimizerConfig, shards: int) -> StateBytes:
    """One worker's share of the state when each tensor is split over `shards` workers (1: ddp)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    share = lambda n: -(-n // shards)  # noqa: E731
    return StateBytes(share(params), share(trainable), share(trainable * optimizer_copies(optimizer)))


def shard_group(config: JobConfig) -> Optional[int]:
    """Workers each tensor is split over; None where only the cluster decides it (hsdp's default)."""
    st, workers = config.strategy, config.scaling.min_workers  # a range's fewest: the largest shares
    if not st.sharded or workers == 1:
        return 1
    if st.name == "fsdp":
        return workers
    return workers // st.replicate_degree if st.replicate_degree != "auto" else None


def check_state_fits(model: nn.Module, config: JobConfig) -> None:
    """Refuse, before Ray starts, a run whose training state alone exceeds the worker's memory."""
    cap = config.scaling.memory_per_worker_gb
    shards = shard_group(config)
    if cap is None or shards is None:
        return
    _refuse_over(model, config, shards, cap * GiB, f"the {cap:g} GiB given", "scaling.memory_per_worker_gb: ")


def check_state_fits_gpu(model: nn.Module, config: JobConfig, shards: int, device: torch.device) -> None:
    """The same floor on a GPU worker, against what its GPU has free, before the model moves
    there: a state that cannot fit is one line at the start, not a CUDA out-of-memory traceback
    after the data has loaded. Free, not total: another process may hold part of the GPU."""
    free, total = torch.cuda.mem_get_info(device)
    where = (f"the {free / GiB:.2f} GiB free on {device} ({torch.cuda.get_device_name(device)}, "
             f"{total / GiB:.1f} GiB)")
    _refuse_over(model, config, shards, free, where, "")


def _refuse_over(model: nn.Module, config: JobConfig, shards: int, limit: float, where: str, prefix: str) -> None:
    need = state_bytes(model, config.optimizer, shards)
    if need.total <= limit:
        return
    strategy = config.strategy.name if shards > 1 else "ddp"
    hint = ""
    workers = config.scaling.min_workers
    if shards == 1 and workers > 1:
        sharded = state_bytes(model, config.optimizer, workers)
        hint = f"; strategy fsdp splits it over the {workers} workers: {sharded.describe()} each"
    raise UserError(f"{prefix}the model's training state takes {need.describe()} per worker under {strategy}, "
                    f"more than {where}{hint}")
