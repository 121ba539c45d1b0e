"""Training throughput: the same work through raytrain-app and through four loops written by hand.

Every variant trains the same model (`raytrain_app.models.build_model`) on the same synthetic
CIFAR-shaped uint8 data (3x32x32), with the same per-step batch, SGD (lr 0.01, momentum 0.9),
for the same number of steps per epoch:

    raytrain-app        the library API (JobConfig -> make_plan -> run_training), 1 Ray Train worker
    hand eager          a minimal PyTorch loop, no Ray: data on the device as uint8, batches cut
                        by a random permutation and normalised there
    hand CUDA graphs    the same under torch.compile(mode="reduce-overhead") (CUDA only)
    seed-style          the tutorials' recipe: float32 TensorDataset on the host, DistributedSampler
                        + set_epoch, DataLoader(num_workers, pin_memory), fp32, DDP at world size 1
    plain TorchTrainer  a minimal Ray Train script whose worker runs the hand eager loop

On CUDA the hand loops and both Ray variants use bf16 autocast and channels_last for conv nets,
and raytrain-app compiles with reduce-overhead; on CPU everything is fp32 and eager, with one
torch thread per loop (Ray gives each 1-CPU worker OMP_NUM_THREADS=1, so --threads 1 compares
like with like). The two Ray variants share one embedded cluster, started after the in-process
loops have finished.

samples/s is the median over the epochs after the first (compilation, allocator and cuDNN
warm-up land in the first). wall s is the whole variant: for the in-process loops from making
the data to the last step; for the Ray variants the fit() call, which adds starting the worker
group and its process group, and for raytrain-app an evaluation pass per epoch and a checkpoint
at the end. `--set` values are YAML, as in `raytrain-app train --set`.

    python benchmarks/throughput.py                                  # CUDA if present: LeNet, batch 512
    python benchmarks/throughput.py --model resnet18 --json runs/throughput-resnet18.json
    python benchmarks/throughput.py --set data.on_device=off         # overrides for raytrain-app only
    python benchmarks/throughput.py --device cpu --steps 10 --epochs 2   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import tempfile
import time
import warnings

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from raytrain_app.cluster.session import embedded_cluster
from raytrain_app.config import with_overrides
from raytrain_app.config.sections import ModelConfig
from raytrain_app.data.synthetic import synthetic
from raytrain_app.driver.plan import make_plan
from raytrain_app.driver.trainer import run_training
from raytrain_app.errors import UserError
from raytrain_app.models import build_model
from raytrain_app.worker.metrics import peak_flops, train_flops_per_sample

SHAPE = [3, 32, 32]
NUM_CLASSES = 10
LABELS = {"raytrain-app": "raytrain-app", "hand-eager": "hand loop, eager", "hand-cudagraphs": "hand loop, CUDA graphs",
          "seed-style": "seed-style DDP", "plain-torchtrainer": "plain TorchTrainer"}
HAND_LOOPS = ("hand-eager", "hand-cudagraphs")


# ---- the loops ----------------------------------------------------------------------------------


def make_data(train_size: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """The training split raytrain-app's `synthetic` builder makes: uint8 pixels, labels, mean, std."""
    train, _ = synthetic(shape=SHAPE, num_classes=NUM_CLASSES, train_size=train_size, eval_size=1)
    return train.x, train.y, float(train.mean), float(train.std)


def make_model(name: str, device: torch.device) -> tuple[nn.Module, torch.memory_format]:
    """The same initial weights in every variant; channels_last lets cuDNN pick faster conv kernels."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=name), tuple(SHAPE), NUM_CLASSES)
    conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    fmt = torch.channels_last if device.type == "cuda" and conv else torch.contiguous_format
    return model.to(device, memory_format=fmt), fmt


def timed_epoch(device: torch.device, samples: int, epoch) -> float:
    """samples/s of one epoch; the GPU's queue is drained before each clock reading."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    epoch()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return samples / (time.perf_counter() - t0)


def hand_loop(model_name: str, batch: int, steps: int, epochs: int, device: torch.device, precision: str,
              cuda_graphs: bool = False, wrap=lambda model: model):
    """The least a PyTorch loop can do for this work; yields samples/s after each epoch.

    The data moves to the device once, as uint8, so a batch costs an index, a cast and a
    normalisation there: no DataLoader, no host-to-device copy. With `cuda_graphs` the model runs
    as replayed CUDA graphs, which removes the per-kernel launch cost that bounds small models.
    `wrap` puts the model in a wrapper first, e.g. DDP for `plain_ddp_scaling.py`.
    """
    x, y, mean, std = make_data(steps * batch)
    x, y = x.to(device), y.to(device)
    model, fmt = make_model(model_name, device)
    step_model = wrap(model)
    step_model = torch.compile(step_model, mode="reduce-overhead") if cuda_graphs else step_model
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dtype = torch.bfloat16 if precision == "bf16" else None

    def epoch() -> None:
        perm = torch.randperm(len(y), device=device)
        for i in range(steps):
            idx = perm[i * batch:(i + 1) * batch]
            xb = x[idx].float().sub_(mean).div_(std).contiguous(memory_format=fmt)
            if cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs may be reused
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(step_model(xb), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    for _ in range(epochs):
        yield timed_epoch(device, steps * batch, epoch)


def seed_style(model_name: str, batch: int, steps: int, epochs: int, device: torch.device,
               loader_workers: int) -> list[float]:
    """The recipe of the tutorials raytrain-app was designed from, at world size 1: what a user
    would otherwise write. Normalised float32 samples on the host, collated one sample at a time
    by DataLoader workers (restarted every epoch, as there), fp32, DDP over Gloo or NCCL."""
    x, y, mean, std = make_data(steps * batch)
    dataset = TensorDataset(x.float().sub_(mean).div_(std), y)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        model, _ = make_model(model_name, device)
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        sampler = DistributedSampler(dataset, shuffle=True)
        loader = DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=loader_workers,
                            pin_memory=device.type == "cuda")

        def epoch() -> None:
            for xb, yb in loader:
                xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                loss = F.cross_entropy(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()

        rates = []
        for e in range(epochs):
            sampler.set_epoch(e)  # a new shuffle each epoch
            rates.append(timed_epoch(device, steps * batch, epoch))
        return rates
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain_train_func(config: dict) -> dict:
    """A Ray Train worker running the hand eager loop: data and model built here, in the worker,
    and a report every epoch, as a plain TorchTrainer script would. Ray Train V2 keeps only
    checkpointed metrics in its Result, so the per-epoch figures come back as the return value."""
    rates = []
    for rate in hand_loop(config["model"], config["batch"], config["steps"], config["epochs"],
                          ray.train.torch.get_device(), config["precision"]):
        rates.append(rate)
        ray.train.report({"epoch": len(rates), "samples_per_s": rate})
    return {"samples_per_s": rates, "torch_threads": torch.get_num_threads()}


def plain_torchtrainer(args, storage: str) -> tuple[list[float], float, int]:
    """Per-epoch samples/s, fit() seconds, and the worker's torch threads."""
    trainer = ray.train.torch.TorchTrainer(
        plain_train_func,
        train_loop_config={k: getattr(args, k) for k in ("model", "batch", "steps", "epochs", "precision")},
        scaling_config=ray.train.ScalingConfig(num_workers=1, use_gpu=args.device == "cuda"),
        run_config=ray.train.RunConfig(name="plain-torchtrainer", storage_path=storage),
    )
    t0 = time.perf_counter()
    result = trainer.fit()
    wall = time.perf_counter() - t0
    return result.return_value["samples_per_s"], wall, result.return_value["torch_threads"]


# ---- raytrain-app (shared with scaling.py) ------------------------------------------------------


def raytrain_job(name: str, model: str, batch: int, steps: int, epochs: int, workers: int, precision: str,
                 compile_mode: str, gpus_per_worker: int) -> dict:
    """A raytrain-app job over synthetic CIFAR-shaped data giving each worker `steps` batches per epoch.

    The schedule is constant (as in the hand loops), evaluation runs on one batch per worker, and
    the only checkpoint is the last epoch's: what the wall time adds to the hand loops stays small.
    """
    return {
        "name": name,
        "data": {"name": "synthetic", "args": {"shape": SHAPE, "train_size": steps * batch * workers,
                                               "eval_size": batch * workers}},
        "model": {"name": model},
        "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "schedule": {"name": "constant"},
        "train": {"batch_size": batch, "epochs": epochs, "precision": precision, "compile": compile_mode},
        "checkpoint": {"every_epochs": epochs},
        "scaling": {"workers": workers, "gpus_per_worker": gpus_per_worker, "cpus_per_worker": 1},
    }


def raytrain_plan(raw: dict, overrides: list[str], run_dir: str, local: bool = False):
    """Apply `--set` overrides and plan on the driver, before any cluster starts: a typo fails in a second."""
    try:
        return make_plan(with_overrides(raw, overrides, "benchmark"), run_dir=run_dir, source="benchmark", local=local)
    except UserError as e:  # ConfigError included: a line per problem, not a traceback
        raise SystemExit("\n".join(f"error: {line}" for line in e.lines)) from None


def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}x" if base else "-"


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    """A Markdown table, columns aligned, ready to paste into benchmarks/README.md."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    for row in [headers, ["-" * w for w in widths], *rows]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")


# ---- main ---------------------------------------------------------------------------------------


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if cuda else "cpu")
    p.add_argument("--model", choices=["resnet18", "lenet", "mlp"], default="lenet")
    p.add_argument("--batch", type=int, help="per-step batch (default 512 on cuda, 128 on cpu)")
    p.add_argument("--precision", choices=["fp32", "bf16"], help="hand loops and Ray variants (default bf16 on "
                                                                 "cuda, fp32 on cpu); seed-style is always fp32")
    p.add_argument("--steps", type=int, default=50, help="steps per epoch")
    p.add_argument("--epochs", type=int, default=4, help="epochs; the first is warm-up")
    p.add_argument("--loader-workers", type=int, default=4, help="seed-style DataLoader worker processes")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the in-process loops on cpu")
    p.add_argument("--variants", default=",".join(LABELS), help="comma list, from: " + ", ".join(LABELS))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override raytrain-app's job config, e.g. data.on_device=on; repeatable")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    # The seed recipe's 4 loader workers on a small machine draw a warning; the table says what they cost.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    on_cuda = args.device == "cuda"
    args.batch = args.batch or (512 if on_cuda else 128)
    args.precision = args.precision or ("bf16" if on_cuda else "fp32")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(LABELS)
    if unknown:
        p.error(f"unknown variants {', '.join(sorted(unknown))}; choose from {', '.join(LABELS)}")
    if args.epochs < 2:
        p.error("--epochs must be at least 2: the first epoch is warm-up")
    if not on_cuda:
        variants = [v for v in variants if v != "hand-cudagraphs"]  # CUDA graphs need CUDA
        torch.set_num_threads(args.threads)
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    tmp = tempfile.mkdtemp(prefix="throughput-")
    if "raytrain-app" in variants:
        plan = raytrain_plan(
            raytrain_job("throughput", args.model, args.batch, args.steps, args.epochs, 1, args.precision,
                         "reduce-overhead" if on_cuda else "off", 1 if on_cuda else 0),
            args.overrides, os.path.join(tmp, "raytrain-app"))

    rates: dict[str, list[float]] = {}
    wall: dict[str, float] = {}
    in_process = {
        "seed-style": lambda: seed_style(args.model, args.batch, args.steps, args.epochs, device, args.loader_workers),
        "hand-eager": lambda: list(hand_loop(args.model, args.batch, args.steps, args.epochs, device, args.precision)),
        "hand-cudagraphs": lambda: list(hand_loop(args.model, args.batch, args.steps, args.epochs, device,
                                                  args.precision, cuda_graphs=True)),
    }
    for name, run in in_process.items():
        if name in variants:
            t0 = time.perf_counter()
            rates[name] = run()
            wall[name] = time.perf_counter() - t0
            if on_cuda:  # hand the memory back: the Ray workers share this GPU
                torch.compiler.reset()
                torch.cuda.empty_cache()

    worker_threads = None
    if {"plain-torchtrainer", "raytrain-app"} & set(variants):
        with embedded_cluster(num_cpus=os.cpu_count() or 1, num_gpus=1 if on_cuda else 0,
                              log_dir=os.path.join(tmp, "logs")):
            if "plain-torchtrainer" in variants:
                rates["plain-torchtrainer"], wall["plain-torchtrainer"], worker_threads = plain_torchtrainer(args, tmp)
            if "raytrain-app" in variants:
                result = run_training(plan, echo=lambda *_: None)
                rates["raytrain-app"] = [row["samples_per_s"] for row in result.metrics]
                wall["raytrain-app"] = result.wall_s

    median = {name: median_after_first(r) for name, r in rates.items()}
    best_plain = max((median[n] for n in HAND_LOOPS if n in median), default=None)
    seed = median.get("seed-style")
    if on_cuda:
        where = f"cuda ({torch.cuda.get_device_name(device)})"
    else:
        where = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; torch threads: " \
                f"in-process {torch.get_num_threads()}, Ray worker {worker_threads or '-'})"
    print(f"{where}, torch {torch.__version__}; {args.model}, batch {args.batch}, {args.precision}, "
          f"{args.steps} steps x {args.epochs} epochs; run dirs and logs in {tmp}")
    order = [n for n in LABELS if n in rates]
    # MFU: every variant does the same FLOPs per sample; the peak is the GPU's bf16 dense one,
    # also for seed-style's fp32, so its figure says how far fp32 stays from what the chip offers.
    flops = train_flops_per_sample(make_model(args.model, torch.device("cpu"))[0], tuple(SHAPE))
    peak = peak_flops(torch.cuda.get_device_name(device), "bf16") if on_cuda else None
    mfu = {n: f"{median[n] * flops / peak:.1%}" if flops and peak else "-" for n in order}
    print_table(["variant", "samples/s", "wall s", "vs best plain loop", "vs seed-style", "MFU (bf16 peak)"],
                [[LABELS[n], f"{median[n]:,.0f}", f"{wall[n]:.1f}", ratio(median[n], best_plain),
                  ratio(median[n], seed), mfu[n]] for n in order])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "torch": torch.__version__, "args": vars(args),
                       "flops_per_sample": flops, "peak_flops": peak,
                       "results": [{"variant": n, "samples_per_s": median[n], "wall_s": wall[n],
                                    "samples_per_s_by_epoch": rates[n]} for n in order]}, f, indent=1)


if __name__ == "__main__":
    main()
