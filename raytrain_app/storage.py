"""Run directories on any pyarrow filesystem: a local path, s3://, gs:// or hdfs://."""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import tempfile
from typing import Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from raytrain_app.errors import UserError, last_line


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


def parent(path: str) -> str:
    """The directory holding `path` (a local path or URI)."""
    return posixpath.dirname(path.rstrip("/")) if "://" in path else os.path.dirname(os.path.abspath(path))


def remove(path: str) -> None:
    """Delete the file or directory `path` (and what it holds), if it exists."""
    fs, p = filesystem_for(path)
    kind = fs.get_file_info(p).type
    if kind == pafs.FileType.File:
        fs.delete_file(p)
    elif kind != pafs.FileType.NotFound:
        fs.delete_dir(p)


def join(base: str, *parts: str) -> str:
    return posixpath.join(base, *parts) if "://" in base else os.path.join(base, *parts)


def exists(path: str) -> bool:
    return _type(path) != pafs.FileType.NotFound


def is_file(path: str) -> bool:
    return _type(path) == pafs.FileType.File


def _type(path: str) -> pafs.FileType:
    fs, p = filesystem_for(path)
    try:
        return fs.get_file_info(p).type
    except (OSError, pa.ArrowException) as e:  # an object store refusing us: credentials, endpoint
        raise UserError(f"cannot read {path}: {explain(e)}") from None


def subdirectories(path: str) -> list[str]:
    """Names of the directories directly under `path` (none when it does not exist)."""
    fs, p = filesystem_for(path)
    try:
        infos = fs.get_file_info(pafs.FileSelector(p, allow_not_found=True))
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"cannot list {path}: {explain(e)}") from None
    return sorted(info.base_name for info in infos if info.type == pafs.FileType.Directory)


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode())


def write_bytes(path: str, data: bytes) -> None:
    """A file written whole or not at all: locally, written then renamed, so a reader never sees
    half of it; an object store writes whole objects anyway (and its rename is a copy)."""
    fs, p = filesystem_for(path)
    fs.create_dir(posixpath.dirname(p), recursive=True)
    tmp = p + ".tmp" if is_local(path) else p
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    if tmp != p:
        fs.move(tmp, p)


def read_bytes(path: str) -> bytes:
    fs, p = filesystem_for(path)
    with fs.open_input_stream(p) as f:
        return f.read()


def read_text(path: str) -> str:
    return read_bytes(path).decode()


def upload(local_path: str, path: str) -> None:
    """Copy a local file or directory to `path` (a local path or URI)."""
    fs, p = filesystem_for(path)
    fs.create_dir(p if os.path.isdir(local_path) else posixpath.dirname(p), recursive=True)
    pafs.copy_files(local_path, p, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def download(path: str, local_path: str) -> None:
    """Copy a file or directory at `path` (a local path or URI) to a local path."""
    fs, p = filesystem_for(path)
    if fs.get_file_info(p).type == pafs.FileType.Directory:
        os.makedirs(local_path, exist_ok=True)
    pafs.copy_files(p, local_path, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
    """`path` itself when local, else a temporary local copy of it (removed afterwards), for
    readers that take only local paths."""
    if is_local(path):
        yield path
        return
    with tempfile.TemporaryDirectory() as directory:
        local = os.path.join(directory, posixpath.basename(path.rstrip("/")))
        download(path, local)
        yield local


def checkpoint_uri(run_dir: str, checkpoint) -> str:
    """Where a Ray checkpoint is, for the user and for `storage` calls.

    Ray hands a checkpoint back as (filesystem, path inside it): on S3 `bucket/runs/x/checkpoint_...`,
    which is no path on this machine. Ray Train keeps checkpoints directly in the run directory,
    so the run directory's own URI names them.
    """
    return join(run_dir, posixpath.basename(checkpoint.path.rstrip("/")))


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
        raise UserError(f"storage {run_dir} is not writable: {explain(e)}") from None


_AWS_ERROR = re.compile(r"AWS Error (\w+) during \w+ operation: ?(.*?)(?: \(Request ID: [^)]*\))?\s*$", re.S)
_REFUSED = {"ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "EXPIRED_TOKEN"}


def explain(e: BaseException) -> str:
    """An object store's error in a few words: the AWS error code and its message, not the
    SDK's request ids; refused credentials say where credentials come from.

    pyarrow and boto3 (the lease) name one refusal differently; both read the same here."""
    error = getattr(e, "response", None)
    if isinstance(error, dict) and isinstance(error.get("Error"), dict):  # botocore's ClientError
        code = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", str(error["Error"].get("Code", ""))).upper()
        detail = str(error["Error"].get("Message", "")).strip().rstrip(".")
        if code == "NO_SUCH_BUCKET":
            return f"Bucket '{error['Error'].get('BucketName', '')}' not found"
        if code in _REFUSED:  # a wrong secret and an unknown key are one refusal to the user
            code = "ACCESS_DENIED"
    else:
        found = _AWS_ERROR.search(str(e))
        if not found:  # a local file's error: the system's words, which pyarrow wraps with a temp file's name
            return os.strerror(e.errno) if isinstance(e, OSError) and e.errno else last_line(e)
        code, detail = found.group(1), found.group(2).strip().rstrip(".")
    text = code + (f": {detail}" if detail and detail != "No response body" else "")
    if code in _REFUSED:
        text += (" (check the credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY here, and the profile's "
                 "runtime_env.env_vars for jobs)")
    return text
