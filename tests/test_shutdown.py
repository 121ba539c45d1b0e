"""Ctrl-C, with stale Ray state in the temp dir, through the real command and the real process
table. On Ray (`--ray`): the embedded cluster's processes are what must not outlive the command
(local mode's Ctrl-C is in test_local_mode)."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from raytrain_app.worker import checkpoint
from tests.checkpoint_files import check_opens
from tests.conftest import REPO, running, short_temp_dir


def descendants(root: int) -> set[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(") ", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, grew = {root}, True
    while grew:
        more = {pid for pid, ppid in parents.items() if ppid in found} - found
        found |= more
        grew = bool(more)
    return found - {root}


def test_ctrl_c_stops_the_workers_and_the_cluster_and_leaves_nothing_half_written(tmp_path):
    # Ray's temp dir names a cluster that is gone; a plain ray.init() would try to attach to it and hang.
    temp = short_temp_dir()
    Path(temp, "ray").mkdir()
    Path(temp, "ray", "ray_current_cluster").write_text("127.0.0.1:1\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = temp

    run_dir = tmp_path / "run"
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", "train", "examples/digits.yaml", "--ray",
                             "--run-dir", str(run_dir), "--set", "train.epochs=500",
                             "--set", "checkpoint.every_epochs=1", "--set", "checkpoint.every_steps=3"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # its own process group, as a terminal's foreground job
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.match(r"epoch +1/500", line):
            break
    assert time.monotonic() - start < 120  # the dead cluster did not make it hang
    started = descendants(proc.pid)  # Ray's GCS, raylet, dashboard agent, workers...
    assert len(started) > 5, lines

    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground process group
    _, err = proc.communicate(timeout=90)
    resume = (f"raytrain-app train examples/digits.yaml --resume --run-dir {run_dir} --set train.epochs=500 "
              "--set checkpoint.every_epochs=1 --set checkpoint.every_steps=3 --set scaling.local=False")
    assert proc.returncode == 130 and err == f"interrupted: `{resume}` continues it\n", err  # that line alone
    deadline = time.monotonic() + 30
    while [p for p in started if running(p)] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in started if running(p)]

    assert not list(run_dir.rglob("*.tmp"))
    kept = sorted(d for d in run_dir.glob("checkpoint_*") if d.is_dir())
    assert kept  # every checkpoint directory whole: a directory without state.pt is a half-written one
    assert [(d.name, checkpoint.verify(str(d), r)) for d in kept for r in (0, 1)] == [(d.name, None) for d in kept
                                                                                      for r in (0, 1)]
    for d in kept:  # and whole as a user opens them, into a LeNet of their own
        check_opens(d, ranks=(0, 1))

    # The command it printed continues the run; then the run's local Ray node dies under it (the
    # kernel's OOM killer sends SIGKILL): one line, exit 1, run.json failed, Ray's logs kept.
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", *shlex.split(resume)[1:], "--ray"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    for line in proc.stdout:
        if line.startswith("resumed from"):
            break
    started = descendants(proc.pid)
    names = {pid: Path(f"/proc/{pid}/cmdline").read_text().split("\0")[0] for pid in started if running(pid)}
    [raylet] = [pid for pid in started if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet"]
    os.kill(raylet, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    message = f"the local Ray node stopped (raylet exited: killed by SIGKILL); logs in {run_dir}/logs/ray"
    assert proc.returncode == 1 and err == f"error: {message}\n", err
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "failed" and record["reason"] == message
    assert (run_dir / "logs" / "ray" / "raylet.out").exists()
    # The raylet's orphans (workers, agents) were killed before the command ended, not left to
    # notice the raylet is gone (which took over 30 s on a loaded machine).
    deadline = time.monotonic() + 10
    while [p for p in started if running(p)] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [names.get(p) for p in started if running(p)]
