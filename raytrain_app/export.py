"""A trained model for use without raytrain-app: its weights in a standard format, and `model.json`.

A checkpoint holds everything needed to resume training (optimizer, schedule, RNG streams) in
raytrain-app's own layout; an export holds only what inference needs. The weights go to one file
(`safetensors`, a plain `pt` state_dict, or a traced `torchscript` module) and beside it
`model.json` says how to use them: the builder and its arguments, the input the model takes,
its output width, and the normalisation the training data had. `load_exported` (and so
`raytrain_app.load_model`) reads an export back into the model it came from.
"""

from __future__ import annotations

import contextlib
import io
import json
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

from raytrain_app import storage
from raytrain_app.checkpoint import choose, loop_state, with_weights
from raytrain_app.errors import UserError

MANIFEST = "model.json"
# Each format's default file name (RUN_DIR/export/NAME); a weights file named otherwise takes
# its format from model.json.
FILE_NAMES = {"safetensors": "model.safetensors", "pt": "model.pt", "torchscript": "model.torchscript.pt"}
NEEDS_SAFETENSORS = "--format safetensors needs safetensors: pip install 'raytrain-app[export]'"


@dataclass(frozen=True)
class Exported:
    checkpoint: str  # the checkpoint directory exported
    weights: str  # the weights file written (local path or URI)
    manifest: str  # the model.json beside it
    notes: tuple[str, ...] = ()  # what the export could not record, for the caller to warn about


def export(run_dir_or_checkpoint: str, format: str, output: Optional[str] = None,
           checkpoint: str = "latest") -> Exported:
    """Write a checkpoint's weights as `format` (safetensors, pt, torchscript) and model.json beside them.

    `checkpoint` picks from a run directory: "latest" (what `load_model` loads), "best" (by the
    run's checkpoint.metric), or a checkpoint_* directory's name. `output` is the weights file
    (default RUN_DIR/export/model.<ext>; an existing directory or one ending in "/" gets that name
    inside); paths or URIs. Raises UserError for a missing run or checkpoint, an unwritable output,
    a missing safetensors package, or a model that torch.jit.trace cannot trace.
    """
    if format not in FILE_NAMES:
        raise UserError(f"--format: unknown format '{format}' (choose from {', '.join(FILE_NAMES)})")
    if format == "safetensors":
        _safetensors()  # before any work: a missing package is the first thing to hear about
    source = choose(storage.normalize(str(run_dir_or_checkpoint)), checkpoint)
    saved = with_weights(source, loop_state(source))
    weights = _weights_path(source, None if output is None else str(output), format)
    manifest_path = storage.join(_parent(weights), MANIFEST)
    storage.check_writable(_parent(weights))  # before tracing or reading data, not after
    manifest, notes = _describe(saved, source, format, _basename(weights))
    try:
        with _staged(weights) as local:
            WRITERS[format](saved, manifest, local)
        storage.write_text(manifest_path, json.dumps(manifest, indent=1) + "\n")
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"cannot write {weights}: {storage.explain(e)}") from None
    return Exported(source, weights, manifest_path, notes)


def _weights_path(source: str, output: Optional[str], format: str) -> str:
    """Where the weights go: RUN_DIR/export/ by default (Ray keeps checkpoints directly in the run
    directory), or `output`, with the format's default name inside when it is a directory."""
    if output is None:
        return storage.join(_parent(source), "export", FILE_NAMES[format])
    into_folder = output.endswith("/") or ("://" not in output and os.path.isdir(os.path.expanduser(output)))
    output = storage.normalize(output)
    if into_folder:
        output = storage.join(output, FILE_NAMES[format])
    if _basename(output) == MANIFEST:
        raise UserError(f"-o {output}: {MANIFEST} is the name of the file written beside the weights")
    return output


def _describe(saved: dict, source: str, format: str, weights_name: str) -> tuple[dict, tuple[str, ...]]:
    """model.json's content for a checkpoint's saved state, and what it could not record."""
    config = saved["config"]
    task = config["task"]["name"]
    normalization, notes = _normalization(config)
    return {
        "format": format,
        "weights": weights_name,
        "model": {"name": config["model"]["name"], "args": config["model"]["args"]},
        "task": task,
        "input_shape": list(saved["input_shape"]),  # the dataset's sample shape, which the builder is given
        "num_classes": saved["num_classes"],  # the output width: classes, targets, or vocabulary
        "example_input": _example_spec(task, saved["input_shape"]),
        "normalization": normalization,
        "data": {"name": config["data"]["name"], "args": config["data"]["args"]},
        "checkpoint": source,
        "epoch": saved["epoch"],
        "torch_version": torch.__version__,
        "raytrain_app_version": _version(),
    }, notes


def _example_spec(task: str, input_shape) -> dict:
    """What the model's forward takes, as a batch of one: a language model reads T token ids of
    its (T + 1)-token samples; every other built-in task reads the sample as float32."""
    if task == "language_model":
        return {"shape": [1, input_shape[0] - 1], "dtype": "int64"}
    return {"shape": [1, *input_shape], "dtype": "float32"}


def _normalization(config: dict) -> tuple[Optional[dict], tuple[str, ...]]:
    """The per-channel (or per-feature) mean and std the training data was normalised with.

    Checkpoints do not hold them, so they are computed again as the data module computes them:
    the run's datasets are built from the saved config (same files, same split seed), and the
    in-memory datasets carry the training split's statistics. Inputs are normalised as
    (x - mean.reshape(shape)) / std.reshape(shape), on the values as stored (0-255 pixels, a
    file's numbers), after any resize. None where the data is not normalised (token ids), or
    where it cannot be built here (then a note says why).
    """
    from raytrain_app.config import JobConfig
    from raytrain_app.data import normalization

    try:
        stats = normalization(JobConfig.from_dict(config).data)
    except UserError as e:
        return None, (f"normalisation not recorded: the training data cannot be built here ({e.lines[0]})",)
    if stats is None:
        return None, ()
    mean, std = stats
    return {"mean": mean.flatten().tolist(), "std": std.flatten().tolist(), "shape": list(mean.shape)}, ()


def _version() -> str:
    try:
        return metadata.version("raytrain-app")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _save_safetensors(saved: dict, manifest: dict, path: str) -> None:
    """Every tensor its own contiguous copy: safetensors refuses tensors that share memory (the
    GPT's tied embedding and head), and a plain `load_state_dict` then finds every key."""
    tensors = {name: t.clone(memory_format=torch.contiguous_format) for name, t in saved["model"].items()}
    _safetensors().save_file(tensors, path, metadata={"format": "pt"})


def _save_pt(saved: dict, manifest: dict, path: str) -> None:
    torch.save(saved["model"], path)


def _save_torchscript(saved: dict, manifest: dict, path: str) -> None:
    """torch.jit.trace in eval mode on a zero batch of one (example_input): a traced module runs
    without Python source, but only along the path that input took."""
    model = _rebuild(manifest, saved["model"], None)
    spec = manifest["example_input"]
    example = torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]))
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # trace's deprecation notice and its warnings about Python branches
            traced = torch.jit.trace(model, example)
    except Exception as e:  # whatever the model does that tracing cannot follow
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(f"--format torchscript: torch.jit.trace could not trace the model: {type(e).__name__}: "
                        f"{detail}; export safetensors or pt instead") from None
    with _jit_deprecation_ignored():
        torch.jit.save(traced, path)


@contextlib.contextmanager
def _jit_deprecation_ignored():
    """torch.jit warns on every call that it is deprecated; TorchScript is still what a C++ or
    mobile runtime loads, and the one format here that needs no model code."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.\w+` is deprecated", category=FutureWarning)
        yield


WRITERS: dict[str, Callable[[dict, dict, str], None]] = {
    "safetensors": _save_safetensors, "pt": _save_pt, "torchscript": _save_torchscript}


def _safetensors():
    """safetensors.torch, an optional dependency (the `export` extra)."""
    try:
        import safetensors.torch
    except ImportError:
        raise UserError(NEEDS_SAFETENSORS) from None
    return safetensors.torch


@contextlib.contextmanager
def _staged(path: str):
    """A local file to write `path` through: renamed into place on a local disk (a reader never
    sees half a file), uploaded whole to a URI."""
    if "://" in path:
        with tempfile.TemporaryDirectory() as folder:
            local = os.path.join(folder, _basename(path))
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
    """Whether `path` names an export (a model.json, a weights file, or a directory holding
    model.json) rather than a checkpoint or run directory."""
    return path.endswith(".json") or _is_file(path) or storage.exists(storage.join(path, MANIFEST))


def load_exported(path: str, model: Optional[Callable] = None) -> torch.nn.Module:
    """The exported model, weights loaded and in eval mode, rebuilt from model.json; `path` is the
    model.json, the weights file, or their directory (local paths or URIs). `model` replaces the
    builder model.json names, as `load_model`'s does."""
    manifest_path, weights = _locate(str(path))
    try:
        manifest = json.loads(storage.read_text(manifest_path))
    except (OSError, pa.ArrowException, ValueError) as e:
        raise UserError(f"cannot read {manifest_path}: {storage.explain(e)}") from None
    if weights is None:
        weights = storage.join(_parent(manifest_path), manifest["weights"])
    format = manifest["format"] if _basename(weights) == manifest["weights"] else _format_of(weights, manifest_path)
    try:
        data = storage.read_bytes(weights)
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"cannot read {weights}: {storage.explain(e)}") from None
    return _rebuild(manifest, READERS[format](data), model)


def _locate(path: str) -> tuple[str, Optional[str]]:
    """model.json's path, and the weights file when `path` named one."""
    if path.endswith(".json"):
        return path, None
    if not _is_file(path):
        return storage.join(path, MANIFEST), None
    manifest = storage.join(_parent(path), MANIFEST)
    if not storage.exists(manifest):
        raise UserError(f"{path}: no {MANIFEST} beside it (export writes one with the weights; it says how to "
                        f"rebuild the model)")
    return manifest, path


def _format_of(weights: str, manifest_path: str) -> str:
    """A weights file that model.json does not name (another format exported into the same
    directory) is read by its default name."""
    for format, name in FILE_NAMES.items():
        if _basename(weights) == name:
            return format
    raise UserError(f"{weights}: {manifest_path} describes another file; export it again with its own -o directory")


def _rebuild(manifest: dict, state_dict: dict, model: Optional[Callable]) -> torch.nn.Module:
    from raytrain_app.config import ModelConfig
    from raytrain_app.models import build_model

    config = ModelConfig(name=model or manifest["model"]["name"], args=manifest["model"]["args"])
    built = build_model(config, manifest["input_shape"], manifest["num_classes"])
    try:
        built.load_state_dict(state_dict)
    except RuntimeError as e:  # weights of another model (another run exported into the same directory)
        raise UserError(f"the weights do not fit the model model.json describes: {str(e).splitlines()[0]}") from None
    return built.eval()


def _read_torchscript(data: bytes) -> dict:
    with _jit_deprecation_ignored():
        return torch.jit.load(io.BytesIO(data), map_location="cpu").state_dict()


READERS: dict[str, Callable[[bytes], dict]] = {
    "safetensors": lambda data: _safetensors().load(data),
    "pt": lambda data: torch.load(io.BytesIO(data), map_location="cpu", weights_only=True),
    "torchscript": _read_torchscript,
}


def _is_file(path: str) -> bool:
    fs, inner = storage.filesystem_for(path)
    try:
        return fs.get_file_info(inner).type == pafs.FileType.File
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"cannot read {path}: {storage.explain(e)}") from None


def _parent(path: str) -> str:
    return posixpath.dirname(path.rstrip("/")) if "://" in path else os.path.dirname(os.path.abspath(path))


def _basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/"))
