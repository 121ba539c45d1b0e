"""Whether a cluster can hold a run, checked before anything waits for resources that do not
exist: Ray would queue such workers forever.

`train` asks it of the cluster it is connected to (Ray's node table), `submit` of a cluster's
dashboard before sending the job. A worker needs all its CPUs and GPUs on one node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from raytrain_app.errors import UserError


@dataclass
class Node:
    node_id: str
    ip: str
    alive: bool
    is_head: bool
    cpus: float
    gpus: float


def workers_that_fit(nodes: list[Node], cpus_per_worker: float, gpus_per_worker: float) -> int:
    return int(sum(min(n.cpus // cpus_per_worker, n.gpus // gpus_per_worker if gpus_per_worker else math.inf)
                   for n in nodes if n.alive))


def check_workers_fit(nodes: list[Node], workers: int, cpus_per_worker: float, gpus_per_worker: float) -> None:
    """`train`: the workers may go to any node."""
    fit = workers_that_fit(nodes, cpus_per_worker, gpus_per_worker)
    if fit < workers:
        each = f"{cpus_per_worker:g} CPU" + (f" and {gpus_per_worker:g} GPU" if gpus_per_worker else "")
        raise UserError(f"the cluster holds {fit} workers of {each} each, not {workers}: it has "
                        f"{_describe(nodes)}")


def check_shape_fits(nodes: list[Node], node_count: int, per_node: int, cpus_per_worker: float,
                     gpus_per_worker: float) -> None:
    """`submit`: `node_count` nodes must each hold `per_node` workers."""
    alive = [n for n in nodes if n.alive]
    need_gpus, need_cpus = gpus_per_worker * per_node, cpus_per_worker * per_node
    fitting = [n for n in alive if n.gpus >= need_gpus and n.cpus >= need_cpus]
    if len(fitting) < node_count:
        what = f"{need_gpus:g} GPUs and {need_cpus:g} CPUs" if need_gpus else f"{need_cpus:g} CPUs"
        short = "GPUs" if need_gpus and sum(n.gpus >= need_gpus for n in alive) < node_count else "CPUs"
        raise UserError(f"not enough {short}: the job needs {node_count} nodes with {what} each; "
                        f"the cluster has {_describe(alive)}")


def connected_nodes() -> list[Node]:
    """The nodes of the cluster this process is connected to."""
    import ray

    return [Node(n["NodeID"], n.get("NodeManagerAddress", "?"), n["Alive"], False,
                 n.get("Resources", {}).get("CPU", 0.0), n.get("Resources", {}).get("GPU", 0.0))
            for n in ray.nodes()]


def _describe(nodes: list[Node]) -> str:
    alive = [n for n in nodes if n.alive]
    listed = ", ".join(f"{n.gpus:g} GPUs/{n.cpus:g} CPUs" for n in alive) or "none"
    return f"{len(alive)} nodes: {listed}"
