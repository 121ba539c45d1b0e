"""The training loop's stall per checkpoint, written in the loop against `checkpoint.async`.

    python benchmarks/checkpoint_stall.py                          # gpt 12 x 768: 86M parameters, ~1 GiB of state
    python benchmarks/checkpoint_stall.py --layers 4 --embd 256    # a quick look (~50 MB)
    python benchmarks/checkpoint_stall.py --device cuda --local-only   # on a GPU, bf16 autocast; local disk only

One process, as local mode's one worker: the built-in `gpt` (vocabulary 256, 256 tokens) with
AdamW, one step taken so that the optimizer's state exists, checkpointed through the loop's own
`report_to_ray` (`worker/after_step.py`) into a run directory on this machine's disk and into one
on an S3-compatible server on loopback (moto, started as tests/objectstore.py starts it). For
each, sync and async take turns, `--checkpoints` of each, with `--steps` training steps after
each checkpoint and then whatever wait the background write still needs: a loop whose
checkpoints are further apart than a write takes (a checkpoint closer than that waits for the one
before, and its stall grows by what is left of that write).

Printed for each target, as medians over its checkpoints: the stall (how long `report_to_ray` held
the loop: the whole write when sync, the copy to host memory when async), the async/sync ratio,
how long the background write took, and the step time after a sync checkpoint (no write under
way) against the step time while an async write runs (on CPU the write takes cores from it).
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from raytrain_app.config import JobConfig  # noqa: E402
from raytrain_app.models.gpt import gpt  # noqa: E402
from raytrain_app.worker.after_step import Background, report_to_ray  # noqa: E402
from raytrain_app.worker.optim import build_optimizer, build_schedule  # noqa: E402
from raytrain_app.worker.rank import Worker  # noqa: E402
from raytrain_app.worker.reporter import Reporter  # noqa: E402
from raytrain_app.worker.state import TrainState  # noqa: E402

TOKENS = 256
GOALS = {"local disk": 1 / 4, "S3 (moto on loopback)": 1 / 10}  # async stall / sync stall, at most


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--embd", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--checkpoints", type=int, default=3, help="of each kind, to each target")
    p.add_argument("--steps", type=int, default=1, help="training steps after each checkpoint")
    p.add_argument("--device", default="cpu", help="cuda: the model and its state on the GPU, steps in bf16 autocast")
    p.add_argument("--local-only", action="store_true", help="no S3 target (a machine without moto)")
    args = p.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = gpt((TOKENS + 1,), 256, n_layer=args.layers, n_head=args.heads, n_embd=args.embd).to(device)
    job = JobConfig.from_dict({"name": "stall", "optimizer": {"name": "adamw", "lr": 1e-4},
                               "checkpoint": {"keep": 1, "metric": "train_loss", "mode": "min"}})
    optimizer = build_optimizer(model.parameters(), job.optimizer, 1)
    state = TrainState(model, optimizer, build_schedule(optimizer, job.schedule, 1000, 10), None)
    tokens = torch.randint(0, 256, (1, TOKENS + 1), device=device)

    def train_step() -> float:
        start = time.perf_counter()
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[0, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.scheduler.step()
        state.step += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    train_step()
    tensors = [*model.state_dict().values(), *(t for s in optimizer.state.values() for t in s.values())]
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"{device}: gpt {args.layers} x {args.embd}: {params:.1f}M parameters, "
          f"AdamW, {sum(t.numel() * t.element_size() for t in tensors) / 2**30:.2f} GiB of state; "
          f"{torch.get_num_threads()} torch threads; {args.checkpoints} checkpoints of each kind to each target, "
          f"{args.steps} step(s) after each")

    scratch = tempfile.mkdtemp(prefix="raytrain-stall-")
    targets = {"local disk": os.path.join(scratch, "run")}
    proc = None
    try:
        if not args.local_only:
            from tests.objectstore import start_moto

            proc, store = start_moto(os.path.join(scratch, "moto.log"))
            os.environ.update(store.env)
            targets["S3 (moto on loopback)"] = f"s3://{store.bucket}/run"
        times = {target: checkpoints(job, run_dir, scratch, state, train_step, args, device)
                 for target, run_dir in targets.items()}
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)

    print("| target | sync stall s | async stall s | async / sync | goal | async write s (background) | "
          "step s, no write | step s, during an async write |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for target, t in times.items():
        m = {name: statistics.median(values) for name, values in t.items()}
        ratio = m["async stall"] / m["sync stall"]
        print(f"| {target} | {m['sync stall']:.2f} | {m['async stall']:.2f} | {ratio:.3f} | "
              f"<= {GOALS[target]:.2f}: {'met' if ratio <= GOALS[target] else 'missed'} | {m['async write']:.2f} | "
              f"{m['sync step']:.2f} | {m['async step']:.2f} |")


def checkpoints(job: JobConfig, run_dir: str, scratch: str, state: TrainState, train_step, args,
                device: torch.device) -> dict[str, list]:
    """`--checkpoints` of each kind into `run_dir`, sync and async in turn: each kind's stalls,
    write times, and the first step's time after each."""
    w = Worker(job, run_dir, 0, 1, "bench", device,
               Reporter(queue.Queue(), 0, os.path.join(scratch, "logs"), False), {}, local=True)
    about = {"config": job.to_dict()}
    background = Background(w)
    times: dict[str, list] = {}
    for _ in range(args.checkpoints):
        for kind, writer in (("sync", None), ("async", background)):
            start = time.perf_counter()
            report_to_ray({"epoch": 0, "step": state.step, "train_loss": 1.0}, state, w, about, writer)
            written = [time.perf_counter()]
            if writer:
                writer.in_flight.add_done_callback(lambda _: written.append(time.perf_counter()))
            steps = [train_step() for _ in range(args.steps)]
            background.wait()  # (the benchmark's wait, not the loop's: see the docstring)
            for name, value in (("stall", written[0] - start), ("write", written[-1] - start), ("step", steps[0])):
                times.setdefault(f"{kind} {name}", []).append(value)
        print(f"  {run_dir}: " + ", ".join(f"{name} {values[-1]:.2f}s" for name, values in times.items()), flush=True)
    background.close(raise_error=True)
    return times


if __name__ == "__main__":
    main()
