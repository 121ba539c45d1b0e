"""Ranks that hang or run slow instead of dying, for real: a rank stuck in its forward, in a data
read and in a Python-level deadlock (by import-path helpers, 2 workers), in local mode and on the
real Ray cluster; a straggler; `raytrain-app stack` on a live run. The hang watch's choice of
culprit is also checked on beats written by hand, where every case can be set up exactly."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from raytrain_app.driver.hangs import HangWatch
from raytrain_app.worker.heartbeat import FLOOR_S
from tests.commands import command
from tests.conftest import REPO
from tests.test_distributed import final_weights, job, run
from tests.test_reliability import faulty

DETECTED_WITHIN_S = 15  # past the timeout: the target


def step_checkpointed(marker, fault, rank=1, **sections):
    """Digits with a dropout MLP, 23 steps per epoch per rank, checkpoints every 5 steps: forward
    call 40 is epoch 2's 17th batch, after the checkpoint at step 35, which the restart continues."""
    return faulty(marker, at=40, fault=fault, rank=rank, checkpoint={"every_steps": 5},
                  failure={"max_failures": 1}, **sections)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run every hung one must reproduce bitwise (no marker: it never faults)."""
    return run(step_checkpointed(tmp_path_factory.mktemp("never") / "marker", "stall"),
               tmp_path_factory.mktemp("straight") / "run")


def hung(config, marker, run_dir, local=True):
    """Run `config` with its fault armed; (the result, its console lines, each line's wall time)."""
    from raytrain_app.driver.plan import make_plan
    from raytrain_app.driver.trainer import run_training

    marker.touch()
    lines, times = [], []

    def echo(line):
        lines.append(line)
        times.append(time.time())

    result = run_training(make_plan(config, run_dir=str(run_dir), local=local), echo=echo)
    assert not marker.exists()  # the fault really happened
    return result, lines, times


def check_hang(result, lines, times, marker, run_dir, straight, timeout_s, phase, frame):
    """Named within the target, the stacks kept, the restart recorded as a hang, and the run
    finished bitwise as if nothing had happened."""
    began = float(open(f"{marker}.at").read())
    [(said, at)] = [(line, t) for line, t in zip(lines, times) if " made no progress " in line]
    assert at - began <= timeout_s + DETECTED_WITHIN_S, (at - began, said)
    found = re.fullmatch(rf"warning: hang: rank 1 on node {re.escape(socket.gethostname())} \(pid \d+\) made no "
                         rf"progress for \d+s in {phase} at step (\d+) \((tests/helpers\.py):\d+ in {frame}\); every "
                         rf"rank's stack in (\S+)", said)
    assert found, said
    step, where, stacks = int(found.group(1)), found.group(2), found.group(3)
    assert stacks == str(run_dir / "logs" / f"hang-{step}.txt")
    text = open(stacks).read()
    rank0, rank1 = text.split("\nrank 1 on node ")  # every rank's stack, rank 0's first
    assert "rank 0 on node " in rank0 and "train_epoch" in rank0
    assert f"{where}\", line" in rank1 and f"in {frame}" in rank1  # the frame the rank is stuck in
    # torch's flight recorder, taken by each rank at half the timeout: the culprit completed every
    # collective it enqueued, the waiting rank has one in flight; the raw dumps are kept for torch's tools.
    flights = [re.findall(r"\n  process group \S+: (\d+) collectives enqueued, (\d+) completed", part)
               for part in (rank0, rank1)]
    assert all(flights) and all(e == c for e, c in flights[1]), text
    assert any(int(e) > int(c) for e, c in flights[0]), text
    assert sorted(os.listdir(run_dir / "logs" / "flight-recorder")) == ["rank_0", "rank_1"]
    [restart] = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert restart["kind"] == "hang" and restart["reason"] == said[len("warning: "):]
    assert [line for line in lines if re.match(r"warning: hang: rank 1 on node \S+ \(pid \d+\); restarting from "
                                              r"\S+checkpoint_\S+ \(restart 1 of 1\)", line)], lines
    assert [row["epoch"] for row in result.metrics] == [1, 2]
    for name, w in final_weights(straight).items():
        assert torch.equal(final_weights(result)[name], w), name


@pytest.mark.slow
@pytest.mark.parametrize("fault, frame, engine", [("stall", "forward", "local"), ("stall", "forward", "ray"),
                                                   ("deadlock", "held.acquire()", "local"),
                                                   ("deadlock", "held.acquire()", "ray")])
def test_a_rank_hung_in_its_forward_is_named_and_its_group_restarts_bitwise_at_the_default_timeout(
        request, straight, tmp_path, fault, frame, engine):
    """Asleep in its forward, or in a Python-level deadlock there. While rank 1 is stuck,
    `raytrain-app stack` shows it there, through the run directory."""
    if engine == "ray":
        request.getfixturevalue("ray_cluster")
    marker, run_dir = tmp_path / "fault", tmp_path / "run"
    shown = []

    def ask_while_stuck():
        while not os.path.exists(f"{marker}.at"):
            time.sleep(0.5)
        time.sleep(5)  # a beat or two from inside the hang
        shown.append(command(["stack", str(run_dir)], REPO, timeout=60))

    asking = threading.Thread(target=ask_while_stuck, daemon=True)
    asking.start()
    result, lines, times = hung(step_checkpointed(marker, fault), marker, run_dir, local=engine == "local")
    check_hang(result, lines, times, marker, run_dir, straight, FLOOR_S, "forward", "forward")
    asking.join(timeout=60)
    [stacks] = shown
    assert stacks.returncode == 0, stacks.stderr
    rank0, rank1 = stacks.stdout.split("\nrank 1 on node ")
    assert re.match(r"rank 0 on node \S+ \(pid \d+\): step \d+, backward for ", rank0), rank0
    assert re.match(r"\S+ \(pid \d+\): step \d+, forward for ", rank1) and frame in rank1, rank1


@pytest.mark.parametrize("engine, timeout_s", [("local", 10), pytest.param("ray", "auto", marks=pytest.mark.slow)])
def test_a_rank_hung_in_a_data_read_is_named_in_the_data_phase(request, tmp_path, engine, timeout_s):
    """A training sample's read that never returns (a dead network filesystem): the other rank
    waits in the gradient all-reduce, and is not the one named. In local mode with a 10 s timeout;
    on Ray at the default."""
    if engine == "ray":
        request.getfixturevalue("ray_cluster")
    marker, run_dir = tmp_path / "fault", tmp_path / "run"
    data = {"name": "tests.helpers:stalling_digits", "args": {"marker": str(marker), "at": 30}, "loader_workers": 0}
    config = job(model={"name": "mlp", "args": {"hidden": [32]}}, data=data, train={"epochs": 2, "batch_size": 32},
                 checkpoint={"every_steps": 5}, failure={"max_failures": 1, "hang_timeout_s": timeout_s})
    reference = job(model={"name": "mlp", "args": {"hidden": [32]}},
                    data={**data, "args": {"marker": str(tmp_path / "never"), "at": 30}},
                    train={"epochs": 2, "batch_size": 32}, checkpoint={"every_steps": 5})
    straight_run = run(reference, tmp_path / "straight")
    result, lines, times = hung(config, marker, run_dir, local=engine == "local")
    check_hang(result, lines, times, marker, run_dir, straight_run, FLOOR_S if timeout_s == "auto" else timeout_s,
               "data", "__getitems__")


def test_a_slow_rank_is_named_in_the_epoch_line_and_in_metrics(tmp_path):
    """Rank 1 sleeps 50 ms in every forward: its own time per step holds those 50 ms, rank 0's
    does not, although both ranks' epochs last as long (rank 0 waits in the all-reduce)."""
    from raytrain_app.driver.plan import make_plan
    from raytrain_app.driver.trainer import run_training

    config = job(model={"name": "tests.helpers:paced", "args": {"seconds": 0.05, "rank": 1}},
                 data={"name": "digits"}, train={"epochs": 1, "batch_size": 64})
    lines = []
    run_training(make_plan(config, run_dir=str(tmp_path / "run"), local=True), echo=lines.append)
    [row] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    fast, slow = row["rank_step_s"]
    assert slow >= 0.05 > fast * 2, row["rank_step_s"]
    assert [s["rank"] for s in row["slow_ranks"]] == [1]
    assert row["slow_ranks"][0]["x_median"] == pytest.approx(slow / fast)
    [epoch] = [line for line in lines if line.startswith("epoch 1/1")]
    assert re.search(rf"\| slow: rank 1 on node {re.escape(socket.gethostname())}: \d+\.\dx the median step, "
                     rf"\d+% waiting for data$", epoch), epoch


def test_stack_shows_every_rank_of_a_live_run(tmp_path):
    """A run whose every step sleeps 0.2 s in its forward: both ranks' stacks show it there."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", "train", "examples/digits.yaml",
                             "--run-dir", str(run_dir), "--set", "model.name=tests.helpers:paced",
                             "--set", "model.args={seconds: 0.2}"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("first step after"):
                break
        time.sleep(5)  # two beats or more (one every 2 s) from inside the training loop
        shown = command(["stack", str(run_dir)], REPO, timeout=60)
        assert shown.returncode == 0, shown.stderr
        parts = re.split(r"^rank (\d) on node \S+ \(pid \d+\): step \d+, (\w+) for [\d.]+s", shown.stdout, flags=re.M)
        assert parts[1::3] == ["0", "1"], shown.stdout
        assert all("train_loop_per_worker" in stack for stack in parts[3::3]), shown.stdout  # the loop's thread
        # Mostly asleep in their forward (0.2 s a step), each stack as of its last beat.
        assert any("time.sleep(self.seconds)" in stack for stack in parts[3::3]), shown.stdout
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=60)
    stopped = command(["stack", str(run_dir)], REPO)
    assert stopped.returncode == 2 and stopped.stderr == (f"error: the run in {run_dir} is not training now "
                                                          "(run.json says interrupted): no stacks to show\n")


# ---- the watch's verdict, on beats written by hand --------------------------------------------


def beat(rank, phase, quiet_s, p99=0.01, step=7):
    return {"rank": rank, "node": "n", "host": f"host{rank}", "pid": 100 + rank, "started": 1.0, "step": step,
            "phase": phase, "quiet_s": quiet_s, "p99_step_s": p99, "floor_s": FLOOR_S, "stack": "",
            "where": "m.py:1 in f"}


def verdict(timeout, *beats):
    watch = HangWatch(timeout, "unused", kill=None, said=None)
    for b in beats:
        watch.beat(b)
    found = watch.check(time.monotonic())
    return found and found[0].beat["rank"]


def test_the_culprit_is_the_rank_outside_a_collective_then_the_one_stopped_longest():
    # Rank 1 stuck in its forward; rank 0 and 2 wait for it in the all-reduce (backward), one of
    # them stopped even earlier by the clocks' word: the one outside a collective is named.
    assert verdict(10, beat(0, "backward", 31), beat(1, "forward", 30), beat(2, "backward", 30)) == 1
    assert verdict(10, beat(0, "backward", 31), beat(1, "backward", 30)) == 0  # a hang inside the collective
    # Rank 1 was a step behind, seconds on a loaded machine, when it stopped in its forward.
    assert verdict(10, beat(0, "backward", 10), beat(1, "forward", 6)) == 1
    assert verdict(10, beat(0, "backward", 9), beat(1, "forward", 9)) is None  # not yet
    # The rank that stopped first is checkpointing or evaluating: their bounds are their own.
    assert verdict(10, beat(0, "checkpoint", 300), beat(1, "after_step", 299)) is None
    assert verdict(10, beat(0, "eval", 300), beat(1, "backward", 299)) is None
    assert verdict(10, beat(0, "start", 300), beat(1, "start", 300)) is None  # compiling its first step
    assert verdict(0, beat(0, "backward", 1e6), beat(1, "forward", 1e6)) is None  # off


def test_the_auto_timeout_is_learned_from_the_slowest_ranks_p99_step():
    assert verdict("auto", beat(0, "backward", FLOOR_S - 1), beat(1, "forward", FLOOR_S - 1)) is None
    assert verdict("auto", beat(0, "backward", FLOOR_S + 1), beat(1, "forward", FLOOR_S + 1)) == 1
    # A 5 s step: 20 steps' worth, 100 s, before a rank still in its forward is a hang.
    slow = (beat(0, "backward", 99, p99=5.0), beat(1, "forward", 99, p99=0.5))
    assert verdict("auto", *slow) is None
    assert verdict("auto", *(dict(b, quiet_s=101) for b in slow)) == 1


def test_a_restarted_groups_old_ranks_are_forgotten():
    watch = HangWatch(10, "unused", kill=None, said=None)
    watch.beat(beat(1, "forward", 60))
    watch.reset()  # the group failed
    watch.beat(beat(1, "forward", 60))  # a late beat of the gone process
    assert watch.check(time.monotonic()) is None
    watch.beat(dict(beat(1, "forward", 60), pid=201))  # its restart's
    assert watch.check(time.monotonic())[0].beat["pid"] == 201
