"""Tasks, losses and metrics: exact over ranks, and the examples that show the range.

The metric test runs real Gloo process groups (no Ray): each rank evaluates its own shard of an
eval set of odd size through the loop's `evaluate`, and the all-reduced result must equal
scikit-learn's computation over the whole set in one process.
"""

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from sklearn import metrics as sk
from torch import nn

from raytrain_app.config import JobConfig, load_config
from raytrain_app.config.sections import ScheduleConfig, TaskConfig
from raytrain_app.data import Datasets, build_datasets, class_count, eval_loader, label_counts
from raytrain_app.data.arrays import ArrayDataset, split
from raytrain_app.data.parquet import read_table
from raytrain_app.data.text import TokenBlocks
from raytrain_app.driver.plan import make_plan
from raytrain_app.driver.trainer import run_training
from raytrain_app.errors import ConfigError, UserError
from raytrain_app.inference import scoring
from raytrain_app.preflight.checks import check_data_and_model
from raytrain_app.tasks import build_task, model_outputs
from raytrain_app.tasks.supervised import class_report, class_weights
from raytrain_app.worker.loop import Precision, Step, eval_epoch, evaluation_sums, train_epoch
from raytrain_app.worker.optim import build_schedule
from raytrain_app.worker.state import TrainState
from tests.gloo import spawn
from tests.helpers import dict_data, dict_step

EVAL_SIZE = 25  # odd: the two ranks hold 13 and 12 samples
TASKS = {
    "classification": {"name": "classification", "metrics": ["accuracy", "top5", "f1_macro"]},
    "regression": {"name": "regression", "metrics": ["mse", "mae", "r2"]},
    "multilabel": {"name": "multilabel", "metrics": ["accuracy", "f1_macro"]},
    "language_model": {"name": "language_model", "metrics": ["perplexity", "token_accuracy"]},
    "custom": {"name": "tests.helpers:dict_step"},
}
WEIGHTS = [0.5, 2.0, 1.0, 3.0, 0.25, 1.5, 1.0]  # task.class_weights for the 7 classes
OUTPUTS = {"classification": 7, "regression": 2, "multilabel": 4, "language_model": 11, "custom": 1}


def eval_set(task: str):
    """Inputs, labels that fit the task, and a fixed model whose outputs are scored."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(EVAL_SIZE, 6, generator=g)
    if task == "language_model":  # 25 sequences of 9 token ids from a vocabulary of 11
        torch.manual_seed(0)
        return torch.randint(0, 11, (EVAL_SIZE, 9), generator=g), None, nn.Sequential(nn.Embedding(11, 6),
                                                                                        nn.Linear(6, 11))
    y = {"classification": torch.randint(0, 7, (EVAL_SIZE,), generator=g),
         "regression": torch.randn(EVAL_SIZE, 2, generator=g) * 3 + 1,
         "multilabel": torch.randint(0, 2, (EVAL_SIZE, 4), generator=g).float()}.get(task)
    torch.manual_seed(0)
    model = nn.Linear(4 if task == "custom" else 6, OUTPUTS[task])
    return x, y, model


def _evaluate_shards(rank: int, out_file: str) -> None:
    """One rank: every task's metrics over this rank's shard, all-reduced by `evaluate`."""
    results = {}
    for task, config in TASKS.items():
        x, y, model = eval_set(task)
        step = Step(model, Precision("fp32", torch.device("cpu")), task=build_task(TaskConfig(**config)))
        ds = (dict_data(eval_size=EVAL_SIZE)[1] if task == "custom" else TokenBlocks(x.to(torch.uint8))
              if task == "language_model" else ArrayDataset(x, y, torch.tensor(0.), torch.tensor(1.)))
        loader = eval_loader(Datasets(ds, ds, (), 0), 5, rank, 2, 0, False)  # this rank's shard, batches of 5
        results[task] = eval_epoch(model, loader, step)
    # Classification with class weights, and the per-class report that `evaluate` writes.
    x, y, model = eval_set("classification")
    task = build_task(TaskConfig(name="classification", class_weights=WEIGHTS))
    task.weight, task.confusion = torch.tensor(WEIGHTS), True
    data = Datasets(ArrayDataset(x, y, torch.tensor(0.), torch.tensor(1.)), None, (), None)
    data.eval = data.train
    sums = evaluation_sums(model, eval_loader(data, 5, rank, 2, 0, False),
                           Step(model, Precision("fp32", torch.device("cpu")), task=task))
    results["weighted"] = {"metrics": task.metrics(sums), "report": class_report(sums),
                           "counts": label_counts(data, 7, rank, 2).tolist(), "classes": class_count(data, rank, 2)}
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(results, f)


@pytest.fixture(scope="module")
def reduced(tmp_path_factory) -> dict:
    """Every task's metrics from two Gloo ranks (one process group for all: spawning costs ~20 s)."""
    out = tmp_path_factory.mktemp("metrics") / "out.json"
    spawn(_evaluate_shards, str(out))
    return json.loads(out.read_text())


@pytest.mark.parametrize("task", list(TASKS))
def test_every_metric_is_exact_over_ranks_on_an_odd_eval_set(task, reduced):
    got = reduced[task]
    x, y, model = eval_set(task)
    assert got["samples"] == EVAL_SIZE
    with torch.no_grad():
        if task == "custom":
            _, data = dict_data(eval_size=EVAL_SIZE)
            error = (model(data.x).squeeze(1) - data.y).numpy()
            assert got["loss"] == pytest.approx(float(np.mean(error ** 2)), rel=1e-5)
            assert got["abs_error"] == pytest.approx(float(np.mean(np.abs(error))), rel=1e-5)
            return
        if task == "language_model":  # every next-token prediction of every sequence
            logits, target = model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()
            nll = nn.functional.cross_entropy(logits, target).item()
            assert got["perplexity"] == pytest.approx(np.exp(nll), rel=1e-5)
            assert got["loss"] == pytest.approx(nll, rel=1e-5)
            assert got["token_accuracy"] == pytest.approx(sk.accuracy_score(target, logits.argmax(1)))
            return
        out = model(x)
    if task == "classification":
        pred = out.argmax(1).numpy()
        assert got["loss"] == pytest.approx(nn.functional.cross_entropy(out, y).item(), rel=1e-5)
        assert got["accuracy"] == pytest.approx(sk.accuracy_score(y, pred))
        assert got["top5"] == pytest.approx(sk.top_k_accuracy_score(y, out.numpy(), k=5, labels=range(7)))
        assert got["f1_macro"] == pytest.approx(sk.f1_score(y, pred, average="macro"))
    elif task == "regression":
        assert got["mse"] == pytest.approx(sk.mean_squared_error(y, out), rel=1e-5)
        assert got["mae"] == pytest.approx(sk.mean_absolute_error(y, out), rel=1e-5)
        assert got["r2"] == pytest.approx(sk.r2_score(y, out), rel=1e-5)
        assert got["loss"] == pytest.approx(got["mse"], rel=1e-5)  # loss: mse (auto)
    else:
        pred = (out > 0).int().numpy()
        assert got["accuracy"] == pytest.approx(float((pred == y.numpy()).mean()))
        assert got["f1_macro"] == pytest.approx(sk.f1_score(y.int().numpy(), pred, average="macro", zero_division=0))
        assert got["loss"] == pytest.approx(nn.functional.binary_cross_entropy_with_logits(out, y).item(), rel=1e-5)


def test_class_weights_and_the_per_class_report_are_exact_over_ranks(reduced):
    """Against scikit-learn: the weighted loss is its sample-weighted log loss, `auto` its
    "balanced" weights from labels counted over both ranks, the report its per-class scores."""
    from sklearn.utils.class_weight import compute_class_weight

    got = reduced["weighted"]
    x, y, model = eval_set("classification")
    with torch.no_grad():
        out = model(x)
    weighted = sk.log_loss(y, torch.softmax(out, 1).numpy(), sample_weight=np.array(WEIGHTS)[y.numpy()],
                           labels=range(7))
    assert got["metrics"]["loss"] == pytest.approx(weighted, rel=1e-5)
    task = build_task(TaskConfig(name="classification", class_weights=WEIGHTS))
    task.weight = torch.tensor(WEIGHTS)
    assert task.train_loss(model, (x, y))[0].item() == pytest.approx(weighted, rel=1e-5)  # what training steps on
    assert got["counts"] == np.bincount(y.numpy(), minlength=7).tolist()
    assert got["classes"] == int(y.max()) + 1
    present = np.unique(y.numpy())
    balanced = compute_class_weight("balanced", classes=present, y=y.numpy())
    assert class_weights("auto", torch.tensor(got["counts"]))[present].tolist() == pytest.approx(balanced.tolist())
    pred = out.argmax(1).numpy()
    precision, recall, f1, support = sk.precision_recall_fscore_support(y, pred, labels=range(7), zero_division=0)
    report = got["report"]
    assert (report["precision"] == pytest.approx(precision.tolist())
            and report["recall"] == pytest.approx(recall.tolist()))
    assert report["f1"] == pytest.approx(f1.tolist()) and report["support"] == support.tolist()
    assert report["confusion"] == sk.confusion_matrix(y, pred, labels=range(7)).tolist()


@pytest.mark.parametrize("task", ["classification", "multilabel"])
def test_f1_macro_counts_the_labels_scikit_learn_counts(task):
    """Classes never seen nor predicted: classification leaves them out, multi-label scores them 0."""
    t = build_task(TaskConfig(name=task, metrics=["f1_macro"]))
    if task == "classification":  # 5 outputs, classes 3 and 4 absent
        out, y = torch.eye(5)[[0, 1, 2, 0, 1]], torch.tensor([0, 1, 1, 0, 2])
        expected = sk.f1_score(y, out.argmax(1), average="macro")
    else:  # label column 2 is never positive nor predicted
        out = torch.tensor([[1., -1, -1], [1, 1, -1], [-1, 1, -1]])
        y = torch.tensor([[1., 0, 0], [0, 1, 0], [0, 1, 0]])
        expected = sk.f1_score(y.int(), (out > 0).int(), average="macro", zero_division=0)
    assert t.metrics(t.sums(out, y))["f1_macro"] == pytest.approx(expected)


def run(config: dict, run_dir, overrides=()):
    job = load_config(config, overrides) if isinstance(config, str) else JobConfig.from_dict(config)
    return run_training(make_plan(job, run_dir=str(run_dir), local=True), echo=lambda line: None)


def test_the_regression_example_reaches_its_bar(tmp_path):
    result = run("examples/regression.yaml", tmp_path / "run")
    last = result.metrics[-1]
    assert last["eval_r2"] >= 0.4, last  # the bar in the example's comment
    assert {"eval_mse", "eval_mae", "eval_r2", "eval_loss"} <= set(last)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval_r2"] for r in rows] == [r["eval_r2"] for r in result.metrics]  # every metric, every epoch
    assert result.best_metrics["eval_r2"] == max(r["eval_r2"] for r in rows if r["epoch"] % 4 == 0)

    # `predict` over the eval split, as a user's file, gives the values that scored the last eval.
    x, y = read_table("examples/diabetes.parquet", "features", "target", None)
    _, _, x_eval, y_eval = split(x, y, 0.2, 0)
    pq.write_table(pa.table({"features": x_eval.numpy().tolist()}), tmp_path / "patients.parquet", row_group_size=30)
    scoring.predict(str(tmp_path / "run"), str(tmp_path / "patients.parquet"), str(tmp_path / "preds.parquet"),
                      "latest", workers=2, echo=lambda line: None)
    predicted = torch.tensor(pq.read_table(tmp_path / "preds.parquet").column("prediction").to_numpy())
    assert float(((predicted - y_eval.squeeze().double()) ** 2).mean()) == pytest.approx(last["eval_mse"], rel=1e-4)


@pytest.mark.slow
def test_the_charlm_example_beats_the_unigram_baseline(tmp_path):
    result = run("examples/charlm.yaml", tmp_path / "run")
    data = build_datasets(load_config("examples/charlm.yaml").data)
    counts = torch.bincount(data.train.tokens[:, 1:].flatten().long(), minlength=256).double() + 1
    targets = torch.bincount(data.eval.tokens[:, 1:].flatten().long(), minlength=256).double()
    unigram = float(torch.exp(-(targets * (counts / counts.sum()).log()).sum() / targets.sum()))
    last = result.metrics[-1]
    assert last["eval_perplexity"] < unigram / 2, (last, unigram)  # the bar in the example's comment
    assert last["eval_token_accuracy"] > 0.3 and last["eval_perplexity"] == pytest.approx(np.exp(last["eval_loss"]))
    assert result.best_metrics["eval_perplexity"] == min(r["eval_perplexity"] for r in result.metrics)


def test_a_custom_step_example_trains_and_checkpoints_by_its_own_metric(tmp_path):
    result = run("examples/custom_step/job.yaml", tmp_path / "run")
    assert result.metrics[-1]["eval_accuracy"] >= 0.9  # the bar in the example's comment
    assert result.best_metrics["eval_accuracy"] == max(r["eval_accuracy"] for r in result.metrics)
    assert 0 < result.metrics[-1]["eval_confident"] <= 1
    assert result.metrics[-1]["train_accuracy"] >= 0.8 and 0 < result.metrics[-1]["train_confident"] <= 1


def test_a_custom_step_on_nested_batches_with_accumulation():
    """Dict batches move to the device as a whole, the step runs under accumulation, and its own
    metric comes back from evaluation (the Ray path is the example's test above)."""
    train, eval_ = dict_data(train_size=64, eval_size=9)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = TrainState(model, opt, build_schedule(opt, ScheduleConfig(name="constant"), 8, 3), None)
    config = JobConfig.from_dict({"task": {"name": dict_step}})  # from Python, the function itself
    assert config.to_dict()["task"]["name"] == "tests.helpers:dict_step"  # files name it by import path
    step = Step(model, Precision("fp32", torch.device("cpu")), accum_steps=2, task=build_task(config.task))
    loader = torch.utils.data.DataLoader(train, batch_size=4)  # default collate: {"x": .., "target": {"y": ..}}
    before = eval_epoch(model, torch.utils.data.DataLoader(eval_, batch_size=4), step)
    for _ in range(3):
        train_epoch(step, loader, state)
        state.finish_epoch()
    after = eval_epoch(model, torch.utils.data.DataLoader(eval_, batch_size=4), step)
    assert state.step == 3 * 64 // (4 * 2)  # one optimizer step per 2 micro-batches of 4
    assert after["abs_error"] < before["abs_error"] / 2 and after["samples"] == 9
    error = (model(eval_.x).squeeze(1) - eval_.y).detach()
    assert after["abs_error"] == pytest.approx(error.abs().mean().item(), rel=1e-5)


def test_a_custom_steps_own_metrics_are_summed_over_the_training_epoch():
    """With the learning rate at 0 the model stays put, so the epoch's train_abs_error must be the
    mean absolute error over the whole training set, whatever the batches and accumulation."""
    train, _ = dict_data(train_size=30)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    state = TrainState(model, opt, build_schedule(opt, ScheduleConfig(name="constant"), 4, 1), None)
    step = Step(model, Precision("fp32", torch.device("cpu")), accum_steps=2,
                task=build_task(TaskConfig(name="tests.helpers:dict_step")))
    totals = train_epoch(step, torch.utils.data.DataLoader(train, batch_size=4), state).all_reduce()
    error = (model(train.x).squeeze(1) - train.y).detach()
    assert totals.metrics() == {"abs_error": pytest.approx(error.abs().mean().item(), rel=1e-6)}
    assert totals.loss == pytest.approx(error.pow(2).mean().item(), rel=1e-6)


@pytest.mark.parametrize("path, overrides, message", [
    ("examples/digits.yaml", ["task.name=tests.helpers:one_argument_step"], "must take \\(model, batch\\)"),
    ("examples/digits.yaml", ["task.name=tests.helpers:no_such_step"], "has no callable 'no_such_step'"),
    ("examples/custom_step/job.yaml", ["checkpoint.metric=eval_f1"],
     r"checkpoint.metric: eval_f1 is not a metric of this run \(the step reports eval_accuracy, train_accuracy, "
     r"eval_confident, train_confident; or train_loss, eval_loss\)"),
    ("examples/regression.yaml", ["task={name: classification}"], "training labels are floats .*use task.name: "
                                                                  "regression"),
    ("examples/digits.yaml", ["task.name=multilabel"], r"labels have shape \(\) per sample: task multilabel needs"),
    ("examples/regression.yaml", ["model.args={hidden: [8], num_classes: 3}"],
     "training targets have 1 values per sample but the model has 3 outputs"),
    ("examples/regression.yaml", ["task={name: language_model}"],
     r"needs samples of integer token ids shaped \(T \+ 1,\), got tuple"),
    ("examples/charlm.yaml", ["model.args={n_layer: 1, num_classes: 100}"],
     r"training token ids range over \[\d+, \d+\] but the model's vocabulary has 100 entries"),
    ("examples/charlm.yaml", ["model.name=torch.nn:EmbeddingBag", "model.args={num_embeddings: 256, embedding_dim: 8}"],
     r"must map \(B, T\) token ids to \(B, T, vocab\) logits"),
])
def test_tasks_that_do_not_fit_the_data_fail_before_ray_in_one_line(path, overrides, message):
    """The driver's checks (`train` runs them before a cluster starts; test_bad_input has the CLI side)."""
    with pytest.raises((UserError, ConfigError)) as info:
        check_data_and_model(load_config(path, overrides))
    assert len(info.value.lines) == 1 and re.search(message, info.value.lines[0]), info.value.lines


def test_a_dataset_without_num_classes_gets_it_from_every_label_or_a_line_saying_how():
    """Classification counts the largest label over the training split (not the first sample's);
    other tasks leave the builder's default, or name what to declare."""
    from raytrain_app.data import class_count

    job = {"data": {"name": "tests.helpers:undeclared_data"}, "model": {"name": "tests.helpers:needs_classes"},
           "train": {"batch_size": 4}}
    data = build_datasets(JobConfig.from_dict(job).data)
    assert data.num_classes is None and data.train[0][1] == 1
    assert class_count(data) == 5
    check_data_and_model(JobConfig.from_dict(job))  # the model gets 5 outputs: every label fits
    with pytest.raises(UserError, match=r"task.class_weights: 2 weights for 5 classes"):
        check_data_and_model(JobConfig.from_dict({**job, "task": {"class_weights": [1.0, 2.0]}}))
    custom = {**job, "task": {"name": "tests.helpers:dict_step"}, "data": {"name": "tests.helpers:dict_data"}}
    with pytest.raises(ConfigError, match=r"model.args.num_classes: the dataset does not declare num_classes"):
        check_data_and_model(JobConfig.from_dict(custom))
    check_data_and_model(JobConfig.from_dict({**custom, "model": {"name": "tests.helpers:defaults_classes"}}))
    with pytest.raises(UserError, match="task language_model needs the vocabulary's size: give the training "
                                        "dataset a `num_classes` attribute"):
        model_outputs(build_task(TaskConfig(name="language_model")), [torch.arange(5)], None)
