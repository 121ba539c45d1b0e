"""How long a hung rank takes to be found, and its group to train again, at the default timeout.

    python benchmarks/hang_detection.py                 # local mode, 2 workers
    python benchmarks/hang_detection.py --ray           # on an embedded Ray cluster

Trains digits with a small MLP (`stalling` below, by import path) on 2 workers, checkpoints
every 5 steps, and makes rank 1 stop for an hour in its forward at call `--at` (epoch 2), once.
The hang watch's timeout is `failure.hang_timeout_s: auto` (the larger of 60 s and 20x the p99
step). Prints, from this script's clock and the run's rank-0 log (one machine):

- detection: from the moment the rank stopped to the console's `hang:` line (target: within
  the timeout + 15 s);
- next step: from that line to the restarted group's first step, which resumes from the latest
  checkpoint;
- the total time lost, and the timeout that was in force.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


class Stalling(nn.Module):
    """An MLP whose rank 1 sleeps for an hour in training forward call `at`, while `marker`
    exists (it is removed, so the restarted rank trains on); the moment goes to MARKER.at."""

    def __init__(self, input_shape: tuple, num_classes: int, marker: str, at: int):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), 64), nn.ReLU(),
                                 nn.Linear(64, num_classes))
        self.marker, self.at, self.calls = marker, at, 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == self.at and os.path.exists(self.marker) and _rank() == 1:
                os.unlink(self.marker)
                with open(f"{self.marker}.at", "w") as f:
                    f.write(repr(time.time()))
                time.sleep(3600)
        return self.net(x)


def _rank() -> int:
    import ray.train

    return ray.train.get_context().get_world_rank()


def stalling(input_shape: tuple, num_classes: int, marker: str, at: int) -> nn.Module:
    return Stalling(input_shape, num_classes, marker, at)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--at", type=int, default=40, help="rank 1's training forward call that hangs")
    p.add_argument("--ray", action="store_true", help="on an embedded Ray cluster instead of local mode")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="more of the run's settings (on a GPU: scaling.gpus_per_worker=0.5, two workers on one)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="hang-bench-") as scratch:
        marker, run_dir = os.path.join(scratch, "marker"), os.path.join(scratch, "run")
        open(marker, "w").close()
        command = [sys.executable, "-m", "raytrain_app.cli", "train", "examples/digits.yaml", "--run-dir", run_dir,
                   "--set", "train.epochs=3", "--set", "checkpoint.every_steps=5", "--set", "failure.max_failures=1",
                   "--set", "model.name=benchmarks.hang_detection:stalling",
                   "--set", f"model.args={{marker: '{marker}', at: {args.at}}}", *(["--ray"] if args.ray else []),
                   *(word for setting in args.set for word in ("--set", setting))]
        proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        said_at = None
        for line in proc.stdout:
            if " made no progress " in line and said_at is None:
                said_at = time.time()
                print(line.rstrip())
        proc.wait()
        if proc.returncode != 0 or said_at is None:
            raise SystemExit(f"the run did not hang and recover as planned (exit {proc.returncode})")
        stopped_at = float(open(f"{marker}.at").read())
        log = open(os.path.join(run_dir, "logs", "rank-0.log")).read()
        firsts = re.findall(r"^(\S+ \S+) INFO first step of this group", log, re.M)
        next_step = datetime.datetime.strptime(firsts[-1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        timeout = re.search(r"made no progress for (\d+)s", open(os.path.join(run_dir, "restarts.jsonl")).read())
        logs = os.path.join(run_dir, "logs")
        recorded = [line.strip() for name in sorted(os.listdir(logs)) if name.startswith("hang-")
                    for line in open(os.path.join(logs, name)) if "collectives enqueued" in line]
        dumps = sorted(os.listdir(os.path.join(logs, "flight-recorder"))) if os.path.isdir(
            os.path.join(logs, "flight-recorder")) else []
    print("flight recorder: " + ("; ".join(recorded) or "no lines") + f" (dumps: {', '.join(dumps) or 'none'})")
    print(f"detection: {said_at - stopped_at:.1f}s after the rank stopped (it had been still {timeout.group(1)}s; "
          f"target: the timeout + 15 s)")
    print(f"next step: {next_step - said_at:.1f}s after the hang was said (a fresh group, restored from the latest "
          f"checkpoint)")
    print(f"lost in all: {next_step - stopped_at:.1f}s ({'Ray' if args.ray else 'local mode'}, 2 workers)")


if __name__ == "__main__":
    main()
