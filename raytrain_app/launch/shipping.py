"""What a submitted job takes to the cluster, checked on this machine before anything is sent.

A job runs its builders on other machines. Code and data reach them in the profile's
`runtime_env.working_dir`, which Ray zips and uploads (minus `excludes`, `.gitignore` and
`.rayignore`), or must already be installed there. Two mistakes are cheap to catch here and
expensive there: a module that imports only from this machine, and an upload too large to send.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
from typing import Optional

import pathspec

from raytrain_app.config import JobConfig
from raytrain_app.errors import UserError

IGNORE_FILES = (".gitignore", ".rayignore")


def upload_bytes(root: str, excludes: list[str]) -> int:
    """Bytes of the files Ray would upload from `root`: all but what `excludes` and the root's
    .gitignore/.rayignore match (gitignore syntax, as Ray reads them)."""
    lines = list(excludes)
    for name in IGNORE_FILES:
        if os.path.isfile(os.path.join(root, name)):
            with open(os.path.join(root, name)) as f:
                lines += f.read().splitlines()
    ignored = pathspec.PathSpec.from_lines("gitwildmatch", lines)
    total = 0
    for folder, dirs, files in os.walk(root):
        relative = os.path.relpath(folder, root)
        dirs[:] = [d for d in dirs if not ignored.match_file(os.path.join(relative, d) + "/")]
        total += sum(os.path.getsize(os.path.join(folder, f)) for f in files
                     if not ignored.match_file(os.path.normpath(os.path.join(relative, f)))
                     and os.path.isfile(os.path.join(folder, f)))
    return total


def check_upload_size(root: str, excludes: list[str], limit_mb: float, profile_source: str) -> None:
    size = upload_bytes(root, excludes)
    if size > limit_mb * 2**20:
        raise UserError(f"{profile_source}: runtime_env.working_dir {root} holds {size / 2**20:.1f} MiB to upload, "
                        f"over runtime_env.max_upload_mb ({limit_mb:g}): add large files to runtime_env.excludes "
                        f"or a .rayignore")


def unshipped_imports(config: JobConfig, working_dir: Optional[str], profile_source: str) -> list[str]:
    """Builders named by import path whose module imports here from a folder the job does not
    upload: the job would fail on the cluster with "cannot import". Installed packages are
    assumed to be installed there too (or listed in runtime_env.pip)."""
    installed = {os.path.realpath(p) for p in sysconfig.get_paths().values()} | {
        os.path.realpath(p) for p in sys.path if "site-packages" in p or "dist-packages" in p}
    found = []
    for key, name in (("model.name", config.model.name), ("data.name", config.data.name)):
        module = name.partition(":")[0].split(".")[0] if ":" in name else None
        try:
            spec = importlib.util.find_spec(module) if module else None
        except (ImportError, ValueError):
            spec = None  # not importable here either: the builder check says so
        if spec is None or not spec.origin or not os.path.isabs(spec.origin):
            continue
        where = os.path.dirname(os.path.realpath(spec.origin))
        if spec.submodule_search_locations:  # a package: its folder's parent is what must be uploaded
            where = os.path.dirname(where)
        if any(_inside(where, root) for root in installed) or (
                working_dir and _inside(where, os.path.realpath(working_dir))):
            continue
        found.append(f"{key} '{name}' imports {module} from {where}, which the job does not upload: set "
                     f"runtime_env.working_dir in {profile_source} to a folder that holds it (or install it "
                     f"on the cluster)")
    return found


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root
