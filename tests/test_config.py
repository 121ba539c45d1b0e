"""The job config: typed loading, --set overrides, and one-line errors that name the key and file."""

import io
import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest
import yaml
from pydantic import ValidationError

from raytrain_app.cluster.profiles import load_profile
from raytrain_app.config import JobConfig, dump_yaml, load_config, updated
from raytrain_app.config.batching import Batching, batching
from raytrain_app.config.resolve import resolve_auto
from raytrain_app.errors import ConfigError
from tests.conftest import REPO


def write(tmp_path, text: str):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_example_loads_with_types_and_defaults():
    config = load_config("examples/digits.yaml")
    assert config.model.name == "lenet" and config.data.args == {"resize": 28}
    assert config.optimizer.lr == 0.01 and isinstance(config.optimizer.lr, float)
    assert config.scaling.backend == "auto" and config.failure.max_failures == 0


def test_overrides_reach_any_field_and_parse_values_as_yaml(tmp_path):
    config = load_config(write(tmp_path, "train: {epochs: 3}\n"), [
        "train.epochs=7", "optimizer.betas=[0.8, 0.9]", "train.grad_clip=1", "model.args.hidden=[8, 4]",
        "data.name=mnist", "train.sync_batchnorm=true", "model.args={width: 8}", "model.args.depth=2"])
    assert config.train.epochs == 7 and config.optimizer.betas == [0.8, 0.9]
    assert config.train.grad_clip == 1.0 and config.model.args == {"width": 8, "depth": 2}
    assert config.data.name == "mnist" and config.train.sync_batchnorm is True


def test_overrides_index_lists(tmp_path):
    """`--set optimizer.betas.0=0.8` changes one element, whether the file holds the list or not."""
    assert load_config(write(tmp_path, "name: x\n"), ["optimizer.betas.0=0.8"]).optimizer.betas == [0.8, 0.999]
    in_file = write(tmp_path, "model: {args: {hidden: [32, 16]}}\noptimizer: {betas: [0.5, 0.6]}\n")
    config = load_config(in_file, ["optimizer.betas.1=0.99", "model.args.hidden.0=64"])
    assert config.optimizer.betas == [0.5, 0.99] and config.model.args["hidden"] == [64, 16]
    with pytest.raises(ConfigError, match=r"--set optimizer.betas.2: optimizer.betas is a list of 2; '2' is not one "
                                          r"of its indexes"):
        load_config(in_file, ["optimizer.betas.2=0.1"])


def test_resolved_config_round_trips_through_yaml(tmp_path):
    config = load_config("examples/digits.yaml", ["train.epochs=5"])
    saved = write(tmp_path, dump_yaml(config))
    assert load_config(saved) == config
    assert yaml.safe_load(saved.read_text())["train"]["epochs"] == 5


@pytest.mark.parametrize("text, overrides, message", [
    ("train: {epoch: 3}\n", [], r":1: train.epoch: unknown key \(did you mean 'train.epochs'\?\)$"),
    ("colour: red\n", [], ":1: colour: unknown key$"),
    ("train:\n  epochs: ten\n", [], ":2: train.epochs: must be an integer, got 'ten'$"),
    ("train: {epochs: 2.5}\n", [], "train.epochs: must be an integer, got 2.5$"),
    ("train: {epochs: true}\n", [], "train.epochs: must be an integer, got True$"),
    ("train: {epochs: 0}\n", [], "train.epochs: must be >= 1, got 0$"),
    ("train: {batch_size: -4}\n", [], "train.batch_size: must be >= 1, got -4$"),
    ("train: {precision: fp8}\n", [], "train.precision: must be one of auto, fp32, bf16, fp16; got 'fp8'$"),
    ("train: {sync_batchnorm: yes}\n", [], "train.sync_batchnorm: must be true or false, got 'yes'$"),
    ("train: 5\n", [], "train: must be a mapping, got int$"),
    ("optimizer: {lr: 0}\n", [], "optimizer.lr: must be > 0, got 0$"),
    ("optimizer: {lr: '0.1'}\n", [], "optimizer.lr: must be a number, got '0.1'$"),
    ("optimizer: {betas: [0.9]}\n", [], "optimizer.betas: must be a list of 2 values, got \\[0.9\\]$"),
    ("optimizer: {name: adam, nesterov: true}\n", [], "optimizer.nesterov: true is used only with sgd and momentum"),
    ("scaling: {workers: 0}\n", [], "scaling.workers: must be >= 1, got 0$"),
    ("scaling: {workers: 4:2}\n", [], r"scaling.workers: min \(4\) must be below max \(2\); a fixed size is a "
                                     "number$"),
    ("scaling: {workers: {min: 2}}\n", [], "scaling.workers.max: is required, got {'min': 2}$"),
    ("scaling: {workers: {min: 1, max: 2, step: 1}}\n", [], "scaling.workers.step: unknown key$"),
    ("scaling: {workers: 1:4}\ntrain: {batch_size: 50}\n", [],
     "scaling.on_resize: keep_global_batch cannot keep the global batch of 200 \\(train.batch_size 50 x 4 workers x "
     "1\\) at 3 workers: it does not split evenly; narrow the range, pick a batch_size that does, or use "
     "on_resize: scale_lr$"),
    ("scaling: {backend: nccl}\n", [], "scaling.backend: nccl needs GPUs"),
    ("scaling: {backend: nccl, workers: 2, gpus_per_worker: 0.5}\n", [],
     "scaling.backend: nccl cannot run two ranks on one GPU, and gpus_per_worker 0.5 makes workers share GPUs"),
    ("data: {eval_fraction: 1.5}\n", [], "data.eval_fraction: must be < 1, got 1.5$"),
    ("task: {name: ranking}\n", [], "task.name: unknown task 'ranking' \\(built-ins: classification, regression, "
                                    "multilabel, language_model; or a custom step 'pkg.module:step'\\)$"),
    ("task: {loss: mse}\n", [], "task.loss: mse does not fit task classification \\(choose from cross_entropy\\)$"),
    ("task: {name: regression, metrics: [accuracy]}\n", [], "task.metrics: accuracy is not a regression metric"),
    ("task: {name: regression, loss: l1, label_smoothing: 0.1}\n", [], "task.label_smoothing: is used only with "
                                                                       "cross_entropy$"),
    ("task: {name: 'a.b:step', metrics: [x]}\n", [], "task.metrics: a custom step computes its own loss and metrics"),
    ("task: {eval_step: 'a.b:ev'}\n", [], "task.eval_step: is used only with a custom step$"),
    ("checkpoint: {metric: eval_r2}\n", [], "checkpoint.metric: eval_r2 is not a metric of this run \\(choose from "
                                             "train_loss, eval_loss, eval_accuracy\\)$"),
    ("name: a/b\n", [], "name: must be a non-empty name without '/'"),
    ("train: {epochs: 3\n", [], ":2: malformed YAML: "),
    ("- a\n- b\n", [], "the top level must be a mapping of keys, got a list"),
    ("", [], ": the config is empty$"),
    ("# only a comment\n", [], ": the config is empty$"),
    ("name: x\n", ["train.epochs"], "bad --set expression 'train.epochs': expected KEY=VALUE"),
    ("name: x\n", ["=3"], "bad --set expression"),
    ("name: x\n", ["train.epochs=[1"], "the value is not valid YAML"),
    ("name: x\n", ["train.epochs=0"], r" \(--set\): train.epochs: must be >= 1, got 0$"),
    ("train: {epochs: 3}\n", ["train.epochs.x=1"], "--set train.epochs.x: train.epochs is not a section"),
])
def test_bad_configs_name_the_key_and_the_file(tmp_path, text, overrides, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert len(info.value.lines) == 1 and re.search(message, info.value.lines[0]), info.value.lines
    if not info.value.lines[0].startswith("bad --set"):  # every other message starts with its file
        assert info.value.lines[0].startswith(str(path))


def test_every_problem_in_a_file_is_reported_with_its_line(tmp_path):
    path = write(tmp_path, "name: job\n"
                           "train:\n"
                           "  epochs: 0\n"
                           "  batch_sise: 8\n"
                           "  precision: fp8\n"
                           "optimizer:\n"
                           "  lr: fast\n"
                           "colour: red\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["scaling.workers=0"])
    assert sorted(info.value.lines) == sorted([
        f"{path}:3: train.epochs: must be >= 1, got 0",
        f"{path}:4: train.batch_sise: unknown key (did you mean 'train.batch_size'?)",
        f"{path}:5: train.precision: must be one of auto, fp32, bf16, fp16; got 'fp8'",
        f"{path}:7: optimizer.lr: must be a number, got 'fast'",
        f"{path}:8: colour: unknown key",
        f"{path} (--set): scaling.workers: must be >= 1, got 0",
    ])


def test_rules_across_sections_are_reported_together(tmp_path):
    path = write(tmp_path, "schedule: {warmup_epochs: 5}\n"
                           "train: {epochs: 2, compile: default, ddp_bucket_cap_mb: 0.5, grad_accum_steps: 2,\n"
                           "        ddp_static_graph: true}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [line.split(": ", 2)[1] for line in info.value.lines] == [
        "schedule.warmup_epochs", "train.ddp_bucket_cap_mb", "train.ddp_static_graph"]
    assert info.value.lines[0] == f"{path}:1: schedule.warmup_epochs: must be at most train.epochs (2), got 5"


def test_empty_standard_input_is_an_error(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    with pytest.raises(ConfigError, match="^-: standard input is empty$"):
        load_config("-")


def test_a_changed_copy_is_validated_again():
    config = load_config("examples/digits.yaml")
    assert updated(config, {"train": {"epochs": 3}}).train.epochs == 3
    with pytest.raises(ConfigError, match=r"^shape: scaling.backend: nccl needs GPUs"):
        updated(config, {"scaling": {"backend": "nccl"}}, source="shape")
    with pytest.raises(ValidationError):  # frozen: no change without validation
        config.train.epochs = 0


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_from_dict_defaults_match_the_models_defaults():
    assert JobConfig.from_dict({}) == JobConfig()


@pytest.mark.parametrize("text, value", [("1e-3", 1e-3), ("1E-3", 1e-3), ("3e4", 3e4), (".5", 0.5),
                                         ("-2e-5", -2e-5)])
def test_floats_as_ml_users_write_them(tmp_path, text, value):
    """YAML 1.1 reads `1e-3` (no dot) as a string; files, --set and profiles read it as Python does."""
    positive = text.lstrip("-")
    in_file = load_config(write(tmp_path, f"optimizer: {{lr: {positive}}}\nmodel: {{args: {{scale: {text}}}}}\n"))
    assert in_file.optimizer.lr == abs(value) and isinstance(in_file.optimizer.lr, float)
    assert in_file.model.args["scale"] == value
    from_set = load_config(write(tmp_path, "name: x\n"), [f"optimizer.lr={positive}", f"model.args.scale={text}"])
    assert from_set.optimizer.lr == abs(value) and from_set.model.args["scale"] == value
    profile = tmp_path / "profile.yaml"
    profile.write_text(f"connect_timeout_s: {positive}\n")
    assert load_profile(str(profile)).connect_timeout_s == abs(value)


def cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "raytrain_app.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, input=stdin)


def test_the_schema_checks_job_files_as_an_editor_would():
    proc = cli("config", "schema")
    assert proc.returncode == 0, proc.stderr
    schema = json.loads(proc.stdout)
    assert schema["properties"]["train"]["$ref"] == "#/$defs/TrainConfig"
    assert "GradScaler" in schema["$defs"]["TrainConfig"]["properties"]["precision"]["description"]
    jsonschema.validate(yaml.safe_load(open("examples/digits.yaml")), schema)  # the example passes
    for bad in ({"train": {"epochs": 0}}, {"train": {"epoch": 3}}, {"optimizer": {"name": "lion"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


@pytest.mark.parametrize("task, metric, mode", [
    ({}, "eval_accuracy", "max"), ({"name": "regression"}, "eval_mse", "min"),
    ({"name": "regression", "metrics": ["r2"]}, "eval_r2", "max"), ({"name": "multilabel"}, "eval_accuracy", "max"),
    ({"name": "pkg.mod:step"}, "eval_loss", "min")])
def test_auto_checkpoint_metric_is_the_tasks_first_and_its_mode_follows(task, metric, mode):
    checkpoint = resolve_auto(JobConfig.from_dict({"task": task})).checkpoint
    assert (checkpoint.metric, checkpoint.mode) == (metric, mode)


@pytest.mark.parametrize("workers, gpus, backend", [(2, 0.5, "gloo"), (1, 0.5, "nccl"), (2, 1, "nccl"), (2, 0, "gloo")])
def test_auto_backend_is_gloo_where_workers_share_a_gpu(workers, gpus, backend):
    """NCCL refuses two ranks on one device ("Duplicate GPU detected", seen on an H100)."""
    config = JobConfig.from_dict({"scaling": {"workers": workers, "gpus_per_worker": gpus}})
    assert resolve_auto(config).scaling.backend == backend


def test_config_show_prints_the_config_as_it_would_run():
    proc = cli("config", "show", "examples/digits.yaml", "--set", "train.epochs=3", "--gpus-per-worker", "1")
    assert proc.returncode == 0, proc.stderr
    shown = yaml.safe_load(proc.stdout)
    assert shown["train"]["epochs"] == 3 and shown["scaling"]["gpus_per_worker"] == 1.0
    assert (shown["train"]["precision"], shown["train"]["channels_last"], shown["scaling"]["backend"]) == \
        ("bf16", "on", "nccl")  # every auto decided
    assert shown["optimizer"]["betas"] == [0.9, 0.999] and shown["checkpoint"]["keep"] == 2  # every default there
    assert JobConfig.from_dict(shown) == resolve_auto(load_config("examples/digits.yaml", [
        "train.epochs=3", "scaling.gpus_per_worker=1"]))
    bad = cli("config", "show", "-", stdin="train: {epochs: 0}\ncolour: red\n")
    assert bad.returncode == 2 and bad.stderr.splitlines() == [
        "error: -:1: train.epochs: must be >= 1, got 0", "error: -:2: colour: unknown key"]
    assert cli("config", "show", "-", stdin="").stderr == "error: -: standard input is empty\n"


def test_the_docs_config_reference_is_the_schema():
    proc = subprocess.run([sys.executable, "scripts/config_reference.py", "--check"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    page = open(os.path.join(REPO, "docs", "reference", "config.md")).read()
    for section, fields in JobConfig.model_fields.items():
        assert re.search(rf"^{section}:", page, re.MULTILINE), section
    assert "  stop_on_nonfinite: true # stop every rank at the first NaN/inf training loss" in page


def _laughs() -> list[str]:
    """A few hundred bytes whose aliases name each other nine times over: 9^9 values once copied out."""
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    return lines


@pytest.mark.parametrize("where", ["job", "set", "profile", "recursive"])
def test_aliases_that_expand_without_end_are_refused_at_once(tmp_path, where):
    import time
    import tracemalloc

    (tmp_path / "job.yaml").write_text("model:\n  args:\n" + "".join(f"    {line}\n" for line in _laughs()))
    (tmp_path / "profile.yaml").write_text("kind: local\nname: p\n" + "".join(f"{line}\n" for line in _laughs()))
    (tmp_path / "recursive.yaml").write_text("model: &m {args: {inner: *m}}\n")
    load = {"job": lambda: load_config(tmp_path / "job.yaml"),
            "set": lambda: load_config(f"{REPO}/examples/digits.yaml", ["model.args={" + ", ".join(_laughs()) + "}"]),
            "profile": lambda: load_profile(str(tmp_path / "profile.yaml")),
            "recursive": lambda: load_config(tmp_path / "recursive.yaml")}[where]
    tracemalloc.start()
    start = time.thread_time()  # this thread's CPU time: what the other tests' processes take is not counted
    with pytest.raises(ConfigError) as caught:
        load()
    seconds = time.thread_time() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # Expanded, the 9^9 values would take gigabytes and minutes: refused, it takes a little of either.
    assert seconds < 1 and peak < 20 * 2**20, (seconds, peak)
    [line] = caught.value.lines
    reason = "a recursive alias" if where == "recursive" else "aliases expand to more than 100,000 values"
    assert "YAML refused" in line and reason in line, line


@pytest.mark.parametrize("text", ["scaling: {workers: 2:4}\n", "scaling: {workers: {min: 2, max: 4}}\n"])
def test_a_range_of_workers_reads_as_one_in_either_form_and_sizes_its_steps(tmp_path, text):
    config = load_config(write(tmp_path, text), ["train.batch_size=12"])
    s = config.scaling
    assert (s.elastic, s.min_workers, s.max_workers, s.workers.model_dump()) == (True, 2, 4, {"min": 2, "max": 4})
    assert yaml.safe_load(dump_yaml(config))["scaling"]["workers"] == {"min": 2, "max": 4}  # what the run dir keeps
    # keep_global_batch: 12 x 4 = 48 a step at any size, in micro-batches no larger than 12; the lr
    # stays scaled for the 4 it is configured at.
    steps = {w: batching(config.train, s, w) for w in (2, 3, 4)}
    assert steps == {2: Batching(12, 2, 4), 3: Batching(8, 2, 4), 4: Batching(12, 1, 4)}
    assert batching(config.train, s, 5) is None  # 48 does not split over 5
    scaled = batching(config.train, s.model_copy(update={"on_resize": "scale_lr"}), 3)
    assert scaled == Batching(12, 1, 3)


def test_a_fixed_size_steps_as_configured(tmp_path):
    config = load_config(write(tmp_path, "scaling: {workers: 3}\ntrain: {batch_size: 10, grad_accum_steps: 2}\n"))
    assert not config.scaling.elastic and (config.scaling.min_workers, config.scaling.max_workers) == (3, 3)
    assert batching(config.train, config.scaling, 3) == Batching(10, 2, 3)
