"""Whether a cluster can hold a run, checked before anything waits for resources that do not
exist: Ray would queue such workers forever.

`train` asks it of the cluster it is connected to (Ray's node table), `submit` of a cluster's
dashboard before sending the job. A worker needs all its CPUs and GPUs on one node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from raytrain_app.config import JobConfig
from raytrain_app.config.sections import ScalingConfig
from raytrain_app.console import count
from raytrain_app.errors import UserError


@dataclass
class Node:
    node_id: str
    ip: str
    alive: bool
    is_head: bool
    cpus: float
    gpus: float
    memory: float = math.inf  # bytes of Ray's `memory` resource


def spare_cpus(config: JobConfig) -> float:
    """CPUs a run needs besides its workers': `data.engine: ray_data` reads in Ray Data tasks of
    one CPU each, which would otherwise wait forever for a cluster the workers fill."""
    return 1.0 if config.data.engine == "ray_data" else 0.0


def workers_that_fit(nodes: list[Node], cpus_per_worker: float, gpus_per_worker: float,
                     memory_per_worker: float = 0) -> int:
    """`memory_per_worker` in bytes."""
    return int(sum(min(n.cpus // cpus_per_worker, n.gpus // gpus_per_worker if gpus_per_worker else math.inf,
                       n.memory // memory_per_worker if memory_per_worker else math.inf)
                   for n in nodes if n.alive))


def check_workers_fit(nodes: list[Node], config: JobConfig) -> None:
    """`train`: the workers may go to any node; Ray Data's CPUs (`spare_cpus`) anywhere. A range
    needs its `min` (it grows as room appears)."""
    s = config.scaling
    fit = workers_that_fit(nodes, s.cpus_per_worker, s.gpus_per_worker, s.resources.get("memory", 0))
    if fit < s.min_workers:
        wanted = f"the {s.min_workers} a range starts at (scaling.workers min)" if s.elastic else str(s.workers)
        raise UserError(f"the cluster holds {fit} workers of {_worker(s)} each, not {wanted}: it has "
                        f"{describe_capacity(nodes)}")
    _check_spare(nodes, s.min_workers * s.cpus_per_worker, spare_cpus(config))


def check_shape_fits(nodes: list[Node], node_count: int, per_node: int, config: JobConfig) -> None:
    """`submit`: `node_count` nodes must each hold `per_node` workers, and Ray Data's CPUs be left."""
    s = config.scaling
    alive = [n for n in nodes if n.alive]
    need_gpus, need_cpus = s.gpus_per_worker * per_node, s.cpus_per_worker * per_node
    need_memory = s.resources.get("memory", 0) * per_node
    fitting = [n for n in alive if n.gpus >= need_gpus and n.cpus >= need_cpus and n.memory >= need_memory]
    if len(fitting) < node_count:
        what = f"{need_gpus:g} GPUs and {need_cpus:g} CPUs" if need_gpus else f"{need_cpus:g} CPUs"
        what += f" and {need_memory / 2**30:g} GiB of memory" if need_memory else ""
        short = ("GPUs" if need_gpus and sum(n.gpus >= need_gpus for n in alive) < node_count else
                 "memory" if need_memory and sum(n.memory >= need_memory for n in alive) < node_count else "CPUs")
        raise UserError(f"not enough {short}: the job needs {node_count} nodes with {what} each; "
                        f"the cluster has {describe_capacity(alive)}")
    _check_spare(alive, need_cpus * node_count, spare_cpus(config))


def _worker(s: ScalingConfig) -> str:
    return (f"{s.cpus_per_worker:g} CPU" + (f" and {s.gpus_per_worker:g} GPU" if s.gpus_per_worker else "")
            + (f" and {s.memory_per_worker_gb:g} GiB of memory" if s.memory_per_worker_gb else ""))


def _check_spare(nodes: list[Node], taken: float, spare: float) -> None:
    if spare and sum(n.cpus for n in nodes if n.alive) - taken < spare:
        raise UserError(f"data.engine: ray_data reads with Ray Data tasks, which need {spare:g} CPU besides the "
                        f"workers' {taken:g}: the cluster has {describe_capacity(nodes)} (lower scaling.workers, or "
                        "use data.engine: native)")


def connected_nodes() -> list[Node]:
    """The nodes of the cluster this process is connected to."""
    import ray

    return [Node(n["NodeID"], n.get("NodeManagerAddress", "?"), n["Alive"], False,
                 n.get("Resources", {}).get("CPU", 0.0), n.get("Resources", {}).get("GPU", 0.0),
                 n.get("Resources", {}).get("memory", math.inf))
            for n in ray.nodes()]


def describe_capacity(nodes: list[Node]) -> str:
    """"2 nodes: 0 GPUs/1 CPUs, 0 GPUs/1 CPUs": the alive nodes' resources."""
    alive = [n for n in nodes if n.alive]
    listed = ", ".join(f"{n.gpus:g} GPUs/{n.cpus:g} CPUs" for n in alive) or "none"
    return f"{len(alive)} nodes: {listed}"


def describe_nodes(title: str, nodes: list[Node], free: dict[str, dict[str, float]]) -> list[str]:
    """`cluster status`'s lines: the cluster's free and total CPUs and GPUs, then each node's."""
    def available(kind: str, among: list[Node]) -> str:
        return f"{sum(max(free[n.node_id][kind], 0.0) for n in among):g}"

    return [f"{title}: {count(len(nodes), 'node')}, "
            f"{available('CPU', nodes)}/{sum(n.cpus for n in nodes):g} CPUs free, "
            f"{available('GPU', nodes)}/{sum(n.gpus for n in nodes):g} GPUs free",
            *(f"  node {n.node_id[:12]}  {n.ip:<15} {'head' if n.is_head else 'worker':<6}  "
              f"{available('CPU', [n])}/{n.cpus:g} CPUs free  {available('GPU', [n])}/{n.gpus:g} GPUs free"
              for n in nodes)]
