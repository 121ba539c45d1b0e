"""The Python API: `raytrain_app.fit` and `load_model`, as docs/reference/python-api.md shows them, on the test
session's Ray cluster (fit uses the connection a caller already has)."""

import re
import signal

import pytest
import torch

import raytrain_app
from raytrain_app.data.arrays import split
from raytrain_app.data.parquet import DIGITS_FILE, read_table
from tests import runrecord
from tests.conftest import REPO

PUBLIC = {"fit", "load_model", "Result", "UserError", "ConfigError", "TrainingFailed", "report", "latest_checkpoint"}


PAGE = "docs/reference/python-api.md"


def docs_example() -> str:
    """The page's first Python block: a notebook's model trained with `fit` and loaded back."""
    page = open(f"{REPO}/{PAGE}").read()
    return re.search(r"```python\n(.*?)```", page, re.S).group(1)


def test_the_package_exports_exactly_the_public_api():
    assert set(raytrain_app.__all__) == PUBLIC
    assert all(hasattr(raytrain_app, name) for name in PUBLIC)


def test_the_docs_example_trains_a_notebook_model_and_predicts_raw_rows(ray_cluster, tmp_path, monkeypatch):
    """On Ray: a notebook that joined a cluster (`ray.init()`) trains there, its model function
    pickled by value to Ray's workers."""
    monkeypatch.chdir(tmp_path)  # its runs/ go here
    namespace = {"__name__": "__main__"}  # as in a notebook: the model function is pickled by value
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    exec(compile(docs_example(), PAGE, "exec"), namespace)
    # Ray Train's fit sets its own SIGINT handler and leaves it: the notebook's are back.
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    result, model = namespace["result"], namespace["model"]

    assert isinstance(result, raytrain_app.Result) and result.run_dir.startswith(str(tmp_path / "runs"))
    assert [row["epoch"] for row in result.metrics] == [1, 2, 3]
    # The best by hand: the kept epoch-end checkpoint of the highest eval_accuracy, the earliest of equals.
    best_checkpoint, best = runrecord.best(result.run_dir)
    assert result.final_checkpoint and result.best_checkpoint == model.source == best_checkpoint
    assert result.best_metrics == best
    # The loaded model takes the eval split's raw rows, as the file stores them, and scores on
    # them exactly what the best checkpoint's epoch reported.
    x, y = read_table(str(DIGITS_FILE), "image", "label", None)
    _, _, x_eval, y_eval = split(x, y, 0.2, 0)
    assert x_eval.dtype == torch.uint8 and not model.training
    with torch.no_grad():
        accuracy = (model(x_eval.reshape(len(x_eval), -1)).argmax(1) == y_eval).double().mean().item()
    assert accuracy == best["eval_accuracy"]
    assert accuracy > 0.8


def test_load_model_takes_a_run_directory_and_names_what_is_missing(tmp_path):
    with pytest.raises(raytrain_app.UserError, match="no checkpoint in"):
        raytrain_app.load_model(str(tmp_path))
