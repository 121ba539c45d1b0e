"""Metrics summed over every rank, never rank 0's alone.

Each rank keeps running sums on its device (one `.item()` per step would stall a GPU every
step) and the epoch's totals are all-reduced once. Losses are sample-weighted: the mean over
all samples seen by all ranks, which is what a single process over the same data would report.
"""

from __future__ import annotations

import copy
import re
import resource
import statistics
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from raytrain_app.distributed import gathered, global_max


class Totals:
    """Running sums of (loss x samples, samples, data wait, bad samples skipped) over a rank's
    epoch, and a custom step's own metrics as (sum, count) pairs.

    The sample count lives on the host (it is known there), so a built-in step costs one device
    op here; everything is all-reduced in one collective at the epoch's end.
    """

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)
        # sums[0] as a view made once: indexing makes a new tensor at every step's add and loss check.
        # Everything that changes `sums` does so in place (copy_, +=, item assignment), so it stays live.
        self.loss_sum = self.sums[0]
        self.named: dict[str, torch.Tensor] = {}  # name -> [sum, count]
        self.samples = 0
        self.data_wait_s = 0.0  # host time spent waiting for batches
        self.skipped: Optional[int] = None  # bad samples skipped, where the data skips them (on_bad: skip)

    def add(self, mean_loss: torch.Tensor, count: int, named: Optional[dict] = None) -> None:
        self.loss_sum.add_(mean_loss.detach(), alpha=count)
        self.samples += count
        if not named:  # a built-in step's
            return
        for name, (total, n) in named.items():
            on = {"dtype": torch.float64, "device": self.sums.device}
            pair = torch.stack([torch.as_tensor(total, **on).detach(), torch.as_tensor(n, **on)])
            if name in self.named:
                self.named[name] += pair
            else:
                self.named[name] = pair

    def all_reduce(self) -> "Totals":
        """Sum over ranks; afterwards `data_wait_s` is the mean over ranks."""
        self.sums[1], self.sums[2], self.sums[3] = self.samples, self.data_wait_s, self.skipped or 0
        world = 1
        if dist.is_available() and dist.is_initialized():
            names = sorted(self.named)  # every rank's step reports the same names
            flat = torch.cat([self.sums, *(self.named[n] for n in names)])
            dist.all_reduce(flat)
            self.sums.copy_(flat[:4])
            self.named = {n: flat[4 + 2 * i: 6 + 2 * i] for i, n in enumerate(names)}
            world = dist.get_world_size()
        self.samples, self.data_wait_s = int(self.sums[1]), float(self.sums[2]) / world
        if self.skipped is not None:
            self.skipped = int(self.sums[3])
        return self

    def state_dict(self) -> dict:
        return {"sums": self.sums.cpu(), "samples": self.samples, "data_wait_s": self.data_wait_s,
                "skipped": self.skipped, "named": {n: v.cpu() for n, v in self.named.items()}}

    def load_state_dict(self, saved: dict) -> None:
        self.sums[:len(saved["sums"])] = saved["sums"].to(self.sums.device)  # 3 sums before skips were counted
        self.samples, self.data_wait_s, self.skipped = saved["samples"], saved["data_wait_s"], saved.get("skipped")
        self.named = {n: v.to(self.sums.device) for n, v in saved.get("named", {}).items()}

    def merge(self, saved: dict) -> None:
        """Add another rank's saved sums to these: a rank of a smaller world carries on the sums of
        the ranks that are gone, so that the epoch's all-reduced totals still cover every sample."""
        self.sums[:len(saved["sums"])] += saved["sums"].to(self.sums.device)
        self.samples += saved["samples"]
        if saved.get("skipped") is not None:
            self.skipped = (self.skipped or 0) + saved["skipped"]
        self.data_wait_s = max(self.data_wait_s, saved["data_wait_s"])  # a time, as the clock: not a count
        for name, pair in saved.get("named", {}).items():
            pair = pair.to(self.sums.device)
            self.named[name] = self.named[name] + pair if name in self.named else pair

    @property
    def loss(self) -> float:
        return float(self.sums[0]) / self.samples

    def metrics(self) -> dict[str, float]:
        """A custom step's metrics over the epoch: sum / count."""
        return {name: float(pair[0]) / max(float(pair[1]), 1e-12) for name, pair in self.named.items()}


class Sums:
    """Named sums (scalars or per-class vectors) over a rank's eval shard, all-reduced in one
    collective. Every rank adds the same names, since every rank's shard holds a batch."""

    def __init__(self):
        self.values: dict[str, torch.Tensor] = {}

    def add(self, sums: dict[str, torch.Tensor]) -> None:
        for name, value in sums.items():
            value = value.detach().double()
            if name in self.values:
                self.values[name] += value
            else:
                self.values[name] = value.clone()

    def all_reduce(self) -> dict[str, torch.Tensor]:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            names = sorted(self.values)
            flat = torch.cat([self.values[n].reshape(-1) for n in names])
            dist.all_reduce(flat)
            for name, part in zip(names, flat.split([self.values[n].numel() for n in names])):
                self.values[name] = part.reshape(self.values[name].shape)
        return self.values


# ---- where an epoch's time goes -------------------------------------------------------------


def train_flops_per_sample(model: nn.Module, input_shape: tuple[int, ...]) -> Optional[float]:
    """FLOPs of one training sample (forward + backward), counted by PyTorch's FlopCounterMode on
    a copy of the model on the meta device: no compute, no device memory, no side effects on
    weights or BatchNorm statistics. None when the model has operations the counter cannot
    follow. The first call imports torch._dynamo (about a second), so the loop calls it only on
    GPUs, after the first epoch."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        # Parameters and buffers become meta tensors as the copy is made (the memo), never copied.
        memo = {id(t): nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad)
                if isinstance(t, nn.Parameter) else torch.empty_like(t, device="meta")
                for t in (*model.parameters(), *model.buffers())}
        # eval mode: the same matmuls and convolutions, without what a model does only while training
        meta = copy.deepcopy(model, memo).eval()
        x = torch.zeros((2, *input_shape), device="meta")
        with FlopCounterMode(display=False) as counter:
            meta(x).float().sum().backward()
        return counter.get_total_flops() / 2 or None
    except Exception:  # noqa: BLE001 - custom ops or meta-incompatible code: FLOPs unknown, no MFU
        return None


# Dense bf16/fp16 tensor-core peaks (FLOP/s) from NVIDIA's data sheets, matched as whole words
# against torch.cuda.get_device_name(); the first match wins. There is no fp32 figure on purpose:
# cuDNN runs fp32 convolutions as TF32, so no single fp32 peak is the right denominator.
PEAK_FLOPS = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
]


def peak_flops(device_name: str, precision: str) -> Optional[float]:
    if precision not in ("bf16", "fp16"):
        return None
    for name, peak in PEAK_FLOPS:
        if re.search(rf"\b{name}\b", device_name):
            return peak
    return None


def allreduce_seconds(numel: int, dtype: torch.dtype, device: torch.device, repeats: int = 5) -> float:
    """Median time to all-reduce `numel` values of `dtype` across the process group: what one
    step's gradient sync would cost if none of it overlapped the backward pass."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0.0
    # Every rank must send as many values: FSDP splits a parameter's rows unevenly when they do not
    # divide by the ranks, so local shards differ in size, and Gloo aborts a mismatched all-reduce.
    buffer = torch.zeros(int(global_max(numel, device)), dtype=dtype, device=device)
    times = []
    for _ in range(repeats + 1):  # the first call warms up the communicator
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return global_max(statistics.median(times[1:]), device)


def time_split(epoch_s: float, data_wait_s: float, syncs: int, sync_s: float) -> dict:
    """An epoch's wall time as shares: waiting for data (measured), gradient all-reduce
    (estimated: syncs x the calibrated unoverlapped all-reduce, so an upper bound) and compute
    (the rest: forward, backward, optimizer)."""
    data = min(data_wait_s, epoch_s)
    comm = min(syncs * sync_s, epoch_s - data)
    return {"data_wait_frac": data / epoch_s, "comm_frac": comm / epoch_s,
            "compute_frac": (epoch_s - data - comm) / epoch_s}


class EpochMetrics:
    """An epoch's row of metrics.jsonl, the same on every rank: losses and accuracy summed over all
    ranks, global throughput (all samples over the slowest rank's time), where the time went, and
    on GPUs the FLOPs achieved and the MFU.

    Calibrated once per run: one unoverlapped all-reduce of what a step sends (the gradients, or
    what a communication hook or a lower reduce dtype makes of them) bounds each step's
    communication; the GPU's dense peak (known GPUs, bf16/fp16) is the MFU's denominator; FLOPs
    per sample are counted after the first epoch, off the start-up path.
    """

    def __init__(self, model: nn.Module, input_shape: tuple[int, ...], precision: str, device: torch.device,
                 world_size: int, sent: tuple[int, torch.dtype]):
        """`sent`: how many values of which dtype a step's gradient collective sends per worker."""
        self.model, self.input_shape, self.device, self.world_size = model, input_shape, device, world_size
        self.sync_s = allreduce_seconds(*sent, device)
        self.peak = peak_flops(torch.cuda.get_device_name(device), precision) if device.type == "cuda" else None
        self.flops_per_sample: Optional[float] = None

    def row(self, epoch: int, step: int, steps: int, lr: float, seconds: float, train: Totals,
            evaluated: dict[str, float], own: tuple[float, float, int] = (0.0, 0.0, 0),
            straggler_factor: float = 2.0) -> dict:
        """`steps`: optimizer steps this epoch (this run's share of it when resumed inside it);
        `evaluated`: the task's metrics over all ranks' eval shards (loss, samples, each metric);
        `own`: this rank's seconds waiting for data and in forward passes, and the steps they
        cover (see `per_rank`)."""
        ranks = per_rank(gathered([*own, seconds], self.device), steps, straggler_factor)
        train.all_reduce()
        slowest = global_max(seconds, self.device)
        row = {
            "epoch": epoch,
            "step": step,
            "train_loss": train.loss,
            **{f"train_{name}": value for name, value in train.metrics().items()},
            **{f"eval_{name}": value for name, value in evaluated.items()},
            "train_samples": train.samples,  # over all ranks, and across a resume inside the epoch
            # bad images skipped over all ranks, in training and evaluation (data.args.on_bad: skip)
            **({"skipped_images": train.skipped} if train.skipped is not None else {}),
            "samples_per_s": train.samples / slowest,
            "samples_per_s_per_worker": train.samples / slowest / self.world_size,
            **time_split(slowest, train.data_wait_s, steps, self.sync_s),
            "epoch_time_s": slowest,
            "world_size": self.world_size,
            # The most any worker's process has held so far in host memory (what
            # scaling.memory_per_worker_gb has to cover), and on GPUs the CUDA allocator's peak.
            "peak_memory_mib": global_max(peak_rss_mib(), self.device),
            **({"peak_gpu_memory_mib": global_max(torch.cuda.max_memory_allocated(self.device) / 2**20, self.device)}
               if self.device.type == "cuda" else {}),
            "lr": lr,
            **ranks,
            "time": time.time(),  # when the epoch ended, for pictures on a time axis (restarts)
        }
        if self.device.type == "cuda" and self.flops_per_sample is None:
            self.flops_per_sample = train_flops_per_sample(self.model, self.input_shape) or 0.0
        if self.flops_per_sample:
            achieved = self.flops_per_sample * row["samples_per_s_per_worker"]
            row["tflops_per_worker"] = achieved / 1e12
            if self.peak:
                row["mfu"] = achieved / self.peak
        return row


def per_rank(own: list[list[float]], steps: int, factor: float) -> dict:
    """Each rank's time per step outside collectives, its share of the epoch spent waiting for
    data, and the ranks that are slow: `own` holds every rank's (data wait, forward) seconds, the
    steps they cover, and its epoch's seconds; `steps` is the epoch's.

    In synchronous training every rank's epoch lasts as long as the slowest one's, since the
    others wait for it in the gradient all-reduce: only a rank's own work (its data wait and its
    forward, which no collective stretches) tells it apart. A slow rank is one whose own work per
    step is `factor` times the median's (the lower median: of two ranks, the faster one), by at
    least a tenth of the step: what costs every rank that much, not a tiny model's jitter. On a
    GPU a forward's host time is the time to launch its kernels, not to run them."""
    step_s = [(data + forward) / max(covered, 1) for data, forward, covered, _ in own]
    waiting = [data / epoch if epoch > 0 else 0.0 for data, _, _, epoch in own]
    typical = statistics.median_low(step_s)
    whole = max(epoch for *_, epoch in own) / max(steps, 1)
    slow = [{"rank": r, "x_median": s / typical, "data_wait_frac": waiting[r]}
            for r, s in enumerate(step_s) if typical > 0 and s > factor * typical and s - typical >= 0.1 * whole]
    return {"rank_step_s": step_s, "rank_data_wait_frac": waiting, "slow_ranks": slow}


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024
