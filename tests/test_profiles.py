"""The shipped cluster profiles parse, and turn cluster shapes into the right worker layout."""

import glob
import json
import os
import re

import jsonschema
import pytest
import ray
import yaml

import raytrain_app
from raytrain_app.cluster.localnodes import cluster_down, cluster_up
from raytrain_app.cluster.profiles import load_profile
from raytrain_app.config import load_config
from raytrain_app.errors import UserError
from raytrain_app.launch.submission import plan_submission

SHIPPED = sorted(glob.glob("cluster/*.yaml"))
# Ray's own schema for cluster-launcher files, shipped with Ray.
with open(os.path.join(os.path.dirname(ray.__file__), "autoscaler", "ray-schema.json")) as _f:
    RAY_LAUNCHER_SCHEMA = json.load(_f)


def test_all_profiles_ship():
    assert [p.split("/")[-1] for p in SHIPPED] == ["aws-gpu.yaml", "kuberay.yaml", "local-2node.yaml", "local.yaml",
                                                   "onprem.yaml", "slurm.yaml"]


@pytest.mark.parametrize("path", SHIPPED)
def test_shipped_profiles_load(path):
    profile = load_profile(path)
    if profile.launcher:
        with open(profile.path(profile.launcher)) as f:
            launcher = yaml.safe_load(f)
        jsonschema.validate(launcher, RAY_LAUNCHER_SCHEMA)  # what `ray up` checks before it starts anything
    if profile.is_local:  # its ports are chosen when it starts
        assert profile.where == "local nodes (not up)" or profile.jobs_address.startswith("http://127.0.0.1:")
    elif profile.kind != "slurm":
        assert profile.jobs_address.startswith("http://127.0.0.1:")  # dashboards stay on loopback


def test_the_launcher_schema_catches_mistakes():
    with open("cluster/launcher/onprem.yaml") as f:
        launcher = yaml.safe_load(f)
    for key, value in (("min_workers", 1), ("max_workers", "one"), ("provider", {"tipe": "local"})):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**launcher, key: value}, RAY_LAUNCHER_SCHEMA)


def test_gpu_cluster_gets_one_nccl_worker_per_gpu():
    sub = plan_submission(load_profile("cluster/aws-gpu.yaml"), load_config("examples/digits.yaml"))
    s = sub.config.scaling
    assert (s.workers, s.gpus_per_worker, s.backend, s.placement) == (8, 1.0, "nccl", "PACK")
    assert sub.config.train.precision == "bf16" and sub.run_dir.startswith("s3://my-bucket/raytrain/runs/digits-")
    assert "pip" not in sub.runtime_env  # nothing from an index: the job brings raytrain-app itself
    assert os.path.dirname(raytrain_app.__file__) in sub.runtime_env["py_modules"]


def test_workers_with_several_gpus_each_split_the_nodes_gpus():
    """The model-parallel example: 2 GPUs per worker, so a 4-GPU node holds 2 workers."""
    job = load_config("examples/model_parallel/job.yaml")
    sub = plan_submission(load_profile("cluster/aws-gpu.yaml"), job, nodes=2, gpus_per_node=4)
    assert (sub.config.scaling.workers, sub.config.scaling.gpus_per_worker) == (4, 2.0)
    with pytest.raises(UserError, match="--gpus-per-node 3 does not split into workers of scaling.gpus_per_worker 2"):
        plan_submission(load_profile("cluster/aws-gpu.yaml"), job, nodes=2, gpus_per_node=3)


def test_cpu_cluster_flags_override_the_profile():
    profile = load_profile("cluster/local-2node.yaml")
    sub = plan_submission(profile, load_config("examples/digits.yaml"), nodes=2, gpus_per_node=0, cpus_per_node=4,
                          workers_per_node=2)
    s = sub.config.scaling
    assert (s.workers, s.cpus_per_worker, s.backend, s.placement) == (4, 2.0, "gloo", "SPREAD")
    with pytest.raises(UserError, match="--workers-per-node 3 needs at least that many CPUs"):
        plan_submission(profile, load_config("examples/digits.yaml"), cpus_per_node=2, workers_per_node=3)
    with pytest.raises(UserError, match="--nodes must be >= 1"):
        plan_submission(profile, load_config("examples/digits.yaml"), nodes=0)


def test_the_cluster_shape_is_checked_against_the_config():
    """Valid as written, invalid once the cluster decides the workers and GPUs: caught before submitting."""
    profile = load_profile("cluster/local-2node.yaml")
    compiled = load_config("examples/digits.yaml", ["train.compile=default", "train.ddp_bucket_cap_mb=0.5",
                                                    "scaling.workers=1"])
    with pytest.raises(UserError, match=r"digits on 2 nodes x 1 workers: train.ddp_bucket_cap_mb: must be >= 1"):
        plan_submission(profile, compiled, nodes=2, gpus_per_node=0)
    assert plan_submission(profile, compiled, nodes=1, gpus_per_node=0).config.scaling.workers == 1
    nccl = load_config("examples/digits.yaml", ["scaling.backend=nccl", "scaling.gpus_per_worker=1"])
    with pytest.raises(UserError, match="scaling.backend: nccl needs GPUs"):
        plan_submission(profile, nccl, nodes=2, gpus_per_node=0)


def test_submit_checks_the_builders_before_anything_leaves(tmp_path):
    """What `train` would find on the cluster, found here: a module that does not import, args the
    builder does not take, labels the model cannot output."""
    profile = load_profile("cluster/local-2node.yaml")
    for overrides, message in ((["model.name=nomodule:build"], "cannot import 'nomodule'"),
                               (["model.args={depth: 3}"], "model.args.depth: unknown argument"),
                               (["model.args={num_classes: 5}"], r"labels range over \[0, 9\]")):
        with pytest.raises(UserError, match=message):
            plan_submission(profile, load_config("examples/digits.yaml", overrides), overrides=overrides)
    # --skip-checks: for packages or data that exist only on the cluster.
    sub = plan_submission(profile, load_config("examples/digits.yaml", ["model.name=nomodule:build"]),
                          check_builders=False)
    assert sub.config.model.name == "nomodule:build"


def test_submit_says_when_the_cluster_shape_replaces_a_set_value():
    profile = load_profile("cluster/local-2node.yaml")
    sets = ["scaling.workers=8", "scaling.cpus_per_worker=1", "train.epochs=2"]
    sub = plan_submission(profile, load_config("examples/digits.yaml", sets), nodes=2, cpus_per_node=2,
                          workers_per_node=1, overrides=sets)
    assert sub.config.scaling.workers == 2 and sub.config.scaling.cpus_per_worker == 2.0
    assert sub.warnings == [
        "--set scaling.workers=8 is replaced by the cluster's shape (2 nodes x 1 workers): workers is 2",
        "--set scaling.cpus_per_worker=1.0 is replaced by the cluster's shape (2 nodes x 1 workers): "
        "cpus_per_worker is 2.0"]


@pytest.mark.parametrize("fields, message", [
    ({"kind": "slurm", "address": "http://head:8265"}, "address: does not apply to kind: slurm"),
    ({"kind": "slurm", "storage": "s3://bucket/runs"}, "slurm.log_dir: storage is a URI"),
    ({"kind": "slurm", "runtime_env": {"pip": ["torch"]}}, "runtime_env: under SLURM jobs run from a shared"),
    ({"kind": "slurm", "slurm": {"time_limit": "2h"}},
     "slurm.time_limit: must be MINUTES, HH:MM:SS or DAYS-HH:MM:SS (sbatch --time), got '2h'"),
    ({"kind": "slurm", "slurm": {"port_min": 30000, "port_max": 30100}}, "at least one block of 200 ports"),
    ({"kind": "kuberay"}, "address: kind: kuberay needs the RayCluster's dashboard"),
    ({"slurm": {"partition": "gpu"}}, "slurm: does not apply to kind: ray"),
    ({"kuberay": {"image": "x"}}, "kuberay: does not apply to kind: ray"),
])
def test_a_key_the_profiles_kind_never_reads_is_refused(tmp_path, fields, message):
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(fields))
    with pytest.raises(UserError, match=re.escape(message)):
        load_profile(str(tmp_path / "p.yaml"))


@pytest.mark.parametrize("fields, owner", [
    ({"kind": "slurm"}, "SLURM allocates nodes per job"),
    ({"kind": "kuberay", "address": "http://127.0.0.1:8265"}, "KubeRay's operator runs its clusters"),
    ({"address": "http://127.0.0.1:8265"}, "it names a running cluster (http://127.0.0.1:8265) and no launcher"),
])
def test_cluster_up_and_down_start_only_what_is_theirs(tmp_path, fields, owner):
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(fields))
    for verb in (cluster_up, cluster_down):
        with pytest.raises(UserError, match=re.escape(owner)):
            verb(load_profile(str(tmp_path / "p.yaml")), print)


def test_a_fixed_port_among_the_kernels_outgoing_ports_is_refused_saying_so(tmp_path):
    """Any outgoing connection may hold a port of the kernel's ephemeral range (a listening socket
    here takes one, as a client's connection would): a profile's fixed port there is refused
    with that cause and the way out, before any node starts."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # from the ephemeral range, as a connection's own port is
        taken.listen()
        port = taken.getsockname()[1]
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        assert low <= port <= high
        (tmp_path / "p.yaml").write_text(yaml.safe_dump({"name": "eph", "address": "local", "nodes": 1,
                                                         "local": {"port": port}}))
        with pytest.raises(UserError) as refused:
            cluster_up(load_profile(str(tmp_path / "p.yaml")), print)
    assert str(refused.value) == (
        f"{tmp_path / 'p.yaml'}: local.port {port}: port {port} is in use (ports {low}-{high} are the kernel's for "
        f"outgoing connections, which take any of them at any time): choose ports below {low}, or leave local's "
        "ports out to have free ones chosen")
