"""Cluster profiles (`cluster/*.yaml`): where a job runs and what the cluster looks like.

A profile names a cluster's Jobs address (or `local`, a cluster that `cluster up` starts on this
machine), its shape (nodes x GPUs and CPUs per node, the defaults that CLI flags override), the
shared storage for run directories, the runtime_env jobs carry, and where the Ray token lives.
The token itself never appears in a profile: only the name of an env var or file holding it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from raytrain_app.config import parse, read_yaml, validate
from raytrain_app.errors import ConfigError, UserError


@dataclass
class RuntimeEnv:
    # A local directory uploaded with the job (null: none). Relative paths are from the profile's folder.
    working_dir: Optional[str] = None
    pip: list = field(default_factory=list)
    env_vars: dict = field(default_factory=dict)
    # Never uploaded from working_dir (gitignore-style patterns).
    excludes: list = field(default_factory=lambda: [".git", ".venv", "venv", "runs", "__pycache__", "*.pt"])
    # The most working_dir may hold once excludes are taken out, checked before anything is sent
    # (Ray refuses packages of 512 MiB and more, but only after the whole upload).
    max_upload_mb: float = 500.0


@dataclass
class Auth:
    # Exactly one of these names where the Ray token is; null for both means no token auth.
    token_env: Optional[str] = None
    token_file: Optional[str] = None


@dataclass
class LocalNodes:
    """Ports for a cluster that `cluster up` runs on this machine; every node gets its own."""

    port: int = 6379  # the head's GCS port
    dashboard_port: int = 8265  # the dashboard and Jobs API, bound to 127.0.0.1
    client_port: int = 10001  # Ray Client server on the head
    worker_port_base: int = 20000  # node i uses worker ports base + 1000*i .. base + 1000*i + 999
    agent_port_base: int = 52365  # node i's dashboard agent listens on base + i
    temp_dir: Optional[str] = None  # default /tmp/raytrain/<name>


@dataclass
class ClusterProfile:
    name: str = "local"
    address: str = "local"  # "local", or the dashboard/Jobs address http://HOST:8265
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_node: int = 1
    storage: str = "/tmp/raytrain/runs"  # path or URI every node can reach
    runtime_env: RuntimeEnv = field(default_factory=RuntimeEnv)
    placement: Literal["PACK", "SPREAD"] = "PACK"
    auth: Auth = field(default_factory=Auth)
    launcher: Optional[str] = None  # a Ray cluster-launcher YAML for `cluster up/down`
    local: LocalNodes = field(default_factory=LocalNodes)
    connect_timeout_s: float = 10.0
    # Set by load_profile: the file it came from, for messages and relative paths.
    source: str = field(default="", init=False, compare=False, repr=False)

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

    def auth_headers(self) -> dict:
        token = self.token()
        return {"Authorization": f"Bearer {token}"} if token else {}


_RULES = [
    ("name", lambda p: bool(re.fullmatch(r"[A-Za-z0-9_.-]+", p.name)), "letters, digits, '.', '_' or '-'"),
    ("address", lambda p: p.address == "local" or re.match(r"https?://[^/\s]+", p.address), "local or http://HOST:PORT"),
    ("nodes", lambda p: p.nodes >= 1, ">= 1"),
    ("gpus_per_node", lambda p: p.gpus_per_node >= 0, ">= 0"),
    ("cpus_per_node", lambda p: p.cpus_per_node >= 1, ">= 1"),
    ("auth", lambda p: not (p.auth.token_env and p.auth.token_file), "one of token_env or token_file, not both"),
    ("connect_timeout_s", lambda p: p.connect_timeout_s > 0, "> 0"),
    ("local.temp_dir", lambda p: len(p.temp_dir) <= 48, "at most 48 characters (Ray's socket paths under it must fit "
                                                        "in 107 bytes)"),
    ("launcher", lambda p: not p.launcher or not p.is_local, "unset for address: local (cluster up starts it directly)"),
]

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL|AUTH", re.IGNORECASE)


def load_profile(path: str) -> ClusterProfile:
    raw, source = read_yaml(path)
    auth = raw.get("auth")
    if isinstance(auth, dict) and "token" in auth:
        raise ConfigError(f"{source}: auth.token: never put a token in a profile; "
                          "name its env var (auth.token_env) or file (auth.token_file)")
    profile = parse(ClusterProfile, raw, source)
    validate(profile, _RULES, source)
    profile.source = source
    return profile


def mask(env: dict) -> dict:
    """Env vars for display: values of names that look secret are hidden."""
    return {k: ("****" if _SECRET.search(k) else v) for k, v in env.items()}
