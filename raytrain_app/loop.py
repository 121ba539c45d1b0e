"""The training loop every Ray Train worker runs, top to bottom.

Ray Train has already started this process, set its device and joined it to the process group
(NCCL or Gloo) when `train_loop_per_worker` is called. From there it is plain DDP:

    build data and model -> wrap in DDP -> restore a checkpoint if there is one ->
    for each epoch: set_epoch, train, evaluate, all-reduce metrics, report (+ checkpoint)

`train_epoch` and `evaluate` take no Ray objects, so benchmarks time them without Ray.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.nn.functional as F
from torch import nn

from raytrain_app import checkpoint
from raytrain_app.checkpoint import TrainState
from raytrain_app.config import JobConfig
from raytrain_app.data import build_datasets, eval_loader, keep_on_device, loader_workers, to_device, train_loader
from raytrain_app.metrics import (Totals, allreduce_seconds, global_max, peak_flops, time_split,
                                  train_flops_per_sample)
from raytrain_app.models import build_model
from raytrain_app.nonfinite import LossCheck, NonFiniteLoss
from raytrain_app.optim import build_optimizer, build_schedule
from raytrain_app.reporter import Reporter
from raytrain_app.strategy import parallelize

@dataclass(frozen=True)
class WorkerArgs:
    """What the driver hands every worker: the one object that crosses the Ray boundary."""

    job: dict  # the resolved job config as plain data; each worker validates it again
    run_dir: str  # a local path or URI: where checkpoints and metrics live
    events: Any  # a ray.util.queue.Queue that the driver's console reads
    progress: bool  # rank 0 reports its position within epochs (the driver shows a bar)
    log_dir: str  # RUN_DIR/logs, a local path or URI: where rank-N.log goes
    cwd: Optional[str]  # the launch directory, when workers should run there (not with a working_dir)


def train_loop_per_worker(args: WorkerArgs) -> None:
    entered = time.time()
    # Run where the user launched, as a hand-written DDP script would: relative data paths and
    # "mypkg.models:build" import paths then mean the same on workers as on the driver.
    if args.cwd and os.path.isdir(args.cwd):
        os.chdir(args.cwd)
        sys.path.insert(0, args.cwd)
    job = JobConfig.from_dict(args.job)
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    report = Reporter(args.events, rank, args.log_dir, args.progress)
    report.info("rank %d/%d on node %s, device %s", rank, world_size, ray.get_runtime_context().get_node_id(), device)
    try:
        _run(job, args, rank, world_size, device, report, entered)
    except BaseException:
        report.failed()
        raise
    report.sync()


def _run(job: JobConfig, args: WorkerArgs, rank: int, world_size: int, device: torch.device, report: Reporter,
         entered: float) -> None:
    tc = job.train

    # Same seed on every rank for the model's initial weights (DDP broadcasts rank 0's anyway,
    # and a 1-worker run starts from the same weights), then a per-rank seed for dropout/augmentation.
    seed_everything(job.seed)
    data = build_datasets(job.data)
    built = build_model(job.model, data.input_shape, data.num_classes)
    parallel = parallelize(built, tc, world_size, device, report.warn)
    model, train_model, memory_format, cuda_graphs = (parallel.model, parallel.train_model, parallel.memory_format,
                                                      parallel.cuda_graphs)
    seed_everything(job.seed + rank)

    # Small datasets live on the GPU: the DataLoader's per-batch cost would exceed a small model's step.
    resident = keep_on_device(data, job.data.on_device, device)
    if resident:
        data = to_device(data, device)
    workers = loader_workers(job.data.loader_workers, data, job.scaling.cpus_per_worker)
    pin = device.type == "cuda" and not resident
    train_dl, sampler = train_loader(data, tc.batch_size, rank, world_size, job.seed, workers, pin, resident)
    eval_dl = eval_loader(data, tc.eval_batch_size, rank, world_size, workers, pin, resident)
    steps_per_epoch = -(-len(train_dl) // tc.grad_accum_steps)
    report.info("data %s, %d loader workers; compile %s%s", "on the device" if resident else "through a DataLoader",
             workers, tc.compile, " with CUDA graphs" if cuda_graphs else "")

    # Where epoch time goes: one unoverlapped all-reduce of the gradients, timed once, bounds
    # each step's communication; on GPUs, FLOPs against the GPU's peak give the MFU.
    sync_s = allreduce_seconds(sum(p.numel() for p in model.parameters() if p.requires_grad), device)
    peak = peak_flops(torch.cuda.get_device_name(device), tc.precision) if device.type == "cuda" else None
    flops_per_sample = None

    optimizer = build_optimizer(model.parameters(), job.optimizer, world_size)
    precision = Precision(tc.precision, device)
    state = TrainState(model, optimizer, build_schedule(optimizer, job.schedule, steps_per_epoch, tc.epochs),
                       precision.scaler)

    resumed = ray.train.get_checkpoint()
    if resumed:
        restored = checkpoint.restore_latest_good(resumed, state, rank, device, args.run_dir,
                                                  warn=report.warn)
        report.say(f"resumed from {restored} at step {state.step}: epoch {state.epoch + 1} from batch {state.batch}")

    def save_and_report(metrics: dict) -> None:
        with tempfile.TemporaryDirectory() as directory:
            checkpoint.save(directory, state, rank, job.to_dict())
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))

    ready = time.time()
    loss_check = LossCheck(device, tc.stop_on_nonfinite)

    def after_step(last_in_epoch: bool) -> None:
        """After each optimizer step: the start-up report (first step), and mid-epoch checkpoints
        every N steps, which record the sampler position."""
        if state.step == 1 and rank == 0:  # a fresh run's first step: tell the driver where start-up went
            report.startup({"loop": entered, "ready": ready, "first_step": time.time()})
        every = job.checkpoint.every_steps
        if every and state.step % every == 0 and not last_in_epoch:
            loss_check.settle()  # never checkpoint weights that a non-finite loss has poisoned
            state.train_time = time.perf_counter() - t0
            # A mid-epoch checkpoint must never rank as "best": it is kept only while it is the latest.
            save_and_report({"epoch": state.epoch, "step": state.step, "batch": state.batch, "mid_epoch": True,
                             job.checkpoint.metric: checkpoint.WORST_SCORE[job.checkpoint.mode]})

    try:
        for epoch in range(state.epoch, tc.epochs):
            sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
            sampler.skip = state.batch * tc.batch_size  # non-zero only when resuming mid-epoch
            on_batch = report.progress(epoch, state.batch + len(train_dl))
            t0 = time.perf_counter() - state.train_time
            first_step = state.step - state.batch // tc.grad_accum_steps  # this epoch's, also when resumed inside it
            train_totals = train_epoch(train_model, train_dl, state, precision, tc.grad_accum_steps, tc.grad_clip,
                                       device, on_batch, after_step, state.totals, memory_format, cuda_graphs,
                                       loss_check)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the epoch ends when the GPU's queue is done, not when Python's is
            train_time = time.perf_counter() - t0
            eval_totals = evaluate(model, eval_dl, precision, device, memory_format)

            train_totals.all_reduce()
            eval_totals.all_reduce()
            slowest = global_max(train_time, device)
            state.epoch, state.batch, state.totals, state.train_time = epoch + 1, 0, None, 0.0
            metrics = {
                "epoch": state.epoch,
                "step": state.step,
                "train_loss": train_totals.loss,
                "eval_loss": eval_totals.loss,
                "eval_accuracy": eval_totals.accuracy,
                "eval_samples": eval_totals.count,
                "samples_per_s": train_totals.count / slowest,
                "samples_per_s_per_worker": train_totals.count / slowest / world_size,
                **time_split(slowest, train_totals.data_wait_s, state.step - first_step, sync_s),
                "epoch_time_s": slowest,
                "world_size": world_size,
                "lr": optimizer.param_groups[0]["lr"],
            }
            if device.type == "cuda" and flops_per_sample is None:  # counted once, off the start-up path
                flops_per_sample = train_flops_per_sample(model, data.input_shape) or 0.0
            if flops_per_sample:
                achieved = flops_per_sample * metrics["samples_per_s_per_worker"]
                metrics["tflops_per_worker"] = achieved / 1e12
                if peak:
                    metrics["mfu"] = achieved / peak

            if state.epoch % job.checkpoint.every_epochs == 0 or state.epoch == tc.epochs:
                save_and_report(metrics)
            else:
                ray.train.report(metrics)
            report.epoch(metrics)
            report.sync()
    except NonFiniteLoss as e:  # every rank stops here at the same step: a clean stop, not a crash
        report.nonfinite({"epoch": state.epoch + 1, "step": e.step, "lr": e.lr})

def train_epoch(
    model: nn.Module,
    loader,
    state: TrainState,
    precision: "Precision",
    accum_steps: int,
    grad_clip: Optional[float],
    device: torch.device,
    on_batch: Optional[Callable[[int], None]] = None,
    after_step: Optional[Callable[[bool], None]] = None,
    totals: Optional[Totals] = None,
    memory_format: torch.memory_format = torch.contiguous_format,
    cuda_graphs: bool = False,
    loss_check: Optional[LossCheck] = None,
) -> Totals:
    """One pass over this rank's shard (or its rest, from `state.batch`); returns its unreduced loss totals.

    With gradient accumulation, each optimizer step averages the gradients of up to
    `accum_steps` micro-batches. DDP all-reduces on every backward unless told not to, so the
    non-final micro-batches run under `no_sync()`: one all-reduce per optimizer step.
    """
    model.train()
    state.totals = totals = totals or Totals(device)
    n = state.batch + len(loader)
    waited_since = time.perf_counter()
    for i, (x, y) in enumerate(loader, start=state.batch):
        totals.data_wait_s += time.perf_counter() - waited_since  # the loader's share of the epoch
        x, y = _to_device(x, device, memory_format), y.to(device, non_blocking=True)
        window_start = i - i % accum_steps
        window_end = min(window_start + accum_steps, n)  # the epoch's last window may be shorter
        last = i + 1 == window_end
        sync = model.no_sync() if not last and hasattr(model, "no_sync") else nullcontext()
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs may be overwritten
        with sync:
            with precision.autocast():
                loss = F.cross_entropy(model(x), y)
            window = window_end - window_start
            precision.backward(loss / window if window > 1 else loss)
        totals.add(loss, len(y))
        state.batch = i + 1
        if last:
            lr = state.optimizer.param_groups[0]["lr"]
            precision.step(state.optimizer, state.model.parameters(), grad_clip)
            state.optimizer.zero_grad(set_to_none=True)
            state.scheduler.step()
            state.step += 1
            if loss_check:
                loss_check.after_step(totals.sums[0], state.step, lr)
            if after_step:
                after_step(i + 1 == n)
        if on_batch:
            on_batch(i + 1)
        waited_since = time.perf_counter()
    if loss_check:
        loss_check.settle()
    return totals


@torch.no_grad()
def evaluate(model: nn.Module, loader, precision: "Precision", device: torch.device,
             memory_format: torch.memory_format = torch.contiguous_format) -> Totals:
    """Loss and accuracy over this rank's unpadded eval shard.

    Takes the bare model, not the DDP wrapper: evaluation needs no gradient sync, and ranks may
    hold one batch more or less than each other.
    """
    model.eval()
    totals = Totals(device)
    for x, y in loader:
        x, y = _to_device(x, device, memory_format), y.to(device, non_blocking=True)
        with precision.autocast():
            logits = model(x)
        totals.add(F.cross_entropy(logits.float(), y), len(y), (logits.argmax(1) == y).sum())
    model.train()
    return totals


class Precision:
    """fp32, bf16 autocast, or fp16 autocast with a GradScaler (fp16's range needs loss scaling)."""

    def __init__(self, name: str, device: torch.device):
        self.device_type = device.type
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name)
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype) if self.dtype else nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, params, grad_clip: Optional[float]) -> None:
        if grad_clip is not None:
            if self.scaler:
                self.scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()


def _to_device(x: torch.Tensor, device: torch.device, memory_format: torch.memory_format) -> torch.Tensor:
    if x.dim() == 4 and memory_format is not torch.contiguous_format:
        return x.to(device, non_blocking=True, memory_format=memory_format)
    return x.to(device, non_blocking=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
