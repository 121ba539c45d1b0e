"""Step time of raytrain-app's worker loop against a minimal hand-written PyTorch loop.

Both run in this one process, on the same model, data, batch size and precision, alternating
epoch by epoch so that machine noise hits both alike; the ratio of their median step times is
the cost of the loop's machinery (DistributedSampler, DataLoader, metric sums, LR schedule,
the heartbeat's phase marks). The loop also runs without its heartbeat, in turn with the other
two: the ratio of those two is what the hang watch's progress signal costs a step.

    python benchmarks/step_overhead.py                       # CPU, LeNet, fp32
    python benchmarks/step_overhead.py --model resnet18 --device cuda --precision bf16 --batch 512
    python benchmarks/step_overhead.py --step custom          # the same step as a custom step function
    python benchmarks/step_overhead.py --model resnet18 --device cuda --precision bf16 --batch 512 \
        --compile reduce-overhead --on-device on --profile    # + a profile of one epoch of each

`--compile` and `--on-device` apply to both loops, as the worker loop applies them (CUDA graphs
at one worker, batches cut on the device). `--profile` then runs one epoch of each loop under
the torch profiler and prints where the time goes and how often the host waited for the GPU:
the first things to read when the ratio is off.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from raytrain_app.config.sections import DataConfig, ModelConfig, OptimizerConfig, ScheduleConfig, TaskConfig
from raytrain_app.data import build_datasets, keep_on_device, to_device, train_loader
from raytrain_app.models import build_model
from raytrain_app.tasks import build_task
from raytrain_app.tasks.custom import CustomStep
from raytrain_app.worker.heartbeat import Heartbeat
from raytrain_app.worker.loop import Precision, Step, seed_everything, train_epoch
from raytrain_app.worker.nonfinite import LossCheck
from raytrain_app.worker.optim import build_optimizer, build_schedule
from raytrain_app.worker.state import TrainState
from raytrain_app.worker.strategy import compiled


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lenet")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=40, help="steps per timed epoch")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeats", type=int, default=5, help="independent measurements, for the ratio's median and range")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--compile", default="off", choices=["off", "default", "reduce-overhead", "max-autotune"])
    p.add_argument("--on-device", default="auto", choices=["auto", "on", "off"], help="as data.on_device")
    p.add_argument("--profile", action="store_true", help="then profile one epoch of each loop")
    p.add_argument("--step", choices=["builtin", "custom"], default="builtin",
                   help="custom: the same cross-entropy step given as a custom step (task.name: pkg.module:step)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    data = build_datasets(DataConfig(name="synthetic", args={"shape": [3, 32, 32],
                                                             "train_size": args.steps * args.batch, "eval_size": 8}))
    seed_everything(0)
    # channels_last for conv nets on CUDA, as the worker loop's `channels_last: auto` does.
    conv = args.model != "mlp"
    fmt = torch.channels_last if device.type == "cuda" and conv else torch.contiguous_format
    ours = build_model(ModelConfig(name=args.model), data.input_shape, 10).to(device, memory_format=fmt)
    hand = build_model(ModelConfig(name=args.model), data.input_shape, 10).to(device, memory_format=fmt)
    hand.load_state_dict(ours.state_dict())
    resident = keep_on_device(data, args.on_device, device)
    data = to_device(data, device) if resident else data

    # raytrain-app: the worker loop's own epoch function, at world size 1.
    loader, sampler = train_loader(data, args.batch, 0, 1, 0, 0, device.type == "cuda" and not resident, resident)
    opt = build_optimizer(ours.parameters(), OptimizerConfig(lr=0.01), 1)
    precision = Precision(args.precision, device)
    state = TrainState(ours, opt, build_schedule(opt, ScheduleConfig(name="constant"), len(loader), 10_000),
                       precision.scaler)

    # The non-finite-loss check is on by default in every run (train.stop_on_nonfinite).
    step_model, graphs = compiled(ours, args.compile, 1, 1, device, print)
    task = CustomStep(cross_entropy_step) if args.step == "custom" else build_task(TaskConfig())
    step = Step(step_model, precision, device=device, memory_format=fmt, cuda_graphs=graphs,
                loss_check=LossCheck(device), task=task)

    # Beats as a worker sends them, every 2 s from a thread of their own, here to nowhere.
    heartbeat = Heartbeat(0, "bench", lambda beat: None).start()

    def run_ours(epoch: int, beats: Heartbeat = heartbeat) -> None:
        sampler.set_epoch(epoch)
        train_epoch(step, loader, state, heartbeat=beats)
        state.finish_epoch()

    # The hand-written loop: index the tensors, normalise, step.
    hand_opt = torch.optim.SGD(hand.parameters(), lr=0.01, momentum=0.9)
    x_all, y_all, mean, std = data.train.x, data.train.y, data.train.mean, data.train.std
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    scaler = torch.amp.GradScaler(device.type) if args.precision == "fp16" else None

    hand_step = torch.compile(hand, mode=None if args.compile == "default" else args.compile) \
        if args.compile != "off" else hand

    def run_hand(epoch: int) -> None:
        perm = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(epoch)).to(x_all.device)
        for i in range(0, len(perm), args.batch):
            idx = perm[i:i + args.batch]
            x = x_all[idx].float().sub_(mean).div_(std).to(device, non_blocking=True, memory_format=fmt)
            y = y_all[idx].to(device, non_blocking=True)
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(hand_step(x), y)
            hand_opt.zero_grad(set_to_none=True)
            if scaler:
                scaler.scale(loss).backward()
                scaler.step(hand_opt)
                scaler.update()
            else:
                loss.backward()
                hand_opt.step()

    run_ours(0), run_hand(0)  # warm-up: allocator, kernels, caches
    print(f"{args.model} batch {args.batch} {args.precision} on {args.device}, torch threads "
          f"{torch.get_num_threads()}, {args.steps} steps x {args.rounds} rounds x {args.repeats} repeats")
    ratios, beats = [], []
    for repeat in range(args.repeats):
        med = alternate({"raytrain-app": run_ours, "no heartbeat": lambda epoch: run_ours(epoch, None),
                         "hand-written": run_hand}, device, args.steps, args.rounds)
        ratios.append(med["raytrain-app"] / med["hand-written"])
        beats.append(med["raytrain-app"] / med["no heartbeat"])
        print(f"  repeat {repeat + 1}: " + ", ".join(f"{name} {t * 1e3:.2f} ms/step" for name, t in med.items())
              + f", ratio {ratios[-1]:.3f}, heartbeat {beats[-1]:.3f}")
    print(f"  ratio raytrain-app / hand-written: median {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f} to {max(ratios):.3f} over {len(ratios)} repeats")
    print(f"  ratio with / without the heartbeat: median {statistics.median(beats):.4f}, "
          f"range {min(beats):.4f} to {max(beats):.4f}")
    heartbeat.stop()
    if args.profile:
        for name, fn in (("raytrain-app", run_ours), ("hand-written", run_hand)):
            print_profile(name, fn, device, args.steps)


def alternate(loops: dict, device: torch.device, steps: int, rounds: int) -> dict[str, float]:
    """Each loop's median seconds per step over `rounds` epochs of `steps` steps, the loops run in
    turn and in alternating order, so that machine noise hits them alike (`fsdp_throughput.py`
    times its loops with it too)."""
    times: dict = {name: [] for name in loops}
    for r in range(1, rounds + 1):
        for name, run_epoch in (list(loops.items()) if r % 2 else list(loops.items())[::-1]):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run_epoch(r)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / steps)
    return {name: statistics.median(t) for name, t in times.items()}


def cross_entropy_step(model, batch):
    """The built-in classification step, written as a user's custom step would be."""
    x, y = batch
    return F.cross_entropy(model(x), y)


# Host-side calls that wait for the GPU, or copy from it: each one stalls the CPU's kernel queue.
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::item",
         "aten::_local_scalar_dense", "Memcpy DtoH")


def print_profile(name: str, run_epoch, device: torch.device, steps: int) -> None:
    """The top operators by device (or CPU) time over one epoch, and the host syncs in it."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run_epoch(99)
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"\n== profile: {name}, one epoch of {steps} steps")
    print(events.table(sort_by=sort, row_limit=15, max_name_column_width=60))
    syncs = [f"{e.key} {e.count}" for e in events if any(s in e.key for s in SYNCS)]
    print("host syncs in the epoch: " + (", ".join(syncs) or "none"))


if __name__ == "__main__":
    main()
