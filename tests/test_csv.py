"""A CSV as users have it (issue 52): the species by name, trained on with a three-line job file
(`data: {name: csv}`), then used from another directory through the commands: `evaluate --data`
on another CSV that lacks a class, `predict` on new rows without a label, `export`, and
`load_model`. Names must map to class ids as training numbered them (the sorted names, taken
from the checkpoint, never from the new file) and come back as names wherever classes are shown.

No Ray: the commands run in local mode, the default on one machine.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.csv as pv
import pyarrow.parquet as pq
import pytest
import torch
from sklearn.datasets import load_iris

import raytrain_app
from tests.commands import command

FEATURES = ["sepal_length", "sepal_width", "petal_length", "petal_width"]
JOB = """\
data: {name: csv, args: {path: iris.csv, label: species}}
model: {name: mlp, args: {hidden: [32]}}
train: {epochs: 50, batch_size: 4}
"""


def iris() -> pa.Table:
    """scikit-learn's iris with the species by name, less the flowers where versicolor and
    virginica come close (every row is then learned), shuffled: no name first comes where it sorts."""
    data = load_iris()
    species = np.array(["setosa", "versicolor", "virginica"])[data.target]
    length, width = data.data[:, 2], data.data[:, 3]
    keep = ((species == "setosa") | (species == "versicolor") & (length < 4.8) & (width < 1.6)
            | (species == "virginica") & (length > 5.0) & (width > 1.7))
    order = np.random.default_rng(3).permutation(int(keep.sum()))
    table = pa.table({**{name: data.data[keep][order, i] for i, name in enumerate(FEATURES)},
                      "species": species[keep][order]})
    assert list(dict.fromkeys(table.column("species").to_pylist())) == ["versicolor", "virginica", "setosa"]
    return table


def raw(table: pa.Table) -> torch.Tensor:
    return torch.tensor(np.stack([table.column(c).to_numpy() for c in FEATURES], axis=1))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The run, trained in its project folder by `raytrain-app train job.yaml`; a folder elsewhere."""
    project = tmp_path_factory.mktemp("project")
    pv.write_csv(iris(), project / "iris.csv")
    (project / "job.yaml").write_text(JOB)
    assert len(JOB.splitlines()) == 3
    proc = command(["train", "job.yaml", "--run-dir", "runs/iris"], project, timeout=240)
    assert proc.returncode == 0, proc.stderr
    return project / "runs" / "iris", tmp_path_factory.mktemp("elsewhere")


def test_the_model_knows_its_classes_by_their_sorted_names_and_gets_every_training_row(trained, tmp_path):
    run_dir, elsewhere = trained
    table = iris()
    truth = table.column("species").to_pylist()
    names = sorted(set(truth))  # computed here, from the CSV written, not by the code under test
    model = raytrain_app.load_model(str(run_dir))
    assert model.class_names == names == ["setosa", "versicolor", "virginica"]
    with torch.no_grad():
        ids = model(raw(table)).argmax(1).tolist()
    assert [model.class_names[i] for i in ids] == truth  # 100% of the training rows, by name

    done = command(["export", str(run_dir), "--format", "pt", "-o", "models/"], elsewhere)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((elsewhere / "models" / "model.pt.json").read_text())
    assert manifest["class_names"] == names and manifest["preprocessing"]["classes"] == names
    assert raytrain_app.load_model(str(elsewhere / "models" / "model.pt")).class_names == names


def test_evaluate_another_csv_from_another_directory_maps_names_as_training_did(trained):
    """The other file has no setosa, and its names in another order: numbered by themselves they
    would be versicolor 0 and virginica 1, which the model calls setosa and versicolor."""
    run_dir, elsewhere = trained
    other = iris().filter(pa.compute.not_equal(iris().column("species"), "setosa"))
    pv.write_csv(other.select(["species", *reversed(FEATURES)]), elsewhere / "other.csv")
    proc = command(["evaluate", str(run_dir), "--data", "other.csv"], elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^eval_accuracy +1$", proc.stdout, re.M), proc.stdout
    support = {"setosa": 0, "versicolor": 42, "virginica": 38}
    for name in support:  # the per-class lines name the classes
        scores = "1.0000" if support[name] else "0.0000"
        assert re.search(rf"^ *{name}( +{scores}){{3}} +{support[name]}$", proc.stdout, re.M), proc.stdout
    [written] = (run_dir / "evaluations").glob("*-file-other.json")
    report = json.loads(written.read_text())["classes"]
    assert report["names"] == list(support) and report["support"] == list(support.values())


def test_predict_new_rows_without_a_label_from_another_directory(trained):
    run_dir, elsewhere = trained
    table = iris()
    truth = table.column("species").to_pylist()
    new = table.drop(["species"]).append_column("id", pa.array([f"flower-{i}" for i in range(len(table))]))
    pv.write_csv(new, elsewhere / "new.csv")
    proc = command(["predict", str(run_dir), "--input", "new.csv", "--output", "preds.parquet"], elsewhere)
    assert proc.returncode == 0 and proc.stdout.endswith(f"{len(table)} predictions in preds.parquet\n"), proc.stderr
    preds = pq.read_table(elsewhere / "preds.parquet")
    assert preds.column_names == ["row", "id", "prediction", "label", "probability"]
    assert preds.column("label").to_pylist() == truth
    assert preds.column("prediction").to_pylist() == [sorted(set(truth)).index(name) for name in truth]


def one_line_error(proc) -> str:
    assert proc.returncode == 2 and proc.stdout == "" and proc.seconds < 15, proc
    [line] = proc.stderr.splitlines()
    return line


def test_user_errors_are_one_line_and_exit_2(trained, tmp_path):
    run_dir, elsewhere = trained
    pv.write_csv(iris(), tmp_path / "iris.csv")

    (tmp_path / "parquet.yaml").write_text(JOB.replace("name: csv", "name: parquet"))
    line = one_line_error(command(["train", "parquet.yaml"], tmp_path))
    assert line == ("error: iris.csv is CSV, not Parquet: read it with data: {name: csv, args: {path: iris.csv, "
                    "label: COLUMN}}")

    (tmp_path / "typo.yaml").write_text(JOB.replace("label: species", "label: specis"))
    line = one_line_error(command(["train", "typo.yaml"], tmp_path))
    assert line == "error: iris.csv: no column 'specis' (did you mean 'species'?)"

    (tmp_path / "typo-feature.yaml").write_text(JOB.replace("label: species", "label: species, features: "
                                                            "[sepal_length, petal_lenght]"))
    line = one_line_error(command(["train", "typo-feature.yaml"], tmp_path))
    assert line == "error: iris.csv: no column 'petal_lenght' (did you mean 'petal_length'?)"

    daisies = iris().slice(0, 3).set_column(4, "species", pa.array(["setosa", "daisy", "virginica"]))
    pv.write_csv(daisies, elsewhere / "daisies.csv")
    line = one_line_error(command(["evaluate", str(run_dir), "--data", "daisies.csv"], elsewhere))
    assert line == ("error: daisies.csv: label 'daisy' in column 'species' is not one of the 3 classes trained on "
                    "(setosa, versicolor, virginica)")
    assert not list((run_dir / "evaluations").glob("*daisies*"))
