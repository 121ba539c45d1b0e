"""After training, as a user goes on: a CSV made into Parquet by `raytrain-app convert`, trained
from its own folder with a relative data path, then used from another directory, on raw rows,
without the training data: `evaluate` (its split and a labelled CSV), `predict` (label-less rows
with the CSV's columns in another order), `export` in every format into one folder, and
`load_model`.
Every one of them must score what the run reported for the checkpoint they all name.

No Ray: training, `evaluate` and `predict` run in local mode (the library calls that the
commands make; on Ray, `evaluate` and `predict` are tested in test_cli), and the commands that
need no Ray run through the CLI.
"""

from __future__ import annotations

import csv
import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.csv as pv
import pyarrow.parquet as pq
import pytest
import torch

import raytrain_app
from raytrain_app import rundir
from raytrain_app.inference import scoring
from tests import runrecord
from tests.commands import command
from tests.conftest import REPO, short_temp_dir

FEATURES = ["age", "tenure_months", "monthly_fee", "support_calls", "usage_gb"]
JOB = """\
name: plans
model: {name: mlp, args: {hidden: [32]}}
data: {name: parquet, args: {path: data/train, eval_path: data/eval}}
task: {class_weights: auto}
optimizer: {name: adam, lr: 0.01}
train: {epochs: 5, batch_size: 32}
checkpoint: {every_epochs: 1, keep: 2}
scaling: {workers: 2}
"""


def customers(n: int, seed: int) -> pa.Table:
    """Which of three plans a customer is on: a rule of features on very different scales (an
    unnormalised model does poorly), one plan rare."""
    rng = np.random.default_rng(seed)
    table = {"age": rng.integers(18, 80, n), "tenure_months": rng.integers(0, 120, n),
             "monthly_fee": rng.uniform(10, 200, n).round(2), "support_calls": rng.integers(0, 12, n),
             "usage_gb": rng.gamma(2.0, 40.0, n).round(1)}
    score = (table["monthly_fee"] - 100) / 50 + (table["usage_gb"] - 80) / 60 - (table["age"] - 50) / 30
    plan = np.where(score > 1.2, 2, np.where(score > -0.5, 1, 0))
    return pa.table({**table, "plan": plan})


def convert(*args) -> None:
    """`raytrain-app convert ARGS`, here."""
    done = command(["convert", *map(str, args)], os.getcwd(), timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The run, trained from its project folder with `data: data/train` (relative), in local mode."""
    project = tmp_path_factory.mktemp("project")
    pv.write_csv(customers(600, 0), project / "train.csv")
    pv.write_csv(customers(150, 1), project / "eval.csv")
    convert("csv", project / "train.csv", project / "data" / "train", "--label", "plan", "--row-group-rows", 100)
    convert("csv", project / "eval.csv", project / "data" / "eval", "--label", "plan")
    (project / "job.yaml").write_text(JOB)
    cwd = os.getcwd()
    os.chdir(project)
    try:
        result = raytrain_app.fit("job.yaml", run_dir="runs/plans", echo=lambda line: None, local=True)
    finally:
        os.chdir(cwd)
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    return project, result, elsewhere


def test_the_run_records_absolute_paths_and_the_best_checkpoint_it_reports(trained):
    project, result, _ = trained
    config = rundir.read_config(result.run_dir)
    assert config["data"]["args"]["path"] == str(project / "data" / "train")  # resolved once, at launch
    assert config["data"]["args"]["eval_path"] == str(project / "data" / "eval")
    # The best by hand: the kept epoch-end checkpoint of the highest eval_accuracy, the earliest of equals.
    path, row = runrecord.best(result.run_dir)
    assert (result.best_checkpoint, result.best_metrics) == (path, row)
    chosen = rundir.choose(result.run_dir)  # what evaluate, predict, export and load_model use
    assert chosen.path == path
    assert chosen.why == f"best: eval_accuracy {row['eval_accuracy']:.4f} at epoch {row['epoch']}"


def test_evaluate_from_another_directory_on_its_split_and_on_a_labelled_csv(trained, monkeypatch):
    project, result, elsewhere = trained
    monkeypatch.chdir(elsewhere)
    best = result.best_metrics
    metrics = scoring.evaluate(os.path.relpath(result.run_dir), echo=lambda line: None, local=True)
    assert metrics["eval_accuracy"] == best["eval_accuracy"]
    assert metrics["eval_loss"] == pytest.approx(best["eval_loss"], rel=1e-6)  # class-weighted, as trained
    name = rundir.choose(result.run_dir).name
    written = json.loads(open(f"{result.run_dir}/evaluations/{name}-eval.json").read())
    assert written["checkpoint"].endswith(name) and sum(written["classes"]["support"]) == 150
    assert os.path.getsize(f"{result.run_dir}/evaluations/{name}-eval-confusion.png") > 1000

    # --checkpoint best and --data-set train: the training rows, scored as load_model scores them raw.
    trained_on = scoring.evaluate(result.run_dir, "best", "train", echo=lambda line: None, local=True)
    rows = customers(600, 0)
    x = torch.from_numpy(np.stack([rows.column(c).to_numpy().astype(np.float64) for c in FEATURES], axis=1))
    with torch.no_grad():
        correct = (raytrain_app.load_model(result.run_dir)(x).argmax(1).numpy() == rows.column("plan").to_numpy())
    assert trained_on["train_accuracy"] == correct.mean() and trained_on["train_samples"] == 600

    labelled = scoring.evaluate(result.run_dir, data=str(project / "eval.csv"), echo=lambda line: None, local=True)
    assert labelled["eval_accuracy"] == best["eval_accuracy"]  # the same rows, read raw from the CSV
    report = json.loads(open(f"{result.run_dir}/evaluations/{name}-file-eval.json").read())["classes"]
    truth = customers(150, 1).column("plan").to_numpy()
    assert report["support"] == np.bincount(truth, minlength=3).tolist()
    assert not os.path.exists(f"{result.run_dir}/evaluations/.file-eval")  # the CSV's Parquet copy is gone


def test_predict_from_another_directory_on_label_less_rows_with_the_csvs_columns(trained, monkeypatch):
    project, result, elsewhere = trained
    monkeypatch.chdir(elsewhere)
    rows = customers(150, 1)
    truth = rows.column("plan").to_numpy()
    shuffled = rows.select(["usage_gb", "age", "monthly_fee", "support_calls", "tenure_months"])
    shuffled = shuffled.append_column("note", pa.array(["vip"] * 150)).append_column("id", pa.array(range(1000, 1150)))
    pv.write_csv(shuffled, "new.csv")  # columns in another order, one more, and ids
    count = scoring.predict(result.run_dir, "new.csv", "preds.parquet", "best", echo=lambda line: None, local=True)
    preds = pq.read_table("preds.parquet")
    assert count == 150 and preds.column("id").to_pylist() == list(range(1000, 1150))
    assert (preds.column("prediction").to_numpy() == truth).mean() == result.best_metrics["eval_accuracy"]

    # The converter's label-less mode gives the same rows as Parquet, and the same predictions;
    # an output's missing folders are made, as on object storage (no folders to make there).
    pv.write_csv(rows.drop(["plan"]), "new-rows.csv")
    convert("csv", "new-rows.csv", "new-parquet", "--no-label")
    scoring.predict(result.run_dir, "new-parquet/part-00000.parquet", "out/today/preds2.parquet",
                    echo=lambda line: None, local=True)
    assert pq.read_table("out/today/preds2.parquet").column("prediction").to_pylist() == \
        preds.column("prediction").to_pylist()

    # An output named .csv is CSV, with what the Parquet holds: a spreadsheet's reader gets the same rows.
    proc = command(["predict", result.run_dir, "--input", "new.csv", "--output", "preds.csv", "--checkpoint", "best",
                    "--local"], elsewhere)
    assert proc.returncode == 0 and proc.stdout.endswith("150 predictions in preds.csv\n"), proc
    with open(os.path.join(elsewhere, "preds.csv"), newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == preds.column_names == ["row", "id", "prediction", "probability"]
    # (probabilities are float32, which CSV writes in as few digits as give the same float32 back)
    assert [[int(r), int(i), int(p), np.float32(q)] for r, i, p, q in table[1:]] == [
        [r["row"], r["id"], r["prediction"], np.float32(r["probability"])] for r in preds.to_pylist()]

    # An output named for a format predict does not write: one line, before Ray, and no file.
    proc = command(["predict", result.run_dir, "--input", "new.csv", "--output", "preds.json"], elsewhere)
    assert (proc.returncode, proc.stderr) == (2, "error: --output preds.json: predictions are written as Parquet "
                                                 "(.parquet, .pq, or no suffix) or CSV (.csv), not .json\n"), proc
    assert not os.path.exists(os.path.join(elsewhere, "preds.json"))

    # A misnamed column: one line, with the closest name, before Ray (asked for with --ray): no Ray
    # session in the temp dir it would use, and nothing written.
    pv.write_csv(rows.rename_columns([c.replace("tenure_months", "tenure_month") for c in rows.column_names]),
                 "typo.csv")
    ray_tmp = short_temp_dir()
    proc = command(["predict", result.run_dir, "--input", "typo.csv", "--output", "p.parquet", "--ray"], elsewhere,
                   {**os.environ, "RAY_TMPDIR": ray_tmp})
    assert os.listdir(ray_tmp) == [] and not os.path.exists(os.path.join(elsewhere, "p.parquet")), proc
    assert (proc.returncode, proc.stdout) == (2, ""), proc
    assert proc.stderr == ("error: --input typo.csv has no column 'tenure_months', which the model was trained on as "
                           "an input (did you mean 'tenure_month'?)\n")


PROJECT_MODEL = """
from torch import nn


def build(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], num_classes))
"""


def test_a_model_from_the_projects_own_module_is_one_line_where_that_module_is_not(tmp_path):
    """A run names its model by import path. From a directory where that module cannot be
    found, `evaluate` and `predict` say so in one line before a cluster or a worker starts
    (they started Ray first, and failed 20 s later); from the project folder they score the run."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "rtafter_models.py").write_text(PROJECT_MODEL)
    pq.write_table(customers(200, 0), project / "train.parquet")
    pq.write_table(customers(20, 1).drop(["plan"]), project / "new.parquet")
    (project / "job.yaml").write_text(json.dumps({
        "name": "own", "model": {"name": "rtafter_models:build"},
        "data": {"name": "parquet", "args": {"path": "train.parquet", "features": FEATURES, "label": "plan"}},
        "train": {"epochs": 1}, "scaling": {"workers": 1}}))
    trained = command(["train", "job.yaml", "--local", "--run-dir", "run"], project)
    assert trained.returncode == 0, trained.stderr
    run_dir = str(project / "run")

    missing = ("error: model.name: cannot import 'rtafter_models': ModuleNotFoundError: No module named "
               "'rtafter_models'\n")
    for args in (["evaluate", run_dir], ["predict", run_dir, "--input", str(project / "new.parquet"), "--output",
                                         "p.csv"]):
        proc = command(args, elsewhere)
        assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", missing), proc
    assert not os.path.exists(elsewhere / "p.csv")

    proc = command(["evaluate", "run", "--local"], project)
    assert proc.returncode == 0, proc
    # It scores the run's checkpoint as training scored that epoch, by the run's own metrics.jsonl.
    _, row = runrecord.best(run_dir)
    printed = dict(line.split() for line in proc.stdout.splitlines() if re.fullmatch(r"eval_\w+ +\S+", line))
    assert printed["eval_accuracy"] == f"{row['eval_accuracy']:.6g}"
    assert float(printed["eval_loss"]) == pytest.approx(row["eval_loss"], rel=1e-5)


def test_a_csv_of_several_targets_predictions_has_a_column_per_target(tmp_path):
    """CSV has no lists: a multi-target regression's `prediction` lists become prediction_0, _1, ...,
    across the parts a run's tasks wrote."""
    parts = tmp_path / "parts"
    parts.mkdir()
    values = np.arange(12, dtype=np.float32).reshape(6, 2) / 4
    for g, rows in enumerate((range(0, 4), range(4, 6))):
        pq.write_table(pa.table({"row": pa.array(list(rows)), "prediction": pa.array(list(values[list(rows)]))}),
                       parts / f"{g:06d}.parquet")
    assert scoring._join(str(parts), 2, str(tmp_path / "p.csv")) == 6
    with open(tmp_path / "p.csv", newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == ["row", "prediction_0", "prediction_1"]
    assert [[float(v) for v in r] for r in table[1:]] == [[i, *values[i]] for i in range(6)]


def test_export_every_format_into_one_folder_and_load_each_on_raw_rows(trained):
    project, result, elsewhere = trained
    name = rundir.choose(result.run_dir).name
    for format in ("safetensors", "pt", "torchscript", "onnx"):
        proc = command(["export", result.run_dir, "--format", format, "-o", "models/"], elsewhere)
        assert proc.returncode == 0 and f"exported {name} (best: eval_accuracy" in proc.stdout, proc.stderr
    raw = customers(150, 1)
    x = torch.from_numpy(np.stack([raw.column(c).to_numpy().astype(np.float64) for c in FEATURES], axis=1))
    truth = torch.from_numpy(raw.column("plan").to_numpy())
    accuracy = result.best_metrics["eval_accuracy"]
    for path in [result.run_dir, *(f"{elsewhere}/models/model.{ext}" for ext in ("safetensors", "pt",
                                                                                 "torchscript.pt"))]:
        model = raytrain_app.load_model(path)
        with torch.no_grad():
            assert (model(x).argmax(1) == truth).double().mean().item() == accuracy, path
    manifest = json.loads(open(f"{elsewhere}/models/model.onnx.json").read())
    assert manifest["preprocessing"]["features"] == FEATURES and manifest["preprocessing"]["label"] == "plan"


def test_runs_names_the_same_best_checkpoint(trained):
    _, result, elsewhere = trained
    proc = command(["runs", os.path.dirname(result.run_dir), "--json"], elsewhere)
    assert proc.returncode == 0, proc
    [run] = json.loads(proc.stdout)
    _, best = runrecord.best(result.run_dir)
    assert run["best"] == f"eval_accuracy {best['eval_accuracy']:.4f} (epoch {best['epoch']})"


@pytest.mark.slow
def test_early_stopping_stops_every_rank_after_the_same_epoch_and_a_resume_counts_on(tmp_path):
    """A learning rate too small to learn: eval accuracy never improves on epoch 1's."""
    run_dir = tmp_path / "run"
    sets = ["optimizer.lr=1e-9", "train.epochs=10", "train.early_stopping={patience: 2}"]
    result = raytrain_app.fit(f"{REPO}/examples/digits.yaml", overrides=sets, run_dir=str(run_dir),
                              echo=lambda line: None, local=True)
    assert [row["epoch"] for row in result.metrics] == [1, 2, 3]
    reason = "eval_accuracy did not improve for 2 epochs (best "
    assert result.stopped_early.startswith(f"stopped early after epoch 3: {reason}") and "at epoch 1)" in \
        result.stopped_early
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "stopped early" and record["reason"] == result.stopped_early
    for rank in (0, 1):  # each rank decided by itself, on the all-reduced metrics
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert log.count("stopping early after epoch 3: ") == 1, rank
    assert rundir.kept(str(run_dir))[-1].epoch == 3  # the epoch it stopped after is checkpointed

    # Resumed with more patience, it goes on counting from the checkpoint: one more epoch is the third.
    resumed = raytrain_app.fit(f"{REPO}/examples/digits.yaml", run_dir=str(run_dir), resume=True,
                               overrides=[*sets, "train.early_stopping.patience=3"], echo=lambda line: None,
                               local=True)
    assert [row["epoch"] for row in resumed.metrics] == [1, 2, 3, 4]
    assert resumed.stopped_early.startswith("stopped early after epoch 4: eval_accuracy did not improve for 3 ")


def test_the_docs_raw_row_example_runs_on_this_run(trained, monkeypatch, capsys, tmp_path):
    """The Python lines of docs/how-to/use-a-checkpoint.md, in the project folder where its `runs/plans` is."""
    import re

    project, result, _ = trained
    page = "docs/how-to/use-a-checkpoint.md"
    [example] = re.findall(r"```python\n(.*?)```", open(f"{REPO}/{page}").read(), re.S)
    monkeypatch.chdir(project)
    namespace = {}
    exec(compile(example, page, "exec"), namespace)
    assert namespace["model"].source == runrecord.best(result.run_dir)[0]
    with torch.no_grad():
        [probabilities] = namespace["model"](namespace["rows"]).softmax(1).tolist()
    assert "Linear(in_features=5" in capsys.readouterr().out  # the model as built, printed

    # The same raw row (the comment names its columns), as a file to `predict` (the columns in another
    # order): the same class, as likely; and through the model as built, on the row normalised by
    # hand with the training rows' statistics.
    row = dict(zip(FEATURES, namespace["rows"].tolist()[0]))
    pv.write_csv(pa.table({name: [value] for name, value in reversed(row.items())}), tmp_path / "one.csv")
    scoring.predict(result.run_dir, str(tmp_path / "one.csv"), str(tmp_path / "one.parquet"), echo=lambda line: None,
                    local=True)
    [predicted] = pq.read_table(tmp_path / "one.parquet").to_pylist()
    assert predicted["prediction"] == int(np.argmax(probabilities))
    assert predicted["probability"] == pytest.approx(max(probabilities), rel=1e-6)
    training = np.stack([customers(600, 0).column(c).to_numpy().astype(np.float64) for c in FEATURES], axis=1)
    x = (np.array([list(row.values())]) - training.mean(0)) / training.std(0, ddof=1)
    with torch.no_grad():
        by_hand = namespace["model"].model(torch.tensor(x, dtype=torch.float32)).softmax(1)
    assert by_hand.tolist()[0] == pytest.approx(probabilities, rel=1e-5)


@pytest.mark.ray
def test_a_shipped_runs_relative_data_path_means_the_project_folder_to_workers_elsewhere(ray_cluster, tmp_path,
                                                                                          monkeypatch):
    """A run whose job shipped its working_dir records its data path as written (relative). From
    the project folder, `evaluate` on a cluster whose workers run in another directory (here the
    session's, started in the repository) reads the project's file, as local mode does."""
    project = tmp_path / "project"
    project.mkdir()
    pq.write_table(customers(200, 0), project / "train.parquet")
    monkeypatch.chdir(project)
    job = {"name": "rel", "model": {"name": "mlp"}, "train": {"epochs": 1}, "scaling": {"workers": 1},
           "data": {"name": "parquet", "args": {"path": "train.parquet", "features": FEATURES, "label": "plan"}}}
    monkeypatch.setenv("RAYTRAIN_SHIPPED_FROM", str(project))  # as inside a submitted job: paths kept as written
    result = raytrain_app.fit(job, run_dir=str(project / "run"), local=True, echo=lambda line: None)
    monkeypatch.delenv("RAYTRAIN_SHIPPED_FROM")
    assert "path: train.parquet" in (project / "run" / rundir.CONFIG).read_text()
    on_ray = scoring.evaluate(result.run_dir, echo=lambda line: None)  # joined: the session's cluster
    assert on_ray == scoring.evaluate(result.run_dir, echo=lambda line: None, local=True)
