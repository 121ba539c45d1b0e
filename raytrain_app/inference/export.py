"""A trained model for use without raytrain-app: its weights in a standard format, and a JSON
file beside them that says how to use them.

A checkpoint holds everything needed to resume training (optimizer, schedule, RNG streams) in
raytrain-app's own layout; an export holds only what inference needs. Each format writes its
weights file (`safetensors`, a plain `pt` state_dict, a traced `torchscript` module, an `onnx`
graph) and `WEIGHTS.json` beside it (`model.safetensors.json`), so several formats share a folder:
the builder and its arguments, the input the file's forward takes, the output width and, where
the training labels were names, each output's class name, and the preprocessing the training data
had (columns, shape, resize, normalisation).

safetensors and pt hold the model as built, whose inputs are preprocessed: the JSON says how.
TorchScript and ONNX hold the preprocessing too, so they take raw rows as the data stores them;
for a model trained on encoded images, decoded pixels, resized and cropped as the JSON says (the
sizes of a resize depend on each image, and a traced graph fixes them). `load_exported` (and
so `raytrain_app.load_model`) reads an export back into a model that takes raw rows.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import posixpath
import tempfile
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Callable, Optional

import pyarrow as pa
import pyarrow.fs as pafs
import torch

from raytrain_app import rundir, storage
from raytrain_app.config.sections import ModelConfig
from raytrain_app.errors import UserError
from raytrain_app.models.trained import TrainedModel, rebuild
from raytrain_app.rundir.checkpoints import for_inference

# Each format's default file name (RUN_DIR/export/NAME); its JSON is NAME.json.
FILE_NAMES = {"safetensors": "model.safetensors", "pt": "model.pt", "torchscript": "model.torchscript.pt",
              "onnx": "model.onnx"}
NEEDS = {"safetensors": "--format safetensors needs safetensors: pip install 'raytrain-app[export]'",
         "onnx": "--format onnx needs onnx, onnxscript and onnxruntime: pip install 'raytrain-app[onnx]'"}
RAW = ("torchscript", "onnx")  # the formats whose file preprocesses raw inputs itself
ONNX_TOLERANCE = 1e-4  # onnxruntime against torch on the same rows, relative to the outputs' scale


@dataclass(frozen=True)
class Exported:
    chosen: rundir.Chosen  # the checkpoint exported, and why that one
    weights: str  # the weights file written (local path or URI)
    manifest: str  # its JSON beside it
    check: str = ""  # what was checked after writing (ONNX: onnxruntime against torch)


def manifest_of(weights: str) -> str:
    return weights + ".json"


def export(run_dir_or_checkpoint: str, format: str, output: Optional[str] = None,
           checkpoint: Optional[str] = None) -> Exported:
    """Write a checkpoint's weights as `format` (safetensors, pt, torchscript, onnx) and WEIGHTS.json
    beside them.

    `checkpoint` picks from a run directory: "best", "latest", a checkpoint_* name, or None for
    the best where the run scored its checkpoints, else the latest (`rundir.choose`). `output` is
    the weights file (default RUN_DIR/export/model.<ext>; an existing directory or one ending in
    "/" gets that name inside); paths or URIs. Raises UserError for a missing run or checkpoint,
    an unwritable output, a missing package, or a model that cannot be traced or exported.
    """
    if format not in FILE_NAMES:
        raise UserError(f"--format: unknown format '{format}' (choose from {', '.join(FILE_NAMES)})")
    _needs(format)  # before any work: a missing package is the first thing to hear about
    chosen = rundir.choose(str(run_dir_or_checkpoint), checkpoint)
    saved = for_inference(chosen.path)
    weights = _weights_path(chosen.path, None if output is None else str(output), format)
    storage.check_writable(storage.parent(weights))  # before tracing, not after
    manifest = _manifest(saved, chosen.path, format, posixpath.basename(weights))
    try:
        with _staged(weights) as local:
            check = WRITERS[format](saved["model"], manifest, local)
        storage.write_text(manifest_of(weights), json.dumps(manifest, indent=1) + "\n")
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"cannot write {weights}: {storage.explain(e)}") from None
    return Exported(chosen, weights, manifest_of(weights), check or "")


def _weights_path(source: str, output: Optional[str], format: str) -> str:
    """Where the weights go: RUN_DIR/export/ by default (Ray keeps checkpoints directly in the run
    directory), or `output`, with the format's default name inside when it is a directory."""
    if output is None:
        return storage.join(storage.parent(source), "export", FILE_NAMES[format])
    into_folder = output.endswith("/") or ("://" not in output and os.path.isdir(os.path.expanduser(output)))
    output = storage.normalize(output)
    if into_folder:
        output = storage.join(output, FILE_NAMES[format])
    if output.endswith(".json"):
        raise UserError(f"-o {output}: name the weights file; its .json is written beside it")
    return output


def _manifest(saved: dict, source: str, format: str, weights_name: str) -> dict:
    """The JSON for a checkpoint's saved state: what a user without raytrain-app needs."""
    config = saved["config"]
    task = config["task"]["name"]
    recipe = saved["preprocess"]
    raw = format in RAW
    return {
        "format": format,
        "weights": weights_name,
        "model": {"name": config["model"]["name"], "args": config["model"]["args"]},
        "task": task,
        "input_shape": list(saved["input_shape"]),  # what the built model takes, which its builder is given
        "num_classes": saved["num_classes"],  # the output width: classes, targets, or vocabulary
        "class_names": (recipe or {}).get("classes"),  # output i is class class_names[i] (null: ids only)
        # What this file's forward takes, as a batch of one: where it preprocesses them, raw rows
        # flat, as a table holds them (TorchScript also takes them shaped as `preprocessing.shape`),
        # or decoded images, resized and cropped as `preprocessing` says.
        "example_input": _example_spec(task, recipe if raw else None, saved["input_shape"]),
        "includes_preprocessing": raw,
        # Applied to raw rows as (resize(x.reshape(-1, *shape)) - mean) / std, mean and std shaped
        # stats_shape; `features` are the table's columns, in order.
        "preprocessing": recipe,
        "data": {"name": config["data"]["name"], "args": config["data"]["args"]},
        "checkpoint": source,
        "epoch": saved["epoch"],
        "torch_version": torch.__version__,
        "raytrain_app_version": _version(),
    }


def _example_spec(task: str, recipe: Optional[dict], input_shape) -> dict:
    """What the forward takes, as a batch of one: a language model reads T token ids of its
    (T + 1)-token samples; every other built-in task reads numbers, float32 for the model as
    built. A file that preprocesses (`recipe`) takes raw rows of any numeric type, or, for
    encoded images, decoded RGB pixels as uint8 (`ImageNormalise`)."""
    if task == "language_model":
        return {"shape": [1, input_shape[0] - 1], "dtype": "int64"}
    if recipe and recipe.get("kind") == "images":
        return {"shape": [1, *recipe["shape"]], "dtype": "uint8",
                "images": f"RGB, the shorter side resized to {recipe['resize']} and the centre {recipe['size']}x"
                          f"{recipe['size']} cropped (antialiased bilinear, as torchvision's Resize and CenterCrop)"}
    return {"shape": [1, *([math.prod(recipe["shape"])] if recipe else input_shape)], "dtype": "float32"}


def _version() -> str:
    try:
        return metadata.version("raytrain-app")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _save_safetensors(weights: dict, manifest: dict, path: str) -> None:
    """Every tensor its own contiguous copy: safetensors refuses tensors that share memory (the
    GPT's tied embedding and head), and a plain `load_state_dict` then finds every key. Written
    as bytes by this process: safetensors' own `save_file` makes the file private (0600), which
    the team the model goes to could not read where the other formats' files are readable."""
    tensors = {name: t.clone(memory_format=torch.contiguous_format) for name, t in weights.items()}
    with open(path, "wb") as f:
        f.write(_needs("safetensors").save(tensors, metadata={"format": "pt"}))


def _save_pt(weights: dict, manifest: dict, path: str) -> None:
    torch.save(weights, path)


def _model(weights: dict, manifest: dict) -> TrainedModel:
    """The trained model behind its preprocessing, for the formats that hold both (its builder
    must import here, which safetensors and pt do not need); of an image model's transform, the
    part a traced graph can hold (`ImageNormalise`)."""
    model = _trained(manifest, None)
    model.model.load_state_dict(weights)
    if manifest["preprocessing"] and manifest["preprocessing"].get("kind") == "images":
        from raytrain_app.data.images import ImageNormalise

        model.preprocess = ImageNormalise(manifest["preprocessing"])
    return model.eval()


def _example(manifest: dict, batch: int = 1) -> torch.Tensor:
    spec = manifest["example_input"]
    return torch.zeros([batch, *spec["shape"][1:]], dtype=getattr(torch, spec["dtype"]))


def _save_torchscript(weights: dict, manifest: dict, path: str) -> None:
    """torch.jit.trace in eval mode on a zero batch of one: a traced module runs without Python
    source, but only along the path that input took."""
    model = _model(weights, manifest)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # trace's deprecation notice and its warnings about Python branches
            traced = torch.jit.trace(model, _example(manifest))
    except Exception as e:  # whatever the model does that tracing cannot follow
        raise UserError(f"--format torchscript: torch.jit.trace could not trace the model: {_first(e)}; "
                        "export safetensors or pt instead") from None
    with _jit_deprecation_ignored():
        torch.jit.save(traced, path)


def _save_onnx(weights: dict, manifest: dict, path: str) -> str:
    """torch.onnx.export (torch.export underneath) with a dynamic batch, in one file; then
    onnxruntime runs it on the same rows as torch, and a difference beyond float error refuses it."""
    import numpy as np
    import onnxruntime

    model = _model(weights, manifest)
    example = _example(manifest, batch=2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(model, (example,), dynamo=True, external_data=False, verbose=False,
                                        dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
                                        input_names=["x"], output_names=["output"])
    except Exception as e:  # whatever torch.export cannot follow
        raise UserError(f"--format onnx: torch.onnx.export could not export the model: {_first(e)}; "
                        "export safetensors, pt or torchscript instead") from None
    data = program.model_proto.SerializeToString()
    rows = _probe(model, manifest)
    with torch.no_grad():
        expected = model(rows).float().numpy()
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": rows.numpy()})[0]
    worst = float(np.abs(got - expected).max()) / max(1.0, float(np.abs(expected).max()))
    if worst > ONNX_TOLERANCE:
        raise UserError(f"--format onnx: onnxruntime's outputs differ from torch's by {worst:.2g} (relative) on "
                        f"the same rows; export torchscript instead")
    with open(path, "wb") as f:
        f.write(data)
    return f"onnxruntime gives torch's outputs within {worst:.1g} on {len(rows)} rows"


def _probe(model: TrainedModel, manifest: dict) -> torch.Tensor:
    """A few raw rows around the training data's statistics (token ids for a language model)."""
    spec, recipe = manifest["example_input"], manifest["preprocessing"]
    generator = torch.Generator().manual_seed(0)
    if spec["dtype"] == "int64":
        return torch.randint(0, manifest["num_classes"], (5, *spec["shape"][1:]), generator=generator)
    if spec["dtype"] == "uint8":
        return torch.randint(0, 256, (5, *spec["shape"][1:]), generator=generator, dtype=torch.uint8)
    rows = torch.randn((5, *spec["shape"][1:]), generator=generator)
    if recipe and not recipe["resize"]:  # on the scale of the data: statistics per value or per channel
        rows = (rows.reshape(5, *recipe["shape"]) * model.preprocess.std + model.preprocess.mean).reshape(rows.shape)
    return rows


def _first(e: BaseException) -> str:
    detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {detail}"


@contextlib.contextmanager
def _jit_deprecation_ignored():
    """torch.jit warns on every call that it is deprecated; TorchScript is still what a C++ or
    mobile runtime loads, and one of the formats here that need no model code."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.\w+` is deprecated", category=FutureWarning)
        yield


WRITERS: dict[str, Callable[[dict, dict, str], Optional[str]]] = {
    "safetensors": _save_safetensors, "pt": _save_pt, "torchscript": _save_torchscript, "onnx": _save_onnx}


def _needs(format: str):
    """The optional package a format writes or reads with (the `export` and `onnx` extras)."""
    try:
        if format == "safetensors":
            import safetensors.torch

            return safetensors.torch
        if format == "onnx":
            import onnx  # noqa: F401 - torch.onnx's exporter needs onnx and onnxscript
            import onnxruntime  # noqa: F401
            import onnxscript  # noqa: F401
    except ImportError:
        raise UserError(NEEDS[format]) from None
    return None


@contextlib.contextmanager
def _staged(path: str):
    """A local file to write `path` through: renamed into place on a local disk (a reader never
    sees half a file), uploaded whole to a URI."""
    if "://" in path:
        with tempfile.TemporaryDirectory() as folder:
            local = os.path.join(folder, posixpath.basename(path))
            yield local
            storage.upload(local, path)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        yield path + ".tmp"
        os.replace(path + ".tmp", path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + ".tmp")


# ---- reading an export back ----------------------------------------------------------------

def is_export(path: str) -> bool:
    """Whether `path` names an export (a weights file or its JSON, or a directory holding them)
    rather than a checkpoint or run directory."""
    return path.endswith(".json") or _is_file(path) or bool(_exports_in(path))


def load_exported(path: str, model: Optional[Callable] = None) -> TrainedModel:
    """The exported model, weights loaded and in eval mode, taking raw rows; `path` is a weights
    file, its JSON, or a directory holding one export (local paths or URIs). `model` replaces the
    builder the JSON names, as `load_model`'s does."""
    manifest_path = _locate(str(path))
    try:
        manifest = json.loads(storage.read_text(manifest_path))
    except (OSError, pa.ArrowException, ValueError) as e:
        raise UserError(f"cannot read {manifest_path}: {storage.explain(e)}") from None
    if not isinstance(manifest, dict) or not {"format", "model", "input_shape", "preprocessing"} <= set(manifest):
        raise UserError(f"{manifest_path} is not an export's JSON of this raytrain-app (an older one's model.json?): "
                        "export the run again")
    weights = manifest_path.removesuffix(".json")
    if manifest["format"] == "onnx":
        raise UserError(f"{weights} is an ONNX graph: run it with onnxruntime.InferenceSession({weights!r}) (it "
                        f"takes raw rows as 'x'), or load a safetensors, pt or torchscript export")
    try:
        data = storage.read_bytes(weights)
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"cannot read {weights}: {storage.explain(e)}") from None
    built = _trained(manifest, model, weights)
    try:
        built.model.load_state_dict(READERS[manifest["format"]](data))
    except RuntimeError as e:  # weights of another model
        raise UserError(f"the weights in {weights} do not fit the model {manifest_path} describes: "
                        f"{str(e).splitlines()[0]}") from None
    return built.eval()


def _locate(path: str) -> str:
    """The JSON of the export `path` names."""
    if path.endswith(".json"):
        return path
    if _is_file(path):
        if not storage.exists(manifest_of(path)):
            raise UserError(f"{path}: no {posixpath.basename(manifest_of(path))} beside it (export writes one with the "
                            "weights; it says how to rebuild the model)")
        return manifest_of(path)
    found = _exports_in(path)
    if not found:
        raise UserError(f"no export in {path}: name a weights file that `raytrain-app export` wrote")
    if len(found) > 1:
        raise UserError(f"{path} holds {len(found)} exports ({', '.join(found)}): name one's weights file")
    return storage.join(path, found[0] + ".json")


def _exports_in(path: str) -> list[str]:
    """The weights files in directory `path` that have their JSON beside them."""
    fs, inner = storage.filesystem_for(path)
    try:
        infos = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    except (OSError, pa.ArrowException):
        return []
    files = {info.base_name for info in infos if info.type == pafs.FileType.File}
    return sorted(name for name in files if name + ".json" in files)


def _trained(manifest: dict, model: Optional[Callable], source: str = "") -> TrainedModel:
    config = ModelConfig(name=manifest["model"]["name"], args=manifest["model"]["args"])
    return rebuild(config, model, manifest["input_shape"], manifest["num_classes"], manifest["preprocessing"],
                   source or manifest["checkpoint"])


def _read_torchscript(data: bytes) -> dict:
    """The model's weights in a traced TrainedModel; its preprocessing is rebuilt from the JSON."""
    with _jit_deprecation_ignored():
        state = torch.jit.load(io.BytesIO(data), map_location="cpu").state_dict()
    return {name.removeprefix("model."): t for name, t in state.items() if name.startswith("model.")}


READERS: dict[str, Callable[[bytes], dict]] = {
    "torchscript": _read_torchscript,
    "safetensors": lambda data: _needs("safetensors").load(data),
    "pt": lambda data: torch.load(io.BytesIO(data), map_location="cpu", weights_only=True),
}


def _is_file(path: str) -> bool:
    fs, inner = storage.filesystem_for(path)
    try:
        return fs.get_file_info(inner).type == pafs.FileType.File
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"cannot read {path}: {storage.explain(e)}") from None
