"""How the model is spread over the workers and readied for the step: SyncBatchNorm, memory
format, DDP, torch.compile. The loop trains what `parallelize` returns.

DDP keeps a full replica on every worker and all-reduces gradients in buckets during backward;
`gradient_as_bucket_view` lets the gradients live in those buckets, saving a copy per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raytrain_app.config import TrainConfig


@dataclass
class Parallel:
    model: nn.Module  # the bare model: state dicts, evaluation
    train_model: nn.Module  # what the training step calls: DDP and/or compiled
    memory_format: torch.memory_format
    cuda_graphs: bool  # the compiled step replays CUDA graphs (mark each step's start)


def parallelize(model: nn.Module, tc: TrainConfig, world_size: int, device: torch.device,
                warn: Callable[[str], None]) -> Parallel:
    model, memory_format = place(model, tc, world_size, device)
    wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  bucket_cap_mb=tc.ddp_bucket_cap_mb, gradient_as_bucket_view=True,
                  static_graph=tc.ddp_static_graph) if world_size > 1 else model
    train_model, cuda_graphs = compiled(wrapped, tc.compile, world_size, tc.grad_accum_steps, device, warn)
    return Parallel(model, train_model, memory_format, cuda_graphs)


def place(model: nn.Module, tc: TrainConfig, world_size: int,
          device: torch.device) -> tuple[nn.Module, torch.memory_format]:
    """The bare model on its device, with SyncBatchNorm across ranks and its memory format."""
    if tc.sync_batchnorm and world_size > 1:  # batch statistics over the global batch, not each rank's
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # channels_last lets cuDNN pick its fastest convolution kernels; it matters only for conv nets.
    memory_format = torch.channels_last if tc.channels_last == "on" and _has_conv(model) else torch.contiguous_format
    return model.to(device, memory_format=memory_format), memory_format


def compiled(model: nn.Module, mode: str, world_size: int, accum_steps: int, device: torch.device,
             warn: Callable[[str], None]) -> tuple[nn.Module, bool]:
    """`train.compile`, and whether the result replays CUDA graphs.

    CUDA graphs (reduce-overhead, max-autotune) remove the launch overhead that bounds small
    models on GPUs, but a graph cannot hold DDP's all-reduce hooks, and gradients accumulated
    across micro-batches would live in graph memory that the next replay overwrites. In those
    cases the graph-free variant of the mode is used (under DDP, torch.compile splits the graph
    at DDP's buckets instead).
    """
    if mode == "off":
        return model, False
    graphs = mode in ("reduce-overhead", "max-autotune") and device.type == "cuda"
    why = "DDP's all-reduce" if world_size > 1 else "gradient accumulation" if accum_steps > 1 else None
    if graphs and why:
        warn(f"train.compile: {mode} uses CUDA graphs, which cannot capture {why}; compiling without them")
        mode, graphs = ("default" if mode == "reduce-overhead" else "max-autotune-no-cudagraphs"), False
    return torch.compile(model, mode=None if mode == "default" else mode), graphs


def _has_conv(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())
