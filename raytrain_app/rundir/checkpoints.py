"""A checkpoint's files read after training, on any machine: rank 0's state, the model's
weights (consolidated from a sharded run's DCP shards), and what a resume or an inference needs
to know of it. Training itself writes and restores them in `worker/checkpoint.py`."""

from __future__ import annotations

import io
import os
import warnings

import torch

from raytrain_app import storage
from raytrain_app.errors import UserError
from raytrain_app.rundir.layout import SHARDS, STATE_FILE


def load_state(checkpoint_dir: str) -> dict:
    """Rank 0's training state from a checkpoint directory (a local path or a URI), with the
    model's full weights under "model", consolidated from the shards of a sharded run."""
    return with_weights(checkpoint_dir, _read_state(checkpoint_dir))


def _read_state(checkpoint_dir: str) -> dict:
    data = storage.read_bytes(storage.join(checkpoint_dir, STATE_FILE))
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def with_weights(checkpoint_dir: str, saved: dict) -> dict:
    """Rank 0's `saved` state with the model's full weights: its own, or its shards' consolidated."""
    return saved if "model" in saved else {**saved, "model": model_weights(checkpoint_dir)}


def model_weights(checkpoint_dir: str) -> dict:
    """A sharded checkpoint's model weights as one full state dict on this process's CPU, read
    shard by shard with DCP (no process group, no GPU); the optimizer state is not read (of a
    remote checkpoint, the shards are downloaded whole first). The tensors to fill are made from
    DCP's own index, so no model needs to be built first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    with storage.local_copy(storage.join(checkpoint_dir, SHARDS)) as local:
        reader = dcp.FileSystemReader(local)
        index = reader.read_metadata().state_dict_metadata
        weights = {key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
                   for key, meta in index.items()
                   if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
        loaded = {"model": weights}
        with warnings.catch_warnings():  # DCP's notice that it loads in one process: that is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(loaded, storage_reader=reader, no_dist=True)
    return loaded["model"]


def loop_state(directory: str) -> dict:
    """Rank 0's state (memory-mapped where local: ranking checkpoints reads no weights), or a
    one-line reason it is no use: a script's checkpoints hold the script's own files, and a
    checkpoint from before input shapes were recorded cannot rebuild its model."""
    try:
        if "://" in directory:
            saved = _read_state(directory)
        else:
            saved = torch.load(os.path.join(directory, STATE_FILE), map_location="cpu",
                               weights_only=True, mmap=True)
    except Exception as e:  # a missing or torn state.pt; weights_only refuses code
        raise UserError(f"{directory} holds no readable {STATE_FILE} ({type(e).__name__}): only the checkpoints "
                        f"of raytrain-app's own training loop can be used here") from None
    if "input_shape" not in saved:
        raise UserError(f"{directory} was written by an older raytrain-app that did not record the model's inputs")
    return saved


def parameter_shapes(directory: str) -> tuple[dict, dict[str, list[int]]]:
    """Rank 0's state (without weights, "sharded" added) and the model's parameter shapes, read
    from the state or, for a sharded checkpoint, from DCP's index alone."""
    saved = _read_state(directory) if "://" in directory else torch.load(
        os.path.join(directory, STATE_FILE), map_location="cpu", weights_only=True, mmap=True)
    if "model" in saved:
        return {**saved, "sharded": False}, {name: list(t.shape) for name, t in saved["model"].items()}
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    with storage.local_copy(storage.join(directory, SHARDS)) as local:
        index = dcp.FileSystemReader(local).read_metadata().state_dict_metadata
    return {**saved, "sharded": True}, {key.removeprefix("model."): list(meta.size) for key, meta in index.items()
                                        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}


def for_inference(directory: str, weights: bool = True) -> dict:
    """Rank 0's state for using the model (with its full weights unless `weights` is False), or a
    one-line reason it cannot be used on new data: a checkpoint that did not record how its
    inputs were preprocessed would silently be given the wrong ones."""
    saved = loop_state(directory)
    if "preprocess" not in saved:
        raise UserError(f"{directory} was written by an older raytrain-app that did not record how its inputs were "
                        "preprocessed; train it again to use it on new data")
    return with_weights(directory, saved) if weights else saved
