"""Preemption and resize costs on a real 2-node local cluster, from one run of several cycles.

    python benchmarks/preemption.py --cycles 3

Brings up two 1-CPU nodes (`cluster up`), trains a `1:2` range of a small MLP on digits on them
(`--ray`, a 2 s look for room), and `--cycles` times: drains the worker node as a spot reclaim
does (`python -m raytrain_app.cluster.drain`, PREEMPTION, 6 s deadline), stops it 14 s after the
drain, waits for the group to shrink, and starts a new node, which the group grows onto. Then it
stops the run (SIGUSR1) and prints, as min / median / max over the cycles:

- the preemption check's cost per step: one ask's time over the interval times the step time,
  as each group's rank 0 measured it (`preemption notices: asked every N steps ...`);
- seconds from the drain to the just-in-time checkpoint written (`notice answered`);
- seconds from the node's stop to the shrunk group's first step, and from the new node's start
  to the grown group's first step (`first step of this group`).

Everything is read from the run's own rank-0 log and this script's clock (one machine).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from raytrain_app.cluster import localnodes  # noqa: E402
from raytrain_app.cluster.dashboard import Dashboard  # noqa: E402
from raytrain_app.cluster.profiles import load_profile  # noqa: E402


def cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "raytrain_app.cli", *args], cwd=REPO, capture_output=True, text=True,
                          **kwargs)


def wait_for(path: Path, pattern: str, count: int, timeout_s: float = 180) -> list[re.Match]:
    """The first `count` matches of `pattern` in the growing file at `path`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = list(re.finditer(pattern, path.read_text(), re.M)) if path.exists() else []
        if len(found) >= count:
            return found
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {count} x {pattern!r} in {path}")


def logged(match: re.Match) -> float:
    """The wall-clock time of a log line (its `%(asctime)s` prefix)."""
    stamp = match.string[match.string.rfind("\n", 0, match.start()) + 1:][:23]
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def spread(values: list[float], unit: str, digits: int = 1) -> str:
    return (f"{min(values):.{digits}f} / {statistics.median(values):.{digits}f} / {max(values):.{digits}f} {unit} "
            f"(n={len(values)})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=3)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="raytrain-preempt-bench-"))
    profile_path = work / "profile.yaml"
    profile_path.write_text(yaml.safe_dump({
        "name": "preempt-bench", "address": "local", "nodes": 2, "cpus_per_node": 1, "placement": "SPREAD",
        "storage": str(work / "storage"), "auth": {"token_file": str(work / "token")},
        "local": {"temp_dir": tempfile.mkdtemp(prefix="rt-", dir="/tmp")}}))
    env = {k: v for k, v in os.environ.items() if k != "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"}
    up = cli("cluster", "up", str(profile_path), env=env)
    if up.returncode:
        raise SystemExit(up.stderr)
    profile = load_profile(str(profile_path))
    worker = int(re.search(r"node 1 up \(worker, pid (\d+)\)", up.stdout).group(1))
    run_dir, added = work / "run", []
    log = run_dir / "logs" / "rank-0.log"
    run = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", "train", "examples/digits.yaml", "--ray",
                            "--run-dir", str(run_dir), "--workers", "1:2", "--set", "model.name=mlp",
                            "--set", "train.epochs=100000", "--set", "scaling.resize_interval_s=2",
                            "--set", "failure.placement_timeout_s=120", "--set", "tracking.tensorboard=false"],
                           cwd=REPO, env={**env, "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5"},
                           stdout=open(work / "console.txt", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    drains, stops, starts = [], [], []
    try:
        wait_for(log, r"first step of this group", 1)
        for cycle in range(args.cycles):
            wait_for(log, r"2 workers, global batch", cycle + 1)
            time.sleep(3)  # a few epochs in
            node = next(n for n in Dashboard.for_profile(profile).alive_nodes() if not n.is_head)
            drains.append(time.time())
            drained = subprocess.run(
                [sys.executable, "-m", "raytrain_app.cluster.drain", "--deadline-s", "6", "--no-wait",
                 "--address", f"127.0.0.1:{profile.ports()['port']}", "--node-id", node.node_id],
                capture_output=True, text=True,
                env={**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": profile.token()})
            if drained.returncode:
                raise SystemExit(drained.stderr)
            time.sleep(max(0.0, drains[-1] + 14 - time.time()))
            os.killpg(worker, signal.SIGTERM)
            stops.append(time.time())
            wait_for(log, r"1 workers, global batch", cycle + 1)
            starts.append(time.time())
            added.append(localnodes.add_node(profile, 2 + cycle))
            worker = added[-1].pid
        wait_for(log, r"2 workers, global batch", args.cycles + 1)
        wait_for(log, r"first step of this group", 2 * args.cycles + 1)
    finally:
        if run.poll() is None:
            os.kill(run.pid, signal.SIGUSR1)  # a checkpoint, and the run stops
            try:
                run.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(run.pid, signal.SIGKILL)
        localnodes.stop_processes([node.pid for node in added])
        cli("cluster", "down", str(profile_path), env=env)

    text = log.read_text()
    costs = [float(ask) / (int(every) * float(step)) * 100 for every, ask, step in
             re.findall(r"asked every (\d+) steps \(([\d.]+) ms an ask, ([\d.]+) ms a step here\)", text)]
    answered = [logged(m) for m in re.finditer(r"notice answered: the checkpoint at step \d+ is written", text)]
    firsts = [logged(m) for m in re.finditer(r"first step of this group", text)][1:]  # after each restart
    print(f"runs: {args.cycles} cycles of drain, stop, shrink, new node, grow; one `1:2` run (digits, mlp); "
          f"console: {work / 'console.txt'}")
    print(f"preemption check, cost per step:      {spread(costs, '%', 2)}")
    print(f"drain -> just-in-time checkpoint:     {spread([a - d for a, d in zip(answered, drains)], 's')}")
    print(f"node stopped -> first step at 1:      {spread([f - s for f, s in zip(firsts[0::2], stops)], 's')}")
    print(f"node started -> first step at 2:      {spread([f - s for f, s in zip(firsts[1::2], starts)], 's')}")


if __name__ == "__main__":
    main()
