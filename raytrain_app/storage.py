"""Run directories on any pyarrow filesystem: a local path, s3://, gs:// or hdfs://."""

from __future__ import annotations

import os
import posixpath

import pyarrow as pa
import pyarrow.fs as pafs

from raytrain_app.errors import UserError


def filesystem_for(path: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path inside it."""
    if "://" in path:
        try:
            return pafs.FileSystem.from_uri(path)
        except (pa.ArrowException, ValueError) as e:
            raise UserError(f"cannot open {path}: {e}") from None
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))


def is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def normalize(path: str) -> str:
    """Absolute local paths, URIs unchanged: Ray Train needs one or the other."""
    return path.rstrip("/") if "://" in path else os.path.abspath(os.path.expanduser(path))


def join(base: str, *parts: str) -> str:
    return posixpath.join(base, *parts) if "://" in base else os.path.join(base, *parts)


def exists(path: str) -> bool:
    fs, p = filesystem_for(path)
    return fs.get_file_info(p).type != pafs.FileType.NotFound


def write_text(path: str, text: str) -> None:
    """Write then rename, so a reader never sees half a file (object stores write whole objects anyway)."""
    fs, p = filesystem_for(path)
    fs.create_dir(posixpath.dirname(p), recursive=True)
    tmp = p + ".tmp"
    with fs.open_output_stream(tmp) as f:
        f.write(text.encode())
    fs.move(tmp, p)


def read_text(path: str) -> str:
    fs, p = filesystem_for(path)
    with fs.open_input_stream(p) as f:
        return f.read().decode()


def check_writable(run_dir: str) -> None:
    """Write and delete a marker: a read-only or full volume is reported before any work starts."""
    marker = join(run_dir, ".write-test")
    try:
        existed = exists(run_dir)
        write_text(marker, "ok")
        fs, path = filesystem_for(marker)
        fs.delete_file(path)
        if not existed:  # a run that fails before it starts leaves no empty directory behind
            fs.delete_dir(path.rsplit("/", 1)[0])
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"storage {run_dir} is not writable: {e}") from None
