"""What a submitted job brings to the cluster: raytrain-app itself, and the pure-Python packages it
needs beyond what a Ray cluster has.

A real cluster's nodes run an image with Ray, torch, torchvision and pyarrow (Ray's own images)
and have never seen raytrain-app; nor is it on any package index. So every job carries the code
this machine runs, as Ray's `py_modules`: Ray uploads each folder once (content-addressed) and
unpacks it on every node that runs a piece of the job, nodes that join later included. Its
dependencies are carried too, from this machine's own installation, when they are pure Python
(`py3-none-any` wheels, which run anywhere the same Python runs) and Ray's own requirements do
not already bring them. The compiled ones are Ray's (numpy, pydantic-core, pyarrow, ...), or
Ray's own vendored copy (psutil, in `ray/thirdparty_files`: `cli/job_entry.py` imports Ray first).
Nothing is fetched from an index, so a cluster without index access works too.

Two ways to the nodes, one content: a Jobs API submission names the folders (`py_modules`) and
Ray uploads them; a RayJob names one zip in the profile's storage (`archive`), which Ray fetches
on every pod. (A SLURM job runs from a shared filesystem, in the environment its profile's
`slurm.setup` activates, where raytrain-app is installed from a checkout or a wheel.)
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.metadata as metadata
import io
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import pyarrow as pa
from packaging.markers import default_environment
from packaging.requirements import Requirement

from raytrain_app import storage
from raytrain_app.errors import UserError

PROJECT = "raytrain-app"
# What every node is taken to have: Ray with its Jobs API and Ray Train, and the ML libraries
# Ray's images carry. Their requirements are never carried (compiled ones could not be).
CLUSTER_HAS = ("ray[default,train]", "torch", "torchvision", "pyarrow")
SKIPPED = ("__pycache__", "*.pyc")  # never uploaded: Python rebuilds them on the node
FOLDER = "_packages"  # in a profile's storage: the bundles RayJobs fetch


@dataclass(frozen=True)
class Carried:
    """One distribution a job brings: its import roots (package folders or module files) and its
    .dist-info folder (so `importlib.metadata` on the node sees the version the job runs)."""

    name: str
    version: str
    paths: tuple[str, ...]


def _key(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def requirement_closure(roots: Iterable[str]) -> dict[str, metadata.Distribution]:
    """Every installed distribution that `roots` need, by normalized name, with the extras asked
    for on the way (`ray[default,train]`)."""
    found: dict[str, metadata.Distribution] = {}
    extras: dict[str, set[str]] = {}
    todo = [Requirement(root) for root in roots]
    while todo:
        requirement = todo.pop()
        key = _key(requirement.name)
        if key in found and set(requirement.extras) <= extras[key]:
            continue
        try:
            found[key] = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            continue  # an optional platform dependency not installed here
        extras[key] = extras.get(key, set()) | set(requirement.extras)
        todo += [Requirement(r) for r in found[key].requires or () if _applies(Requirement(r), extras[key])]
    return found


def _applies(requirement: Requirement, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    environment = default_environment()
    return any(requirement.marker.evaluate({**environment, "extra": extra}) for extra in {"", *extras})


def _pure(dist: metadata.Distribution) -> bool:
    """A `py3-none-any` wheel: the same files on any platform."""
    tags = [line.split(":", 1)[1].strip() for line in (dist.read_text("WHEEL") or "").splitlines()
            if line.startswith("Tag:")]
    return bool(tags) and all(tag.endswith("-none-any") for tag in tags)


def _roots(dist: metadata.Distribution) -> tuple[str, ...]:
    """The folders and module files a distribution installed at the top of site-packages, and its
    .dist-info folder."""
    tops = {file.parts[0] for file in dist.files or () if len(file.parts) > 1 or file.suffix == ".py"}
    tops -= {"..", "__pycache__"}
    return tuple(sorted(str(dist.locate_file(top)) for top in tops
                        if not top.endswith(".data") and os.path.exists(dist.locate_file(top))))


@functools.cache
def carried() -> tuple[Carried, ...]:
    """raytrain-app (from wherever this process imports it: a checkout in development, else
    site-packages), then each pure-Python distribution it needs that the cluster's Ray does not."""
    version = metadata.version(PROJECT)
    items = [Carried(PROJECT, version, (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                        _dist_info(version)))]
    cluster = requirement_closure(CLUSTER_HAS)
    for key, dist in sorted(requirement_closure([PROJECT]).items()):
        if key != PROJECT and key not in cluster and _pure(dist):
            items.append(Carried(dist.metadata["Name"], dist.version, _roots(dist)))
    return tuple(items)


def _dist_info(version: str) -> str:
    """A .dist-info folder naming this version, written for the job: a checkout in development
    has an .egg-info instead, and an installed one lists files of this machine."""
    folder = Path(tempfile.mkdtemp(prefix="raytrain-app-job-")) / f"raytrain_app-{version}.dist-info"
    folder.mkdir()
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PROJECT}\nVersion: {version}\n")
    atexit.register(shutil.rmtree, folder.parent, True)
    return str(folder)


def not_carried() -> list[Requirement]:
    """raytrain-app's own requirements that the cluster must have: what the job does not bring."""
    brought = {_key(c.name) for c in carried()}
    return [r for r in map(Requirement, metadata.distribution(PROJECT).requires or ())
            if _applies(r, set()) and _key(r.name) not in brought]


def describe() -> str:
    """What a job brings, for `submit --dry-run` and the docs (how-to/ray-clusters.md)."""
    return ", ".join(f"{c.name} {c.version}" for c in carried())


def py_modules() -> list[str]:
    """The folders and files Ray's `py_modules` uploads (each cached on the cluster by content)."""
    return [path for c in carried() for path in c.paths]


def _files() -> Iterator[tuple[str, str]]:
    """(path inside the bundle, path here) for every file a job brings, in a fixed order."""
    for root in py_modules():
        base = os.path.dirname(root)
        if os.path.isfile(root):
            yield os.path.relpath(root, base), root
            continue
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if not name.endswith(".pyc"):
                    path = os.path.join(folder, name)
                    yield os.path.relpath(path, base), path


@functools.cache
def bundle_name() -> str:
    """raytrain-app-VERSION-HASH: the hash of every file's path and bytes, so a changed file
    (a checkout in development) is a new bundle and an unchanged one is never sent twice."""
    digest = hashlib.sha256()
    for inside, path in _files():
        digest.update(inside.encode() + b"\0" + Path(path).read_bytes() + b"\0")
    return f"{PROJECT}-{carried()[0].version}-{digest.hexdigest()[:16]}"


def archive(folder: str) -> str:
    """The bundle as one zip in `folder` (a path or URI), written unless it is there already; its
    URI. The zip holds one top folder, which Ray drops when it unpacks a remote package, so the
    packages land at the top of the folder it puts on PYTHONPATH."""
    uri = storage.join(folder, f"{bundle_name()}.zip")
    if "://" not in uri:
        uri = "file://" + os.path.abspath(os.path.expanduser(uri))
    try:
        if not storage.exists(uri):
            storage.write_bytes(uri, _zipped())
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"cannot upload raytrain-app to {uri}: {storage.explain(e)}") from None
    return uri


def _zipped() -> bytes:
    data = io.BytesIO()
    with zipfile.ZipFile(data, "w", zipfile.ZIP_DEFLATED) as z:
        for inside, path in _files():
            info = zipfile.ZipInfo(f"{bundle_name()}/{inside}", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (os.stat(path).st_mode & 0o777) << 16
            z.writestr(info, Path(path).read_bytes(), zipfile.ZIP_DEFLATED)
    return data.getvalue()
