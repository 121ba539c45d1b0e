"""torch.compile's work kept in the run directory, so that a restarted worker group, a `--resume`
and every worker of the run start from it instead of compiling again.

Why: a compile takes seconds on a CPU and tens of seconds on a GPU, per worker, and a restart
often lands where nothing was compiled before (another node, a fresh container, a SLURM
requeue). Each worker of a run compiles into the run's own Inductor cache directory on its
machine (`TORCHINDUCTOR_CACHE_DIR`): Inductor's graphs, AOTAutograd's, autotuning results, and
the compiled kernels themselves (C++ libraries on CPU, Triton's on GPU, under `triton/`).
Rank 0 archives that directory into the run directory (`layout.COMPILE_CACHE`) after its first
compiled step and again at an epoch's end when more was compiled (the epoch's shorter last
batch, say); a worker that starts unpacks it before its first step, and Inductor then finds
every graph and kernel it needs. Dynamo still traces the model (seconds); nothing is compiled.

Inductor's cache directory is the supported way to carry compiled kernels between machines.
torch's portable cache (`torch.compiler.save_cache_artifacts`) leaves CPU kernels out: a restart
with it still spent the whole compile on the C++ code (10.1 s against 10.4 s cold, here).

The archive's first member names the torch version and the device it was compiled for; a cache
from another torch or device could never be used, so it is skipped with one line. The cache is
an optimisation: one that cannot be read or written is a warning, never a failed run. Nor may it
take the space a checkpoint needs (a checkpoint that fails on a full disk fails the run): on a
local run directory, a checkpoint finding less room than it takes removes the archive first
(`give_way`), and the archive is not written where it would leave less room than the run's
latest checkpoint takes.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import platform
import shutil
import tarfile
import tempfile
from contextlib import suppress
from typing import TYPE_CHECKING, Callable

import torch

from raytrain_app import storage
from raytrain_app.rundir import snapshot
from raytrain_app.rundir.layout import COMPILE_CACHE

if TYPE_CHECKING:
    from raytrain_app.worker.reporter import Reporter

KEY = "raytrain-compile-cache.json"  # the archive's first member: what it was compiled for
SKIPPED = ("locks",)  # Inductor's lock files: this machine's, never carried
SPARE = 1.1  # a checkpoint's room: its size and a tenth, for the index and logs written beside it


def compiled_for(device: torch.device) -> dict:
    """What a cache must have been compiled for to be of use here."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"
    return {"torch": torch.__version__, "device": name}


def compile_counts() -> tuple[int, int]:
    """(graphs Inductor compiled, graphs it took from its cache) so far in this process."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"]


class CompileCache:
    def __init__(self, run_dir: str, rank: int, device: torch.device, report: "Reporter"):
        self.path = storage.join(run_dir, COMPILE_CACHE)
        self.rank, self.key, self.report = rank, compiled_for(device), report
        # The run's own directory on this machine, under the user's TORCHINDUCTOR_CACHE_DIR if set.
        self._before = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
        base = self._before["TORCHINDUCTOR_CACHE_DIR"] or os.path.join(tempfile.gettempdir(),
                                                                      f"torchinductor_{os.getuid()}")
        self.local = os.path.join(base, "runs", hashlib.sha1(storage.normalize(run_dir).encode()).hexdigest()[:16])
        # Triton's kernels in it too: Inductor fixes TRITON_CACHE_DIR at a process's first Triton
        # kernel, so a process that compiled before (a notebook's) would keep them elsewhere.
        self.triton = (os.path.join(self.local, "triton", str(device.index or 0))
                       if device.type == "cuda" and not self._before["TRITON_CACHE_DIR"] else None)
        self.saved: set = set()  # what the run's archive holds
        self.counts = (0, 0)
        self.stepped = False

    def open(self) -> None:
        """Before the first step compiles: Inductor compiles into the run's directory, seeded from
        the run's archive."""
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.local  # Inductor reads it at every lookup
        if self.triton:
            os.environ["TRITON_CACHE_DIR"] = self.triton
        os.makedirs(self.local, exist_ok=True)
        self.saved = self._unpack()
        self.counts = compile_counts()  # this process's so far: a notebook's worker may have compiled before
        # A C++ compile on a machine without CUDA warns on the console that torch found no CUDA
        # runtime: true, and nothing a CPU run needs.
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

    def close(self) -> None:
        for key, value in self._before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def _unpack(self) -> set:
        """The archive's files into the run's directory here; returns their names (none when
        there is no archive, or it is of no use here)."""
        try:
            if not storage.exists(self.path):
                return set()
            with tarfile.open(fileobj=io.BytesIO(storage.read_bytes(self.path))) as tar:
                key = json.load(tar.extractfile(tar.next()))
                if key != self.key:
                    self.report.warn(f"compile cache ignored: compiled by torch {key.get('torch')} for "
                                     f"{key.get('device')}, and this worker runs torch {self.key['torch']} on "
                                     f"{self.key['device']}")
                    return set()
                files = [m for m in tar.getmembers()[1:] if m.isfile()]
                # Unpacked aside, then each file renamed into place: the run's other workers on this
                # machine unpack the same files at the same time, and none may read half of one.
                with tempfile.TemporaryDirectory(dir=os.path.dirname(self.local)) as aside:
                    tar.extractall(aside, files, filter="data")
                    for m in files:
                        os.makedirs(os.path.dirname(os.path.join(self.local, m.name)), exist_ok=True)
                        os.replace(os.path.join(aside, m.name), os.path.join(self.local, m.name))
        except Exception as e:  # noqa: BLE001 - an unreadable cache costs a compile, never the run
            self.report.warn(f"compile cache {self.path} not read ({storage.explain(e)}): compiling from scratch")
            return set()
        if self.rank == 0:
            self.report.say(f"compile cache: {len(files)} compiled files from {self.path}")
        return {m.name for m in files}

    def after_step(self) -> None:
        """After this process's first step, which compiled the step: what was compiled, and saved."""
        if self.stepped:
            return
        self.stepped = True
        compiled, cached = (now - before for now, before in zip(compile_counts(), self.counts))
        self.report.info("first step: Inductor compiled %d graphs and took %d from its cache", compiled, cached)
        self.save()

    def save(self) -> None:
        """Rank 0's: the run's Inductor directory, when it holds files the archive does not."""
        if self.rank != 0:
            return
        files = self._files()
        if files <= self.saved:
            return
        try:
            buffer = io.BytesIO()
            with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
                key = json.dumps(self.key).encode()
                info = tarfile.TarInfo(KEY)
                info.size = len(key)
                tar.addfile(info, io.BytesIO(key))
                for name in sorted(files):
                    try:
                        tar.add(os.path.join(self.local, name), name, recursive=False)
                    except FileNotFoundError:  # a compiler's temporary file, renamed since the listing
                        files.discard(name)
            archive = buffer.getvalue()
            short = _short_of_room(self.path, len(archive) - _bytes_on_disk(self.path))
            if short:
                self.report.warn(f"compile cache not written to {self.path}: {short}")
                return
            storage.write_bytes(self.path, archive)
        except Exception as e:  # noqa: BLE001 - the cache is an optimisation: the run goes on
            self.report.warn(f"compile cache not written to {self.path} ({storage.explain(e)}); the run goes on")
            return
        self.saved = files

    def _files(self) -> set:
        """The run's Inductor files, as paths relative to its directory."""
        found = set()
        for folder, dirs, names in os.walk(self.local):
            dirs[:] = [d for d in dirs if d not in SKIPPED]
            found.update(os.path.relpath(os.path.join(folder, n), self.local) for n in names)
        return found


def give_way(run_dir: str, staged: str, warn: Callable[[str], None]) -> None:
    """Before rank 0 writes the checkpoint staged in `staged`: where the run directory's disk has
    less room than the checkpoint takes (the run's latest, or for its first what rank 0 staged),
    the run's archive goes, with a warning. Local run directories only: a store's space is not
    the disk's."""
    path = storage.join(run_dir, COMPILE_CACHE)
    if "://" in run_dir or not os.path.exists(path):
        return
    try:
        short = _short_of_room(path, 0, _bytes_on_disk(staged))
        if short:
            os.unlink(path)
            warn(f"compile cache {path} removed, {short}: a restart compiles again")
    except Exception as e:  # noqa: BLE001 - never why a checkpoint fails: the write says what is wrong
        warn(f"compile cache {path}: its room was not checked ({storage.explain(e)})")


def _short_of_room(path: str, growth: int, checkpoint: int = 0) -> str:
    """Why the disk of the run directory holding `path` has too little room for its next
    checkpoint (the larger of `checkpoint` and the run's latest, and a tenth) once `growth`
    more bytes are written; "" where it has room, or is not a local disk."""
    run_dir = os.path.dirname(path)
    if "://" in run_dir:
        return ""
    latest = snapshot.latest(run_dir)
    needed = SPARE * max(checkpoint, _bytes_on_disk(latest) if latest else 0)
    free = shutil.disk_usage(run_dir).free - growth
    if free >= needed:
        return ""
    return (f"the next checkpoint needs its space ({free / 2**20:.1f} MB free, a checkpoint takes "
            f"{needed / 2**20:.1f} MB)")


def _bytes_on_disk(path: str) -> int:
    """What a file, or a directory's files, take on disk (0 for none)."""
    files = [path] if os.path.isfile(path) else [os.path.join(folder, name) for folder, _, names in os.walk(path)
                                                 for name in names]
    total = 0
    for file in files:
        with suppress(FileNotFoundError):  # a checkpoint being pruned meanwhile
            total += os.stat(file).st_blocks * 512
    return total
