"""`export`: a checkpoint's weights in a standard format plus model.json, usable without
raytrain-app, and read back by `raytrain_app.load_model`.

Checkpoints are written here as the training loop writes them (`checkpoint.save` of a
TrainState, with the config and input shape beside it), without Ray. The proof that an export
stands alone is a fresh Python process that never imports raytrain_app: a plain LeNet written
from scratch loads the safetensors file, and torch.jit.load the torchscript one, and both give
the trained model's logits bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import raytrain_app
from raytrain_app import checkpoint
from raytrain_app.config import JobConfig, load_config
from raytrain_app.data import build_datasets
from raytrain_app.export import export
from raytrain_app.models import build_model
from raytrain_app.optim import build_optimizer, build_schedule
from raytrain_app.plan import resolve_auto
from raytrain_app.state import TrainState
from tests.conftest import REPO

DIGITS = resolve_auto(load_config(f"{REPO}/examples/digits.yaml"))  # resolved, as workers receive it
DIGITS_SHAPE, DIGITS_CLASSES = (1, 28, 28), 10
FIRST, SECOND = "checkpoint_2025-01-01_00-00-00.000000", "checkpoint_2025-01-01_00-01-00.000000"
TINY_GPT = resolve_auto(JobConfig.from_dict({
    "model": {"name": "gpt", "args": {"n_layer": 1, "n_head": 2, "n_embd": 16}},
    "data": {"name": "text", "args": {"max_bytes": 20_000, "block": 16}},
    "task": {"name": "language_model"},
}))

# A LeNet written from scratch with raytrain_app's layer names: what a user without raytrain-app
# writes from model.json. It normalises raw inputs with model.json's statistics.
PLAIN_LENET = r'''
import json, sys
import torch
from torch import nn
from safetensors.torch import load_file

class LeNet(nn.Module):
    def __init__(self, in_channels, image_size, num_classes):
        super().__init__()
        pad = (32 - image_size) // 2
        side = ((image_size + 2 * pad - 4) // 2 - 4) // 2
        self.features = nn.Sequential(nn.Conv2d(in_channels, 6, 5, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(16 * side * side, 120), nn.ReLU(),
                                        nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))

folder, raw, out = sys.argv[1:]
meta = json.load(open(folder + "/model.json"))
assert meta["model"] == {"name": "lenet", "args": {}}
c, h, w = meta["input_shape"]
model = LeNet(c, h, meta["num_classes"])
model.load_state_dict(load_file(folder + "/" + meta["weights"]))
norm = meta["normalization"]
mean, std = (torch.tensor(norm[k]).reshape(norm["shape"]) for k in ("mean", "std"))
with torch.no_grad():
    torch.save(model.eval()((torch.load(raw) - mean) / std), out)
assert "raytrain_app" not in sys.modules
'''

TORCHSCRIPT = r'''
import sys
import torch

weights, x, out = sys.argv[1:]
with torch.no_grad():
    torch.save(torch.jit.load(weights)(torch.load(x)), out)
assert "raytrain_app" not in sys.modules
'''


def save_checkpoint(directory, job: JobConfig, input_shape, num_classes: int, epoch: int = 1, seed: int = 0,
                    batch: int = 0) -> nn.Module:
    """A checkpoint as the loop writes it (rank 0's state and the config, shape and outputs it
    records); returns its model in eval mode."""
    torch.manual_seed(seed)
    model = build_model(job.model, input_shape, num_classes)
    optimizer = build_optimizer(model.parameters(), job.optimizer, 1)
    schedule = build_schedule(optimizer, job.schedule, 10, job.train.epochs)
    state = TrainState(model, optimizer, schedule, None, epoch=epoch, step=10 * epoch, batch=batch)
    os.makedirs(directory)
    checkpoint.save(str(directory), 0, state, {"config": job.to_dict(), "input_shape": list(input_shape),
                                               "num_classes": num_classes})
    return model.eval()


@pytest.fixture(scope="module")
def digits_data():
    return build_datasets(DIGITS.data)


@pytest.fixture
def digits_run(tmp_path):
    """A run directory with one checkpoint of the digits example's LeNet, and that model."""
    run_dir = tmp_path / "run"
    return run_dir, save_checkpoint(run_dir / FIRST, DIGITS, DIGITS_SHAPE, DIGITS_CLASSES)


def raw_digits(digits_data, tmp_path):
    """Stored-value inputs (what a user has before normalising), saved for a fresh process, and
    the same inputs normalised as the data module normalises them."""
    raw = torch.rand((4, *DIGITS_SHAPE), generator=torch.Generator().manual_seed(1)) * 16
    torch.save(raw, tmp_path / "raw.pt")
    train = digits_data.train
    return str(tmp_path / "raw.pt"), raw.sub(train.mean).div(train.std)


def fresh_python(code: str, *args) -> None:
    """Run `code` in a new interpreter, outside the repository, so nothing of raytrain_app loads."""
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=os.path.dirname(args[-1]),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def test_safetensors_give_the_same_logits_in_a_process_without_raytrain_app(digits_run, digits_data, tmp_path):
    run_dir, model = digits_run
    done = export(str(run_dir), "safetensors")
    assert done.weights == str(run_dir / "export" / "model.safetensors")
    assert done.manifest == str(run_dir / "export" / "model.json") and done.checkpoint == str(run_dir / FIRST)
    raw, x = raw_digits(digits_data, tmp_path)
    fresh_python(PLAIN_LENET, run_dir / "export", raw, tmp_path / "out.pt")
    assert torch.equal(torch.load(tmp_path / "out.pt"), logits(model, x))


def test_torchscript_gives_the_same_logits_in_a_process_without_raytrain_app(digits_run, tmp_path):
    run_dir, model = digits_run
    done = export(str(run_dir), "torchscript", output=str(tmp_path / "out" / "lenet.ts"))
    x = torch.randn((3, *DIGITS_SHAPE), generator=torch.Generator().manual_seed(2))
    torch.save(x, tmp_path / "x.pt")
    fresh_python(TORCHSCRIPT, done.weights, tmp_path / "x.pt", tmp_path / "out.pt")
    assert torch.equal(torch.load(tmp_path / "out.pt"), logits(model, x))


def test_model_json_records_the_builder_input_and_normalisation(digits_run, digits_data):
    run_dir, _ = digits_run
    manifest = json.loads(open(export(str(run_dir), "pt").manifest).read())
    assert {k: manifest[k] for k in ("format", "weights", "model", "task", "input_shape", "num_classes")} == {
        "format": "pt", "weights": "model.pt", "model": {"name": "lenet", "args": {}}, "task": "classification",
        "input_shape": [1, 28, 28], "num_classes": 10}
    assert manifest["example_input"] == {"shape": [1, 1, 28, 28], "dtype": "float32"}
    assert manifest["data"] == {"name": "digits", "args": {"resize": 28}}
    norm, train = manifest["normalization"], digits_data.train
    assert torch.equal(torch.tensor(norm["mean"]).reshape(norm["shape"]), train.mean)
    assert torch.equal(torch.tensor(norm["std"]).reshape(norm["shape"]), train.std)
    assert manifest["torch_version"] == torch.__version__ and manifest["raytrain_app_version"]
    assert manifest["checkpoint"] == str(run_dir / FIRST) and manifest["epoch"] == 1


@pytest.mark.parametrize("format", ["safetensors", "pt", "torchscript"])
def test_load_model_reads_an_export_back(digits_run, tmp_path, format):
    run_dir, model = digits_run
    done = export(str(run_dir / FIRST), format, output=str(tmp_path / "out") + "/")
    x = torch.randn((2, *DIGITS_SHAPE), generator=torch.Generator().manual_seed(3))
    for path in (done.weights, done.manifest, os.path.dirname(done.weights)):
        loaded = raytrain_app.load_model(path)
        assert not loaded.training and torch.equal(logits(loaded, x), logits(model, x))


def test_tied_gpt_embeddings_export_and_load(tmp_path):
    model = save_checkpoint(tmp_path / "run" / FIRST, TINY_GPT, (17,), 256)
    assert model.head.weight is model.tok.weight  # the case safetensors refuses to save as is
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    for format in ("safetensors", "torchscript"):
        done = export(str(tmp_path / "run"), format)
        manifest = json.loads(open(done.manifest).read())
        assert manifest["example_input"] == {"shape": [1, 16], "dtype": "int64"}
        assert manifest["normalization"] is None and not done.notes  # token ids are not normalised
        assert torch.equal(logits(raytrain_app.load_model(done.weights), ids), logits(model, ids))
    # model.json now names the torchscript file; the safetensors one beside it still loads as safetensors
    first = raytrain_app.load_model(str(tmp_path / "run" / "export" / "model.safetensors"))
    assert torch.equal(logits(first, ids), logits(model, ids))


def test_best_latest_and_named_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    best = save_checkpoint(run_dir / FIRST, DIGITS, DIGITS_SHAPE, DIGITS_CLASSES, epoch=1, seed=1)
    named = save_checkpoint(run_dir / SECOND, DIGITS, DIGITS_SHAPE, DIGITS_CLASSES, epoch=2, seed=2)
    # Inside epoch 4: epoch 3 (the best score, but no checkpoint of its own) is its last completed one.
    latest = save_checkpoint(run_dir / "checkpoint_2025-01-01_00-02-00.000000", DIGITS, DIGITS_SHAPE,
                             DIGITS_CLASSES, epoch=3, seed=3, batch=5)
    rows = [{"epoch": 1, "eval_accuracy": 0.9}, {"epoch": 2, "eval_accuracy": 0.8}, {"epoch": 3, "eval_accuracy": 0.95}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    x = torch.randn((2, *DIGITS_SHAPE), generator=torch.Generator().manual_seed(5))
    for which, expected in (("best", best), ("latest", latest), (SECOND, named)):
        done = export(str(run_dir), "pt", output=str(tmp_path / which / "model.pt"), checkpoint=which)
        assert torch.equal(logits(raytrain_app.load_model(done.weights), x), logits(expected, x)), which
    with pytest.raises(raytrain_app.UserError, match=f"has no checkpoint_nope .*{FIRST}"):
        export(str(run_dir), "pt", checkpoint="checkpoint_nope")


def one_line_error(call, *args, **kwargs) -> str:
    with pytest.raises(raytrain_app.UserError) as caught:
        call(*args, **kwargs)
    assert len(caught.value.lines) == 1 and "\n" not in str(caught.value)
    return str(caught.value)


def test_a_directory_without_a_run_or_checkpoint_is_a_user_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"no checkpoint in {empty}" in one_line_error(export, str(empty), "pt")
    assert f"{tmp_path / 'missing'} does not exist" in one_line_error(export, str(tmp_path / "missing"), "pt")
    (empty / FIRST).mkdir()  # a checkpoint directory without raytrain-app's state.pt (a script's)
    assert f"{empty / FIRST} holds no readable state.pt" in one_line_error(export, str(empty), "pt")
    (tmp_path / "weights.pt").write_bytes(b"")
    assert "no model.json beside it" in one_line_error(raytrain_app.load_model, str(tmp_path / "weights.pt"))


def test_data_that_cannot_be_built_here_leaves_normalisation_out_with_a_note(tmp_path):
    job = JobConfig.from_dict({**DIGITS.to_dict(), "data": {"name": "mnist", "args": {"root": str(tmp_path / "no")}}})
    save_checkpoint(tmp_path / "run" / FIRST, job, DIGITS_SHAPE, DIGITS_CLASSES)
    done = export(str(tmp_path / "run"), "pt")
    assert json.loads(open(done.manifest).read())["normalization"] is None
    assert len(done.notes) == 1
    assert done.notes[0].startswith("normalisation not recorded: ") and "MNIST" in done.notes[0]


def test_an_unwritable_output_is_a_user_error(digits_run, tmp_path):
    run_dir, _ = digits_run
    (tmp_path / "a-file").write_text("")
    below_a_file = tmp_path / "a-file" / "model.pt"
    assert f"{tmp_path / 'a-file'} is not writable" in one_line_error(export, str(run_dir), "pt",
                                                                      output=str(below_a_file))


def test_safetensors_missing_is_a_user_error_naming_the_extra(digits_run, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # what an install without the extra sees
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    assert "pip install 'raytrain-app[export]'" in one_line_error(export, str(digits_run[0]), "safetensors")


class ScalarOut(nn.Module):
    """A model whose output torch.jit.trace cannot record (a Python float)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        return self.linear(x).sum().item()


def scalar_out(input_shape, num_classes):
    return ScalarOut()


def test_a_model_that_cannot_be_traced_is_a_user_error(tmp_path):
    job = JobConfig.from_dict({**DIGITS.to_dict(), "model": {"name": "tests.test_export:scalar_out"}})
    save_checkpoint(tmp_path / "run" / FIRST, job, (4,), 2)
    assert "torch.jit.trace could not trace the model" in one_line_error(export, str(tmp_path / "run"),
                                                                         "torchscript")
