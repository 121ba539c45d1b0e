"""The job config: typed loading, --set overrides, and one-line errors that name the key and file."""

import pytest
import yaml

from raytrain_app.config import JobConfig, dump_yaml, load_config
from raytrain_app.errors import ConfigError
from raytrain_app.profiles import load_profile


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
        "data.name=mnist", "train.sync_batchnorm=true"])
    assert config.train.epochs == 7 and config.optimizer.betas == (0.8, 0.9)
    assert config.train.grad_clip == 1.0 and config.model.args == {"hidden": [8, 4]}
    assert config.data.name == "mnist" and config.train.sync_batchnorm is True


def test_resolved_config_round_trips_through_yaml(tmp_path):
    config = load_config("examples/digits.yaml", ["train.epochs=5"])
    saved = write(tmp_path, dump_yaml(config))
    assert load_config(saved) == config
    assert yaml.safe_load(saved.read_text())["train"]["epochs"] == 5


@pytest.mark.parametrize("text, overrides, message", [
    ("train: {epoch: 3}\n", [], r"unknown key 'train.epoch' \(did you mean 'train.epochs'\?\)"),
    ("colour: red\n", [], "unknown key 'colour'"),
    ("train: {epochs: ten}\n", [], "train.epochs must be an integer, got 'ten'"),
    ("train: {epochs: 2.5}\n", [], "train.epochs must be an integer"),
    ("train: {epochs: true}\n", [], "train.epochs must be an integer"),
    ("train: {epochs: 0}\n", [], "train.epochs must be >= 1, got 0"),
    ("train: {batch_size: -4}\n", [], "train.batch_size must be >= 1"),
    ("train: {precision: fp8}\n", [], "train.precision must be one of auto, fp32, bf16, fp16; got 'fp8'"),
    ("train: 5\n", [], "train must be a mapping, got int"),
    ("optimizer: {lr: 0}\n", [], "optimizer.lr must be > 0"),
    ("optimizer: {betas: [0.9]}\n", [], "optimizer.betas must be a list of 2 values"),
    ("optimizer: {name: adam, nesterov: true}\n", [], "optimizer.nesterov must be used only with sgd"),
    ("scaling: {workers: 0}\n", [], "scaling.workers must be >= 1"),
    ("scaling: {backend: nccl}\n", [], "scaling.backend must be gloo or auto when scaling.gpus_per_worker is 0"),
    ("data: {eval_fraction: 1.5}\n", [], "data.eval_fraction must be between 0 and 1"),
    ("train: {epochs: 3\n", [], "malformed YAML at line 2"),
    ("- a\n- b\n", [], "the top level must be a mapping of keys, got a list"),
    ("", ["train.epochs"], "bad --set expression 'train.epochs': expected KEY=VALUE"),
    ("", ["=3"], "bad --set expression"),
    ("", ["train.epochs=[1"], "the value is not valid YAML"),
    ("train: {epochs: 3}\n", ["train.epochs.x=1"], "--set train.epochs.x: train.epochs is not a section"),
])
def test_bad_configs_name_the_key_and_the_file(tmp_path, text, overrides, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path, overrides)
    assert "\n" not in str(info.value)
    if not overrides:
        assert str(path) in str(info.value)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_from_dict_defaults_match_dataclass_defaults():
    assert JobConfig.from_dict({}) == JobConfig()


@pytest.mark.parametrize("text, value", [("1e-3", 1e-3), ("1E-3", 1e-3), ("3e4", 3e4), (".5", 0.5),
                                         ("-2e-5", -2e-5)])
def test_floats_as_ml_users_write_them(tmp_path, text, value):
    """YAML 1.1 reads `1e-3` (no dot) as a string; files, --set and profiles read it as Python does."""
    positive = text.lstrip("-")
    in_file = load_config(write(tmp_path, f"optimizer: {{lr: {positive}}}\nmodel: {{args: {{scale: {text}}}}}\n"))
    assert in_file.optimizer.lr == abs(value) and isinstance(in_file.optimizer.lr, float)
    assert in_file.model.args["scale"] == value
    from_set = load_config(write(tmp_path, ""), [f"optimizer.lr={positive}", f"model.args.scale={text}"])
    assert from_set.optimizer.lr == abs(value) and from_set.model.args["scale"] == value
    profile = tmp_path / "profile.yaml"
    profile.write_text(f"connect_timeout_s: {positive}\n")
    assert load_profile(str(profile)).connect_timeout_s == abs(value)
