"""The `raytrain-app` command as a user runs it: a real process, its exit code and its console."""

import json
import os
import re
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from raytrain_app.data.arrays import split
from raytrain_app.data.parquet import DIGITS_FILE, read_table
from tests.commands import command as forked_command
from tests.conftest import REPO


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "raytrain_app.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def forked(*args):
    """A command whose own start-up is not under test, forked from a server that imported it once."""
    return forked_command(args, REPO)


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cli") / "digits"
    start = time.monotonic()
    proc = cli("train", "examples/digits.yaml", "--workers", "2", "--run-dir", str(run_dir), *KEEP_WORST)
    proc.seconds = time.monotonic() - start
    return run_dir, proc


# Keep the checkpoints with the *lowest* accuracy: with accuracy rising, the best by the metric and
# the latest are then different checkpoints, so keeping by the metric shows.
KEEP_WORST = ("--set", "checkpoint.every_epochs=1", "--set", "checkpoint.mode=min")


@pytest.mark.slow
def test_digits_example_trains_to_95_percent(digits_run):
    run_dir, proc = digits_run
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == list(range(1, 13))
    for key in ("epoch", "train_loss", "eval_loss", "eval_accuracy", "samples_per_s", "world_size", "lr"):
        assert key in rows[-1]
    assert rows[-1]["world_size"] == 2 and rows[-1]["eval_accuracy"] >= 0.95
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["scaling"]["backend"] == "gloo"
    assert (run_dir / "logs" / "rank-1.log").exists()
    # Local mode (the default on one machine): each worker process's own output in the launch's logs.
    assert proc.stdout.startswith(f"run {run_dir}: 2 workers, gloo, fp32, local mode")
    assert len(list((run_dir / "logs" / "local").glob("launch-1_*/attempt_0/[01]/stderr.log"))) == 2


def test_startup_json_breaks_the_first_step_down(digits_run):
    run_dir, proc = digits_run
    phases = json.loads((run_dir / "startup.json").read_text())
    assert list(phases) == ["imports+checks", "cluster", "worker group", "data+model", "first step", "total"]
    assert all(value >= 0 for value in phases.values())
    parts = sum(value for key, value in phases.items() if key != "total")
    assert 0.5 * phases["total"] < parts <= phases["total"] + 0.01  # the gaps between phases are small
    assert f"first step after {phases['total']:.1f}s (imports+checks {phases['imports+checks']:.1f}s" in proc.stdout


def test_the_summarys_wall_time_is_the_commands(digits_run):
    run_dir, proc = digits_run
    wall = float(re.search(r"^wall time +([0-9.]+)s$", proc.stdout, re.M).group(1))
    startup = json.loads((run_dir / "startup.json").read_text())
    assert startup["total"] < wall <= proc.seconds  # imports and the cluster's start and stop included
    # All but Python's own start and the exit: the command's imports and checks, and then the whole
    # run, as run.json records it from its start to its end (times of day, apart from the wall
    # time's clock), less the summary's rounding to 0.1 s.
    record = json.loads((run_dir / "run.json").read_text())
    assert wall >= startup["imports+checks"] + record["updated"] - record["started"] - 0.06


def test_keeps_the_best_checkpoints_by_the_metric(digits_run):
    run_dir, _ = digits_run
    rows = {r["epoch"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    kept = {torch.load(p, weights_only=True)["epoch"] for p in run_dir.glob("checkpoint_*/state.pt")}
    best_two = set(sorted(rows, key=lambda e: rows[e]["eval_accuracy"])[:2])  # keep: 2, mode: min
    assert best_two != {11, 12}  # the test means something only if best and latest differ
    assert kept == best_two | {12}  # the best two by the metric, plus the latest


def test_a_run_leaves_its_pictures_and_tensorboard_curves(digits_run, tmp_path):
    run_dir, proc = digits_run
    png = (run_dir / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1200
    assert re.search(rf"report +{re.escape(str(run_dir / 'report.png'))}", proc.stdout)  # named at the end

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    accuracy = events.Scalars("epoch/eval_accuracy")
    assert [(e.step, round(e.value, 5)) for e in accuracy] == [(r["step"], round(r["eval_accuracy"], 5)) for r in rows]
    assert events.Scalars("startup/total_s")[0].value > 0 and events.Scalars("step/lr")

    compared = forked("report", str(run_dir), str(run_dir), "-o", str(tmp_path / "both.png"))
    assert compared.returncode == 0 and compared.stdout.strip() == str(tmp_path / "both.png"), compared.stderr
    # An output it cannot write: the system's words, not pyarrow's wrapping of them around a temp file's name.
    unwritable = forked("report", str(run_dir), "-o", "/proc/raytrain/report.png")
    assert (unwritable.returncode, unwritable.stderr) == (
        2, "error: cannot write /proc/raytrain/report.png: No such file or directory\n"), unwritable


def test_evaluate_and_predict_reproduce_the_runs_last_eval(digits_run, ray_cluster, tmp_path):
    """Through the library, on the session's cluster (a process joined to Ray evaluates there; the
    commands are one call each; their errors go through the command below and in
    test_bad_input); then the commands on one machine, which run in local mode by default and
    must give the same answers."""
    from raytrain_app.inference import scoring

    run_dir, _ = digits_run
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])

    # One worker instead of the run's two: the exact evaluation gives the same numbers.
    metrics = scoring.evaluate(str(run_dir), "latest", "eval", workers=1, echo=lambda line: None)
    [written] = (run_dir / "evaluations").glob("checkpoint_*-eval.json")
    evaluated = json.loads(written.read_text())
    assert evaluated["workers"] == 1 and evaluated["metrics"] == metrics
    assert metrics["eval_accuracy"] == last["eval_accuracy"]
    assert metrics["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)

    # The eval split as a user's Parquet file (raw pixels, the shape in its metadata), in 4 row groups.
    x, y = read_table(str(DIGITS_FILE), "image", "label", None)
    _, _, x_eval, y_eval = split(x, y, 0.2, 0)
    pixels = x_eval.reshape(len(y_eval), -1).numpy()
    table = pa.table({"image": pa.FixedSizeListArray.from_arrays(pa.array(pixels.ravel()), pixels.shape[1]),
                      "id": pa.array([f"digit-{i}" for i in range(len(y_eval))])})
    pq.write_table(table.replace_schema_metadata({"raytrain.shape": "[1, 8, 8]"}), tmp_path / "new.parquet",
                   row_group_size=100)
    rows = scoring.predict(str(run_dir), str(tmp_path / "new.parquet"), str(tmp_path / "preds.parquet"), "latest",
                             batch_size=64, echo=lambda line: None)
    assert rows == len(y_eval)
    preds = pq.read_table(tmp_path / "preds.parquet")
    assert preds.column("row").to_pylist() == list(range(len(y_eval)))
    assert preds.column("id").to_pylist() == table.column("id").to_pylist()
    correct = (preds.column("prediction").to_numpy() == y_eval.numpy()).mean()
    assert correct == last["eval_accuracy"]
    assert all(0.1 <= p <= 1 for p in preds.column("probability").to_pylist())

    # The commands, with no flag: local mode (no cluster), the same numbers, the same predictions.
    local = forked("evaluate", str(run_dir), "--checkpoint", "latest")
    assert local.returncode == 0 and local.stdout.startswith("evaluating checkpoint_") and \
        ": 1 worker, local mode\n" in local.stdout, local.stderr
    assert json.loads(written.read_text())["metrics"] == metrics  # rewritten, the same
    assert re.search(rf"^eval_accuracy +{metrics['eval_accuracy']:.6g}$", local.stdout, re.M)
    local = forked("predict", str(run_dir), "--checkpoint", "latest", "--input",
                   str(tmp_path / "new.parquet"), "--output", str(tmp_path / "local.parquet"))
    assert local.returncode == 0 and f"{len(y_eval)} predictions in" in local.stdout, local.stderr
    assert local.stdout.startswith(f"predicting {tmp_path / 'new.parquet'} with checkpoint_") and \
        " over 1 worker, in this process\n" in local.stdout, local.stdout
    assert pq.read_table(tmp_path / "local.parquet").equals(preds)
    refused = forked("evaluate", str(run_dir), "--local", "--workers", "2")
    assert refused.returncode == 2 and refused.stderr.strip() == ("error: --local runs one worker in this process: "
                                                                  "drop --workers and --address, or --local")

    # Rows that do not fit the model: one line, exit 2, before Ray starts.
    pq.write_table(pa.table({"pixels": [[0.0] * 64]}), tmp_path / "wrong.parquet")
    proc = forked("predict", str(run_dir), "--input", str(tmp_path / "wrong.parquet"), "--output", str(tmp_path / "p"))
    assert proc.returncode == 2 and "has no column 'image'" in proc.stderr and len(proc.stderr.splitlines()) == 1
    pq.write_table(pa.table({"image": [[0.0] * 10]}), tmp_path / "short.parquet")
    proc = forked("predict", str(run_dir), "--input", str(tmp_path / "short.parquet"), "--output", str(tmp_path / "p"))
    assert proc.returncode == 2 and "10 values per row, but the model was trained on samples of 64 values shaped " \
        "[1, 8, 8]" in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    proc = forked("predict", str(run_dir), "--input", str(tmp_path / "new.parquet"), "--output", "/proc/preds.parquet")
    assert proc.returncode == 2 and "is not writable" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_evaluate_and_predict_run_in_this_process_by_default_where_nothing_is_lost(monkeypatch):
    """As `train` chooses local mode: not with --workers or --address, a cluster to use, GPU
    workers (N GPUs that one process would not use), or what needs Ray; a run that trained on Ray
    (scaling.local: false) scores the same in local mode."""
    from raytrain_app.config import JobConfig
    from raytrain_app.inference.scoring import local_by_default

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    digits = yaml.safe_load(open(os.path.join(REPO, "examples", "digits.yaml")))

    def job(**scaling):
        return JobConfig.from_dict({**digits, "scaling": {**digits.get("scaling", {}), **scaling}})

    assert local_by_default(job(), None, None, False) and local_by_default(job(local=False), None, None, False)
    assert not local_by_default(job(), None, None, True)  # a process joined to Ray (a notebook's ray.init())
    assert not local_by_default(job(), 2, None, False) and not local_by_default(job(), None, "127.0.0.1:6379", False)
    assert not local_by_default(job(gpus_per_worker=1), None, None, False)
    raydata = JobConfig.from_dict({**digits, "data": {"name": "parquet", "engine": "ray_data",
                                                      "args": {"path": "a", "eval_path": "b"}}})
    assert not local_by_default(raydata, None, None, False)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # inside a Ray job
    assert not local_by_default(job(), None, None, False)


def test_runs_lists_the_run_as_finished(digits_run):
    run_dir, _ = digits_run
    proc = forked("runs", str(run_dir.parent), "--json")
    [listed] = [r for r in json.loads(proc.stdout) if r["name"] == run_dir.name]
    assert listed["status"] == "finished" and listed["epochs_done"] == 12 and listed["epochs"] == 12


def test_console_holds_only_our_lines(digits_run):
    _, proc = digits_run
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("run ") and sum(line.startswith("epoch ") for line in lines) == 12
    assert "final eval_accuracy" in proc.stdout and "best checkpoint" in proc.stdout
    assert not [line for line in lines if re.search(r"\b(INFO|WARNING)\b|RayTrainWorker|pid=", line)]


@pytest.mark.slow
def test_an_existing_run_needs_resume_and_resume_continues_it(digits_run):
    run_dir, _ = digits_run
    proc = forked("train", "examples/digits.yaml", "--run-dir", str(run_dir))
    assert proc.returncode == 2 and "pass --resume" in proc.stderr
    proc = forked("train", "examples/digits.yaml", "--run-dir", str(run_dir), "--resume", "--set", "train.epochs=13",
                  *KEEP_WORST)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^resumed from \S+ at step \d+: epoch 13 from batch 0$", proc.stdout, re.MULTILINE), proc.stdout
    assert [line.split("|")[0].strip() for line in proc.stdout.splitlines() if line.startswith("epoch ")] == [
        "epoch 13/13"]  # the one new epoch; the twelve before it were not trained again
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == list(range(1, 14))


@pytest.mark.slow
def test_a_worker_killed_beyond_max_failures_exits_1_naming_the_rank_its_node_and_the_cause(tmp_path):
    marker = tmp_path / "kill"
    marker.touch()
    proc = forked("train", "examples/digits.yaml", "--run-dir", str(tmp_path / "run"), "--set", "train.epochs=1",
                  "--set", "model.name=tests.helpers:faulty_mlp",
                  "--set", f"model.args={{marker: '{marker}', at: 3, rank: 1, fault: kill}}")
    assert proc.returncode == 1, proc.stderr
    assert re.fullmatch(r"training failed: rank 1 on node \S+ \(pid \d+\): worker process died: killed by SIGKILL\n",
                        proc.stderr)
    assert "Traceback" not in proc.stdout + proc.stderr  # the launcher's and the peers' accounts: in the logs


def test_an_unexpected_error_is_one_line_and_keeps_its_traceback(capsys):
    from raytrain_app.cli import exit_codes

    with pytest.raises(SystemExit) as exited:
        with exit_codes():
            {}["no such key"]  # any bug, wherever it is raised
    assert exited.value.code == 1
    err = capsys.readouterr().err
    found = re.fullmatch(r"error: internal error, KeyError: 'no such key' \(at test_cli\.py:\d+; "
                         r"traceback in (\S+)\)\n", err)
    assert found, err
    kept = open(found.group(1)).read()
    assert kept.startswith("Traceback (most recent call last)") and "KeyError: 'no such key'" in kept


def leaf_commands(group, path=()):
    import click

    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from leaf_commands(command, (*path, name))
        else:
            yield (*path, name)


def test_output_into_a_closed_pipe_ends_quietly_as_unix_tools_do():
    """`raytrain-app ... | head`: the reader leaves early; no "internal error", no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", "slurm", "render", "examples/digits.yaml",
                             "--cluster", "cluster/slurm.yaml", "--skip-checks"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command (still importing) writes its first line
    said = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and said == "", said


def test_every_commands_help_ends_with_two_or_three_examples():
    from click.testing import CliRunner

    from raytrain_app.cli import main

    commands = list(leaf_commands(main))
    assert len(commands) == 22
    for command in commands:
        text = CliRunner().invoke(main, [*command, "--help"]).output
        body, _, options = text.partition("\nOptions:")
        examples = body.rstrip().split("Examples:")[-1].strip().splitlines()
        assert "Examples:" in body and 2 <= len(examples) <= 3, (command, body)
        assert all(e.strip().startswith(("raytrain-app ", "#")) for e in examples), (command, examples)


def test_shell_completion_completes_commands_and_paths():
    env = {**os.environ, "_RAYTRAIN_APP_COMPLETE": "bash_complete"}

    def complete(words: str) -> list[str]:
        proc = subprocess.run([sys.executable, "-m", "raytrain_app.cli"], capture_output=True, text=True, cwd=REPO,
                              env={**env, "COMP_WORDS": words, "COMP_CWORD": str(len(words.split()) - 1)})
        return proc.stdout.splitlines()

    assert "plain,evaluate" in complete("raytrain-app ev")
    assert complete("raytrain-app submit job.yaml --cluster clu") == ["file,clu"]  # the shell lists files
    assert complete("raytrain-app report run") == ["file,run"]
    assert complete("raytrain-app runs ru") == ["dir,ru"]
