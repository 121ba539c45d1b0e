"""Checkpoint files: written safely, verified, and restored newest-good-first.

Rank 0 writes the state every rank shares (`state.pt`); every rank writes what it alone holds
(`rank{N}.pt`); see `state.py` for what is in them. Ray Train merges the ranks' files into one
checkpoint directory on the run's storage and keeps the best K (in local mode, `commit` does).

Under FSDP/HSDP no rank holds the whole model, so the weights and optimizer state go instead
into `shards/` through `torch.distributed.checkpoint` (DCP): each rank writes its own shards
(`__RANK_0.distcp`) and rank 0 the index (`.metadata`). DCP reads them back into any mesh, so a
run resumes at another world size, and `load_state` consolidates them on one process's CPU.

Safety: each file is written under a temporary name and renamed, with a `.sha256` beside it, so
a partial or corrupted checkpoint is detected on restore and skipped in favour of the previous
good one. Everything is loaded with `weights_only=True`, so a checkpoint cannot run code.

`save` writes at once. A `Snapshot` (`checkpoint.async`) is the same checkpoint taken in two
parts: a copy of the state in host memory, taken between two steps, and the files written from
that copy later, by another thread, while training goes on (see `after_step.Background`).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import posixpath
import re
import sys
from concurrent.futures import Future
from typing import Callable, Optional

import pyarrow.fs as pafs
import torch

from raytrain_app import rundir, storage
from raytrain_app.config.sections import CheckpointConfig
from raytrain_app.errors import UserError
from raytrain_app.rundir import snapshot
from raytrain_app.rundir.layout import SHARDS, STATE_FILE
from raytrain_app.worker.state import TrainState

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
    _write_parts(directory, rank, _parts(rank, state, about), _position(state))


class Snapshot:
    """A checkpoint of `state` at the step the loop is at, whose files are written later, from
    another thread, while the loop trains on (`checkpoint.async`).

    Taking it copies everything `save` writes into host memory with `stager` (a
    `torch.distributed.checkpoint.staging.DefaultStager`, whose buffers the next snapshot reuses):
    a deep copy, so the steps that follow cannot change what is written, and the checkpoint is
    bitwise the one `save` would have written at this step. Sharded weights and optimizer state
    go through DCP's own `async_save`, which copies them the same way and writes them on a
    thread of its own, its collectives on `group` (a Gloo group apart from the loop's: two
    threads' collectives on one group could interleave differently on each rank)."""

    def __init__(self, directory: str, rank: int, state: TrainState, about: dict, stager, group=None):
        self.directory, self.rank, self.step, self.position = directory, rank, state.step, _position(state)
        self.parts = stager.stage(_parts(rank, state, about))
        self.shards: Optional[Future] = None
        if state.sharded:
            import torch.distributed.checkpoint as dcp

            self.shards = dcp.async_save(state.sharded_state_dict(), checkpoint_id=os.path.join(directory, SHARDS),
                                         process_group=group, async_stager=stager)

    def write(self) -> None:
        """The files, from the copy: what `save` writes, into `directory`."""
        if self.shards:
            self.shards.result()
        _write_parts(self.directory, self.rank, self.parts, self.position)


def _parts(rank: int, state: TrainState, about: dict) -> dict:
    """The files besides DCP's shards, by name: rank 0's shared state, and this rank's own."""
    shared = {STATE_FILE: {**state.state_dict(), **about}} if rank == 0 else {}
    return {**shared, f"rank{rank}.pt": state.rank_state_dict()}


def _position(state: TrainState) -> tuple[int, int, int]:
    return state.epoch, state.step, state.batch


def _write_parts(directory: str, rank: int, parts: dict, position: tuple[int, int, int]) -> None:
    for name in _listing(directory):  # this rank's shards (its own directory); checksums as for the others
        _write_checksum(os.path.join(directory, name))
    for name, obj in parts.items():
        _write(directory, name, obj)
    if rank == 0:  # where in training it was taken, readable without torch: which checkpoint is best needs only this
        rundir.write_position(directory, *position)


def commit(staged: str, run_dir: str, rank: int, metrics: dict, c: CheckpointConfig, device: torch.device,
           group=None) -> None:
    """Local mode's part of what Ray Train does with a reported checkpoint: every rank copies its
    staged files into one new directory of the run (named, as Ray names them, by rank 0's clock),
    and once all have, rank 0 indexes it and drops the worst past `checkpoint.keep`. Until then
    the run's latest checkpoint is the one before: a rank killed mid-copy leaves an unindexed
    directory, which `rundir.remove_partial` clears. The collectives go over `group` (default:
    the loop's), on `device`."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    name = [_new_name()]
    if distributed:
        dist.broadcast_object_list(name, src=0, group=group, device=device if device.type == "cuda" else None)
    failed: Optional[OSError] = None
    try:
        storage.upload(staged, storage.join(run_dir, name[0]))
    except OSError as e:
        failed = e  # said after the vote: the other ranks learn that the checkpoint is not whole, and go on
    if _everywhere(failed is None, device, group) and rank == 0:
        snapshot.add(run_dir, name[0], metrics, c.metric, c.mode, c.keep)
    if failed:
        raise failed


def commit_files(staged: dict[int, str], run_dir: str, metrics: dict, c: CheckpointConfig) -> dict[int, OSError]:
    """`commit` for ranks that one process serves (local mode's script ranks, `driver/scripts.py`):
    each rank's staged files into one new directory of the run, indexed once all are in; returns
    the ranks whose files could not be written (then it is not indexed, as under `commit`)."""
    name = _new_name()
    failed = {}
    for rank, path in sorted(staged.items()):
        try:
            storage.upload(path, storage.join(run_dir, name))
        except OSError as e:
            failed[rank] = e
    if not failed:
        snapshot.add(run_dir, name, metrics, c.metric, c.mode, c.keep)
    return failed


def _new_name() -> str:
    """A new checkpoint directory's name, as Ray Train names them."""
    return datetime.datetime.now().strftime("checkpoint_%Y-%m-%d_%H-%M-%S.%f")


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


def _everywhere(ok: bool, device: torch.device, group=None) -> bool:
    """Whether `ok` holds on every rank of `group` (alone: whether it holds here)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return ok
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
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
        problem = _checksum_problem(directory, name)
        if problem:
            return problem
    return None


def _checksum_problem(directory: str, name: str) -> Optional[str]:
    path = os.path.join(directory, name)
    try:
        expected = open(path + ".sha256").read().split()[0]
    except (OSError, IndexError):
        return f"{name}.sha256 is missing"
    if _sha256(path) != expected:
        return f"{name} does not match its checksum (partial or corrupted write)"
    return None


def load_into(directory: str, state: TrainState, rank: int, device: torch.device) -> dict:
    """Restore `state` from a verified local checkpoint directory; returns the layout (world size,
    mesh) it was written under. A sharded checkpoint loads into any mesh, or into a plain model;
    an unsharded one into a sharded model too (each rank keeps its shards of the full state)."""
    saved = torch.load(os.path.join(directory, STATE_FILE), map_location="cpu", weights_only=True)
    shards = os.path.join(directory, SHARDS)
    state.load_state_dict(saved, shards if os.path.isdir(shards) else None)
    # A smaller world than the checkpoint's: rank r also carries on the parts of the ranks gone,
    # r + W, r + 2W, ... (a larger one: its new ranks have no part and keep their fresh seed).
    world = _world_size()
    then = saved.get("layout", {}).get("world_size", world)
    gone = [_rank_part(directory, r, verified=False) for r in range(rank + world, then, world)]
    state.load_rank_state_dict(_rank_part(directory, rank, verified=True), device, [g for g in gone if g])
    return saved.get("layout", {})


def _rank_part(directory: str, rank: int, verified: bool) -> Optional[dict]:
    """`rank{rank}.pt`, or None if that rank did not exist; `verify` has checked this rank's own,
    and another rank's is checked against its checksum here."""
    path = os.path.join(directory, f"rank{rank}.pt")
    if not os.path.exists(path):
        return None
    problem = None if verified else _checksum_problem(directory, f"rank{rank}.pt")
    if problem:
        raise ValueError(problem)
    return torch.load(path, weights_only=True)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


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
