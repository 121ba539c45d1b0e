"""`export` and `load_model`: a checkpoint's model in standard formats, each with its JSON, usable
without raytrain-app and without the training data, on raw rows.

Checkpoints are written here as the training loop writes them (`checkpoint.save` of a
TrainState, with what the loop records beside it, the preprocessing from the real data module),
without Ray. The proof that an export stands alone is a fresh Python process that never imports
raytrain_app: a plain LeNet written from scratch loads the safetensors file and applies the
JSON's preprocessing to raw pixels by its formula, and torch.jit.load runs the TorchScript file
on the same raw pixels; both give load_model's outputs bit for bit. ONNX is checked by
onnxruntime.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import raytrain_app
from raytrain_app import rundir
from raytrain_app.config import JobConfig, load_config
from raytrain_app.config.resolve import resolve_auto
from raytrain_app.data import build_datasets
from raytrain_app.inference.export import FILE_NAMES, export
from raytrain_app.models import build_model
from raytrain_app.worker import checkpoint
from raytrain_app.worker.optim import build_optimizer, build_schedule
from raytrain_app.worker.state import TrainState
from tests.conftest import REPO
from tests.helpers import save_checkpoint

DIGITS = resolve_auto(load_config(f"{REPO}/examples/digits.yaml"))  # resolved, as workers receive it
DIGITS_SHAPE, DIGITS_CLASSES = (1, 28, 28), 10
FIRST, SECOND = "checkpoint_2025-01-01_00-00-00.000000", "checkpoint_2025-01-01_00-01-00.000000"
TINY_GPT = resolve_auto(JobConfig.from_dict({
    "model": {"name": "gpt", "args": {"n_layer": 1, "n_head": 2, "n_embd": 16}},
    "data": {"name": "text", "args": {"max_bytes": 20_000, "block": 16}},
    "task": {"name": "language_model"},
}))

# A LeNet written from scratch with raytrain_app's layer names: what a user without raytrain-app
# writes from the JSON. It preprocesses raw 8x8 pixels as the JSON's formula says.
PLAIN_LENET = r'''
import json, sys
import torch
import torch.nn.functional as F
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

weights, raw, out = sys.argv[1:]
meta = json.load(open(weights + ".json"))
assert meta["model"] == {"name": "lenet", "args": {}} and not meta["includes_preprocessing"]
c, h, w = meta["input_shape"]
model = LeNet(c, h, meta["num_classes"])
model.load_state_dict(load_file(weights))
p = meta["preprocessing"]
mean, std = (torch.tensor(p[k]).reshape(p["stats_shape"]) for k in ("mean", "std"))
x = torch.load(raw).reshape(-1, *p["shape"]).float()
x = F.interpolate(x, size=(p["resize"], p["resize"]), mode="bilinear", align_corners=False)
with torch.no_grad():
    torch.save(model.eval()((x - mean) / std), out)
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


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """A run directory with one checkpoint of the digits example's LeNet, and that model."""
    run_dir = tmp_path_factory.mktemp("export") / "run"
    return run_dir, save_checkpoint(run_dir / FIRST, DIGITS)


def raw_pixels(n: int = 5, seed: int = 1) -> torch.Tensor:
    """Rows as the digits file stores them: 64 uint8 grey levels in 0..16, flat."""
    return torch.randint(0, 17, (n, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def preprocessed(rows: torch.Tensor) -> torch.Tensor:
    """The same rows as the data module makes them for training: resized and normalised."""
    from raytrain_app.data.arrays import resize_images

    train = build_datasets(DIGITS.data).train
    return resize_images(rows.reshape(-1, 1, 8, 8), 28).float().sub_(train.mean).div_(train.std)


def fresh_python(code: str, *args) -> None:
    """Run `code` in a new interpreter, outside the repository, so nothing of raytrain_app loads."""
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=os.path.dirname(args[-1]),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def outputs(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def test_load_model_takes_raw_rows_and_preprocesses_them_as_training_did(digits_run):
    run_dir, model = digits_run
    loaded = raytrain_app.load_model(str(run_dir))
    rows = raw_pixels()
    assert not loaded.training and loaded.source == str(run_dir / FIRST)
    assert torch.equal(outputs(loaded, rows), outputs(model, preprocessed(rows)))
    assert torch.equal(outputs(loaded, rows.reshape(-1, 1, 8, 8)), outputs(loaded, rows))  # flat or as stored
    assert torch.equal(outputs(loaded.model, preprocessed(rows)), outputs(model, preprocessed(rows)))


def test_every_format_into_one_folder_each_with_its_json(digits_run, tmp_path):
    run_dir, _ = digits_run
    folder = tmp_path / "exports"
    done = {f: export(str(run_dir), f, output=str(folder) + "/") for f in FILE_NAMES}
    assert sorted(os.listdir(folder)) == sorted([*FILE_NAMES.values(), *(f"{n}.json" for n in FILE_NAMES.values())])
    umask = os.umask(0)
    os.umask(umask)
    modes = {name: oct((folder / name).stat().st_mode & 0o777) for name in os.listdir(folder)}
    assert modes == {name: oct(0o666 & ~umask) for name in modes}  # as any new file: none private
    rows = raw_pixels()
    expected = outputs(raytrain_app.load_model(str(run_dir)), rows)
    for format in ("safetensors", "pt", "torchscript"):
        for path in (done[format].weights, done[format].manifest):
            assert torch.equal(outputs(raytrain_app.load_model(path), rows), expected), (format, path)
    manifest = json.loads(open(done["pt"].manifest).read())
    assert {k: manifest[k] for k in ("format", "weights", "model", "task", "input_shape", "num_classes")} == {
        "format": "pt", "weights": "model.pt", "model": {"name": "lenet", "args": {}}, "task": "classification",
        "input_shape": [1, 28, 28], "num_classes": 10}
    assert manifest["example_input"] == {"shape": [1, 1, 28, 28], "dtype": "float32"}
    assert not manifest["includes_preprocessing"]
    train = build_datasets(DIGITS.data).train
    p = manifest["preprocessing"]
    assert (p["features"], p["label"], p["shape"], p["resize"]) == ("image", "label", [1, 8, 8], 28)
    assert torch.equal(torch.tensor(p["mean"]).reshape(p["stats_shape"]), train.mean)
    assert torch.equal(torch.tensor(p["std"]).reshape(p["stats_shape"]), train.std)
    assert manifest["checkpoint"] == str(run_dir / FIRST) and manifest["epoch"] == 1
    assert manifest["torch_version"] == torch.__version__ and manifest["raytrain_app_version"]
    raw = json.loads(open(done["torchscript"].manifest).read())
    assert raw["includes_preprocessing"] and raw["example_input"] == {"shape": [1, 64], "dtype": "float32"}
    with pytest.raises(raytrain_app.UserError, match=f"{folder} holds 4 exports"):
        raytrain_app.load_model(str(folder))
    with pytest.raises(raytrain_app.UserError, match="is an ONNX graph: run it with onnxruntime"):
        raytrain_app.load_model(done["onnx"].weights)


def test_safetensors_give_the_same_outputs_in_a_process_without_raytrain_app(digits_run, tmp_path):
    run_dir, _ = digits_run
    done = export(str(run_dir), "safetensors", output=str(tmp_path / "lenet.safetensors"))
    rows = raw_pixels()
    torch.save(rows, tmp_path / "raw.pt")
    fresh_python(PLAIN_LENET, done.weights, tmp_path / "raw.pt", tmp_path / "out.pt")
    assert torch.equal(torch.load(tmp_path / "out.pt"), outputs(raytrain_app.load_model(str(run_dir)), rows))


def test_torchscript_takes_raw_rows_in_a_process_without_raytrain_app(digits_run, tmp_path):
    run_dir, _ = digits_run
    done = export(str(run_dir), "torchscript", output=str(tmp_path / "out" / "lenet.ts"))
    rows = raw_pixels(7, seed=2)  # another batch size than the trace's
    torch.save(rows, tmp_path / "x.pt")
    fresh_python(TORCHSCRIPT, done.weights, tmp_path / "x.pt", tmp_path / "out.pt")
    assert torch.equal(torch.load(tmp_path / "out.pt"), outputs(raytrain_app.load_model(str(run_dir)), rows))


def test_onnx_runs_in_onnxruntime_on_raw_rows(digits_run, tmp_path):
    import onnxruntime

    run_dir, _ = digits_run
    done = export(str(run_dir), "onnx", output=str(tmp_path / "lenet.onnx"))
    assert done.check.startswith("onnxruntime gives torch's outputs within")
    rows = raw_pixels(9, seed=3)
    session = onnxruntime.InferenceSession(done.weights, providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": rows.float().numpy()})[0]
    expected = outputs(raytrain_app.load_model(str(run_dir)), rows).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert (got.argmax(1) == expected.argmax(1)).all()


def test_tied_gpt_embeddings_export_and_load(tmp_path):
    model = save_checkpoint(tmp_path / "run" / FIRST, TINY_GPT)
    assert model.head.weight is model.tok.weight  # the case safetensors refuses to save as is
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    for format in ("safetensors", "torchscript"):
        done = export(str(tmp_path / "run"), format)
        manifest = json.loads(open(done.manifest).read())
        assert manifest["example_input"] == {"shape": [1, 16], "dtype": "int64"}
        assert manifest["preprocessing"] is None  # token ids are not normalised
        assert torch.equal(outputs(raytrain_app.load_model(done.weights), ids), outputs(model, ids))


def test_every_command_names_the_same_checkpoint_and_ties_go_to_the_earliest(tmp_path):
    """Epochs 1 and 2 tie on the metric, epoch 3 is a mid-epoch checkpoint of a better epoch row."""
    run_dir = tmp_path / "run"
    first = save_checkpoint(run_dir / FIRST, DIGITS, epoch=1, seed=1)
    second = save_checkpoint(run_dir / SECOND, DIGITS, epoch=2, seed=2)
    latest = save_checkpoint(run_dir / "checkpoint_2025-01-01_00-02-00.000000", DIGITS, epoch=3, seed=3, batch=5)
    rows = [{"epoch": 1, "eval_accuracy": 0.9}, {"epoch": 2, "eval_accuracy": 0.9}, {"epoch": 3, "eval_accuracy": 0.95}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run_dir / "config.yaml").write_text(open(f"{REPO}/examples/digits.yaml").read())
    rows = raw_pixels()
    chosen = rundir.choose(str(run_dir))
    assert chosen.name == FIRST and chosen.why == "best: eval_accuracy 0.9000 at epoch 1"
    assert rundir.best(str(run_dir))[0].name == FIRST  # what the summary and `runs` show
    assert torch.equal(outputs(raytrain_app.load_model(str(run_dir)), rows), outputs(first, preprocessed(rows)))
    assert export(str(run_dir), "pt", output=str(tmp_path / "a" / "m.pt")).chosen.name == FIRST
    for which, expected in (("latest", latest), (SECOND, second)):
        done = export(str(run_dir), "pt", output=str(tmp_path / which / "model.pt"), checkpoint=which)
        assert torch.equal(outputs(raytrain_app.load_model(done.weights), rows), outputs(expected, preprocessed(rows)))
        assert torch.equal(outputs(raytrain_app.load_model(str(run_dir), checkpoint=which), rows),
                           outputs(expected, preprocessed(rows)))
    with pytest.raises(raytrain_app.UserError, match=f"has no checkpoint_nope .*{FIRST}"):
        export(str(run_dir), "pt", checkpoint="checkpoint_nope")
    (run_dir / "metrics.jsonl").unlink()  # no scores: the default is the latest, and says so
    assert rundir.choose(str(run_dir)).why == "latest: epoch 3, batch 5 (no checkpoint has a score)"
    with pytest.raises(raytrain_app.UserError, match="--checkpoint best: no checkpoint of .* has a eval_accuracy"):
        rundir.choose(str(run_dir), "best")


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
    assert "no weights.pt.json beside it" in one_line_error(raytrain_app.load_model, str(tmp_path / "weights.pt"))


def test_a_checkpoint_that_did_not_record_its_preprocessing_is_refused(tmp_path):
    model = build_model(DIGITS.model, DIGITS_SHAPE, DIGITS_CLASSES)
    optimizer = build_optimizer(model.parameters(), DIGITS.optimizer, 1)
    state = TrainState(model, optimizer, build_schedule(optimizer, DIGITS.schedule, 10, 12), None, epoch=1)
    os.makedirs(tmp_path / "old" / FIRST)
    checkpoint.save(str(tmp_path / "old" / FIRST), 0, state, {"config": DIGITS.to_dict(), "input_shape":
                                                              list(DIGITS_SHAPE), "num_classes": DIGITS_CLASSES})
    assert "did not record how its inputs were preprocessed" in one_line_error(raytrain_app.load_model,
                                                                               str(tmp_path / "old"))


def test_an_unwritable_output_is_a_user_error(digits_run, tmp_path):
    run_dir, _ = digits_run
    (tmp_path / "a-file").write_text("")
    below_a_file = tmp_path / "a-file" / "model.pt"
    assert f"{tmp_path / 'a-file'} is not writable" in one_line_error(export, str(run_dir), "pt",
                                                                      output=str(below_a_file))


@pytest.mark.parametrize("format, extra", [("safetensors", "export"), ("onnx", "onnx")])
def test_a_missing_package_is_a_user_error_naming_the_extra(digits_run, monkeypatch, format, extra):
    for module in ("safetensors", "safetensors.torch", "onnxruntime"):
        monkeypatch.setitem(sys.modules, module, None)  # what an install without the extra sees
    assert f"pip install 'raytrain-app[{extra}]'" in one_line_error(export, str(digits_run[0]), format)


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
    job = JobConfig.from_dict({**TINY_GPT.to_dict(), "model": {"name": "tests.test_export:scalar_out"}})
    save_checkpoint(tmp_path / "run" / FIRST, job, input_shape=(5,), num_classes=2)
    assert "torch.jit.trace could not trace the model" in one_line_error(export, str(tmp_path / "run"),
                                                                         "torchscript")


def test_load_model_hands_its_devices_to_a_model_that_places_itself(tmp_path):
    """The model-parallel example's builder takes `devices`: load_model passes them on (here two
    names of the CPU, as a worker with two GPUs would pass two GPUs)."""
    job = JobConfig.from_dict({**DIGITS.to_dict(), "model": {"name": "examples.model_parallel.model:build"}})
    save_checkpoint(tmp_path / "run" / FIRST, job)
    devices = [torch.device("cpu"), torch.device("cpu", 0)]
    loaded = raytrain_app.load_model(str(tmp_path / "run"), devices=devices)
    assert (loaded.model.first, loaded.model.last) == (devices[0], devices[1])
    default = raytrain_app.load_model(str(tmp_path / "run"))
    assert default.model.last == torch.device("cpu")  # without devices: the CPU
    rows = raw_pixels()
    assert torch.equal(outputs(loaded, rows), outputs(default, rows))
