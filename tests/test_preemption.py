"""A preemption as a cloud makes one, on a real 2-node Ray cluster on loopback: Ray's own
`ray drain-node` (reason PREEMPTION, a deadline), the API Ray's autoscaler uses for a spot
reclaim, then the node stopped at the deadline. The run answers the notice with a checkpoint at
the step it is at, and, with too few nodes left for its fixed size, says so and ends within
`failure.placement_timeout_s` instead of waiting forever; a range of workers goes on at the size
that fits, and grows again when a node joins, training every sample once per epoch throughout."""

import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import psutil
import pytest
import yaml

from raytrain_app import rundir
from raytrain_app.cluster import localnodes
from raytrain_app.cluster.dashboard import Dashboard
from raytrain_app.cluster.profiles import ClusterProfile, load_profile
from raytrain_app.rundir import snapshot
from tests import runrecord
from tests.commands import command
from tests.conftest import REPO, running, short_temp_dir

# A node may take minutes to (re)join on CI's two busy cores: `two_nodes` waits up to 300 s for it
# before a test's own minutes start.
pytestmark = pytest.mark.timeout(900)


@dataclass
class Cluster:
    profile: ClusterProfile
    worker: int  # the leader of the worker node a test drains and stops
    added: list = field(default_factory=list)  # nodes the tests started, stopped with the cluster

    def add_node(self) -> psutil.Process:
        """A node joining, as a cloud adds one; numbered after the nodes before it (its ports)."""
        self.added.append(localnodes.add_node(self.profile, len(self.added) + 2))
        return self.added[-1]

    def join_node(self) -> psutil.Process:
        """A node joined, and both nodes' CPUs free. A node that dies while it joins (its ports were
        free at `cluster up`, and CI's busy machine may have taken one since) gives way to the next
        one, numbered on, twice."""
        for _ in range(3):
            node = self.add_node()
            if wait_for_both_cpus(self.profile, node):
                return node
            said = localnodes.last_line(localnodes.node_log(self.profile, len(self.added) + 1))
            print(f"node {node.pid} died while joining: {said or '(no log)'}")
        pytest.fail("three nodes in turn died while joining the cluster (their logs are in its temp_dir)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """`cluster up` of two 1-CPU nodes (free ports) for this module, and `cluster down` after it.
    Each test stops the worker node under its run, so no other module shares this cluster."""
    home = tmp_path_factory.mktemp("preempt")
    path = home / "profile.yaml"
    path.write_text(yaml.safe_dump({"name": "preempt", "address": "local", "nodes": 2, "cpus_per_node": 1,
                                    "storage": str(home / "storage"), "placement": "SPREAD",
                                    "auth": {"token_file": str(home / "token")},
                                    "local": {"temp_dir": short_temp_dir()}}))
    # Its nodes run Ray Train's preemption watcher, which the session's cluster turns off.
    env = {k: v for k, v in os.environ.items() if k != "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"}
    up = command(["cluster", "up", str(path)], REPO, env, timeout=120)
    assert up.returncode == 0, up.stderr
    leaders = {kind: int(pid) for kind, pid in re.findall(r"node \d up \((\w+), pid (\d+)\)", up.stdout)}
    nodes = Cluster(load_profile(str(path)), leaders["worker"])
    yield nodes
    command(["cluster", "down", str(path)], REPO, timeout=120)
    localnodes.stop_processes([node.pid for node in nodes.added if node.is_running()])


@pytest.fixture
def two_nodes(cluster):
    """The head and a live worker node, with both CPUs free: where an earlier test stopped the
    worker, a new one joins in its place (Ray keeps the stopped one's record, as a dead node).
    The elastic test comes first, on the fresh cluster: the autoscaling coordinator that sizes
    an elastic group is a detached actor that reads the nodes every 20 s, so a run started just
    after a node joined would start at one worker and grow at its next look."""
    if running(cluster.worker):
        wait_for_both_cpus(cluster.profile)
    else:
        cluster.worker = cluster.join_node().pid
    return cluster


def wait_for_both_cpus(profile, joining: Optional[psutil.Process] = None) -> bool:
    """Until both nodes' CPUs are free: a node joined, and no placement group is left. False if
    the `joining` node died first."""
    # (a node may take minutes to join on CI's busy cores)
    dashboard, deadline = Dashboard.for_profile(profile), time.monotonic() + 300
    while sum(node["CPU"] for node in dashboard.free().values()) < 2:
        if joining is not None and not running(joining.pid):
            return False
        assert time.monotonic() < deadline, dashboard.free()
        time.sleep(0.5)
    return True


def test_a_range_shrinks_at_a_drain_grows_when_a_node_joins_and_trains_every_sample_once(two_nodes, tmp_path):
    """`workers: 1:2` under FSDP2 on the two nodes; the worker node drained mid-epoch and then
    stopped; a new node started. The run checkpoints at the notice, goes on at one worker from
    that step (the shards gathered into one whole model by torch.distributed.checkpoint; two
    micro-batches a step: the global batch is kept), grows back to two at the next look for room
    (sharded again), says each resize in one line, and finishes. Each sample is trained once
    per epoch across both resizes: what each group trained up to the checkpoint the next one
    resumed from, and all that the last trained. The model is slowed while the test changes the
    cluster. (DDP's notices are the fixed-size test's; a replicated model's restore at another
    size is the simpler case of the same path.)"""
    nodes = two_nodes
    run_dir, seen, hold = tmp_path / "run", tmp_path / "seen", tmp_path / "hold"
    seen.mkdir()
    hold.touch()
    # About 3 held epochs pass before the group has grown back (50 ms a batch); the rest go at full
    # speed, and are what the test's CPU goes to.
    epochs, size = 8, 2000
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "name": "elastic", "data": {"name": "tests.helpers:index_data", "args": {"train_size": size, "eval_size": 5}},
        "model": {"name": "tests.helpers:recorder", "args": {"out_dir": str(seen), "per_process": True,
                                                             "hold": str(hold), "hold_s": 0.05}},
        # Checkpoints every 90 steps, never at an epoch's end (250 steps at either size, and 2250
        # is past the last epoch): every restart resumes inside an epoch, whose rest the new
        # world's ranks are dealt.
        "train": {"epochs": epochs, "batch_size": 4}, "checkpoint": {"every_steps": 90, "every_epochs": 100},
        "strategy": {"name": "fsdp"},
        "scaling": {"workers": "1:2", "resize_interval_s": 2}, "failure": {"placement_timeout_s": 60},
        "tracking": {"tensorboard": False, "report_png": False}}))
    env = {**os.environ, "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5"}
    env.pop("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", None)
    errors = tmp_path / "stderr"
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", "train", str(job), "--ray",
                             "--run-dir", str(run_dir)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=open(errors, "w"), text=True, env=env, start_new_session=True)
    joined = None
    try:
        said, notice = drain(proc, nodes.profile, nodes.worker, epochs)
        for line in proc.stdout:
            said.append(line)
            if line.startswith("resized: shrank"):
                break
        joined = nodes.add_node()
        for line in proc.stdout:
            said.append(line)
            if line.startswith("resized: grew"):
                break
        hold.unlink()  # the rest at full speed
        out, _ = proc.communicate(timeout=120)
        said.append(out)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if joined is not None:
            localnodes.stop_processes([joined.pid])
    console = "".join(said)
    assert proc.returncode == 0, console + errors.read_text()
    assert re.findall(r"^resized: .*$", console, re.M) == [
        "resized: shrank 2 -> 1 workers; global batch 8 (2 micro-batches of 4)",
        "resized: grew 1 -> 2 workers; global batch 8"], console
    restarts = [json.loads(line) for line in (run_dir / rundir.RESTARTS).read_text().splitlines()]
    assert [r["reason"] for r in restarts if r["kind"] == "resize"] == ["shrank 2 -> 1 workers",
                                                                         "grew 1 -> 2 workers"]
    rows = [json.loads(line) for line in (run_dir / rundir.METRICS).read_text().splitlines()]
    assert [r["epoch"] for r in rows] == list(range(1, epochs + 1))
    sizes = [r["world_size"] for r in rows]
    assert sizes[0] == sizes[-1] == 2, sizes  # (the one-worker group may have ended no epoch)
    assert all(r["train_samples"] == size for r in rows), rows
    # The first restart resumed from the checkpoint taken at the notice, or from a later one (the
    # group trains on until Ray Train stops it); each group trained from the step the checkpoint
    # it resumed from holds.
    log = (run_dir / "logs" / "rank-0.log").read_text()
    # Each group's model: sharded over both ranks, whole on the one (FSDP has nothing to shard
    # over), sharded again; each restored from the checkpoint the one before left.
    layouts = re.findall(r"sharded over mesh \(2,\)|replicated", log)
    assert layouts == ["sharded over mesh (2,)", "replicated", "sharded over mesh (2,)"], layouts
    restarts = re.findall(r"resumed from \S+ at step (\d+): epoch \d+ from batch (\d+)", log)
    resumed = [int(step) for step, _ in restarts]
    assert len(resumed) == 2 and resumed[0] >= int(notice[2] or 0), (resumed, notice.groups())
    assert all(int(batch) > 0 for _, batch in restarts), restarts  # inside an epoch, both times
    by_age = lambda rank: sorted(seen.glob(f"rank-{rank}-*.txt"), key=lambda p: p.stat().st_mtime)  # noqa: E731
    zeros, ones = by_age(0), by_age(1)
    assert len(zeros) == 3 and len(ones) == 2, sorted(p.name for p in seen.iterdir())
    lines = lambda path, n=None: [i for line in path.read_text().splitlines()[:n]  # noqa: E731
                                  for i in map(int, line.split())]
    trained = lines(zeros[0], resumed[0]) + lines(ones[0], resumed[0])  # one batch a step at 2 workers
    trained += lines(zeros[1], 2 * (resumed[1] - resumed[0]))  # two at 1
    trained += lines(zeros[2]) + lines(ones[1])
    counts = collections.Counter(trained)
    assert set(counts) == set(range(size)) and set(counts.values()) == {epochs}, collections.Counter(counts.values())


def test_a_drained_node_gets_a_checkpoint_at_the_notice_and_a_run_too_big_for_what_is_left_ends(two_nodes, tmp_path):
    """The model records each batch's samples (paced at 0.2 s a batch, 23 batches an epoch), so
    that what the checkpoint holds can be counted against what the ranks trained."""
    nodes = two_nodes
    run_dir, seen, hold = tmp_path / "run", tmp_path / "seen", tmp_path / "hold"
    seen.mkdir()
    hold.touch()
    size = 2 * 4 * 23
    env = {**os.environ, "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5"}  # the watcher's polls, in a test's time
    env.pop("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", None)
    errors = tmp_path / "stderr"  # a file, which no full pipe can stall the run on
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", "train", "examples/digits.yaml", "--ray",
                             "--run-dir", str(run_dir), "--set", "train.epochs=200", "--set", "train.batch_size=4",
                             "--set", f"data={{name: 'tests.helpers:index_data', args: {{train_size: {size}, "
                                      "eval_size: 5}}",
                             "--set", f"model={{name: 'tests.helpers:recorder', args: {{out_dir: '{seen}', "
                                      f"per_process: true, hold: '{hold}', hold_s: 0.2}}}}",
                             "--set", "checkpoint.every_epochs=100", "--set", "failure.placement_timeout_s=8"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=open(errors, "w"), text=True, env=env,
                            start_new_session=True)
    try:
        drain_and_stop(proc, nodes.profile, nodes.worker, run_dir, errors, seen, size)
    finally:
        if proc.poll() is None:  # a failed assertion: the run must not outlive the test
            os.killpg(proc.pid, signal.SIGKILL)


def drain_and_stop(proc: subprocess.Popen, profile, worker: int, run_dir, errors, seen, size: int) -> None:
    said, notice = drain(proc, profile, worker, 200)
    stopped = time.monotonic()
    assert "using the running local cluster 'preempt'" in "".join(said), said
    step, epoch, batch, epoch_end = notice.groups()[1:]
    out, _ = proc.communicate(timeout=120)
    said.append(out)
    err = errors.read_text()
    assert proc.returncode == 1, "".join(said) + err
    assert time.monotonic() - stopped < 8 + 20  # the placement timeout, and the restart's own start
    assert re.fullmatch(r"training failed: the cluster could not place 2 workers within 8s "
                        r"\(failure\.placement_timeout_s\): it holds 1 now \(1 nodes: 0 GPUs/1 CPUs\); "
                        rf"`--resume --run-dir {run_dir}` continues from its latest checkpoint "
                        r"\(with --workers 1 it fits now\)\n", err.split("error: ")[-1]), err
    # The checkpoint taken at the notice is the run's latest, where it stood then: mid-epoch (or,
    # at an epoch's last step, that epoch's own).
    _, position = runrecord.latest(run_dir)
    if epoch_end:
        assert (position["epoch"], position["batch"]) == (int(epoch_end), 0), position
    else:
        assert (position["step"], position["epoch"] + 1, position["batch"]) == (int(step), int(epoch), int(batch))
        assert int(batch) > 0
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"
    # What the ranks trained up to that step, by the recorder (one line a batch, one batch a step at 2
    # workers), is what the checkpoint says: each sample once in each epoch done, and the epoch under
    # way's first batches, 4 distinct samples each. One group trained (the restart could place none),
    # and it trained that far.
    files = sorted(seen.glob("rank-*.txt"))
    assert [path.name.split("-")[1] for path in files] == ["0", "1"], files
    batches = [path.read_text().splitlines() for path in files]
    assert all(len(lines) >= position["step"] for lines in batches), (position, [len(lines) for lines in batches])
    counts = collections.Counter(int(i) for lines in batches for line in lines[:position["step"]] for i in line.split())
    assert set(counts) == set(range(size))
    under_way = 2 * 4 * position["batch"]
    assert collections.Counter(counts.values()) == collections.Counter({position["epoch"]: size - under_way,
                                                                        position["epoch"] + 1: under_way}), position


def train_worker(process: psutil.Process) -> bool:
    """A Ray Train worker actor's process (Ray titles it after the actor)."""
    try:
        return " ".join(process.cmdline()).startswith("ray::RayTrainWorker")
    except psutil.Error:  # gone meanwhile
        return False


def drain(proc: subprocess.Popen, profile, worker_leader: int, epochs: int):
    """After the first epoch, the worker node drained (PREEMPTION, 6 s), and stopped well past
    the deadline; (the console so far, the notice's match)."""
    said = []
    for line in proc.stdout:
        said.append(line)
        if re.match(rf"epoch +1/{epochs}", line):
            break
    worker = next(n for n in Dashboard.for_profile(profile).alive_nodes() if not n.is_head)
    drained = time.time()
    # What a KubeRay worker pod's preStop hook runs: Ray's drain (PREEMPTION), then a wait until
    # the deadline, which keeps the pod up while the run checkpoints.
    drain = subprocess.run([sys.executable, "-m", "raytrain_app.cluster.drain", "--deadline-s", "6",
                            "--address", f"127.0.0.1:{profile.ports()['port']}", "--node-id", worker.node_id,
                            "--reason", "spot reclaim"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": profile.token()})
    assert drain.returncode == 0 and f"node {worker.node_id[:12]} drained" in drain.stdout, drain.stdout + drain.stderr
    assert time.time() - drained >= 5.5  # it waited out the deadline
    notice = None
    for line in proc.stdout:
        said.append(line)
        notice = re.match(r"warning: preemption notice: node (\w+) \(rank [01]\) goes away in \d+s; a checkpoint at "
                          r"(?:step (\d+) \(epoch (\d+), batch (\d+)\)|the end of epoch (\d+)),", line)
        if notice:
            break
    assert notice and worker.node_id.startswith(notice[1]), said
    # Past the deadline, once Ray Train has stopped the group (counting a preemption: a node
    # stopped first would kill its workers, a failure that max_failures counts; under load that
    # can take longer than the deadline), the cloud takes the node: its processes stop.
    time.sleep(max(0.0, drained + 8 - time.time()))
    node = psutil.Process(worker_leader)
    waited = time.monotonic()
    while any(train_worker(p) for p in node.children(recursive=True)):
        assert time.monotonic() - waited < 60, "the drained node's workers were never stopped"
        time.sleep(0.2)
    os.killpg(worker_leader, signal.SIGTERM)
    return said, notice


def drain_for_later(profile):
    """The worker node drained (PREEMPTION) with a deadline 120 s away, not waited for."""
    worker = next(n for n in Dashboard.for_profile(profile).alive_nodes() if not n.is_head)
    drain = subprocess.run([sys.executable, "-m", "raytrain_app.cluster.drain", "--deadline-s", "120", "--no-wait",
                            "--address", f"127.0.0.1:{profile.ports()['port']}", "--node-id", worker.node_id,
                            "--reason", "spot reclaim"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": profile.token()})
    assert drain.returncode == 0, drain.stdout + drain.stderr


def test_a_node_stopped_before_its_drains_deadline_counts_as_a_preemption(two_nodes, tmp_path):
    """The cloud takes the node before the deadline its notice gave (a pod's grace shorter than the
    drain's), after the run's checkpoint for it: Ray Train counts the workers' deaths as a plain
    failure, which `failure.max_failures` (0) would end the run on. The run counts a preemption
    (`failure.max_preemption_failures`, unlimited) and restarts; with one node left it cannot place
    its 2 workers, and says so."""
    nodes = two_nodes
    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5"}
    env.pop("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", None)
    errors = tmp_path / "stderr"
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", "train", "examples/digits.yaml", "--ray",
                             "--run-dir", str(run_dir), "--set", "train.epochs=200",
                             "--set", "model={name: 'tests.helpers:paced'}", "--set", "checkpoint.every_epochs=100",
                             "--set", "failure.placement_timeout_s=8"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=open(errors, "w"), text=True, env=env,
                            start_new_session=True)
    said = []
    try:
        for line in proc.stdout:
            said.append(line)
            if re.match(r"epoch +1/200", line):
                break
        drain_for_later(nodes.profile)
        notice = None
        for line in proc.stdout:
            said.append(line)
            notice = re.match(r"warning: preemption notice: .*a checkpoint at (?:step (\d+) |the end of epoch (\d+))",
                              line)
            if notice:
                break
        assert notice, said
        deadline = time.monotonic() + 60  # the checkpoint answering it, registered by Ray Train's controller
        while not answered(run_dir, notice):
            assert time.monotonic() < deadline, "".join(said)
            time.sleep(0.2)
        os.killpg(nodes.worker, signal.SIGTERM)  # the node goes, long before its deadline
        out, _ = proc.communicate(timeout=120)
        said.append(out)
    finally:
        if proc.poll() is None:  # a failed assertion: the run must not outlive the test
            os.killpg(proc.pid, signal.SIGKILL)
    console, err = "".join(said), errors.read_text()
    assert proc.returncode == 1, console + err
    assert re.search(r"^warning: rank \d on node \S+ \(pid \d+\): .*; its node was being drained \(a preemption\); "
                     rf"restarting from {run_dir}/checkpoint_\S+ \(preemption 1 of unlimited\)$", console,
                     re.M), console
    assert "training failed: the cluster could not place 2 workers within 8s" in err, err
    assert [json.loads(line)["kind"] for line in (run_dir / rundir.RESTARTS).read_text().splitlines()] == [
        "preemption"]


def answered(run_dir, notice: re.Match) -> bool:
    """The run's latest checkpoint is the one written for the notice (at its step, or its epoch's end)."""
    latest = snapshot.latest(str(run_dir))
    if latest is None:
        return False
    position = json.loads(open(os.path.join(latest, rundir.POSITION)).read())
    step, epoch_end = notice.groups()
    return position["step"] == int(step) if step else (position["epoch"], position["batch"]) == (int(epoch_end), 0)


def test_a_drain_reaches_a_scripts_own_handler_whose_checkpoint_the_run_resumes_from(two_nodes, tmp_path):
    """A torchrun-style script with its own checkpoint-on-SIGTERM handler, on both nodes: the
    drain's notice becomes SIGTERM to every rank's script, which checkpoints through
    `raytrain_app.report`. The node then goes; with one node left the 2 workers cannot be placed,
    and once a node has joined, `--resume` continues from the script's checkpoint."""
    nodes = two_nodes
    script, run_dir = "tests/scripts/checkpoint_on_sigterm.py", tmp_path / "run"
    env = {**os.environ, "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5"}
    env.pop("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", None)
    errors = tmp_path / "stderr"
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", "train", script, "--workers", "2", "--ray",
                             "--run-dir", str(run_dir), "--set", "failure.placement_timeout_s=8"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=open(errors, "w"), text=True, env=env,
                            start_new_session=True)
    said, joined = [], None
    try:
        for line in proc.stdout:
            said.append(line)
            if line.startswith("step 3"):
                break
        drain_for_later(nodes.profile)
        saved = None
        for line in proc.stdout:
            said.append(line)
            found = re.match(r"checkpointed at step (\d+) on SIGTERM$", line)
            if found:
                saved = int(found[1])
                break
        assert saved is not None, "".join(said)
        # The checkpoint, registered by Ray Train's controller, and its report heard by the driver's
        # callbacks (RestartNotices, which learns that it answers the notice, comes before the one
        # that writes metrics.jsonl): a node gone before that is a plain failure.
        deadline, metrics = time.monotonic() + 60, run_dir / "metrics.jsonl"
        while snapshot.latest(str(run_dir)) is None or not (metrics.exists() and metrics.read_text().strip()):
            assert time.monotonic() < deadline, "".join(said)
            time.sleep(0.2)
        os.killpg(nodes.worker, signal.SIGTERM)  # the node goes, before its deadline
        out, _ = proc.communicate(timeout=120)
        said.append(out)
        console, err = "".join(said), errors.read_text()
        logs = "".join(path.read_text() for path in (run_dir / "logs").glob("rank-*.log"))
        assert re.search(r"INFO a preemption notice: SIGTERM to the script \(rank \d, pid \d+\)", logs), logs
        assert proc.returncode == 1 and "could not place 2 workers within 8s" in err, console + err
        assert re.search(rf"restarting from {run_dir}/checkpoint_\S+ \(preemption 1 of unlimited\)$", console,
                         re.M), console
        [row] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert row["step"] == saved and row["checkpoint"] == snapshot.latest(str(run_dir))

        joined = nodes.join_node()
        resumed = command(["train", script, "--workers", "2", "--ray", "--resume", "--run-dir", str(run_dir),
                           "--", "--steps", str(saved + 3)], REPO, env, timeout=300)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert f"resumed at step {saved + 1}\n" in resumed.stdout, resumed.stdout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if joined is not None:
            localnodes.stop_processes([joined.pid])
