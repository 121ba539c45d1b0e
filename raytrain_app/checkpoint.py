"""Checkpoint files: written safely, verified, and restored newest-good-first.

Rank 0 writes the state every rank shares (`state.pt`); every rank writes what it alone holds
(`rank{N}.pt`); see `state.py` for what is in them. Ray Train merges the ranks' files into one
checkpoint directory on the run's storage and keeps the best K.

Under FSDP/HSDP no rank holds the whole model, so the weights and optimizer state go instead
into `shards/` through `torch.distributed.checkpoint` (DCP): each rank writes its own shards
(`__RANK_0.distcp`) and rank 0 the index (`.metadata`). DCP reads them back into any mesh, so a
run resumes at another world size, and `load_state` consolidates them on one process's CPU.

Safety: each file is written under a temporary name and renamed, with a `.sha256` beside it, so
a partial or corrupted checkpoint is detected on restore and skipped in favour of the previous
good one. Everything is loaded with `weights_only=True`, so a checkpoint cannot run code.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import posixpath
import re
import sys
import warnings
from typing import Callable, Optional

import pyarrow.fs as pafs
import torch

from raytrain_app import rundir, storage
from raytrain_app.errors import UserError
from raytrain_app.rundir import STATE_FILE
from raytrain_app.state import TrainState
SHARDS = "shards"  # the DCP directory of a sharded run's weights and optimizer state
# load_state_dict's words for weights of another model (shapes, names), as opposed to a torn file.
_MISFIT = re.compile(r"size mismatch|Missing key\(s\)|Unexpected key\(s\)")

# The score a mid-epoch checkpoint reports for `checkpoint.metric`, so that Ray's best-K never
# keeps it for its score. Finite on purpose: Ray's JSON index of checkpoints turns NaN into null,
# and a resumed run's controller then fails sorting it.
WORST_SCORE = {"max": -sys.float_info.max, "min": sys.float_info.max}


def save(directory: str, rank: int, state: TrainState, about: dict) -> None:
    """`about`: plain data saved beside rank 0's state (the config, the model's input shape)."""
    if state.sharded:
        import torch.distributed.checkpoint as dcp

        dcp.save(state.sharded_state_dict(), checkpoint_id=os.path.join(directory, SHARDS))
        for name in _listing(directory):  # this rank's files (its own directory); checksums as for the others
            _write_checksum(os.path.join(directory, name))
    if rank == 0:
        _write(directory, STATE_FILE, {**state.state_dict(), **about})
        # Where in training it was taken, readable without torch: which checkpoint is best needs only this.
        rundir.write_position(directory, state.epoch, state.step, state.batch)
    _write(directory, f"rank{rank}.pt", state.rank_state_dict())


def restore_latest_good(latest, state: TrainState, rank: int, device: torch.device, run_dir: str,
                        warn: Callable[[str], None]) -> tuple[str, dict]:
    """Restore the newest checkpoint that verifies, newest first; returns its URI and the layout
    (world size, strategy, mesh) it was written under.

    Every rank walks the same list in the same order, and a checkpoint is taken only when every
    rank verified and loaded its part: ranks that resumed from different checkpoints would train
    apart, and under sharding would mix shards or wait on each other's collectives.
    """
    for candidate in [latest, *_older_than(latest)]:
        uri = storage.checkpoint_uri(run_dir, candidate)
        layout = None
        with candidate.as_directory() as directory:
            problem = verify(directory, rank)
            if _everywhere(problem is None, device):
                try:
                    layout = load_into(directory, state, rank, device)
                except UserError:
                    raise
                except RuntimeError as e:
                    if _MISFIT.search(str(e)):  # whole and readable, but another model's: no damage to skip
                        raise UserError(f"{uri} does not fit the model: {str(e).splitlines()[0]}") from None
                    problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                except Exception as e:  # weights_only refuses code; a torn file fails to parse
                    problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            else:
                problem = problem or "another rank's part of it is damaged"
        if _everywhere(layout is not None, device):
            return uri, layout
        warn(f"skipping checkpoint {uri}: {problem or 'another rank could not load its part'}")
    raise RuntimeError(f"no usable checkpoint: every checkpoint in {run_dir} is damaged")


def _everywhere(ok: bool, device: torch.device) -> bool:
    """Whether `ok` holds on every rank (alone: whether it holds here)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return ok
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def verify(directory: str, rank: int) -> Optional[str]:
    """None if the checkpoint's files are complete and match their checksums, else what is wrong.
    Every rank checks every shard: at another world size a rank reads from several."""
    shards = [name for name in _listing(directory) if not name.endswith(".sha256")]
    if os.path.isdir(os.path.join(directory, SHARDS)) and f"{SHARDS}/.metadata" not in shards:
        return f"{SHARDS}/.metadata is missing"
    for name in (STATE_FILE, f"rank{rank}.pt", *shards):
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            if name == STATE_FILE:
                return "state.pt is missing"
            continue  # a rank that did not exist when it was written keeps its fresh seed
        try:
            expected = open(path + ".sha256").read().split()[0]
        except (OSError, IndexError):
            return f"{name}.sha256 is missing"
        if _sha256(path) != expected:
            return f"{name} does not match its checksum (partial or corrupted write)"
    return None


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
                   for key, meta in index.items() if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
        loaded = {"model": weights}
        with warnings.catch_warnings():  # DCP's notice that it loads in one process: that is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(loaded, storage_reader=reader, no_dist=True)
    return loaded["model"]


def load_into(directory: str, state: TrainState, rank: int, device: torch.device) -> dict:
    """Restore `state` from a verified local checkpoint directory; returns the layout (world size,
    mesh) it was written under. A sharded checkpoint loads into any mesh, or into a plain model."""
    saved = torch.load(os.path.join(directory, STATE_FILE), map_location="cpu", weights_only=True)
    shards = os.path.join(directory, SHARDS)
    if state.sharded and not os.path.isdir(shards):
        raise UserError("a checkpoint written without sharding cannot be resumed under strategy fsdp or hsdp: "
                        "resume it under the strategy that wrote it, or start a new run")
    state.load_state_dict(saved, shards if os.path.isdir(shards) else None)
    rank_file = os.path.join(directory, f"rank{rank}.pt")
    if os.path.exists(rank_file):  # a rank that did not exist when it was written keeps its fresh seed
        state.load_rank_state_dict(torch.load(rank_file, weights_only=True), device)
    return saved.get("layout", {})


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


def _older_than(latest) -> list:
    """The run's earlier checkpoints, newest first (Ray names them by timestamp), on the latest's
    own filesystem: its path is a path inside that filesystem, not a local path or a URI."""
    from ray.train import Checkpoint

    fs = latest.filesystem
    parent, mine = posixpath.split(latest.path.rstrip("/"))
    names = sorted((info.base_name for info in fs.get_file_info(pafs.FileSelector(parent))
                    if info.type == pafs.FileType.Directory and info.base_name.startswith("checkpoint_")
                    and info.base_name < mine), reverse=True)
    return [Checkpoint(posixpath.join(parent, name), filesystem=fs) for name in names]


def _listing(directory: str) -> list[str]:
    """The files under the checkpoint's shards/ directory, as paths relative to the checkpoint."""
    shards = os.path.join(directory, SHARDS)
    return [f"{SHARDS}/{name}" for name in sorted(os.listdir(shards))] if os.path.isdir(shards) else []


def _write_checksum(path: str) -> None:
    with open(path + ".sha256.tmp", "w") as f:
        f.write(f"{_sha256(path)}  {os.path.basename(path)}\n")
    os.replace(path + ".sha256.tmp", path + ".sha256")


def _write(directory: str, name: str, obj) -> None:
    """torch.save under a temporary name, then rename: a reader never sees half a file."""
    path = os.path.join(directory, name)
    try:
        torch.save(obj, path + ".tmp")
        os.replace(path + ".tmp", path)
        _write_checksum(path)
    except BaseException:  # a full disk, an interrupt: leave the previous file, not a torn one beside it
        for torn in (path + ".tmp", path + ".sha256.tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(torn)
        raise


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
