"""Where one training run's CPU-seconds go, process by process: the Ray Train actors a run starts
on a running cluster (the test suite's case: one session cluster, many runs), or local mode's
fork server and workers. Each process's CPU time is read every 0.1 s while the runs go on, so
processes that end before the last run are counted too; they are grouped by the title Ray gives
its workers (`ray::TrainController`) or their command line.

    python benchmarks/run_cpu.py --runs 2                 # on an embedded cluster, started first
    python benchmarks/run_cpu.py --runs 2 --local
    python benchmarks/run_cpu.py --set model='{name: tests.helpers:paced}' --set train.epochs=6

Run it on an otherwise idle machine: the counts are every process's on it. This one's (the
driver's) includes its polling, about 0.06 CPU-seconds a second.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import sys
import tempfile
import threading
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Poll(threading.Thread):
    """Each process's last seen CPU-seconds, from a baseline taken when it starts."""

    def __init__(self):
        super().__init__(daemon=True)
        self.base = {key: cpu for key, (_, cpu) in self._read().items()}
        self.seen: dict[tuple[int, float], tuple[str, float]] = {}
        self.done = threading.Event()

    def _read(self) -> dict[tuple[int, float], tuple[str, float]]:
        found = {}
        for p in psutil.process_iter(["pid", "cmdline", "cpu_times", "create_time"]):
            if p.info["cpu_times"] is None:
                continue
            key, t = (p.pid, p.info["create_time"]), p.info["cpu_times"]
            found[key] = (" ".join(p.info["cmdline"] or []).strip()[:70], t.user + t.system)
        return found

    def run(self) -> None:
        while not self.done.is_set():
            for key, (title, cpu) in self._read().items():
                # A Ray worker keeps the first actor title it shows (`ray::TrainController`):
                # it starts as `python default_worker.py`, may idle as `ray::IDLE`, and then
                # shows the method it runs; a zombie shows nothing.
                known = self.seen.get(key, ("",))[0]
                if not known.startswith("ray::") or known == "ray::IDLE":
                    known = title.split(".")[0] if title.startswith("ray::") else (known or title)
                self.seen[key] = (known, cpu)
            time.sleep(0.1)

    def totals(self) -> list[tuple[str, int, float]]:
        cpu, count = collections.Counter(), collections.Counter()
        for key, (title, seconds) in self.seen.items():
            used = seconds - self.base.get(key, 0.0)
            if used > 0.05:
                title = title or "?"
                cpu[title] += used
                count[title] += 1
        return [(title, count[title], seconds) for title, seconds in cpu.most_common()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default="examples/digits.yaml")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--local", action="store_true", help="local mode, no cluster")
    parser.add_argument("--set", action="append", default=[], help="an override, as `train --set` takes")
    args = parser.parse_args()
    os.chdir(REPO)
    sys.path.insert(0, REPO)  # tests.helpers' models, for --set model=...
    os.environ.update(RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="0", RAY_TRAIN_METRICS_ENABLED="0")  # as `train` does
    if not args.local:
        import ray

        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
        time.sleep(10)  # the cluster's own start-up is not a run's
    from raytrain_app import fit

    poll = Poll()
    poll.start()
    start = time.monotonic()
    overrides = ["tracking.report_png=false", "tracking.tensorboard=false", *args.set]
    with tempfile.TemporaryDirectory() as runs:
        for i in range(args.runs):
            fit(args.job, run_dir=os.path.join(runs, str(i)), overrides=overrides, local=args.local or None,
                echo=lambda line: None)
    wall = time.monotonic() - start
    time.sleep(2)  # the last run's actors exit
    poll.done.set()
    poll.join()
    rows = poll.totals()
    total = sum(seconds for _, _, seconds in rows)
    print(f"{args.runs} run(s) of {args.job} {'in local mode' if args.local else 'on Ray'}: {wall:.1f} s, "
          f"{total:.1f} CPU-seconds ({total / args.runs:.1f} a run)")
    for title, count, seconds in rows[:20]:
        print(f"{seconds / args.runs:7.2f} a run  x{count:<3d} {title}")


if __name__ == "__main__":
    main()
