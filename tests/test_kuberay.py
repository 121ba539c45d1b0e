"""`k8s render`: the RayJob manifest, checked against the part of KubeRay's RayJob schema it uses
and the operator's own rules, and against a golden file for 2 nodes x 4 GPUs.

No Kubernetes runs here: nothing in this file shows that an operator accepts or runs the
manifest, only that it has the fields, types and values KubeRay v1.7.0 defines.
"""

import copy
import json
import os
import re
import zipfile

import jsonschema
import pytest
import yaml

from raytrain_app.config import JobConfig
from raytrain_app.launch.kuberay import merged
from tests.commands import command
from tests.conftest import REPO

GOLDEN = os.path.join(REPO, "tests", "golden", "rayjob-2x4-gpu.yaml")
CRD_SCHEMA = os.path.join(REPO, "tests", "kuberay", "rayjobs.v1.7.0.schema.json")

# The RayJob fields raytrain-app writes, with their types as KubeRay v1.7.0 defines them
# (ray-operator/apis/ray/v1/rayjob_types.go and raycluster_types.go; types and patterns as in
# config/crd/bases/ray.io_rayjobs.yaml). Stricter than the CRD in two ways: unknown keys are
# refused (Kubernetes would silently drop a misspelt field), and submissionMode is checked
# against the Go constants (the CRD has no enum for it).
QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                       r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"}
STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
INT32 = {"type": "integer", "minimum": -2**31, "maximum": 2**31 - 1}


def strict(properties: dict, required: tuple = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


RESOURCES = strict({"limits": {"type": "object", "additionalProperties": QUANTITY},
                    "requests": {"type": "object", "additionalProperties": QUANTITY}})
CONTAINER = strict({"name": {"type": "string"}, "image": {"type": "string"}, "resources": RESOURCES,
                    "ports": {"type": "array", "items": strict({"containerPort": INT32, "name": {"type": "string"}},
                                                               ("containerPort",))},
                    "volumeMounts": {"type": "array", "items": strict({"name": {"type": "string"},
                                                                       "mountPath": {"type": "string"}},
                                                                      ("name", "mountPath"))},
                    "env": {"type": "array", "items": strict({
                        "name": {"type": "string"}, "value": {"type": "string"},
                        "valueFrom": strict({"fieldRef": strict({"fieldPath": {"type": "string"}},
                                                                ("fieldPath",))})}, ("name",))},
                    "lifecycle": strict({"preStop": strict({"exec": strict({
                        "command": {"type": "array", "items": {"type": "string"}}})})})}, ("name",))
VOLUME = strict({"name": {"type": "string"},
                 "emptyDir": strict({"medium": {"type": "string"}, "sizeLimit": QUANTITY})}, ("name",))
POD_TEMPLATE = strict({"metadata": strict({"labels": STRINGS, "annotations": STRINGS}), "spec": strict({
    "containers": {"type": "array", "items": CONTAINER, "minItems": 1},  # the operator wants one at least
    "serviceAccountName": {"type": "string"}, "nodeSelector": STRINGS, "priorityClassName": {"type": "string"},
    "terminationGracePeriodSeconds": {"type": "integer", "minimum": 0},
    "volumes": {"type": "array", "items": VOLUME},
    "tolerations": {"type": "array", "items": strict({"key": {"type": "string"}, "operator": {"type": "string"},
                                                      "effect": {"type": "string"}})},
}, ("containers",))})
RAYJOB_SCHEMA = strict({
    "apiVersion": {"const": "ray.io/v1"},
    "kind": {"const": "RayJob"},
    "metadata": strict({"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": STRINGS,
                        "annotations": STRINGS}, ("name",)),
    "spec": strict({
        "entrypoint": {"type": "string"},
        "runtimeEnvYAML": {"type": "string"},
        "jobId": {"type": "string"},
        "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"]},
        "shutdownAfterJobFinishes": {"type": "boolean"},
        "ttlSecondsAfterFinished": {**INT32, "minimum": 0},
        "backoffLimit": {**INT32, "minimum": 0},
        "activeDeadlineSeconds": {**INT32, "minimum": 1},
        "rayClusterSpec": strict({
            "rayVersion": {"type": "string"}, "enableInTreeAutoscaling": {"type": "boolean"},
            "authOptions": strict({"mode": {"enum": ["disabled", "token"]}, "secretName": {"type": "string"}}),
            "headGroupSpec": strict({"rayStartParams": STRINGS, "template": POD_TEMPLATE}, ("template",)),
            "workerGroupSpecs": {"type": "array", "items": strict({
                "groupName": {"type": "string"}, "replicas": INT32, "minReplicas": INT32, "maxReplicas": INT32,
                "rayStartParams": STRINGS, "template": POD_TEMPLATE,
            }, ("groupName", "minReplicas", "maxReplicas", "template"))},
        }, ("headGroupSpec",)),
    }),
}, ("apiVersion", "kind", "metadata", "spec"))


BUCKET_PROFILE: dict = {}  # the shipped profile with its storage in the tests' bucket, and that bucket's credentials


@pytest.fixture(scope="module", autouse=True)
def bucket_profile(s3, tmp_path_factory):
    """`k8s render` uploads raytrain-app to the profile's storage: here a real S3-compatible
    server's bucket instead of the shipped profile's s3://my-bucket."""
    path = tmp_path_factory.mktemp("profile") / "kuberay.yaml"
    path.write_text(yaml.safe_dump(profile_fields(s3.bucket)))
    BUCKET_PROFILE.update(path=str(path), env={**os.environ, **s3.env}, store=s3)


def profile_fields(bucket: str = "rta-bucket") -> dict:
    """cluster/kuberay.yaml as shipped, its storage in `bucket`."""
    fields = yaml.safe_load(open(os.path.join(REPO, "cluster/kuberay.yaml")))
    return {**fields, "storage": fields["storage"].replace("s3://my-bucket", f"s3://{bucket}")}


def render(*args, profile=None):
    return command(["k8s", "render", "examples/digits.yaml", "--cluster", profile or BUCKET_PROFILE["path"], *args],
                   REPO, BUCKET_PROFILE["env"], 60)


def normalized(manifest: str) -> str:
    """What changes from one render or machine to the next, named: the job id, the package's
    content hash, and the versions installed here."""
    manifest = re.sub(r"digits-\d{8}-\d{6}-[0-9a-f]{4}", "digits-ID", manifest)
    manifest = re.sub(r"raytrain-app-([^-/]+)-[0-9a-f]{16}\.zip", r"raytrain-app-\1-HASH.zip", manifest)
    return re.sub(r"RAYTRAIN_SUBMITTED_WITH: .*", "RAYTRAIN_SUBMITTED_WITH: VERSIONS", manifest)


def rendered_2x4() -> str:
    proc = render("--nodes", "2", "--gpus-per-node", "4")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return proc.stdout


def test_the_rayjob_for_two_nodes_of_four_gpus_matches_the_golden_file():
    """Regenerate after a deliberate change with RAYTRAIN_UPDATE_GOLDEN=1: that run writes the file
    and fails, so a rewrite is never taken for a pass; look at its diff, then run again."""
    text = normalized(rendered_2x4())
    if os.environ.get("RAYTRAIN_UPDATE_GOLDEN") == "1":
        with open(GOLDEN, "w") as f:
            f.write(text)
        pytest.fail(f"{GOLDEN} rewritten: check its diff, then run without RAYTRAIN_UPDATE_GOLDEN")
    with open(GOLDEN) as f:
        assert text == f.read()


def pruned(value, schema: dict, where: str = "") -> list[str]:
    """The fields the Kubernetes API server would drop from `value` (a structural schema prunes
    every field it does not declare, unless it preserves unknown fields)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, dict):
        declared, extra = schema.get("properties"), schema.get("additionalProperties")
        dropped = []
        for key, item in value.items():
            if declared is not None and key not in declared:
                dropped.append(f"{where}.{key}")
            elif declared is not None or isinstance(extra, dict):
                dropped += pruned(item, declared[key] if declared is not None else extra, f"{where}.{key}")
        return dropped
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [f for i, item in enumerate(value) for f in pruned(item, schema["items"], f"{where}[{i}]")]
    return []


@pytest.mark.slow
def test_the_rayjob_fits_the_crd_kuberay_ships_and_nothing_of_it_is_pruned():
    """Against KubeRay v1.7.0's own CRD schema (tests/kuberay/), which the API server validates a
    RayJob with: every field valid, and none that the server would silently drop."""
    schema = json.load(open(CRD_SCHEMA))
    for args in (("--nodes", "2", "--gpus-per-node", "4"), ("--nodes", "1", "--name", "x" * 60),
                 ("--nodes", "2:5", "--set", "scaling.on_resize=scale_lr")):
        proc = render(*args)
        assert proc.returncode == 0, proc.stderr
        manifest = yaml.safe_load(proc.stdout)
        jsonschema.validate(manifest, schema)
        assert pruned(manifest, schema) == []
        name = manifest["metadata"]["name"]
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 47, name
    long_name = yaml.safe_load(render("--name", "x" * 60).stdout)["metadata"]["name"]
    assert long_name.startswith("x" * 20) and re.search(r"-\d{8}-\d{6}-[0-9a-f]{4}$", long_name)  # still unique
    misspelt = yaml.safe_load(rendered_2x4())
    misspelt["spec"]["shutdownAfterJobFinish"] = True  # the check is not vacuous
    assert pruned(misspelt, schema) == [".spec.shutdownAfterJobFinish"]


def test_the_rayjob_fits_kuberays_schema_and_the_operators_rules():
    manifest = yaml.safe_load(rendered_2x4())
    jsonschema.validate(manifest, RAYJOB_SCHEMA)
    spec, cluster = manifest["spec"], manifest["spec"]["rayClusterSpec"]
    # ValidateRayJobMetadata: a DNS-1035 label of at most 47 characters.
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", manifest["metadata"]["name"])
    assert len(manifest["metadata"]["name"]) <= 47
    # ValidateRayClusterSpec: without autoscaling, replicas pinned between min and max.
    workers = cluster["workerGroupSpecs"][0]
    assert workers["minReplicas"] == workers["replicas"] == workers["maxReplicas"] == 2
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"cpu": "16", "memory": "120Gi", "nvidia.com/gpu": "4"}
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # workers on the worker pods only
    assert spec["shutdownAfterJobFinishes"] is True and spec["backoffLimit"] == 2
    # Every pod's /dev/shm is memory of its own, not the container's 64 MB (NCCL, DataLoader workers).
    for template in (cluster["headGroupSpec"]["template"], workers["template"]):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        [mount] = [m for m in template["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert volumes[mount["name"]]["emptyDir"] == {"medium": "Memory"}
    # A worker pod being deleted drains its Ray node first, within its grace period: the run gets a
    # preemption notice and checkpoints (the hook is what tests/test_preemption.py drains with).
    pod = workers["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 60
    assert pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == [
        "python", "-c", open(os.path.join(REPO, "raytrain_app/cluster/drain.py")).read(), "--deadline-s", "50"]
    assert {"name": "MY_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in \
        pod["containers"][0]["env"]
    # A retry runs on a new cluster: the same job id and run directory, resumed if it holds a checkpoint.
    run_dir = manifest["metadata"]["annotations"]["raytrain.run_dir"]
    assert run_dir == "s3://rta-bucket/raytrain/runs/" + spec["jobId"]
    assert spec["entrypoint"].endswith(f"--run-dir {run_dir} --resume-if-any")
    env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    config = JobConfig.from_dict(yaml.safe_load(env["RAYTRAIN_JOB_CONFIG"]))
    assert (config.scaling.workers, config.scaling.backend, config.scaling.gpus_per_worker) == (8, "nccl", 1.0)
    assert env["NCCL_DEBUG"] == "WARN"


def test_a_range_of_nodes_is_a_worker_group_that_the_autoscaler_grows_from_min_to_max():
    """`--nodes 2:5`: the cluster starts at 2 worker pods, and KubeRay's autoscaler adds pods up to 5
    as Ray Train's elastic scaling asks for them; the job's workers are the matching range."""
    proc = render("--nodes", "2:5", "--gpus-per-node", "4")  # 8 to 20 workers: a global batch cannot be kept
    assert proc.returncode == 2 and "keep_global_batch cannot keep the global batch of 640" in proc.stderr
    proc = render("--nodes", "2:5", "--gpus-per-node", "4", "--set", "scaling.on_resize=scale_lr")
    assert proc.returncode == 0, proc.stderr
    manifest = yaml.safe_load(proc.stdout)
    jsonschema.validate(manifest, RAYJOB_SCHEMA)
    cluster = manifest["spec"]["rayClusterSpec"]
    workers = cluster["workerGroupSpecs"][0]
    assert (workers["replicas"], workers["minReplicas"], workers["maxReplicas"]) == (2, 2, 5)
    assert cluster["enableInTreeAutoscaling"] is True
    env = yaml.safe_load(manifest["spec"]["runtimeEnvYAML"])["env_vars"]
    config = JobConfig.from_dict(yaml.safe_load(env["RAYTRAIN_JOB_CONFIG"]))
    assert (config.scaling.min_workers, config.scaling.max_workers) == (8, 20)
    fixed = yaml.safe_load(rendered_2x4())["spec"]["rayClusterSpec"]
    assert "enableInTreeAutoscaling" not in fixed  # a fixed size stays pinned


@pytest.mark.parametrize("path, value", [
    (("spec", "backoffLimit"), "2"),
    (("spec", "submissionMode"), "K8sMode"),
    (("spec", "shutdownAfterJobFinish"), True),
    (("spec", "rayClusterSpec", "headGroupSpec", "rayStartParams", "num-cpus"), 0),
    (("spec", "rayClusterSpec", "workerGroupSpecs", 0, "groupName"), None),
    (("spec", "rayClusterSpec", "workerGroupSpecs", 0, "template", "spec", "containers", 0, "resources", "limits",
      "nvidia.com/gpu"), "four"),
])
def test_the_schema_subset_refuses_what_kuberay_would(path, value):
    """The schema above is not vacuous: each of these breaks the manifest as KubeRay reads it."""
    manifest = copy.deepcopy(yaml.safe_load(rendered_2x4()))
    node = manifest
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(manifest, RAYJOB_SCHEMA)


@pytest.mark.parametrize("change, message", [
    ({"kuberay": {"image": None}}, "kuberay.image is not set: a RayJob names the image its pods run"),
    ({"runtime_env": {"env_vars": {"AWS_SECRET_ACCESS_KEY": "${AWS_SECRET_ACCESS_KEY}"}}},
     "runtime_env.env_vars.AWS_SECRET_ACCESS_KEY takes a value from this machine"),
    ({"kind": "ray", "kuberay": None}, "is a profile of kind: ray; k8s render needs kind: kuberay"),
    ({"runtime_env": {"working_dir": "."}}, "runtime_env.working_dir is a folder on this machine, which a RayJob "
                                            "cannot carry: put your code in kuberay.image"),
    ({"kuberay": {"worker_memory_gb": 8}, "_args": ["--set", "scaling.memory_per_worker_gb=16"]},
     "kuberay.worker_memory_gb 8 cannot hold 4 workers of scaling.memory_per_worker_gb 16"),
])
def test_a_render_the_profile_cannot_make_is_one_line(tmp_path, monkeypatch, change, message):
    fields = profile_fields()
    change = dict(change)
    args = change.pop("_args", [])
    for key, value in change.items():
        if value is None:
            fields.pop(key)
        elif isinstance(value, dict):
            fields[key] = {k: v for k, v in {**fields.get(key, {}), **value}.items() if v is not None}
        else:
            fields[key] = value
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(fields))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "set-here")  # set, and still refused
    proc = render(*args, profile=str(tmp_path / "p.yaml"))
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and message in proc.stderr, proc.stderr


def test_storage_on_a_path_renders_with_a_warning(tmp_path):
    fields = profile_fields()
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({**fields, "storage": str(tmp_path / "runs")}))
    proc = render(profile=str(tmp_path / "p.yaml"))
    assert proc.returncode == 0 and yaml.safe_load(proc.stdout)["kind"] == "RayJob"
    assert proc.stderr == (f"warning: storage {tmp_path / 'runs'} is a path: unless every pod mounts it (a shared "
                           "volume), the run directory dies with the cluster and a retry starts over; use s3:// or "
                           "gs://\n")


def test_the_rayjob_brings_raytrain_app_from_the_profiles_storage(tmp_path):
    """The pods run an image without raytrain-app: the RayJob's runtime env names a zip in the
    bucket, whose one top folder holds this checkout's package, a .dist-info naming its version,
    and the pure-Python packages it needs beyond Ray's (pathspec, tqdm, ...)."""
    env = {**BUCKET_PROFILE["env"], "RAY_AUTH_TOKEN": "a-token-that-must-stay-here-0123456789abcdef"}
    proc = command(["k8s", "render", "examples/digits.yaml", "--cluster", BUCKET_PROFILE["path"],
                    "--set", "failure.max_failures=5"], REPO, env, 60)
    assert proc.returncode == 0, proc.stderr
    assert "a-token-that-must-stay-here" not in proc.stdout and "raytrain-app]" not in proc.stdout
    manifest = yaml.safe_load(proc.stdout)
    spec = manifest["spec"]
    assert spec["entrypoint"].startswith("printenv RAYTRAIN_JOB_CONFIG | python -m raytrain_app.cli.job_entry ")
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    [uri] = runtime_env["py_modules"]
    assert re.fullmatch(r"s3://rta-bucket/raytrain/runs/_packages/raytrain-app-0\.1\.0-[0-9a-f]{16}\.zip", uri), uri
    key = uri[len("s3://rta-bucket/"):]
    store = BUCKET_PROFILE["store"]
    archive = tmp_path / "bundle.zip"
    store.client().download_file(store.bucket, key, str(archive))
    with zipfile.ZipFile(archive) as z:
        names = z.namelist()
        top = {name.split("/")[0] for name in names}
        assert top == {os.path.basename(key)[:-len(".zip")]}  # one folder, which Ray drops when it unpacks
        inside = {name.split("/", 1)[1] for name in names}
        assert "raytrain_app/cli/job_entry.py" in inside and "pathspec/__init__.py" in inside
        assert not [n for n in inside if "__pycache__" in n or n.endswith(".pyc")]
        metadata = z.read(f"{top.pop()}/raytrain_app-0.1.0.dist-info/METADATA").decode()
        assert "Name: raytrain-app" in metadata and "Version: 0.1.0" in metadata
        shipped = z.read(next(n for n in names if n.endswith("raytrain_app/launch/package.py")))
    assert shipped == open(os.path.join(REPO, "raytrain_app/launch/package.py"), "rb").read()
    config = JobConfig.from_dict(yaml.safe_load(runtime_env["env_vars"]["RAYTRAIN_JOB_CONFIG"]))
    assert config.failure.max_failures == 5  # the job's own, kept
    again = yaml.safe_load(rendered_2x4())
    assert yaml.safe_load(again["spec"]["runtimeEnvYAML"])["py_modules"] == [uri]  # the same content, not sent twice
    config = JobConfig.from_dict(yaml.safe_load(yaml.safe_load(again["spec"]["runtimeEnvYAML"])["env_vars"][
        "RAYTRAIN_JOB_CONFIG"]))
    assert config.failure.max_failures == 3  # kuberay.max_failures: a lost pod restarts the group in the cluster
    assert again["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token", "secretName": "raytrain-ray-token"}


def test_a_pod_template_merges_into_head_and_worker_pods_as_kubernetes_merges_them():
    base = {"spec": {"volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
                     "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                     "containers": [{"name": "ray-worker", "image": "ray", "env": [{"name": "A", "value": "1"}]},
                                    {"name": "sidecar", "image": "s"}]}}
    patch = {"metadata": {"labels": {"kueue.x-k8s.io/queue-name": "q"}},
             "spec": {"priorityClassName": "high",
                      "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}},
                                  {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}],
                      "tolerations": [{"key": "spot", "operator": "Exists"}],
                      "containers": [{"env": [{"name": "A", "value": "2"}, {"name": "B", "value": "3"}]},
                                     {"name": "sidecar", "image": "s2"}]}}
    assert merged(base, patch) == {
        "spec": {"volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
                             {"name": "data", "persistentVolumeClaim": {"claimName": "d"}}],
                 "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"},
                                 {"key": "spot", "operator": "Exists"}],
                 "containers": [{"name": "ray-worker", "image": "ray",
                                 "env": [{"name": "A", "value": "2"}, {"name": "B", "value": "3"}]},
                                {"name": "sidecar", "image": "s2"}],
                 "priorityClassName": "high"},
        "metadata": {"labels": {"kueue.x-k8s.io/queue-name": "q"}}}
    assert base["spec"]["containers"][0]["env"] == [{"name": "A", "value": "1"}]  # the base is not changed


def test_a_pod_template_renders_into_both_pod_kinds_within_kuberays_crd(tmp_path):
    template = {"metadata": {"labels": {"kueue.x-k8s.io/queue-name": "team-a"},
                             "annotations": {"scheduling.volcano.sh/queue-name": "gpu"}},
                "spec": {"priorityClassName": "high", "imagePullSecrets": [{"name": "registry"}],
                         "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
                         "containers": [{"env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                             "name": "hf", "key": "token"}}}],
                             "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                         "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}}]}}
    fields = profile_fields()
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({**fields, "kuberay": {**fields["kuberay"],
                                                                           "pod_template": template}}))
    proc = render("--nodes", "2", "--gpus-per-node", "4", profile=str(tmp_path / "p.yaml"))
    assert proc.returncode == 0, proc.stderr
    manifest = yaml.safe_load(proc.stdout)
    schema = json.load(open(CRD_SCHEMA))
    jsonschema.validate(manifest, schema)
    assert pruned(manifest, schema) == []
    cluster = manifest["spec"]["rayClusterSpec"]
    for pod, container in ((cluster["headGroupSpec"]["template"], "ray-head"),
                           (cluster["workerGroupSpecs"][0]["template"], "ray-worker")):
        assert pod["metadata"] == template["metadata"] and pod["spec"]["priorityClassName"] == "high"
        [ray] = pod["spec"]["containers"]
        assert ray["name"] == container and {"name": "data", "mountPath": "/data"} in ray["volumeMounts"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in ray["volumeMounts"]  # ours kept beside the patch's
        assert ray["env"][-1]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
        assert [v["name"] for v in pod["spec"]["volumes"]] == ["dshm", "data"]
    worker = cluster["workerGroupSpecs"][0]["template"]["spec"]
    assert [t["key"] for t in worker["tolerations"]] == ["nvidia.com/gpu", "spot"]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**fields, "kuberay": {**fields["kuberay"],
                                                                             "pod_template": {"spek": {}}}}))
    proc = render(profile=str(tmp_path / "bad.yaml"))
    assert proc.returncode == 2 and "kuberay.pod_template" in proc.stderr and "spek" in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1
