"""A script with its own preemption handling, as HF's Trainer (`enable_jit_checkpoint`) and
Lightning have it: SIGTERM sets a flag, the ranks agree on it at the next step (an all-reduce),
and every rank checkpoints and exits. Resumes from `raytrain_app.latest_checkpoint()`.

    python checkpoint_on_sigterm.py --steps N
"""

import argparse
import os
import signal
import tempfile
import time

import torch
import torch.distributed as dist

import raytrain_app

asked = []
signal.signal(signal.SIGTERM, lambda signum, frame: asked.append(signum))  # needs the main thread

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1000)
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()

start = 0
checkpoint = raytrain_app.latest_checkpoint()
if checkpoint:
    start = torch.load(os.path.join(checkpoint, "state.pt"))["step"] + 1
    if rank == 0:
        print(f"resumed at step {start}", flush=True)

for step in range(start, args.steps):
    time.sleep(0.1)
    stop = torch.tensor([float(bool(asked))])
    dist.all_reduce(stop)  # every rank learns that one was asked to stop
    if rank == 0:
        print(f"step {step}", flush=True)
    if stop.item():
        with tempfile.TemporaryDirectory() as directory:
            if rank == 0:
                torch.save({"step": step}, os.path.join(directory, "state.pt"))
            raytrain_app.report({"step": step}, checkpoint_dir=directory if rank == 0 else None)
        if rank == 0:
            print(f"checkpointed at step {step} on SIGTERM", flush=True)
        break
dist.destroy_process_group()
