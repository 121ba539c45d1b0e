"""Time to the first compiled step of a restart, with the run's compile cache and without it.

Through the real `raytrain-app train` command, `train.compile: default`, each step on a machine
whose own Inductor cache is empty (a fresh `TORCHINDUCTOR_CACHE_DIR`), as after a restart on
another node or in a fresh container:

    cold       a fresh run: everything compiled
    no cache   `--resume` of it, its compile cache removed: everything compiled again
    cache      `--resume` of it with its compile cache: unpacked, nothing compiled

The first step's time is rank 0's, from its log: from the line that says the data and model are
ready to the line written after the first optimizer step, which also says how many graphs
Inductor compiled and how many it took from its cache. The resumes are run alternately,
`--repeats` times each, and the ratio is of their medians.

    python benchmarks/compile_cache.py                          # CPU: digits, LeNet, 2 workers, local mode
    python benchmarks/compile_cache.py --workers 1 --gpus-per-worker 1 --set model.name=resnet18
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(os.path.dirname(HERE), "examples", "digits.yaml")
STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO "


def first_step(run_dir: str) -> tuple[float, str]:
    """Seconds from rank 0's last 'data ... compile' line to its next 'first step' line, and the latter."""
    log = open(os.path.join(run_dir, "logs", "rank-0.log")).read()
    ready = list(re.finditer(STAMP + r"data .*; compile ", log, re.M))[-1]
    done = re.compile(STAMP + r"(first step: .*)$", re.M).search(log, ready.end())
    seconds = [datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f") for m in (ready, done)]
    return (seconds[1] - seconds[0]).total_seconds(), done.group(2)


def train(run_dir: str, inductor: str, extra: list[str]) -> tuple[float, str]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor}
    subprocess.run([sys.executable, "-m", "raytrain_app.cli", "train", JOB, "--run-dir", run_dir,
                    "--set", "train.compile=default", *extra], env=env, check=True, stdout=subprocess.DEVNULL)
    return first_step(run_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="2")
    p.add_argument("--gpus-per-worker", default="0")
    p.add_argument("--set", action="append", default=[], help="more config overrides, KEY=VALUE")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    common = ["--workers", args.workers, "--gpus-per-worker", args.gpus_per_worker]
    for s in args.set:
        common += ["--set", s]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        fresh = iter(os.path.join(tmp, f"inductor-{i}") for i in range(1000))  # an empty Inductor cache each time
        cold, said = train(run_dir, next(fresh), common + ["--set", "train.epochs=1"])
        print(f"cold, a fresh run: first step {cold:.1f} s ({said})")
        archive = os.path.join(run_dir, "compile_cache.bin")
        shutil.copy(archive, archive + ".kept")
        times: dict = {"no cache": [], "cache": []}
        epochs = iter(range(2, 1000))  # each resume trains one more epoch
        for _ in range(args.repeats):
            for name in times:
                if name == "no cache":
                    os.remove(archive)
                else:
                    shutil.copy(archive + ".kept", archive)
                t, said = train(run_dir, next(fresh), common + ["--resume", "--set", f"train.epochs={next(epochs)}"])
                times[name].append(t)
                print(f"  --resume, {name}: first step {t:.1f} s ({said})")
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"restart's first step: {med['no cache']:.1f} s without the compile cache, {med['cache']:.1f} s with "
              f"it: {med['no cache'] / med['cache']:.1f}x sooner (medians of {args.repeats})")


if __name__ == "__main__":
    main()
