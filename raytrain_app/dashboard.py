"""A cluster's dashboard address: reachability, nodes and the Jobs API, each with a bounded timeout.

Everything here goes through Ray's own HTTP endpoints (`/api/version`, the state API's
`/api/v0/nodes`) and Ray's `JobSubmissionClient`, with the profile's token as a Bearer header.
"""

from __future__ import annotations

import re
from typing import Optional

import requests

from raytrain_app.capacity import Node
from raytrain_app.console import route_ray_logs
from raytrain_app.errors import UserError
from raytrain_app.profiles import ClusterProfile


# A line of `ray status`'s per-node usage: "1.0/2.0 CPU (1.0 used of 2.0 reserved in placement groups)"
_USAGE = re.compile(r"^(?P<used>[\d.]+)/(?P<total>[\d.]+) (?P<name>CPU|GPU)"
                    r"(?: \((?P<pg_used>[\d.]+) used of (?P<reserved>[\d.]+) reserved)?", re.M)


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
        except requests.RequestException:
            raise UserError(f"cannot reach the Ray cluster at {self.address} within {self.timeout_s:g}s") from None
        if response.status_code in (401, 403):
            raise UserError(f"the Ray cluster at {self.address} refused the token ({response.status_code}): "
                            "check the profile's auth.token_env / auth.token_file")
        if not response.ok:
            raise UserError(f"the Ray cluster at {self.address} answered {path} with HTTP {response.status_code}")
        return response.json()

    def check(self) -> str:
        """Raise unless the cluster answers; returns its Ray version."""
        return self.get("/api/version").get("ray_version", "?")

    def nodes(self) -> list[Node]:
        result = self.get("/api/v0/nodes?detail=1&limit=1000")["data"]["result"]
        rows = result["result"] if isinstance(result, dict) else result
        return [Node(n["node_id"], n.get("node_ip", "?"), n["state"] == "ALIVE", bool(n.get("is_head_node")),
                     n.get("resources_total", {}).get("CPU", 0.0), n.get("resources_total", {}).get("GPU", 0.0))
                for n in rows]

    def free(self) -> dict[str, dict[str, float]]:
        """CPUs and GPUs per node id that no task or actor uses and no placement group reserves
        (Ray Train reserves its workers' share in one). Ray's HTTP API has them only as the
        lines `ray status` prints, so they are read from those; a node missing here is unknown."""
        data = self.get("/nodes?view=summary").get("data", {})
        lines = data.get("nodeLogicalResources") or data.get("node_logical_resources") or {}
        free = {}
        for node_id, text in lines.items():
            for m in _USAGE.finditer(text):
                used, total = float(m["used"]), float(m["total"])
                if m["reserved"]:  # `used` counts what runs in placement groups, not what they hold
                    used += float(m["reserved"]) - float(m["pg_used"])
                free.setdefault(node_id, {})[m["name"]] = max(total - used, 0.0)
        return free

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
