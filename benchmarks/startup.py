"""Start-up cost: wall time of the tiny 2-worker job through five launchers, alternating.

    python benchmarks/startup.py --rounds 3

Runs, round after round, (1) `raytrain-app train examples/digits.yaml --set train.epochs=1
--local` (local mode: no Ray cluster), (2) the same with `--address local` (a fresh embedded
cluster), (3) the same `train` joining a local cluster that `raytrain-app cluster up
cluster/local.yaml` started before the rounds (stopped after them), (4) the same work as a plain
Ray Train `TorchTrainer` script, (5) the same work under `torchrun --standalone
--nproc_per_node 2`, and prints the median wall times and their ratios to torchrun. Then a
torchrun-style script (`examples/torchrun_script/train.py --epochs 1`): `train SCRIPT --workers 2`
in local mode and on a fresh embedded cluster, against `torchrun --standalone` of the same script.
raytrain-app's own breakdown (imports, cluster, worker group, data, first step) is read from
each run's startup.json; torchrun's first step from a file its rank 0 writes after it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SCRIPT = "examples/torchrun_script/train.py"


def timed(cmd: list[str], cwd: str, env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    bin_dir = os.path.dirname(sys.executable)
    tmp = tempfile.mkdtemp(prefix="startup-")
    app = [os.path.join(bin_dir, "raytrain-app")]
    train = app + ["train", "examples/digits.yaml", "--set", "train.epochs=1"]
    variants = {
        "raytrain-app train --local": lambda r: train + ["--local", "--run-dir", f"{tmp}/local{r}"],
        "raytrain-app train --ray": lambda r: train + ["--address", "local", "--run-dir", f"{tmp}/run{r}"],
        "raytrain-app, cluster up": lambda r: train + ["--ray", "--run-dir", f"{tmp}/reuse{r}"],
        "plain TorchTrainer": lambda r: [sys.executable, os.path.join(HERE, "plain_torchtrainer.py")],
        "torchrun --standalone": lambda r: [os.path.join(bin_dir, "torchrun"), "--standalone", "--nproc_per_node",
                                            "2", os.path.join(HERE, "plain_ddp.py")],
        "script: train --local": lambda r: app + ["train", SCRIPT, "--workers", "2", "--local", "--run-dir",
                                                  f"{tmp}/script-local{r}", "--", "--epochs", "1"],
        "script: train --ray": lambda r: app + ["train", SCRIPT, "--workers", "2", "--address", "local", "--run-dir",
                                                f"{tmp}/script-ray{r}", "--", "--epochs", "1"],
        "script: torchrun": lambda r: [os.path.join(bin_dir, "torchrun"), "--standalone", "--nproc_per_node", "2",
                                       SCRIPT, "--epochs", "1"],
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    torchrun_first_step: list[float] = []  # seconds from the command's start, as startup.json's total
    # A SIGTERM (a `timeout`, a kill) ends the run through the `finally` below, as Ctrl-C does: a
    # `cluster up` cluster left running would be joined by every later `train` on this machine.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    subprocess.run(app + ["cluster", "up", "cluster/local.yaml"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    try:
        for r in range(args.rounds):
            order = list(variants.items())
            for name, cmd in order[r % len(order):] + order[: r % len(order)]:  # rotate who goes first
                stamp = os.path.join(tmp, f"first-step-{r}")
                started = time.time()
                times[name].append(timed(cmd(r), REPO, {**os.environ, "FIRST_STEP_FILE": stamp}))
                if name == "torchrun --standalone":
                    torchrun_first_step.append(float(Path(stamp).read_text()) - started)
    finally:
        subprocess.run(app + ["cluster", "down", "cluster/local.yaml"], cwd=REPO, stdout=subprocess.DEVNULL)

    print(f"tiny 2-worker job (digits, 1 epoch, Gloo), {args.rounds} alternating rounds, {os.cpu_count()} CPUs")
    for name, ts in times.items():
        base = statistics.median(times["script: torchrun" if name.startswith("script") else "torchrun --standalone"])
        m = statistics.median(ts)
        print(f"  {name:<26} median {m:6.1f}s  ({', '.join(f'{t:.1f}' for t in ts)})  {m / base:4.2f}x torchrun")
    for label, prefix in (("local mode", "local"), ("fresh cluster", "run"), ("cluster up", "reuse")):
        phases = [json.loads(Path(f"{tmp}/{prefix}{r}/startup.json").read_text()) for r in range(args.rounds)]
        print(f"  raytrain-app start-up ({label}), median s: " + ", ".join(
            f"{k} {statistics.median(p[k] for p in phases):.1f}" for k in phases[0]))
    print(f"  torchrun's first step, median s from the command's start: {statistics.median(torchrun_first_step):.1f}")


if __name__ == "__main__":
    main()
