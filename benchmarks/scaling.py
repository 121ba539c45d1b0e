"""CPU scaling of raytrain-app on Gloo: 1, 2 and 4 workers at a fixed per-worker batch.

Each run trains the same model on synthetic CIFAR-shaped data sized so that every worker takes
the same number of steps per epoch (train_size = steps x batch x workers), in fp32, with one CPU
(and so one torch thread) per worker. All runs share one embedded Ray cluster; then each runs
again in local mode (`--local`: no Ray cluster, torch's launcher). For each worker
count it prints the global samples/s (median over the epochs after the first), the scaling
efficiency, samples/s / (workers x one worker's samples/s), and where an epoch's time goes,
from the workers' own metrics: waiting for data, gradient all-reduce (an estimate: an upper
bound, since it assumes no overlap with the backward pass) and compute. Target: efficiency
>= 0.85 at 2 and 4 workers. Beside it, the same work as a hand-written DDP loop under
`torchrun --standalone` (`plain_ddp_scaling.py`) gives the efficiency this machine allows
without Ray.

Workers are processes, one per core: on a machine with fewer cores than workers they share
cores, and efficiency < 1 there measures oversubscription, not the trainer.

    python benchmarks/scaling.py                                     # LeNet, batch 64, 1, 2, 4 workers
    python benchmarks/scaling.py --model mlp --json runs/scaling-mlp.json
    python benchmarks/scaling.py --workers 1,2 --steps 10 --epochs 2   # smoke test

With `--hooks none,fp16,bf16,powersgd`, each DDP communication hook (`ddp.comm_hook`) trains the
same job again at the largest worker count, in local mode, in a table of its own beside torchrun
DDP. On one machine the workers' all-reduce goes over loopback, which moves gigabytes a second
on the same cores that compute, so there is little to save. `--link 2gbit` (root, Linux `tc`)
throttles loopback for the whole run to the bandwidth of a cluster's network, where the
all-reduce costs what it costs between nodes; it is put back when the run ends.

    python benchmarks/scaling.py --model mlp --workers 1,2 --hooks none,fp16,bf16,powersgd
    sudo python benchmarks/scaling.py --model mlp --workers 1,2 --hooks none,fp16,bf16,powersgd --link 2gbit
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager

import torch

from raytrain_app.cluster.session import embedded_cluster
from raytrain_app.driver.trainer import run_training

# The job, plan and table helpers of benchmarks/throughput.py, beside this file.
from throughput import median_after_first, print_table, raytrain_job, raytrain_plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="1,2,4", help="comma list of worker counts; must include 1")
    p.add_argument("--model", choices=["resnet18", "lenet", "mlp"], default="lenet")
    p.add_argument("--batch", type=int, default=64, help="per-worker batch")
    p.add_argument("--steps", type=int, default=100, help="steps per worker per epoch")
    p.add_argument("--epochs", type=int, default=4, help="epochs; the first is warm-up")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override the job config, e.g. train.ddp_bucket_cap_mb=1; repeatable")
    p.add_argument("--hooks", help="comma list of ddp.comm_hook values to compare at the largest worker count")
    p.add_argument("--link", help="throttle loopback to this rate for the run (tc's units: 2gbit, 500mbit)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    with throttled_loopback(args.link):
        run(p, args)


def run(p: argparse.ArgumentParser, args) -> None:
    counts = sorted({int(w) for w in args.workers.split(",")})
    if counts[0] != 1:
        p.error("--workers must include 1: efficiency is relative to one worker")
    if args.epochs < 2:
        p.error("--epochs must be at least 2: the first epoch is warm-up")
    tmp = tempfile.mkdtemp(prefix="scaling-")
    plans = {w: raytrain_plan(raytrain_job(f"scaling-{w}", args.model, args.batch, args.steps, args.epochs, w,
                                           "fp32", "off", 0), args.overrides, os.path.join(tmp, f"workers-{w}"))
             for w in counts}

    histories, walls = {}, {}
    cpus = max(os.cpu_count() or 1, counts[-1])  # every worker gets its CPU, shared or not
    with embedded_cluster(num_cpus=cpus, num_gpus=0, log_dir=os.path.join(tmp, "logs")):
        for w, plan in plans.items():
            result = run_training(plan, echo=lambda *_: None)
            histories[w], walls[w] = result.metrics, result.wall_s
    local = {}
    for w in counts:  # the same jobs in local mode
        plan = raytrain_plan(raytrain_job(f"scaling-{w}", args.model, args.batch, args.steps, args.epochs, w, "fp32",
                                          "off", 0), args.overrides, os.path.join(tmp, f"local-{w}"), local=True)
        rows = run_training(plan, echo=lambda *_: None).metrics
        local[w] = median_after_first([row["samples_per_s"] for row in rows])

    def median_of(w: int, key: str):
        """Median of a metric over the epochs after the first; None where the rows do not carry it."""
        values = [row[key] for row in histories[w] if key in row]
        return median_after_first(values) if len(values) == len(histories[w]) else None

    plain = {w: median_after_first(plain_ddp(w, args)) for w in counts}
    rows, results = [], []
    single = median_of(1, "samples_per_s")
    for w in counts:
        rate, epoch_s = median_of(w, "samples_per_s"), median_of(w, "epoch_time_s")
        split = {k: median_of(w, k) for k in ("data_wait_frac", "comm_frac", "compute_frac")}
        efficiency = rate / (w * single)
        rows.append([str(w), f"{rate:,.0f}", f"{rate / w:,.0f}", f"{efficiency:.2f}",
                     f"{plain[w] / (w * plain[1]):.2f}", f"{rate / plain[w]:.2f}x", f"{local[w] / plain[w]:.2f}x",
                     *("-" if v is None else f"{v:.0%}" for v in split.values()), f"{epoch_s:.2f}", f"{walls[w]:.1f}"])
        results.append({"workers": w, "samples_per_s": rate, "efficiency": efficiency,
                        "plain_ddp_samples_per_s": plain[w], "local_mode_samples_per_s": local[w], **split,
                        "epoch_time_s": epoch_s, "wall_s": walls[w], "history": histories[w]})

    print(f"{os.cpu_count()} CPUs, torch {torch.__version__}, Gloo; {args.model}, batch {args.batch} per worker, fp32, "
          f"{args.steps} steps per worker x {args.epochs} epochs; run dirs and logs in {tmp}")
    print_table(["workers", "samples/s", "per worker", "efficiency", "torchrun DDP efficiency", "vs torchrun DDP",
                 "local mode vs torchrun DDP",
                 "data wait",
                 "comm (est.)", "compute",
                 "epoch s", "wall s"], rows)
    if counts[-1] > (os.cpu_count() or 1):
        print(f"note: {counts[-1]} workers on {os.cpu_count()} cores share cores; efficiency there measures "
              f"oversubscription, not the trainer")
    hooks = compare_hooks(args, counts[-1], plain[counts[-1]], tmp) if args.hooks else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "torch": torch.__version__, "args": vars(args), "results": results,
                       "hooks": hooks}, f, indent=1)


def compare_hooks(args, workers: int, plain: float, tmp: str) -> list[dict]:
    """Each communication hook at `workers` workers in local mode: samples/s against torchrun DDP's
    (no hook) and against raytrain-app with none, and the epoch line's estimate of the comm share."""
    found = []
    for hook in args.hooks.split(","):
        plan = raytrain_plan(raytrain_job(f"hook-{hook}", args.model, args.batch, args.steps, args.epochs, workers,
                                          "fp32", "off", 0), [*args.overrides, f"ddp.comm_hook={hook}"],
                             os.path.join(tmp, f"hook-{hook}"), local=True)
        rows = run_training(plan, echo=lambda *_: None).metrics
        found.append({"hook": hook, "samples_per_s": median_after_first([r["samples_per_s"] for r in rows]),
                      "comm_frac": median_after_first([r["comm_frac"] for r in rows])})
    none = next((f["samples_per_s"] for f in found if f["hook"] == "none"), None)
    link = f", loopback throttled to {args.link}" if args.link else ""
    print(f"\nddp.comm_hook at {workers} workers, local mode{link}:")
    print_table(["comm_hook", "samples/s", "vs torchrun DDP", "vs none", "comm (est.)"],
                [[f["hook"], f"{f['samples_per_s']:,.0f}", f"{f['samples_per_s'] / plain:.2f}x",
                  f"{f['samples_per_s'] / none:.2f}x" if none else "-", f"{f['comm_frac']:.0%}"] for f in found])
    return found


@contextmanager
def throttled_loopback(rate: str | None):
    """Loopback at `rate` (a token bucket filter, Linux tc), as a cluster's network would carry
    the all-reduce; None: as it is."""
    if not rate:
        yield
        return
    tc = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
    added = subprocess.run(tc, capture_output=True, text=True)
    if added.returncode:
        raise SystemExit(f"error: --link {rate}: {' '.join(tc)} failed (root and a loopback without a qdisc "
                         f"needed): {added.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=True)


def plain_ddp(workers: int, args) -> list[float]:
    """Per-epoch global samples/s of the hand-written DDP loop on `workers` torchrun processes."""
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node",
           str(workers), os.path.join(here, "plain_ddp_scaling.py"), "--model", args.model, "--batch", str(args.batch),
           "--steps", str(args.steps), "--epochs", str(args.epochs)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])["samples_per_s"]


if __name__ == "__main__":
    main()
