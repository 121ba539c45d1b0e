"""Cluster profiles (`cluster/*.yaml`): where a job runs and what the cluster looks like.

A profile names a cluster's Jobs address (or `local`, a cluster that `cluster up` starts on this
machine), its shape (nodes x GPUs and CPUs per node, the defaults that CLI flags override), the
shared storage for run directories, the runtime_env jobs carry, and where the Ray token lives.
The token itself never appears in a profile: only the name of an env var or file holding it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, PrivateAttr, field_validator, model_validator

from raytrain_app.config import Section
from raytrain_app.configfile import read_yaml, validated
from raytrain_app.errors import UserError


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
    """Ports for a cluster that `cluster up` runs on this machine; every node gets its own."""

    port: int = Field(6379, ge=1, le=65535, description="the head's GCS port")
    dashboard_port: int = Field(8265, ge=1, le=65535, description="dashboard and Jobs API, bound to 127.0.0.1")
    client_port: int = Field(10001, ge=1, le=65535, description="Ray Client server on the head")
    worker_port_base: int = Field(20000, ge=1, le=64535, description="node i: worker ports base + 1000 i ... + 999")
    agent_port_base: int = Field(52365, ge=1, le=65535, description="node i: dashboard agent on base + i")
    temp_dir: Optional[str] = Field(None, max_length=48, description="default /tmp/raytrain/NAME; at most 48 "
                                                                     "characters (Ray's socket paths must fit)")


class ClusterProfile(Section):
    name: str = Field("local", pattern=r"^[A-Za-z0-9_.-]+$")
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
    _source: str = PrivateAttr("")

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        if value != "local" and not re.match(r"https?://[^/\s]+", value):
            raise ValueError("must be local or http://HOST:PORT")
        return value

    @model_validator(mode="after")
    def _launcher_not_local(self):
        if self.launcher and self.is_local:
            raise ValueError("launcher: must be unset for address: local (cluster up starts it directly)")
        if len(self.temp_dir) > 48:
            raise ValueError("local.temp_dir: the default /tmp/raytrain/NAME is over 48 characters: shorten name "
                             "or set local.temp_dir")
        return self

    @property
    def source(self) -> str:
        """The file this profile came from, for messages and relative paths."""
        return self._source

    @property
    def is_local(self) -> bool:
        return self.address == "local"

    @property
    def jobs_address(self) -> str:
        return f"http://127.0.0.1:{self.local.dashboard_port}" if self.is_local else self.address.rstrip("/")

    @property
    def temp_dir(self) -> str:
        return self.local.temp_dir or f"/tmp/raytrain/{self.name}"

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
