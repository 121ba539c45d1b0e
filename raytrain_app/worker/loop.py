"""The training loop every Ray Train worker runs, top to bottom.

Ray Train has already started this process, set its device and joined it to the process group
(NCCL or Gloo) when `train_loop_per_worker` is called. From there it is plain DDP (or FSDP2,
see `strategy.py`):

    build data, task and model -> wrap in DDP or shard -> restore a checkpoint if there is one ->
    for each epoch: set_epoch, train, evaluate, all-reduce metrics, report (+ checkpoint)

The task (`tasks.py`) decides what a step optimises and what evaluation measures.

`train_epoch` and `evaluate` take no Ray objects, so tests and benchmarks call them without Ray.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import ray.train
import ray.train.torch
import torch
from torch import nn

from raytrain_app.config import JobConfig
from raytrain_app.config.batching import batching
from raytrain_app.data import (
    FirstBatches,
    build_datasets,
    class_count,
    eval_loader,
    keep_on_device,
    label_counts,
    loader_workers,
    skipped,
    to_device,
    train_loader,
)
from raytrain_app.data.preprocess import recipe
from raytrain_app.distributed import global_max
from raytrain_app.models import build_model, places_itself
from raytrain_app.tasks import build_task, model_outputs
from raytrain_app.tasks.base import Task
from raytrain_app.tasks.supervised import Classification, class_weights
from raytrain_app.tracking import Trackers
from raytrain_app.worker import checkpoint, preemption
from raytrain_app.worker.after_step import AfterStep, report_to_ray
from raytrain_app.worker.args import WorkerArgs
from raytrain_app.worker.compile_cache import CompileCache
from raytrain_app.worker.early_stopping import EarlyStopping
from raytrain_app.worker.heartbeat import (
    AFTER_STEP,
    BACKWARD,
    CHECKPOINT,
    COMPILE,
    DATA,
    EVAL,
    FORWARD,
    OPTIMIZER,
    Heartbeat,
)
from raytrain_app.worker.memory import check_state_fits_gpu, shard_group
from raytrain_app.worker.metrics import EpochMetrics, Sums, Totals
from raytrain_app.worker.nonfinite import LossCheck, NonFiniteLoss
from raytrain_app.worker.optim import build_optimizer, build_schedule, extend_schedule
from raytrain_app.worker.rank import Worker
from raytrain_app.worker.reporter import Reporter
from raytrain_app.worker.state import TrainState
from raytrain_app.worker.strategy import describe_layout, is_sharded, no_grad_sync, parallelize


def train_loop_per_worker(args: WorkerArgs) -> None:
    entered = time.time()
    # Run where the user launched, as a hand-written DDP script would: relative data paths and
    # "mypkg.models:build" import paths then mean the same on workers as on the driver.
    if args.cwd and os.path.isdir(args.cwd):
        os.chdir(args.cwd)
        sys.path.insert(0, args.cwd)
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    report = Reporter(args.events, rank, args.log_dir, args.progress)
    node = args.node or (socket.gethostname() if args.local else ray.get_runtime_context().get_node_id())
    report.info("rank %d/%d on node %s, device %s", rank, world_size, node, device)
    job = JobConfig.from_dict(args.job)
    heartbeat = Heartbeat(rank, node, report.beat, timeout=job.failure.hang_timeout_s, run_dir=args.run_dir).start()
    try:
        _run(Worker(job, args.run_dir, rank, world_size, node, device, report,
                    {**(args.marks or {}), "loop": entered}, args.local, args.notices, args.stop_flag, heartbeat))
    except BaseException:
        report.failed()
        raise
    finally:
        heartbeat.stop()
    report.sync()


def _run(w: Worker) -> None:
    job, tc, run_dir, rank, world_size, device, report = (w.job, w.job.train, w.run_dir, w.rank, w.world_size,
                                                           w.device, w.report)
    # The same seed on every rank for the initial weights (DDP broadcasts rank 0's anyway, and a
    # 1-worker run starts from the same ones), then each rank its own for dropout and augmentation.
    seed_everything(job.seed)
    data = build_datasets(job.data)
    preprocess = recipe(data.train)  # what a user of the trained model must do to raw inputs
    task = build_task(job.task)
    classification = isinstance(task, Classification)
    outputs = model_outputs(task, data.train, class_count(data, rank, world_size, device) if classification
                            else data.num_classes)
    if classification and job.task.class_weights is not None:
        task.weight = class_weights(job.task.class_weights, label_counts(data, outputs, rank, world_size, device))
        report.info("class weights: %s", task.weight.tolist())
        report.say(f"class weights ({'auto' if job.task.class_weights == 'auto' else 'given'}): "
                   f"{task.weight.min():.3g} to {task.weight.max():.3g} over {outputs} classes")
    model = build_model(job.model, data.input_shape, outputs, ray.train.torch.get_devices())
    offloaded = job.strategy.sharded and job.strategy.cpu_offload  # its state lives in host memory
    if device.type == "cuda" and not places_itself(job.model) and not offloaded:  # before it moves to the GPU
        check_state_fits_gpu(model, job, shard_group(job) or ray.train.get_context().get_local_world_size(), device)
    parallel = parallelize(model, job, world_size, w.node, device, report.warn, placed=places_itself(job.model))
    seed_everything(job.seed + rank)

    # Small datasets live on the GPU: the DataLoader's per-batch cost would exceed a small model's step.
    resident = keep_on_device(data, job.data.on_device, device)
    data = to_device(data, device) if resident else data
    workers = loader_workers(job.data.loader_workers, data, job.scaling.cpus_per_worker)
    pin = device.type == "cuda" and not resident
    batches = batching(tc, job.scaling, world_size)  # as configured, or as a range's resize keeps it
    report.group(world_size, batches.describe(world_size))
    train_dl, sampler = train_loader(data, batches.batch_size, rank, world_size, job.seed, workers, pin, resident,
                                     job.data.engine, device)
    train_dl = FirstBatches(train_dl, tc.limit_batches)  # all of them, but in a smoke run
    eval_dl = FirstBatches(eval_loader(data, tc.eval_batch_size, rank, world_size, workers, pin, resident, device),
                           tc.limit_eval_batches)
    report.info("data %s, %d loader workers; compile %s%s; %s", "on the device" if resident else
                "from Ray Data" if job.data.engine == "ray_data" else "through a DataLoader",
                workers, tc.compile, " with CUDA graphs" if parallel.cuda_graphs else "", parallel.describe())

    optimizer = build_optimizer(parallel.model.parameters(), job.optimizer, batches.lr_workers)
    precision = Precision(tc.precision, device)
    steps_per_epoch = -(-len(train_dl) // batches.accum_steps)
    state = TrainState(parallel.model, optimizer, build_schedule(optimizer, job.schedule, steps_per_epoch, tc.epochs),
                       precision.scaler, sharded=parallel.mesh is not None,
                       early_stopping=EarlyStopping(tc.early_stopping) if tc.early_stopping else None,
                       comm_hook=parallel.comm_hook)
    step = Step(parallel.train_model, precision, task, batches.accum_steps, tc.grad_clip, device,
                parallel.memory_format, parallel.cuda_graphs, LossCheck(device, tc.stop_on_nonfinite),
                samples_per_batch=batches.batch_size * world_size, compiled=tc.compile != "off")
    epoch_metrics = EpochMetrics(parallel.model, data.input_shape, tc.precision, device, world_size,
                                 parallel.sent_per_step())
    # What each checkpoint holds besides the state: the config, what the model was built for and
    # how raw inputs become its inputs (`raytrain_app.load_model` rebuilds it from these), and the
    # layout it was trained under, with a streamed dataset's row groups, which its position within
    # an epoch refers to.
    layout = {"world_size": world_size, "accum_steps": batches.accum_steps,
              "strategy": job.strategy.name if parallel.mesh else "ddp",
              "mesh": list(parallel.mesh or ()), "data": getattr(data.train, "fingerprint", None)}
    about = {"config": job.to_dict(), "input_shape": list(data.input_shape), "num_classes": outputs,
             "preprocess": preprocess, "layout": layout,
             "class_weights": task.weight.tolist() if classification and task.weight is not None else None}
    latest = w.latest_checkpoint()
    if latest:
        restored, saved_layout = checkpoint.restore_latest_good(latest, state, rank, device, run_dir, report.warn)
        saved_layout = saved_layout or layout
        if state.samples is None:  # a checkpoint from before positions were counted over all ranks
            state.samples = state.batch * tc.batch_size * saved_layout["world_size"]
        # The epoch's position in this group's micro-batches: its optimizer steps are the same.
        state.batch = state.batch // saved_layout.get("accum_steps", tc.grad_accum_steps) * batches.accum_steps
        report.say(f"resumed from {restored} at step {state.step}: epoch {state.epoch + 1} from batch {state.batch}")
        report.restored(state.rows)
        at = state.epoch * steps_per_epoch + state.samples // (step.samples_per_batch * batches.accum_steps)
        extended = extend_schedule(optimizer, state.scheduler, at, steps_per_epoch, tc.epochs, job.schedule.on_extend)
        if extended:
            report.say(extended)
        for warning in resume_warnings(saved_layout, layout, mid_epoch=state.batch > 0, resized=job.scaling.elastic):
            report.warn(warning)
    trackers = Trackers(job, run_dir, rank, world_size, state)  # rank 0's TensorBoard, MLflow, W&B
    compile_cache = CompileCache(run_dir, rank, device, report) if tc.compile != "off" else None
    after_step = AfterStep(job, about, w, step.loss_check, trackers, {**w.marks, "ready": time.time()}, compile_cache)

    try:
        if compile_cache:
            compile_cache.open()
        for epoch in range(state.epoch, tc.epochs):
            sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
            sampler.start = state.samples  # non-zero only when resuming inside the epoch
            first_step = state.step - state.batch // batches.accum_steps  # this epoch's, also when resumed inside it
            state.clock.start()
            w.heartbeat.reset_spent()
            skipped_before = [skipped(split) for split in (data.train, data.eval)]
            train_totals = train_epoch(step, train_dl, state, report.progress(epoch, state.batch + len(train_dl)),
                                       after_step, w.heartbeat)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the epoch ends when the GPU's queue is done, not when Python's is
            seconds = state.clock.elapsed()
            spent, spent_steps = w.heartbeat.reset_spent()
            w.heartbeat.at(EVAL)
            evaluated = eval_epoch(parallel.model, eval_dl, step)
            if skipped_before[0] is not None:  # bad images skipped this epoch, in training and evaluation
                now = [skipped(split) for split in (data.train, data.eval)]
                train_totals.skipped = (train_totals.skipped or 0) + sum(now) - sum(skipped_before)
            w.heartbeat.at(CHECKPOINT)  # and the epoch's metrics, whose collectives wait for every rank
            if compile_cache:
                compile_cache.save()  # what the epoch compiled after its first step (its shorter last batch)
            state.finish_epoch()
            metrics = epoch_metrics.row(state.epoch, state.step, state.step - first_step,
                                        optimizer.param_groups[0]["lr"], seconds, train_totals, evaluated,
                                        own=(spent.get(DATA, 0.0), spent.get(FORWARD, 0.0), spent_steps),
                                        straggler_factor=job.failure.straggler_factor)
            # The same decision on every rank: it reads all-reduced metrics.
            stop = state.early_stopping.update(metrics) if state.early_stopping else None
            save = (state.epoch % job.checkpoint.every_epochs == 0 or state.epoch == tc.epochs or stop
                    or after_step.save_at_epoch_end)
            trackers.epoch(metrics)  # (durable before the epoch's checkpoint, as before a step's)
            state.rows.append(metrics)  # (in the checkpoint, for a driver that dies before its row)
            report_to_ray({**metrics, **after_step.answer()} if save else metrics, state, w, about if save else None,
                          after_step.background, urgent=after_step.save_at_epoch_end)
            if after_step.save_at_epoch_end:
                report.info("notice answered: the checkpoint at step %d is written", state.step)
                after_step.save_at_epoch_end = False
            report.epoch(metrics)
            if stop:
                report.stopped_early({"epoch": state.epoch, "reason": stop})
            report.sync()
            if stop:
                break
            if after_step.stop_after_epoch and state.epoch < tc.epochs:  # (after the last, the run is done)
                raise preemption.Stopping(after_step.stop_after_epoch)
    except NonFiniteLoss as e:  # every rank stops here at the same step: a clean stop, not a crash
        report.nonfinite({"epoch": state.epoch + 1, "step": e.step, "lr": e.lr})
    except preemption.Stopping as e:  # every rank at the same step, after its checkpoint
        report.stopped(e.where)
    finally:
        after_step.close()  # the checkpoint still being written, if any, before this rank ends
        trackers.close()
        if compile_cache:
            compile_cache.close()


def resume_warnings(saved: Optional[dict], now: dict, mid_epoch: bool, resized: bool = False) -> list[str]:
    """What a resume cannot reproduce exactly: another world size, strategy or mesh than the
    checkpoint's (the rest of the epoch under way is still trained once, sample for sample, see
    `data.TrainShard`), unless an elastic run `resized` (the driver says so), or, inside an epoch,
    a streamed dataset whose row groups changed since or whose world size did."""
    if not saved:  # a checkpoint from before layouts were recorded
        return []
    warnings = []
    if not resized and any(saved[k] != now[k] for k in ("world_size", "strategy", "mesh")):
        how = " through torch.distributed.checkpoint" if saved["mesh"] else ""
        warnings.append(f"resharded{how} from {describe_layout(saved)} to {describe_layout(now)}: the run goes on "
                        "from the saved state, but is not bitwise the run it would have been")
    if saved.get("data") != now["data"] and mid_epoch:
        warnings.append("the streamed dataset's files changed since the checkpoint: the epoch under way goes on "
                        "over the new row groups from the same batch, not exactly as it would have")
    elif now["data"] and mid_epoch and saved["world_size"] != now["world_size"]:
        warnings.append(f"a streamed dataset is read in a stretch per rank: the epoch under way goes on over "
                        f"{now['world_size']} ranks' stretches from the same batch, so some of its rows are read "
                        "twice or not at all (resume at the same world size, or at an epoch's end, to avoid it)")
    return warnings


@dataclass
class Step:
    """How an optimizer step runs: which model the step calls (DDP and/or compiled), in which
    precision, over how many micro-batches, with what clipping, where batches go, and what the
    task computes from them."""

    model: nn.Module
    precision: "Precision"
    task: Task
    accum_steps: int = 1
    grad_clip: Optional[float] = None
    device: torch.device = torch.device("cpu")
    memory_format: torch.memory_format = torch.contiguous_format
    cuda_graphs: bool = False  # the compiled step replays CUDA graphs: mark where each step begins
    loss_check: Optional[LossCheck] = None
    samples_per_batch: int = 0  # of the epoch's permutation, over all ranks: how far a micro-batch moves it
    compiled: bool = False  # the epoch's last batch, often shorter, may compile a graph of its own


def train_epoch(step: Step, loader, state: TrainState, on_batch: Optional[Callable[[int], None]] = None,
                after_step: Optional[Callable[[TrainState, bool], None]] = None,
                heartbeat: Optional[Heartbeat] = None) -> Totals:
    """One pass over this rank's shard (or its rest, from `state.batch`); returns its unreduced loss totals.

    With gradient accumulation, each optimizer step averages the gradients of up to
    `accum_steps` micro-batches. DDP all-reduces on every backward unless told not to, so the
    non-final micro-batches run under `no_sync()`: one all-reduce per optimizer step. The
    `heartbeat` hears each phase as it begins.
    """
    step.model.train()
    if not (state.batch and state.totals):  # a fresh epoch; a resumed one continues its restored sums
        state.totals = Totals(step.device)
    totals = state.totals
    n = state.batch + len(loader)
    at, stepped = (heartbeat.at, heartbeat.stepped) if heartbeat else (_unheard, _unheard)
    at(DATA)
    waited_since = time.perf_counter()
    for i, batch in enumerate(loader, start=state.batch):
        totals.data_wait_s += time.perf_counter() - waited_since  # the loader's share of the epoch
        compiling = step.compiled and i + 1 == n
        at(COMPILE if compiling else FORWARD)
        batch = step.task.move(batch, step.device, step.memory_format)
        window_start = i - i % step.accum_steps
        window_end = min(window_start + step.accum_steps, n)  # the epoch's last window may be shorter
        last = i + 1 == window_end
        sync = no_grad_sync(step.model) if not last else nullcontext()
        if step.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs may be overwritten
        with sync:
            with step.precision.autocast():
                loss, count, named = step.task.train_loss(step.model, batch)
            window = window_end - window_start
            at(COMPILE if compiling else BACKWARD)
            step.precision.backward(loss / window if window > 1 else loss)
        totals.add(loss, count, named)
        state.batch, state.samples = i + 1, state.samples + step.samples_per_batch
        if last:
            at(OPTIMIZER)
            lr = state.optimizer.param_groups[0]["lr"]
            step.precision.step(state.optimizer, state.model.parameters(), step.grad_clip)
            state.optimizer.zero_grad(set_to_none=True)
            state.scheduler.step()
            state.step += 1
            stepped(state.step)
            if step.loss_check:
                step.loss_check.after_step(totals.loss_sum, state.step, lr)
            if after_step:
                at(AFTER_STEP)
                after_step(state, i + 1 == n)
        if on_batch:
            on_batch(i + 1)
        at(DATA)
        waited_since = time.perf_counter()
    if step.loss_check:
        step.loss_check.settle()
    return totals


def _unheard(*_) -> None:
    """What a loop without a heartbeat (a test's, a benchmark's) does at each phase."""


def eval_epoch(model: nn.Module, loader, step: Step) -> dict[str, float]:
    """The task's metrics over every rank's unpadded eval shard: each rank sums over its own,
    the sums are all-reduced, and only then divided."""
    return step.task.metrics(evaluation_sums(model, loader, step))


@torch.no_grad()
def evaluation_sums(model: nn.Module, loader, step: Step) -> dict[str, torch.Tensor]:
    """The task's sums over every rank's unpadded eval shard, all-reduced.

    Takes the bare model, not the DDP wrapper: evaluation needs no gradient sync, and ranks may
    hold one batch more or less than each other. A sharded model gathers its parameters from
    every rank in each forward, so there a rank short of batches repeats its first one, its
    sums dropped, until every rank has run as many forwards.
    """
    model.eval()
    sums = Sums()
    rounds = int(global_max(len(loader), step.device)) if is_sharded(model) else len(loader)
    first = None
    for batch in loader:
        batch = step.task.move(batch, step.device, step.memory_format)
        with step.precision.autocast():
            sums.add(step.task.eval_sums(model, batch))
        first = batch if first is None else first
    for _ in range(rounds - len(loader)):
        with step.precision.autocast():
            step.task.eval_sums(model, first)
    model.train()
    return sums.all_reduce()


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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
