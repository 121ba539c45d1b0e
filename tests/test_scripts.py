"""torchrun-style scripts, unchanged, each rank its own process (`train SCRIPT.py -- ARGS`).

Each test runs a real script with 2 Gloo ranks, in local mode and on the session's Ray cluster:
the tutorial-style script must give exactly what `torchrun --nproc_per_node 2` gives; a failing
rank must be named; a hung rank found; a killed rank must restart the group and the script resume
through `latest_checkpoint()`; a stop request must reach the script's own signal handler.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress

import pytest
import torch

from raytrain_app import TrainingFailed, fit
from raytrain_app.data.parquet import DIGITS_FILE
from tests.conftest import REPO, TUTORIAL_SCRIPT, epoch_lines

ENGINES = ["local", "ray"]


@pytest.fixture(params=ENGINES)
def engine(request):
    """Each test in local mode (each rank a process of this machine) and on the Ray cluster."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return request.param

PROBE = '''
import json, os, signal, sys
import torch.distributed as dist
import raytrain_app
signal.signal(signal.SIGTERM, lambda *_: None)  # the main thread of its own process, as under torchrun
os.write(2, f"native write from rank {os.environ['RANK']}\\n".encode())  # below Python's sys.stderr
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
        "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "RAYTRAIN_RUN_DIR"]
dist.init_process_group("gloo")  # from the environment, as under torchrun
with open(f"/proc/{os.getppid()}/maps") as maps:  # what the process serving this rank has loaded
    serving_torch = "libtorch_cpu" in maps.read()
print("env " + json.dumps({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv, "cwd": os.getcwd(),
                           "main": __name__, "serving_torch": serving_torch}))
raytrain_app.report({"rank_value": dist.get_rank(), "name": f"rank {dist.get_rank()}"})
if dist.get_rank() == 1:
    raise RuntimeError("boom on rank 1")
print("rank 0 done")
'''


def run(script, run_dir, engine, args=(), overrides=(), resume=False):
    lines = []
    result = fit(str(script), script_args=list(args), workers=2, run_dir=str(run_dir), overrides=overrides,
                 resume=resume, echo=lines.append, local=engine == "local")
    return result, lines


def test_a_tutorial_script_runs_unchanged_and_matches_torchrun(tmp_path, torchrun_reference, engine):
    reference_lines, reference_checkpoint = torchrun_reference
    checkpoint = tmp_path / "model.pt"
    _, lines = run(TUTORIAL_SCRIPT, tmp_path / "run", engine,
                   ["--data", str(DIGITS_FILE), "--checkpoint", str(checkpoint)])
    assert epoch_lines("\n".join(lines)) == reference_lines and len(reference_lines) == 2  # rank 0's prints only
    ours, theirs = torch.load(checkpoint), torch.load(reference_checkpoint)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)  # bit for bit
    rank1 = (tmp_path / "run" / "logs" / "rank-1.log").read_text()
    assert "rank 1/2 on node" in rank1 and "epoch " not in rank1  # rank 1 printed nothing


def test_a_rank_that_raises_fails_the_run_naming_it_with_the_torchrun_environment(tmp_path, engine):
    """Also: the script may set a signal handler, what it writes below Python (a native library's
    stderr) is on the console and in the rank's log, and on Ray no worker loads torch."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    lines = []
    where = rf"{re.escape(socket.gethostname())} \(pid \d+\)" if engine == "local" else r"[\d.]+"  # name, or IP
    failed = rf"^rank 1 on node {where}: {re.escape(str(script))} exited with status 1: RuntimeError: boom on rank 1$"
    with pytest.raises(TrainingFailed, match=failed):
        fit(str(script), script_args=["--flag", "value"], workers=2, run_dir=str(tmp_path / "run"),
            echo=lines.append, local=engine == "local")
    assert "native write from rank 0" in lines
    logs = tmp_path / "run" / "logs"
    seen = [json.loads(re.search(r"^env (.*)$", (logs / f"rank-{r}.log").read_text(), re.M).group(1)) for r in (0, 1)]
    for rank, probe in enumerate(seen):
        env = probe["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(rank), str(rank),
                                                                                                "2", "2")
        assert env["GROUP_RANK"] == env["NODE_RANK"] == "0" and env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["RAYTRAIN_RUN_DIR"] == str(tmp_path / "run")
        assert probe["argv"] == [str(script), "--flag", "value"] and probe["main"] == "__main__"
    assert seen[0]["env"]["MASTER_PORT"] == seen[1]["env"]["MASTER_PORT"]
    # On Ray, no worker loads torch: each starts and serves its script's process, which loads its
    # own (rank 0's serves the ranks' store). In local mode the driver, which has, serves them all.
    assert [probe["serving_torch"] for probe in seen] == [engine == "local"] * 2
    assert "Traceback" in (logs / "rank-1.log").read_text()  # the whole story stays in the rank's log
    assert "native write from rank 1" in (logs / "rank-1.log").read_text()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row.pop("time") > 0 for row in rows] == [True]
    assert rows == [{"report": 1, "rank_value": 0.5, "name": "rank 0"}]  # numbers averaged, others rank 0's


def test_a_hung_rank_of_a_script_is_named_from_its_stack_and_the_group_restarts(tmp_path, engine):
    """Rank 1 sleeps mid-epoch: its stack stops changing and it prints nothing, while rank 0
    waits in its backward, for DDP's all-reduce (a collective, not the culprit)."""
    result, lines = run("examples/torchrun_script/train.py", tmp_path / "run", engine,
                        ["--epochs", "3", "--hang-at-epoch", "1"],
                        overrides=["failure.max_failures=1", "failure.hang_timeout_s=10"])
    [said] = [line for line in lines if " made no progress " in line]
    found = re.fullmatch(r"warning: hang: rank 1 on node \S+ \(pid \d+\) made no progress for \d+s in script "
                         r"\(examples/torchrun_script/train\.py:\d+ in main\); every rank's stack in (\S+)", said)
    assert found, said
    stacks = open(found.group(1)).read()
    assert "time.sleep(3600)" in stacks and "rank 0 on node" in stacks and ", backward for " in stacks
    [restart] = [json.loads(line) for line in (tmp_path / "run" / "restarts.jsonl").read_text().splitlines()]
    assert restart["kind"] == "hang" and restart["reason"] == said[len("warning: "):]
    assert [row["epoch"] for row in result.metrics] == [0, 1, 2]


def test_a_killed_rank_restarts_the_group_and_the_script_resumes_also_with_resume(tmp_path, engine):
    result, lines = run("examples/torchrun_script/train.py", tmp_path / "run", engine,
                        ["--epochs", "4", "--crash-at-epoch", "2"], overrides=["failure.max_failures=1"])
    said = "\n".join(lines)
    assert re.search(r"warning: rank 1 .*train\.py killed by SIGKILL.*restarting from .*checkpoint_.*"
                     r"\(restart 1 of 1\)", said)
    at = int(re.search(r"^restart 1: resumed from \S+ at epoch (\d)$", said, re.M).group(1))
    assert at in (1, 2)  # from the last checkpoint Ray Train had registered when rank 1 died
    assert [row["epoch"] for row in result.metrics] == [0, 1, 2, 3]  # re-run epochs replace their rows
    assert result.metrics[-1]["accuracy"] > 0.8 and result.final_checkpoint == result.metrics[-1]["checkpoint"]

    # --resume with more epochs: the script finds the last checkpoint, and its reports are added
    # after the earlier ones, none replaced.
    resumed, lines = run("examples/torchrun_script/train.py", tmp_path / "run", engine, ["--epochs", "5"], resume=True)
    assert re.search(r"^restart 0: resumed from \S+ at epoch 4$", "\n".join(lines), re.M)
    assert [row["epoch"] for row in resumed.metrics] == [0, 1, 2, 3, 4]
    assert resumed.metrics[-1]["report"] == result.metrics[-1]["report"] + 1


@pytest.mark.parametrize("sent, engine", [("SIGUSR1", "local"), ("SIGTERM", "local"), ("SIGUSR1", "ray")])
def test_a_stop_reaches_the_scripts_own_handler_which_checkpoints_and_resume_continues(request, tmp_path, sent,
                                                                                       engine):
    """SIGUSR1 to `train` (SLURM's `--signal`, `raytrain-app` stop requests) or SIGTERM (a pod's,
    a scheduler's; local mode, where `train` passes it on): every rank's script gets
    SIGTERM, its handler checkpoints through `raytrain_app.report`, and `--resume` continues there."""
    if engine == "ray":
        request.getfixturevalue("ray_cluster")
    script, run_dir = "tests/scripts/checkpoint_on_sigterm.py", str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", "train", script, "--workers", "2",
                             "--run-dir", run_dir, "--local" if engine == "local" else "--ray"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    said = []
    try:
        for line in proc.stdout:
            said.append(line)
            if line.startswith("step 3"):  # the script is in its loop: its handler is in place
                break
        os.kill(proc.pid, getattr(signal, sent))
        said += proc.stdout.readlines()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(said)
    assert re.search(rf"^{sent}: SIGTERM to the script \(rank 0, pid \d+\), which has 60s \(script\.stop_grace_s\) "
                     r"to checkpoint and exit$", text, re.M), text
    saved = int(re.search(r"^checkpointed at step (\d+) on SIGTERM$", text, re.M).group(1))
    assert re.search(r"^the script exited [\d.]+s after the stop signal, with status 0$", text, re.M), text
    assert proc.returncode == (75 if sent == "SIGUSR1" else 130), text  # stopped: --resume; or interrupted
    [row] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == saved and row["checkpoint"].startswith(f"{run_dir}/checkpoint_")

    _, lines = run(script, run_dir, engine, ["--steps", str(saved + 3)], resume=True)
    assert f"resumed at step {saved + 1}" in lines and lines.count(f"step {saved + 1}") == 1


def test_a_driver_killed_outright_leaves_no_script_process_behind(tmp_path):
    """SIGKILL (the OOM killer's) on `train` in local mode while rank 1's script sleeps mid-epoch
    and rank 0's waits for it in a collective: each is a session of its own, out of reach of the
    driver's process group, and neither would notice. Both end with the driver that served them."""
    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", "train", "examples/torchrun_script/train.py",
                             "--workers", "2", "--local", "--run-dir", str(tmp_path / "run"), "--",
                             "--hang-at-epoch", "0"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    ranks = []
    try:
        deadline = time.monotonic() + 60
        while len(ranks) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            ranks = [p for p in psutil.Process(proc.pid).children() if "raytrain_app.worker.script_process" in
                     p.cmdline()]
            time.sleep(0.2)
        assert all(os.getsid(p.pid) == p.pid for p in ranks), ranks
        time.sleep(5)  # (their group is up by then and rank 1 asleep; at any moment, they must end with the driver)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        _, left = psutil.wait_procs(ranks, timeout=15)
        assert not left, left
    finally:
        for p in ranks:  # what a failed assertion would leave: ours, by pid
            with suppress(psutil.Error):
                p.kill()
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_the_hf_trainer_pattern_gives_torchrun_losses_and_its_native_warnings_are_shown(tmp_path, engine):
    """A tiny GPT-2 under HF's Trainer, with its SIGTERM checkpoint handler (main thread only), gives
    the losses `torchrun` gives; DDP's C++ warning reaches the console and the rank's log."""
    script = "tests/scripts/hf_trainer.py"
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script,
                               str(tmp_path / "torchrun")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert torchrun.returncode == 0, torchrun.stderr[-2000:]
    losses = re.findall(r"^step \d+ loss [\d.]+$", torchrun.stdout, re.M)
    assert len(losses) == 6
    _, lines = run(script, tmp_path / "run", engine, [str(tmp_path / "ours")])
    assert [line for line in lines if re.match(r"step \d+ loss ", line)] == losses
    warning = "find_unused_parameters=True was specified in DDP constructor"  # from reducer.cpp, below Python
    assert any(warning in line for line in lines), lines
    assert warning in (tmp_path / "run" / "logs" / "rank-0.log").read_text()


@pytest.mark.slow
def test_a_local_script_run_never_loads_ray(tmp_path):
    """Local mode launches a script's ranks itself, as torchrun does, and starts about as soon: the
    driver imports neither Ray nor Ray Train (a second and a half of imports)."""
    code = ("import sys\nfrom raytrain_app import fit\n"
            f"fit('examples/torchrun_script/train.py', workers=2, local=True, run_dir={str(tmp_path / 'run')!r}, "
            "script_args=['--epochs', '1'], echo=lambda line: None)\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "[]"
