"""A cluster's dashboard address: reachability, nodes and the Jobs API, each with a bounded timeout.

Everything here goes through Ray's own HTTP endpoints (`/api/version`, the state API's
`/api/v0/nodes`, placement groups and actors) and Ray's `JobSubmissionClient`, with the profile's
token as a Bearer header.
"""

from __future__ import annotations

import math
import re
from typing import Optional

import requests

from raytrain_app.cluster.capacity import Node
from raytrain_app.cluster.profiles import ClusterProfile
from raytrain_app.console import route_ray_logs
from raytrain_app.errors import UserError


class Dashboard:
    def __init__(self, address: str, headers: dict, timeout_s: float):
        self.address, self.headers, self.timeout_s = address, headers, timeout_s
        self._client = None

    @classmethod
    def for_profile(cls, profile: ClusterProfile) -> "Dashboard":
        return cls(profile.jobs_address, profile.auth_headers(), profile.connect_timeout_s)

    def get(self, path: str):
        try:
            response = requests.get(self.address + path, headers=self.headers, timeout=self.timeout_s)
        except requests.Timeout:
            raise UserError(f"cannot reach the Ray cluster at {self.address}: "
                            f"no answer within {self.timeout_s:g}s") from None
        except requests.RequestException as e:  # refused, unresolvable: said at once, and so
            raise UserError(f"cannot reach the Ray cluster at {self.address}: {_why(e)}") from None
        if response.status_code in (401, 403):
            raise UserError(f"the Ray cluster at {self.address} refused the token ({response.status_code}): "
                            "check the profile's auth.token_env / auth.token_file")
        if not response.ok:
            raise UserError(f"the Ray cluster at {self.address} answered {path} with HTTP {response.status_code}")
        return response.json()

    def check(self) -> str:
        """Raise unless the cluster answers; returns its Ray version."""
        return self.get("/api/version").get("ray_version", "?")

    def session(self) -> str:
        """The cluster's Ray session name: a new one each time the cluster starts."""
        return self.get("/api/version").get("session_name", "")

    def nodes(self) -> list[Node]:
        rows = self._state("nodes")
        return [Node(n["node_id"], n.get("node_ip", "?"), n["state"] == "ALIVE", bool(n.get("is_head_node")),
                     n.get("resources_total", {}).get("CPU", 0.0), n.get("resources_total", {}).get("GPU", 0.0),
                     n.get("resources_total", {}).get("memory", math.inf))
                for n in rows]

    def free(self) -> dict[str, dict[str, float]]:
        """CPUs and GPUs per alive node id that no placement group reserves and no actor outside
        one holds (Ray Train reserves its workers' share in a placement group; plain tasks are
        not counted), from the state API."""
        free = {n.node_id: {"CPU": n.cpus, "GPU": n.gpus} for n in self.alive_nodes()}
        held = [(b.get("node_id"), b.get("unit_resources", {}))
                for g in self._state("placement_groups") if g.get("state") == "CREATED" for b in g.get("bundles") or []]
        held += [(a.get("node_id"), a.get("required_resources") or {}) for a in self._state("actors")
                 if a.get("state") == "ALIVE" and not a.get("placement_group_id")]
        for node_id, resources in held:
            for kind in free.get(node_id, {}):
                free[node_id][kind] -= resources.get(kind, 0.0)
        return free

    def _state(self, kind: str) -> list[dict]:
        result = self.get(f"/api/v0/{kind}?detail=1&limit=10000")["data"]["result"]
        return result["result"] if isinstance(result, dict) else result

    def alive_nodes(self) -> list[Node]:
        return [n for n in self.nodes() if n.alive]

    def busy(self) -> bool:
        """Whether a Ray job (submitted, or a driver that joined) is pending or running; asked over
        HTTP, so that Ray is not loaded before a `train` sets its auth variables."""
        return any(job.get("status") in ("PENDING", "RUNNING") for job in self.get("/api/jobs/"))

    def jobs(self):
        """Ray's JobSubmissionClient for this address, made once, after a bounded reachability check."""
        if self._client is None:
            self.check()
            from ray.job_submission import JobSubmissionClient

            route_ray_logs(None, verbose=False)  # importing Ray gave its loggers a console handler again
            self._client = JobSubmissionClient(self.address, headers=self.headers, verify=True)
        return self._client


def reachable(address: str, headers: Optional[dict] = None, timeout_s: float = 2.0) -> bool:
    try:
        return requests.get(address + "/api/version", headers=headers or {}, timeout=timeout_s).ok
    except requests.RequestException:
        return False


def _why(e: Exception) -> str:
    """The socket's own words under requests' wrapping (connection refused, name not known)."""
    cause = e
    while cause.__context__ is not None or cause.__cause__ is not None:
        cause = cause.__cause__ or cause.__context__
    text = str(cause)
    found = re.search(r"\[Errno -?\d+\] ([^')\]]+)", text)
    return found.group(1).strip().lower() if found else "no connection"
