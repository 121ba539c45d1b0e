"""Cluster profiles (`cluster/*.yaml`): where a job runs and what the cluster looks like.

A profile's `kind` says who owns the cluster:
- `ray`: a running Ray cluster's Jobs address (or `local`, a cluster that `cluster up` starts on
  this machine);
- `kuberay`: the same Jobs path to a KubeRay RayCluster's dashboard, plus what `k8s render`
  needs to write a RayJob that brings its own cluster;
- `slurm`: SLURM allocates the nodes and each job starts its own Ray inside the allocation.

It also holds the cluster's shape (nodes x GPUs and CPUs per node, the defaults that CLI flags
override), the shared storage for run directories, the environment jobs carry, and where the Ray
token lives. The token itself never appears in a profile: only the name of an env var or file
holding it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, PrivateAttr, field_validator, model_validator

from raytrain_app.config.files import read_yaml, validated
from raytrain_app.config.sections import Section
from raytrain_app.errors import UserError

# Ray's Unix socket paths must fit in 107 bytes. The longest, the head's
# TEMP/session_DATE_TIME_PID/sockets/dash_MetricsHead, takes 68 beyond TEMP with a 7-digit PID
# (another node's, under TEMP/N, up to 67).
MAX_TEMP_DIR = 39


class RuntimeEnv(Section):
    working_dir: Optional[str] = Field(None, description="a directory to upload with every job (relative to the "
                                                         "profile's folder), minus excludes")
    excludes: list[str] = Field(default_factory=lambda: [".git", ".venv", "venv", "runs", "__pycache__", "*.pt"],
                                description="never uploaded from working_dir (gitignore patterns; .gitignore and "
                                            ".rayignore count too)")
    max_upload_mb: float = Field(500.0, gt=0, description="refuse, before sending anything, a working_dir larger "
                                                          "than this (Ray refuses 512 MiB, after the upload)")
    pip: list[str] = Field(default_factory=list)
    env_vars: dict[str, Any] = Field(default_factory=dict, description="e.g. NCCL_SOCKET_IFNAME; ${NAME} is taken "
                                                                       "from the submitting environment")


class Auth(Section):
    token_env: Optional[str] = Field(None, description="an env var holding the Ray token")
    token_file: Optional[str] = Field(None, description="a file holding the Ray token (created, mode 0600, by "
                                                        "cluster up)")

    @model_validator(mode="before")
    @classmethod
    def _no_token(cls, data: Any) -> Any:
        if isinstance(data, dict) and "token" in data:
            raise ValueError("token: never put a token in a profile; name its env var (auth.token_env) or file "
                             "(auth.token_file)")
        return data

    @model_validator(mode="after")
    def _one_source(self):
        if self.token_env and self.token_file:
            raise ValueError("token_env: name one of token_env or token_file, not both")
        return self


class LocalNodes(Section):
    """Ports for a cluster that `cluster up` runs on this machine; every node gets its own. Left
    out, they are chosen free when the cluster starts and recorded in its temp dir, so that two
    users, or two profiles, never collide."""

    port: Optional[int] = Field(None, ge=1, le=65535, description="the head's GCS port (null: chosen free)")
    dashboard_port: Optional[int] = Field(None, ge=1, le=65535, description="dashboard and Jobs API, bound to "
                                                                            "127.0.0.1 (null: chosen free)")
    client_port: Optional[int] = Field(None, ge=1, le=65535, description="Ray Client server on the head (null: "
                                                                         "chosen free)")
    worker_port_base: Optional[int] = Field(None, ge=1, le=64535, description="node i: worker ports base + 1000 i "
                                                                              "... + 999 (null: chosen free)")
    agent_port_base: Optional[int] = Field(None, ge=1, le=65535, description="node i: dashboard agent on base + i "
                                                                             "(null: chosen free)")
    temp_dir: Optional[str] = Field(None, max_length=MAX_TEMP_DIR,
                                    description=f"default RUNTIME/NAME, RUNTIME being this user's own folder "
                                                "($XDG_RUNTIME_DIR/raytrain, else /tmp/raytrain-UID; mode 0700); "
                                                f"at most {MAX_TEMP_DIR} characters (Ray's socket paths must fit); "
                                                "node i > 0 uses TEMP/i")


PORTS = ("port", "dashboard_port", "client_port", "worker_port_base", "agent_port_base")
PORTS_FILE = "raytrain-ports.json"  # in the cluster's temp dir: the ports `cluster up` chose


def user_runtime_dir() -> str:
    """This user's own folder for local clusters: $XDG_RUNTIME_DIR/raytrain (a per-user 0700
    tmpfs on systemd machines), else /tmp/raytrain-UID."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.stat(runtime).st_uid == os.getuid():
        return os.path.join(runtime, "raytrain")
    return f"/tmp/raytrain-{os.getuid()}"


class Slurm(Section):
    """How `submit` asks SLURM for nodes and starts Ray inside them (see `slurm.py`)."""

    partition: Optional[str] = Field(None, description="sbatch --partition, checked against sinfo before submitting "
                                                       "(default: the cluster's default partition)")
    account: Optional[str] = Field(None, description="sbatch --account")
    time_limit: Optional[str] = Field(None, description="sbatch --time: MINUTES, HH:MM:SS or DAYS-HH:MM:SS")
    signal_s: Optional[int] = Field(120, ge=1, le=65535,
                                    description="SLURM sends the job SIGUSR1 this long before its time limit "
                                                "(--signal=B:USR1@N), as a preemption with a grace time does: "
                                                "the run checkpoints at its next step, stops, and the job "
                                                "requeues itself (--requeue) to resume; null: neither")
    sbatch_options: list[str] = Field(default_factory=list, description='more sbatch options, one per item, e.g. '
                                                                        '"--qos=high" or "--constraint=a100"')
    setup: list[str] = Field(default_factory=list, description="shell lines run before Ray starts, e.g. `module "
                                                               "load cuda/12.4`, `source ~/venv/bin/activate`; "
                                                               "srun hands their environment to every node")
    socket_ifname: Optional[str] = Field(None, pattern=r"^[A-Za-z0-9_.:-]+$",
                                         description="the interface nodes reach each other on: Ray's node "
                                                     "address, NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME")
    node_wait_s: float = Field(600.0, gt=0, allow_inf_nan=False,
                               description="how long a job waits for every node's Ray to join (Ray's own "
                                           "symmetric-run gives up after 30 s)")
    node_tmp: str = Field("/tmp", pattern=r"^/\S*$", max_length=32,
                          description="node-local disk for Ray's temp dir, NODE_TMP/rt-JOBID (Ray's Unix "
                                      "socket paths must stay under 107 bytes)")
    port_min: int = Field(20000, ge=1024, le=65535, description="each job's Ray ports are a block of 200 in "
                                                               "[port_min, port_max], chosen by its job id, so "
                                                               "two jobs sharing a node never collide; above "
                                                               "10002-19999, where any other Ray on the node puts "
                                                               "its workers by default")
    port_max: int = Field(32767, ge=1024, le=65535, description="keep below the kernel's ephemeral ports (32768+)")
    log_dir: Optional[str] = Field(None, description="a shared directory for SLURM's job output files, "
                                                     "raytrain-JOBID.out (default: STORAGE/slurm-logs; required "
                                                     "when storage is a URI)")

    @field_validator("time_limit")
    @classmethod
    def _time(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not re.fullmatch(r"(\d+-)?\d+(:\d{1,2}){0,2}", value):
            raise ValueError(f"must be MINUTES, HH:MM:SS or DAYS-HH:MM:SS (sbatch --time), got {value!r}")
        return value

    @model_validator(mode="after")
    def _ports(self):
        if self.port_max - self.port_min + 1 < PORT_BLOCK:
            raise ValueError(f"port_max: [port_min, port_max] must hold at least one block of {PORT_BLOCK} ports")
        return self


PORT_BLOCK = 200  # a job's Ray ports: GCS, client, dashboard, agent, then its workers'


class KubeRay(Section):
    """What `k8s render` writes into a RayJob (see `kuberay.py`)."""

    image: Optional[str] = Field(None, description="the container image for head and workers, with Ray and torch "
                                                   "(e.g. rayproject/ray:2.60.0-py311-gpu); the job brings "
                                                   "raytrain-app, uploaded to storage")
    namespace: Optional[str] = Field(None, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    ray_version: Optional[str] = Field(None, pattern=r"^\d+\.\d+(\.\d+)?$",
                                       description="rayClusterSpec.rayVersion (default: the Ray installed here)")
    head_cpus: float = Field(2.0, gt=0, description="the head pod's CPUs; it runs no training worker")
    head_memory_gb: float = Field(8.0, gt=0)
    worker_memory_gb: float = Field(32.0, gt=0, description="each worker pod's memory")
    service_account: Optional[str] = Field(None, description="serviceAccountName of every pod, e.g. for "
                                                             "object-storage credentials")
    node_selector: dict[str, str] = Field(default_factory=dict, description="nodeSelector of the worker pods, "
                                                                            "e.g. a GPU node pool")
    ttl_seconds_after_finished: int = Field(600, ge=0, description="how long the finished cluster stays for a "
                                                                   "look at its logs")
    backoff_limit: int = Field(2, ge=0, le=10, description="retries, each on a new RayCluster; they resume from "
                                                          "the run directory in storage")
    active_deadline_s: Optional[int] = Field(None, gt=0, description="activeDeadlineSeconds: fail a job running "
                                                                    "longer than this")
    max_failures: int = Field(3, ge=-1, description="worker-group restarts inside the RayJob's cluster (a lost "
                                                    "pod, a crashed worker) before its attempt fails and "
                                                    "backoff_limit starts a new cluster; a job's own "
                                                    "failure.max_failures above 0 is kept (-1: unlimited)")
    auth_secret: Optional[str] = Field(None, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                                       description="a Kubernetes Secret whose auth_token key holds the Ray token "
                                                   "(authOptions.secretName); null: KubeRay makes one per cluster")
    pod_template: dict[str, Any] = Field(default_factory=dict,
                                         description="merged into the head's and the workers' pod templates: "
                                                     "metadata (labels, annotations: Kueue, Volcano) and spec "
                                                     "(volumes, priorityClassName, tolerations, ...); a container "
                                                     "without a name is the Ray container")
    termination_grace_s: int = Field(60, ge=15, le=3600,
                                     description="a worker pod's terminationGracePeriodSeconds; a pod being "
                                                 "deleted (a spot reclaim, an eviction) first drains its Ray node "
                                                 "with a deadline 10 s inside it (a preStop hook), so the run "
                                                 "checkpoints at the step it is at")


    @field_validator("pod_template")
    @classmethod
    def _pod_template(cls, value: dict) -> dict:
        for key in sorted(set(value) - {"metadata", "spec"}):
            raise ValueError(f"{key}: a pod template holds metadata and spec")
        for key in sorted(set(value.get("metadata") or {}) - {"labels", "annotations"}):
            raise ValueError(f"metadata.{key}: only labels and annotations can be added to the pods' metadata")
        return value


class ClusterProfile(Section):
    name: str = Field("local", pattern=r"^[A-Za-z0-9_.-]+$")
    kind: Literal["ray", "kuberay", "slurm"] = Field("ray", description="ray: a Ray cluster's Jobs API; kuberay: "
                                                                        "the same, plus `k8s render`; slurm: "
                                                                        "sbatch, and Ray inside each allocation")
    address: str = Field("local", description="local: `cluster up` runs the nodes here; or http://HOST:PORT, a "
                                              "cluster's dashboard")
    nodes: int = Field(1, ge=1, description="defaults for --nodes, --gpus-per-node, --cpus-per-node")
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_node: int = Field(1, ge=1)
    storage: str = Field("/tmp/raytrain/runs", description="path or URI (s3://, gs://, hdfs://) every node can reach")
    runtime_env: RuntimeEnv = Field(default_factory=RuntimeEnv)
    placement: Literal["PACK", "SPREAD"] = Field("PACK", description="PACK fills a node first; SPREAD deals "
                                                                     "workers out across nodes")
    auth: Auth = Field(default_factory=Auth)
    launcher: Optional[str] = Field(None, description="a Ray cluster-launcher YAML: cluster up/down run ray "
                                                      "up/down on it")
    local: LocalNodes = Field(default_factory=LocalNodes)
    connect_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    slurm: Slurm = Field(default_factory=Slurm, description="kind: slurm only")
    kuberay: KubeRay = Field(default_factory=KubeRay, description="kind: kuberay only")
    _source: str = PrivateAttr("")

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        if value != "local" and not re.match(r"https?://[^/\s]+", value):
            raise ValueError("must be local or http://HOST:PORT")
        return value

    @model_validator(mode="after")
    def _fields_of_the_kind(self):
        """A key that the profile's kind never reads is a mistake, not a silent no-op."""
        unused = {"ray": {"slurm", "kuberay"}, "kuberay": {"slurm", "launcher", "local"},
                  "slurm": {"kuberay", "address", "launcher", "local", "auth", "connect_timeout_s"}}[self.kind]
        for key in sorted(unused & self.model_fields_set):
            raise ValueError(f"{key}: does not apply to kind: {self.kind}")
        if self.kind == "kuberay" and self.address == "local":
            raise ValueError("address: kind: kuberay needs the RayCluster's dashboard, http://HOST:PORT")
        if self.kind == "slurm":
            if self.runtime_env.pip or {"max_upload_mb", "excludes"} & self.runtime_env.model_fields_set:
                raise ValueError("runtime_env: under SLURM jobs run from a shared filesystem: set slurm.setup "
                                 "to activate an environment; only working_dir and env_vars apply")
            if "://" in self.storage and not self.slurm.log_dir:
                raise ValueError("slurm.log_dir: storage is a URI, and SLURM writes job output to a file: name "
                                 "a shared directory")
        return self

    @model_validator(mode="after")
    def _launcher_not_local(self):
        if self.launcher and self.is_local:
            raise ValueError("launcher: must be unset for address: local (cluster up starts it directly)")
        if len(self.temp_dir) > MAX_TEMP_DIR:
            raise ValueError(f"local.temp_dir: the default {self.temp_dir} is over {MAX_TEMP_DIR} characters: "
                             "shorten name or set local.temp_dir")
        return self

    @property
    def source(self) -> str:
        """The file this profile came from, for messages and relative paths."""
        return self._source

    @property
    def is_local(self) -> bool:
        return self.kind == "ray" and self.address == "local"

    @property
    def where(self) -> str:
        """The cluster, as messages name it."""
        if self.kind == "slurm":
            return f"SLURM partition {self.slurm.partition}" if self.slurm.partition else "SLURM's default partition"
        if self.is_local:
            return "local nodes" + (f" at {self.jobs_address}" if self.local_ports_known() else " (not up)")
        return self.jobs_address

    def local_ports_known(self) -> bool:
        try:
            self.ports()
            return True
        except UserError:
            return False

    @property
    def jobs_address(self) -> str:
        return f"http://127.0.0.1:{self.ports()['dashboard_port']}" if self.is_local else self.address.rstrip("/")

    @property
    def temp_dir(self) -> str:
        return self.local.temp_dir or os.path.join(user_runtime_dir(), self.name)

    def ports(self) -> dict[str, int]:
        """A local cluster's ports: the profile's, and those `cluster up` chose for the rest."""
        given = {name: getattr(self.local, name) for name in PORTS if getattr(self.local, name) is not None}
        if len(given) == len(PORTS):
            return given
        try:
            chosen = json.loads(Path(self.temp_dir, PORTS_FILE).read_text())
        except (OSError, ValueError):
            raise UserError(f"cluster '{self.name}' is not up (its ports are chosen when it starts): "
                            f"`raytrain-app cluster up {self.source}` starts it") from None
        return {**chosen, **given}

    def path(self, relative: str) -> str:
        """A path from the profile, relative to the profile's own folder."""
        return os.path.normpath(os.path.join(os.path.dirname(self.source) or ".", os.path.expanduser(relative)))

    def token(self) -> Optional[str]:
        """The Ray token from the profile's named source; None when the profile uses no token."""
        if self.auth.token_env:
            value = os.environ.get(self.auth.token_env)
            if not value:
                raise UserError(f"{self.source}: auth.token_env names ${self.auth.token_env}, which is not set")
            return value.strip()
        if self.auth.token_file:
            path = os.path.expanduser(self.auth.token_file)
            try:
                return Path(path).read_text().strip()
            except OSError:
                raise UserError(f"{self.source}: cannot read the token file {path} named by auth.token_file") from None
        return None

    def job_env_vars(self) -> dict[str, str]:
        """runtime_env.env_vars with `${NAME}` taken from this machine's environment at submit time,
        so that a profile can pass credentials on (`AWS_SECRET_ACCESS_KEY: ${AWS_SECRET_ACCESS_KEY}`)
        without holding them."""

        def expand(key: str, value) -> str:
            def lookup(found: re.Match) -> str:
                if found.group(1) not in os.environ:
                    raise UserError(f"{self.source}: runtime_env.env_vars.{key} names ${{{found.group(1)}}}, "
                                    f"which is not set here")
                return os.environ[found.group(1)]

            return _ENV_REF.sub(lookup, str(value))

        return {key: expand(key, value) for key, value in self.runtime_env.env_vars.items()}

    def ray_auth_env(self) -> dict[str, str]:
        """The variables Ray's own processes and clients read their token from: the file's path
        (RAY_AUTH_TOKEN_PATH) when the profile names one, so the token stays out of environments;
        empty when the profile uses no token."""
        token = self.token()  # readable, or a one-line error
        if not token:
            return {}
        if self.auth.token_file:
            return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": os.path.expanduser(self.auth.token_file)}
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}

    def auth_headers(self) -> dict:
        token = self.token()
        return {"Authorization": f"Bearer {token}"} if token else {}


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL|AUTH", re.IGNORECASE)


def load_profile(path: str) -> ClusterProfile:
    doc = read_yaml(path)
    profile = validated(ClusterProfile, doc)
    profile._source = doc.source
    return profile


def mask(env: dict) -> dict:
    """Env vars for display: values of names that look secret are hidden."""
    return {k: ("****" if _SECRET.search(k) else v) for k, v in env.items()}
