"""Ctrl-C and stale Ray state, through the real command and the real process table."""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from raytrain_app import checkpoint
from tests.conftest import REPO, running


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
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", "train", "examples/digits.yaml",
                             "--run-dir", str(run_dir), "--set", "train.epochs=500",
                             "--set", "checkpoint.every_epochs=1", "--set", "checkpoint.every_steps=3"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.match(r"epoch +2/500", line):
            break
    started = descendants(proc.pid)  # Ray's GCS, raylet, dashboard agent, workers...
    assert len(started) > 5, lines

    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "interrupted", err
    deadline = time.monotonic() + 30
    while [p for p in started if running(p)] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in started if running(p)]

    assert not list(run_dir.rglob("*.tmp"))
    kept = sorted(run_dir.glob("checkpoint_*"))
    assert kept and all(checkpoint.verify(str(d), r) is None for d in kept for r in (0, 1) if (d / "state.pt").exists())


def test_a_dead_cluster_in_rays_temp_files_does_not_make_train_hang(tmp_path):
    # Ray's temp dir names a cluster that is gone; a plain ray.init() would try to attach to it.
    temp = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    Path(temp, "ray").mkdir()
    Path(temp, "ray", "ray_current_cluster").write_text("127.0.0.1:1\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = temp
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "raytrain_app.cli", "train", "examples/digits.yaml",
                           "--run-dir", str(tmp_path / "run"), "--set", "train.epochs=1"],
                          cwd=REPO, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "epoch 1/1" in proc.stdout and time.monotonic() - start < 120
