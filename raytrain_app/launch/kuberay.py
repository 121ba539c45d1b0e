"""A KubeRay `RayJob` (ray.io/v1) for a job: KubeRay's operator creates a RayCluster of a head and
N worker pods, submits the same `train` entrypoint to it, and deletes the cluster when the job
ends. The pods run a plain Ray image: raytrain-app is a zip in the profile's storage, named in
the job's runtime env, which Ray fetches on every pod (`package.archive`).

Retries (`backoffLimit`) each run on a new cluster (KubeRay v1.7.0, `rayjob_controller.go`), so the
job has a fixed run directory in the profile's storage and a fixed `jobId`, and its entrypoint
resumes from that directory's latest checkpoint (`--resume-if-any`) instead of starting over.
"""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path
from typing import Any

import yaml
from packaging.version import Version

from raytrain_app import storage
from raytrain_app.cluster import drain as drain_hook
from raytrain_app.config import dump_yaml, updated
from raytrain_app.errors import UserError
from raytrain_app.launch import package
from raytrain_app.launch.backend import Echo
from raytrain_app.launch.rayjobs import RayJobs
from raytrain_app.launch.submission import CONFIG_ENV, Submission

NAME_LIMIT = 47  # KubeRay: a RayJob's name is a DNS-1035 label of at most 53 - 6 characters
TOKEN_AUTH_SINCE = "2.52.0"  # Ray's token authentication, which KubeRay's authOptions turns on
FETCHABLE = ("s3", "gs", "file")  # where the profile's storage may be and Ray still fetches a runtime env


def rayjob(sub: Submission) -> dict[str, Any]:
    """The RayJob manifest for `sub`, with raytrain-app uploaded to the profile's storage."""
    profile, k = sub.profile, sub.profile.kuberay
    if not k.image:
        raise UserError(f"{profile.source}: kuberay.image is not set: a RayJob names the image its pods run "
                        "(Ray and torch, e.g. rayproject/ray:2.60.0-py311-gpu)")
    if "working_dir" in sub.runtime_env:
        raise UserError(f"{profile.source}: runtime_env.working_dir is a folder on this machine, which a RayJob "
                        "cannot carry: put your code in kuberay.image")
    secret = next((key for key, value in profile.runtime_env.env_vars.items() if "${" in str(value)), None)
    if secret:
        raise UserError(f"{profile.source}: runtime_env.env_vars.{secret} takes a value from this machine, which "
                        "a manifest would hold in plain text: give the pods their credentials through "
                        "kuberay.service_account or kuberay.pod_template (env from a Secret)")
    ray_version = k.ray_version or version("ray")
    if Version(ray_version) < Version(TOKEN_AUTH_SINCE):
        raise UserError(f"{profile.source}: kuberay.ray_version {ray_version}: RayJobs run with Ray's token "
                        f"authentication, which needs Ray {TOKEN_AUTH_SINCE} or later")
    s = sub.config.scaling
    gpus = int(s.gpus_per_worker) * sub.workers_per_node
    if s.memory_per_worker_gb and s.memory_per_worker_gb * sub.workers_per_node > k.worker_memory_gb:
        raise UserError(f"{profile.source}: kuberay.worker_memory_gb {k.worker_memory_gb:g} cannot hold "
                        f"{sub.workers_per_node} workers of scaling.memory_per_worker_gb {s.memory_per_worker_gb:g}")
    worker_resources = {"cpu": str(profile.cpus_per_node), "memory": f"{k.worker_memory_gb:g}Gi",
                        **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    head_resources = {"cpu": f"{k.head_cpus:g}", "memory": f"{k.head_memory_gb:g}Gi"}
    # A container's /dev/shm is 64 MB unless a pod mounts one: NCCL between a pod's GPUs and the
    # DataLoader's worker processes pass tensors through it.
    pod = {**({"serviceAccountName": k.service_account} if k.service_account else {}),
           "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]}
    shm = {"volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}
    # A worker pod being deleted drains its Ray node first (cluster/drain.py, its source inline:
    # the image has no raytrain-app): Ray Train tells the run, which checkpoints at the step it is
    # at, while the hook keeps the pod up until the deadline, 10 s before Kubernetes' SIGKILL.
    drain = {"lifecycle": {"preStop": {"exec": {"command": [
        "python", "-c", Path(drain_hook.__file__).read_text(), "--deadline-s", str(k.termination_grace_s - 10)]}}},
        "env": [{"name": "MY_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]}
    head = {"spec": {**pod, "containers": [{
        "name": "ray-head", "image": k.image,
        "ports": [{"containerPort": 6379, "name": "gcs-server"}, {"containerPort": 8265, "name": "dashboard"},
                  {"containerPort": 10001, "name": "client"}],
        "resources": {"limits": head_resources, "requests": head_resources}, **shm}]}}
    worker = {"spec": {
        **pod,
        "terminationGracePeriodSeconds": k.termination_grace_s,
        **({"nodeSelector": dict(k.node_selector)} if k.node_selector else {}),
        **({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]} if gpus else {}),
        "containers": [{"name": "ray-worker", "image": k.image,
                        "resources": {"limits": worker_resources, "requests": worker_resources}, **shm, **drain}]}}
    spec = {
        "entrypoint": sub.entrypoint,
        "runtimeEnvYAML": _yaml(runtime_env(sub)),
        "jobId": sub.submission_id,  # the same on every retry, as is the run directory it names
        "submissionMode": "K8sJobMode",
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": k.ttl_seconds_after_finished,
        "backoffLimit": k.backoff_limit,
        **({"activeDeadlineSeconds": k.active_deadline_s} if k.active_deadline_s else {}),
        "rayClusterSpec": {
            "rayVersion": ray_version,
            # Ray's token on every pod and the job's submitter, from a Secret: never in the manifest.
            "authOptions": {"mode": "token", **({"secretName": k.auth_secret} if k.auth_secret else {})},
            **({"enableInTreeAutoscaling": True} if sub.max_nodes else {}),
            "headGroupSpec": {
                # No CPUs for Ray's scheduler on the head: training workers go to the worker pods.
                "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
                "template": merged(head, k.pod_template),
            },
            "workerGroupSpecs": [{
                "groupName": "gpu-workers" if gpus else "cpu-workers",
                # A range starts at its min, and KubeRay's autoscaler adds pods up to its max as
                # Ray Train asks for them (elastic scaling); a fixed size is pinned.
                "replicas": sub.nodes, "minReplicas": sub.nodes, "maxReplicas": sub.max_nodes or sub.nodes,
                "rayStartParams": {},
                "template": merged(worker, k.pod_template),
            }],
        },
    }
    metadata = {"name": rayjob_name(sub.submission_id),
                **({"namespace": k.namespace} if k.namespace else {}),
                "labels": {"app.kubernetes.io/managed-by": "raytrain-app"},
                "annotations": {"raytrain.run_dir": sub.run_dir}}
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": metadata, "spec": spec}


def runtime_env(sub: Submission) -> dict[str, Any]:
    """The RayJob's runtime env: raytrain-app as one zip in the profile's storage, which Ray
    fetches on every pod (`package.archive`), the profile's pip packages, and the job's variables,
    its config restarting the worker group inside the cluster (`kuberay.max_failures`) before a
    lost pod costs a retry of the whole cluster."""
    folder = storage.join(storage.normalize(sub.profile.storage), package.FOLDER)
    scheme = folder.split("://")[0] if "://" in folder else "file"
    if scheme not in FETCHABLE:
        raise UserError(f"{sub.profile.source}: storage {sub.profile.storage}: a RayJob's pods fetch raytrain-app "
                        f"from it, and Ray fetches from {', '.join(f'{s}://' for s in FETCHABLE)} only")
    env = dict(sub.runtime_env["env_vars"])
    if sub.config.failure.max_failures == 0:
        config = updated(sub.config, {"failure": {"max_failures": sub.profile.kuberay.max_failures}})
        env[CONFIG_ENV] = dump_yaml(config)
    return {"py_modules": [package.archive(folder)],
            **({"pip": sub.runtime_env["pip"]} if "pip" in sub.runtime_env else {}),
            "env_vars": env}


def merged(base: Any, patch: Any) -> Any:
    """`patch` (the profile's pod_template) merged into `base`, as Kubernetes' strategic merge does
    for pod templates: mappings key by key, lists of named items (containers, volumes, env,
    volumeMounts, ports) item by item by name, other lists (tolerations) extended, and a patch's
    scalar replacing the base's. A container without a name is the pod's Ray container."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{key: merged(base[key], value) if key in base else value for key, value in patch.items()}}
    if isinstance(base, list) and isinstance(patch, list):
        named = all(isinstance(item, dict) and "name" in item for item in base)
        if not named:
            return base + patch
        out = list(base)
        for item in patch:
            name = item.get("name", base[0]["name"] if base else None) if isinstance(item, dict) else None
            where = next((i for i, old in enumerate(out) if old["name"] == name), None)
            if where is None:
                out.append(item)
            else:
                out[where] = merged(out[where], item)
        return out
    return patch


class KubeRay(RayJobs):
    """Jobs go to a KubeRay RayCluster's Jobs API, as for kind: ray; `k8s render` writes a RayJob
    that brings a cluster of its own."""

    def render(self, sub: Submission, warn: Echo) -> str:
        manifest = rayjob(sub)
        if storage.is_local(sub.run_dir):
            warn(f"storage {sub.profile.storage} is a path: unless every pod mounts it (a shared volume), the "
                 "run directory dies with the cluster and a retry starts over; use s3:// or gs://")
        return _yaml(manifest)


def rayjob_name(submission_id: str) -> str:
    """A DNS-1035 label of at most NAME_LIMIT characters: lowercase letters, digits and '-',
    starting with a letter; a long job name is cut, its date and suffix (what makes it unique) kept."""
    label = re.sub(r"[^a-z0-9-]+", "-", submission_id.lower()).strip("-")
    label = label if label[:1].isalpha() else f"job-{label}"
    if len(label) > NAME_LIMIT:
        unique = len("-20261124-101500-1a2b")
        label = label[:NAME_LIMIT - unique].rstrip("-") + label[-unique:]
    return label


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the runtime env, the job config in it) as readable `|` blocks, and
    shared values written out each time rather than as YAML anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def _yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)
