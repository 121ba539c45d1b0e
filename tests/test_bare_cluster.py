"""Jobs on a Ray cluster that has never seen raytrain-app (tests/barecluster.py): a real `ray start`
from a second virtual environment with Ray, torch, torchvision and pyarrow only, token auth on.

Every other cluster the tests start runs this checkout's own Python, which has raytrain-app
installed; this one is what users have: Ray's image, and raytrain-app only as the job brings it.
"""

import dataclasses
import json
import os
import re
import shutil
import tempfile
import time

import pytest
import yaml

from raytrain_app.errors import UserError
from raytrain_app.launch import versions
from raytrain_app.launch.versions import Versions
from tests import barecluster
from tests.commands import command
from tests.conftest import REPO

EPOCH_LINE = re.compile(r"^epoch +1/1 \| train_loss", re.M)
# The first test may wait for the cluster's environment to be built (conftest starts it early).
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bare")
    cluster = barecluster.start(barecluster.bare_venv(), folder)
    yield cluster
    cluster.stop()


def profile(cluster, folder, **fields) -> str:
    path = folder / "profile.yaml"
    path.write_text(yaml.safe_dump({"name": "bare", "address": cluster.address, "nodes": 1, "cpus_per_node": 2,
                                    "storage": str(folder / "runs"), "auth": {"token_file": str(cluster.token_file)},
                                    **fields}))
    return str(path)


def submit(*args, env=None, timeout=300):
    return command(["submit", *args], REPO, env, timeout)


def epochs_in(run_dir: str) -> list[int]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [row["epoch"] for row in map(json.loads, f) if "epoch" in row]


def test_a_job_brings_raytrain_app_to_a_cluster_that_never_saw_it(bare, tmp_path):
    proc = submit("examples/digits.yaml", "--cluster", profile(bare, tmp_path), "--workers-per-node", "2",
                  "--set", "train.epochs=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert EPOCH_LINE.search(proc.stdout) and "succeeded" in proc.stdout
    assert "raytrain-app" not in proc.stderr  # nothing installed there to replace
    [run_dir] = [str(p) for p in (tmp_path / "runs").iterdir() if p.name.startswith("digits-")]
    assert epochs_in(run_dir) == [1]
    # No matplotlib there (a compiled package the job does not bring): the curves are drawn later.
    assert f"draw it later where matplotlib is: raytrain-app report {run_dir}" in proc.stdout


def test_a_torchrun_style_script_importing_raytrain_app_runs_there(bare, tmp_path):
    proc = submit("examples/torchrun_script/train.py", "--cluster", profile(bare, tmp_path), "--workers-per-node",
                  "2", "--", "--epochs", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert "succeeded" in proc.stdout and re.search(r"^epoch 0: train_loss [\d.]+ accuracy [\d.]+$", proc.stdout, re.M)


def test_another_raytrain_app_installed_there_is_replaced_by_the_jobs_own_and_said(bare, tmp_path):
    """An old raytrain-app in the cluster's image: the job runs the one it brings (the installed one
    would fail at import), and `submit` says so before sending it."""
    runtime = tempfile.mkdtemp(prefix="rt-", dir="/tmp")  # a fresh cache of clusters' versions: the image changed
    try:
        with barecluster.old_raytrain_app(bare.venv):
            proc = submit("examples/digits.yaml", "--cluster", profile(bare, tmp_path), "--workers-per-node", "2",
                          "--set", "train.epochs=1", env={**os.environ, "XDG_RUNTIME_DIR": runtime})
    finally:
        shutil.rmtree(runtime)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert (f"warning: the cluster at {bare.address} has raytrain-app 0.0.1 installed; the job brings raytrain-app "
            "0.1.0 from this machine and runs it instead\n") in proc.stderr
    assert EPOCH_LINE.search(proc.stdout)


def test_the_cluster_is_asked_its_versions_and_a_mismatch_is_one_line_each(bare):
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(bare.address, headers=bare.headers)
    there = versions.probe(client, bare.address, f"test-{time.time()}")
    here = Versions.here()
    assert there.python == here.python  # the same interpreter built the venv
    assert there.packages == {**here.packages, "raytrain-app": None}  # psutil found as Ray vendors it
    versions.check(here, there, "the cluster")  # nothing to refuse
    older = dataclasses.replace(there, python="3.99.1", packages={**there.packages, "ray": "2.59.0",
                                                                   "pydantic": "1.10.2", "torch": None})
    with pytest.raises(UserError) as refused:
        versions.check(here, older, "the cluster at X")
    assert refused.value.lines == [
        f"the cluster at X runs Python 3.99.1 and this machine Python {here.python}: submit from a Python 3.99 "
        "environment (the job runs the submitting machine's raytrain-app code there)",
        f"the cluster at X runs Ray 2.59.0 and this machine Ray {here.packages['ray']}: use the same Ray on both "
        "(pip install 'ray[default,train]==2.59.0' where the job is submitted)",
        f"the cluster at X has no torch, and raytrain-app needs {declared('torch')}: install it in the cluster's "
        "image or environment (jobs bring only pure-Python packages)",
        f"the cluster at X has pydantic 1.10.2, and raytrain-app needs {declared('pydantic')}: install it in the "
        "cluster's image or environment (jobs bring only pure-Python packages)"]


def declared(name: str) -> str:
    """What pyproject.toml's dependencies say of `name`, as written there (e.g. "torch>=2.6")."""
    return re.search(rf'^\s*"({name}[<>=!~][^"]*)"', open(os.path.join(REPO, "pyproject.toml")).read(), re.M).group(1)


def test_a_rayjobs_runtime_env_runs_its_entrypoint_on_the_bare_cluster(bare, tmp_path):
    """What `k8s render` writes, run by Ray as KubeRay's submitter would: the entrypoint, with the
    runtime env that names raytrain-app's zip in the profile's storage (a path here: file://)."""
    from ray.job_submission import JobSubmissionClient

    fields = yaml.safe_load(open(os.path.join(REPO, "cluster/kuberay.yaml")))
    (tmp_path / "k.yaml").write_text(yaml.safe_dump({**fields, "storage": str(tmp_path / "runs"), "nodes": 1,
                                                     "gpus_per_node": 0, "cpus_per_node": 2}))
    proc = command(["k8s", "render", "examples/digits.yaml", "--cluster", str(tmp_path / "k.yaml"),
                    "--workers-per-node", "2", "--set", "train.epochs=1"], REPO, None, 60)
    assert proc.returncode == 0, proc.stderr
    spec = yaml.safe_load(proc.stdout)["spec"]
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert runtime_env["py_modules"][0].startswith(f"file://{tmp_path / 'runs' / '_packages'}/raytrain-app-")
    client = JobSubmissionClient(bare.address, headers=bare.headers)
    client.submit_job(entrypoint=spec["entrypoint"], runtime_env=runtime_env, submission_id=spec["jobId"])
    deadline = time.monotonic() + 240
    while (status := str(client.get_job_status(spec["jobId"]).value)) not in ("SUCCEEDED", "FAILED", "STOPPED"):
        assert time.monotonic() < deadline, client.get_job_logs(spec["jobId"])[-3000:]
        time.sleep(1)
    logs = client.get_job_logs(spec["jobId"])
    assert status == "SUCCEEDED", logs[-3000:]
    assert EPOCH_LINE.search(logs)
    assert epochs_in(str(tmp_path / "runs" / spec["jobId"])) == [1]
