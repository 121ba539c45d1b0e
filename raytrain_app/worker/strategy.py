"""How the model is spread over the workers and readied for the step: SyncBatchNorm, memory
format, DDP or FSDP2, torch.compile. The loop trains what `parallelize` returns.

DDP keeps a full replica on every worker and all-reduces gradients in buckets during backward;
`gradient_as_bucket_view` lets the gradients live in those buckets, saving a copy per step.

FSDP2 (`fully_shard`, as torchtitan applies it) keeps 1/N of every parameter, gradient and
optimizer state per worker, as DTensors. Each shard unit (a transformer block, say) gathers
its parameters just before its forward and backward and frees them after, and gradients are
reduce-scattered instead of all-reduced; the root unit takes what is left (embeddings, head).
HSDP puts the same sharding on the second dimension of a 2-D mesh (the workers of one node,
by default) and replicates across the first, so the heavy collectives stay within a node.
Ray Train has started the process group; the mesh is built on top of it.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raytrain_app.config import JobConfig
from raytrain_app.config.sections import StrategyConfig, TrainConfig
from raytrain_app.errors import ConfigError
from raytrain_app.worker.comm_hook import CommHook


@dataclass
class Parallel:
    model: nn.Module  # the model whose state is saved and which evaluates: bare, or FSDP-sharded itself
    train_model: nn.Module  # what the training step calls: DDP and/or compiled, or the sharded model
    memory_format: torch.memory_format
    cuda_graphs: bool  # the compiled step replays CUDA graphs (mark each step's start)
    mesh: Optional[tuple[int, ...]] = None  # the device mesh's shape when sharded, else None
    comm_hook: Optional[CommHook] = None  # what DDP's all-reduce sends, when not plain fp32
    reduce_dtype: torch.dtype = torch.float32  # what FSDP2 reduce-scatters gradients in

    def describe(self) -> str:
        return f"sharded over mesh {self.mesh}" if self.mesh else "replicated"

    def sent_per_step(self) -> tuple[int, torch.dtype]:
        """How many values of which dtype a step's gradient collective sends per worker. A sharded
        parameter counts its local shard: the whole model's size would not fit one device."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters() if p.requires_grad]
        if self.comm_hook:
            return self.comm_hook.sent(local)
        return sum(p.numel() for p in local), self.reduce_dtype


def describe_layout(layout: dict) -> str:
    """A checkpoint's layout (world size, strategy, mesh) in words, for the resume message."""
    workers = f"{layout['world_size']} worker{'s' if layout['world_size'] > 1 else ''}"
    return f"{workers} under {layout['strategy']} {tuple(layout['mesh'])}" if layout["mesh"] else workers


def is_sharded(model: nn.Module) -> bool:
    """Without importing FSDP where nothing did: its import (sympy through DTensor) costs about a
    second, and every evaluation of an unsharded model asks."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def parallelize(model: nn.Module, job: JobConfig, world_size: int, node: str, device: torch.device,
                warn: Callable[[str], None], placed: bool = False) -> Parallel:
    """`node`: this worker's node (Ray's node id), for HSDP's one replica per node. `placed`: the
    model has put its layers on the worker's devices itself (see `models.places_itself`)."""
    tc, st = job.train, job.strategy
    sharded = st.sharded and world_size > 1
    # A sharded model stays where it was built (the CPU): fully_shard moves each unit to the
    # mesh's device as it shards it, so a GPU holds at most one unit whole, never the model.
    model, memory_format = place(model, tc, world_size, None if placed or sharded else device)
    if sharded:
        ranks = mesh_ranks(st, world_size, node)
        wrapped = shard(model, st, ranks, device)
        train_model, cuda_graphs = compiled(wrapped, tc.compile, world_size, tc.grad_accum_steps, device, warn)
        return Parallel(wrapped, train_model, memory_format, cuda_graphs, tuple(ranks.shape),
                        reduce_dtype=REDUCE_DTYPES[st.reduce_dtype])
    # Under DDP the model is compiled inside it, not around it: Dynamo does not trace DDP's own
    # forward, and then compiles the module DDP calls only where its code is not torch's (a
    # built-in nn.Sequential stayed eager). Compiled inside, it still gets DDP's bucket splitting.
    train_model, cuda_graphs = compiled(model, tc.compile, world_size, tc.grad_accum_steps, device, warn)
    hook = None
    if world_size > 1:
        # device_ids=None: a model on several devices (or the CPU) is not DDP's to place.
        train_model = DDP(train_model, device_ids=[device.index] if device.type == "cuda" and not placed else None,
                          bucket_cap_mb=tc.ddp_bucket_cap_mb, gradient_as_bucket_view=True,
                          static_graph=tc.ddp_static_graph)
        if job.ddp.comm_hook != "none":
            hook = CommHook(job.ddp, job.seed, world_size, device, warn)
            hook.register(train_model)
    return Parallel(model, train_model, memory_format, cuda_graphs, comm_hook=hook)


def mesh_ranks(st: StrategyConfig, world_size: int, node: str) -> torch.Tensor:
    """The ranks laid out as the device mesh. fsdp: one dimension over every worker. hsdp:
    (replicas, shards), each row the workers of one node (or of consecutive nodes, with an
    explicit replicate_degree), whatever order Ray numbered them in. One replica per node needs
    the same number of workers on each; every rank sees every rank's node, so all agree."""
    if st.name == "fsdp":
        return torch.arange(world_size)
    import torch.distributed as dist

    nodes = [None] * world_size
    dist.all_gather_object(nodes, node)
    by_node: dict = {}
    for rank, name in enumerate(nodes):
        by_node.setdefault(name, []).append(rank)
    replicas = st.replicate_degree
    if replicas == "auto":
        counts = sorted({len(ranks) for ranks in by_node.values()})
        if len(counts) > 1:
            raise ConfigError(f"strategy.replicate_degree: auto needs the same number of workers on every node, got "
                              f"{', '.join(map(str, counts))} on different nodes: set it explicitly")
        replicas = len(by_node)
    return torch.tensor([rank for ranks in by_node.values() for rank in ranks]).reshape(replicas, -1)


REDUCE_DTYPES = {"auto": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def shard(model: nn.Module, st: StrategyConfig, ranks: torch.Tensor, device: torch.device) -> nn.Module:
    """`fully_shard` on each shard unit, innermost first, then on the root: the root is sharded in
    place (it becomes an FSDPModule and its parameters DTensors)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    names = ("replicate", "shard") if ranks.dim() == 2 else ("shard",)
    options = {
        "mesh": DeviceMesh(device.type, ranks, mesh_dim_names=names),
        "reshard_after_forward": st.reshard_after_forward,
        # bf16 gathers and compute; gradients reduced in fp32 unless strategy.reduce_dtype says
        # otherwise, as torchtitan does.
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16 if st.mixed_precision == "bf16" else None,
                                          reduce_dtype=REDUCE_DTYPES[st.reduce_dtype]),
        "offload_policy": CPUOffloadPolicy() if st.cpu_offload else OffloadPolicy(),
    }
    for unit in shard_units(model, st.shard_modules):
        fully_shard(unit, **options)
    return fully_shard(model, **options)


def shard_units(model: nn.Module, names) -> list[nn.Module]:
    """The submodules sharded as units, children before parents. `auto`: the repeated blocks, the
    elements of a ModuleList or Sequential whose children are all of one class that has
    submodules of its own (transformer layers, ResNet blocks; not a Sequential of Linears).
    Raises ConfigError for a name that is no module class of the model."""
    modules = [m for _, m in model.named_modules()][1:]
    if names == "auto":
        repeated = {type(c) for m in modules if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1
                    for c in m if len({type(x) for x in m}) == 1 and any(True for _ in c.children())}
        chosen = [m for m in modules if type(m) in repeated]
    else:
        present = {type(m).__name__ for m in modules}
        missing = [n for n in names if n not in present]
        if missing:
            raise ConfigError(f"strategy.shard_modules: {', '.join(missing)} names no module of the model (its "
                              f"module classes: {', '.join(sorted(present)) or 'none'})")
        chosen = [m for m in modules if type(m).__name__ in names]
    return chosen[::-1]


def no_grad_sync(model: nn.Module):
    """Backward without the gradient collective, for the non-final micro-batches of an
    accumulated step: DDP's `no_sync()`, FSDP2's `set_requires_gradient_sync(False)` (gradients
    then accumulate unsharded and are reduce-scattered once, on the final micro-batch)."""
    if hasattr(model, "set_requires_gradient_sync"):
        return _fsdp_no_sync(model)
    return model.no_sync() if hasattr(model, "no_sync") else nullcontext()


@contextmanager
def _fsdp_no_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def place(model: nn.Module, tc: TrainConfig, world_size: int,
          device: Optional[torch.device]) -> tuple[nn.Module, torch.memory_format]:
    """The bare model on its device (None: where it is), with SyncBatchNorm across ranks and its
    memory format."""
    if tc.sync_batchnorm and world_size > 1:  # batch statistics over the global batch, not each rank's
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # channels_last lets cuDNN pick its fastest convolution kernels; it matters only for conv nets.
    memory_format = torch.channels_last if tc.channels_last == "on" and _has_conv(model) else torch.contiguous_format
    return model.to(device, memory_format=memory_format), memory_format


def compiled(model: nn.Module, mode: str, world_size: int, accum_steps: int, device: torch.device,
             warn: Callable[[str], None]) -> tuple[nn.Module, bool]:
    """`train.compile`, and whether the result replays CUDA graphs.

    CUDA graphs (reduce-overhead, max-autotune) remove the launch overhead that bounds small
    models on GPUs, but a graph cannot hold the gradient collectives (DDP's all-reduce hooks,
    FSDP's gathers and reduce-scatters), and gradients accumulated
    across micro-batches would live in graph memory that the next replay overwrites. In those
    cases the graph-free variant of the mode is used (under DDP, torch.compile splits the graph
    at DDP's buckets instead).
    """
    if mode == "off":
        return model, False
    graphs = mode in ("reduce-overhead", "max-autotune") and device.type == "cuda"
    why = "the gradient collectives" if world_size > 1 else "gradient accumulation" if accum_steps > 1 else None
    if graphs and why:
        warn(f"train.compile: {mode} uses CUDA graphs, which cannot capture {why}; compiling without them")
        mode, graphs = ("default" if mode == "reduce-overhead" else "max-autotune-no-cudagraphs"), False
    return torch.compile(model, mode=None if mode == "default" else mode), graphs


def _has_conv(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())
