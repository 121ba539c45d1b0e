"""A preemption as a cloud makes one, on a real 2-node Ray cluster on loopback: Ray's own
`ray drain-node` (reason PREEMPTION, a deadline), the API Ray's autoscaler uses for a spot
reclaim, then the node stopped at the deadline. The run answers the notice with a checkpoint at
the step it is at, and, with too few nodes left for its fixed size, says so and ends within
`failure.placement_timeout_s` instead of waiting forever."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from raytrain_app import rundir
from raytrain_app.cluster.dashboard import Dashboard
from raytrain_app.cluster.profiles import load_profile
from raytrain_app.rundir import snapshot
from tests.commands import command
from tests.conftest import REPO, short_temp_dir


@pytest.fixture
def two_nodes(tmp_path):
    """`cluster up` of two 1-CPU nodes (free ports), and `cluster down` after the test: the
    worker node is stopped under the run, so no other test shares this cluster."""
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump({"name": "preempt", "address": "local", "nodes": 2, "cpus_per_node": 1,
                                    "storage": str(tmp_path / "storage"), "placement": "SPREAD",
                                    "auth": {"token_file": str(tmp_path / "token")},
                                    "local": {"temp_dir": short_temp_dir()}}))
    # Its nodes run Ray Train's preemption watcher, which the session's cluster turns off.
    env = {k: v for k, v in os.environ.items() if k != "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"}
    up = command(["cluster", "up", str(path)], REPO, env, timeout=120)
    assert up.returncode == 0, up.stderr
    leaders = {kind: int(pid) for kind, pid in re.findall(r"node \d up \((\w+), pid (\d+)\)", up.stdout)}
    yield str(path), load_profile(str(path)), leaders
    command(["cluster", "down", str(path)], REPO, timeout=120)


def test_a_drained_node_gets_a_checkpoint_at_the_notice_and_a_run_too_big_for_what_is_left_ends(two_nodes, tmp_path):
    _, profile, leaders = two_nodes
    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5"}  # the watcher's polls, in a test's time
    env.pop("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", None)
    errors = tmp_path / "stderr"  # a file, which no full pipe can stall the run on
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", "train", "examples/digits.yaml", "--ray",
                             "--run-dir", str(run_dir), "--set", "train.epochs=200", "--set", "model.name=mlp",
                             "--set", "checkpoint.every_epochs=100", "--set", "failure.placement_timeout_s=16"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=open(errors, "w"), text=True, env=env,
                            start_new_session=True)
    try:
        drain_and_stop(proc, profile, leaders, run_dir, errors)
    finally:
        if proc.poll() is None:  # a failed assertion: the run must not outlive the test
            os.killpg(proc.pid, signal.SIGKILL)


def drain_and_stop(proc: subprocess.Popen, profile, leaders: dict, run_dir, errors) -> None:
    said = []
    for line in proc.stdout:
        said.append(line)
        if re.match(r"epoch +2/200", line):
            break
    assert "using the running local cluster 'preempt'" in "".join(said), said

    worker = next(n for n in Dashboard.for_profile(profile).alive_nodes() if not n.is_head)
    drained = time.time()
    drain = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "drain-node",
                            "--address", f"127.0.0.1:{profile.ports()['port']}", "--node-id", worker.node_id,
                            "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaim",
                            "--deadline-remaining-seconds", "6"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": profile.token()})
    assert drain.returncode == 0, drain.stdout + drain.stderr
    notice = None
    for line in proc.stdout:
        said.append(line)
        notice = re.match(r"warning: preemption notice: node (\w+) \(rank [01]\) goes away in \d+s; a checkpoint at "
                          r"(?:step (\d+) \(epoch (\d+), batch (\d+)\)|the end of epoch (\d+)),", line)
        if notice:
            break
    assert notice and worker.node_id.startswith(notice[1]), said
    step, epoch, batch, epoch_end = notice.groups()[1:]
    # Well past the deadline (by when Ray Train has stopped the group, counting a preemption; a
    # node stopped first would kill its workers, a failure that max_failures counts) the cloud
    # takes the node: its processes stop.
    time.sleep(max(0.0, drained + 14 - time.time()))
    os.killpg(leaders["worker"], signal.SIGTERM)
    stopped = time.monotonic()

    out, _ = proc.communicate(timeout=120)
    said.append(out)
    err = errors.read_text()
    assert proc.returncode == 1, "".join(said) + err
    assert time.monotonic() - stopped < 16 + 20  # the placement timeout, and the restart's own start
    assert re.fullmatch(r"training failed: the cluster could not place 2 workers within 16s "
                        r"\(failure\.placement_timeout_s\): it holds 1 now \(1 nodes: 0 GPUs/1 CPUs\); "
                        rf"`--resume --run-dir {run_dir}` continues from its latest checkpoint "
                        r"\(with --workers 1 it fits now\)\n", err.split("error: ")[-1]), err
    # The checkpoint taken at the notice is the run's latest, where it stood then: mid-epoch (or,
    # at an epoch's last step, that epoch's own).
    latest = snapshot.latest(str(run_dir))
    position = json.loads(open(os.path.join(latest, rundir.POSITION)).read())
    if epoch_end:
        assert (position["epoch"], position["batch"]) == (int(epoch_end), 0), position
    else:
        assert (position["step"], position["epoch"] + 1, position["batch"]) == (int(step), int(epoch), int(batch))
        assert int(batch) > 0
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"
