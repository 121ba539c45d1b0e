"""The Python API: `raytrain_app.fit` and `load_model`, as the README shows them, on the test
session's Ray cluster (fit uses the connection a caller already has)."""

import re

import pytest
import torch

import raytrain_app
from raytrain_app.config import JobConfig
from raytrain_app.data import build_datasets
from tests.conftest import REPO

PUBLIC = {"fit", "load_model", "Result", "UserError", "ConfigError", "TrainingFailed", "report", "latest_checkpoint"}


def readme_example() -> str:
    readme = open(f"{REPO}/README.md").read()
    section = readme[readme.index("## Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_package_exports_exactly_the_public_api():
    assert set(raytrain_app.__all__) == PUBLIC
    assert all(hasattr(raytrain_app, name) for name in PUBLIC)


def test_the_readme_example_trains_a_notebook_model_and_loads_it_back(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # its runs/ go here
    namespace = {"__name__": "__main__"}  # as in a notebook: the model function is pickled by value
    exec(compile(readme_example(), "README.md", "exec"), namespace)
    result, model = namespace["result"], namespace["model"]

    assert isinstance(result, raytrain_app.Result) and result.run_dir.startswith(str(tmp_path / "runs"))
    assert [row["epoch"] for row in result.metrics] == [1, 2, 3]
    assert result.final_checkpoint and result.best_checkpoint
    # The loaded model is the best checkpoint's: it scores on the eval set what that epoch reported.
    config = JobConfig.from_dict({"data": {"name": "digits"}})
    data = build_datasets(config.data)
    x = torch.stack([data.eval[i][0] for i in range(len(data.eval))])
    y = torch.tensor([int(data.eval[i][1]) for i in range(len(data.eval))])
    assert not model.training
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    best = max(result.metrics, key=lambda row: row["eval_accuracy"])
    assert accuracy == pytest.approx(best["eval_accuracy"], abs=1e-6)
    assert accuracy > 0.8


def test_load_model_takes_a_run_directory_and_names_what_is_missing(ray_cluster, tmp_path):
    with pytest.raises(raytrain_app.UserError, match="no checkpoint in"):
        raytrain_app.load_model(str(tmp_path))
