"""Step time of raytrain-app's worker loop against a minimal hand-written PyTorch loop.

Both run in this one process, on the same model, data, batch size and precision, alternating
epoch by epoch so that machine noise hits both alike; the ratio of their median step times is
the cost of the loop's machinery (DistributedSampler, DataLoader, metric sums, LR schedule).

    python benchmarks/step_overhead.py                       # CPU, LeNet, fp32
    python benchmarks/step_overhead.py --model resnet18 --device cuda --precision bf16 --batch 512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from raytrain_app.config import DataConfig, ModelConfig, OptimizerConfig, ScheduleConfig
from raytrain_app.data import build_datasets, train_loader
from raytrain_app.loop import Precision, Step, seed_everything, train_epoch
from raytrain_app.models import build_model
from raytrain_app.nonfinite import LossCheck
from raytrain_app.optim import build_optimizer, build_schedule
from raytrain_app.state import TrainState


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
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    data = build_datasets(DataConfig(name="synthetic", args={"shape": [3, 32, 32], "train_size": args.steps * args.batch,
                                                             "eval_size": 8}))
    seed_everything(0)
    ours = build_model(ModelConfig(name=args.model), data.input_shape, 10).to(device)
    hand = build_model(ModelConfig(name=args.model), data.input_shape, 10).to(device)
    hand.load_state_dict(ours.state_dict())

    # raytrain-app: the worker loop's own epoch function, at world size 1.
    loader, sampler = train_loader(data, args.batch, 0, 1, 0, 0, device.type == "cuda")
    opt = build_optimizer(ours.parameters(), OptimizerConfig(lr=0.01), 1)
    precision = Precision(args.precision, device)
    state = TrainState(ours, opt, build_schedule(opt, ScheduleConfig(name="constant"), len(loader), 10_000),
                       precision.scaler)

    # The non-finite-loss check is on by default in every run (train.stop_on_nonfinite).
    step = Step(ours, precision, device=device, loss_check=LossCheck(device))

    def run_ours(epoch: int) -> None:
        sampler.set_epoch(epoch)
        train_epoch(step, loader, state)
        state.finish_epoch()

    # The hand-written loop: index the tensors, normalise, step.
    hand_opt = torch.optim.SGD(hand.parameters(), lr=0.01, momentum=0.9)
    x_all, y_all, mean, std = data.train.x, data.train.y, data.train.mean, data.train.std
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    scaler = torch.amp.GradScaler(device.type) if args.precision == "fp16" else None

    def run_hand(epoch: int) -> None:
        perm = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(epoch))
        for i in range(0, len(perm), args.batch):
            idx = perm[i:i + args.batch]
            x = x_all[idx].float().sub_(mean).div_(std).to(device, non_blocking=True)
            y = y_all[idx].to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(hand(x), y)
            hand_opt.zero_grad(set_to_none=True)
            if scaler:
                scaler.scale(loss).backward()
                scaler.step(hand_opt)
                scaler.update()
            else:
                loss.backward()
                hand_opt.step()

    def timed(fn, epoch: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(epoch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / args.steps

    run_ours(0), run_hand(0)  # warm-up: allocator, kernels, caches
    print(f"{args.model} batch {args.batch} {args.precision} on {args.device}, torch threads "
          f"{torch.get_num_threads()}, {args.steps} steps x {args.rounds} rounds x {args.repeats} repeats")
    ratios = []
    for repeat in range(args.repeats):
        times = {"raytrain-app": [], "hand-written": []}
        for r in range(1, args.rounds + 1):
            order = [("raytrain-app", run_ours), ("hand-written", run_hand)]
            for name, fn in (order if r % 2 else order[::-1]):
                times[name].append(timed(fn, r))
        med = {k: statistics.median(v) for k, v in times.items()}
        ratios.append(med["raytrain-app"] / med["hand-written"])
        print(f"  repeat {repeat + 1}: " + ", ".join(f"{name} {t * 1e3:.2f} ms/step" for name, t in med.items())
              + f", ratio {ratios[-1]:.3f}")
    print(f"  ratio raytrain-app / hand-written: median {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f} to {max(ratios):.3f} over {len(ratios)} repeats")


if __name__ == "__main__":
    main()
