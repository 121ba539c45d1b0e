"""Drain this machine's Ray node as a cloud's spot reclaim does, then wait out the deadline
(`python -m raytrain_app.cluster.drain`).

A KubeRay worker pod runs it as its preStop hook: Kubernetes deletes a pod (a spot node
reclaimed, an eviction, a scale-down) by running the hook, then sending SIGTERM, then SIGKILL after
`terminationGracePeriodSeconds`. The hook drains the pod's Ray node (Ray's `ray drain-node`, reason
PREEMPTION, with a deadline inside the grace period), so Ray Train tells the run, whose loop writes
a checkpoint at the step it is at (see `worker/preemption.py`), and keeps the pod up until the
deadline, while that checkpoint is written.

The pod's image may have no raytrain-app (a job brings it in its runtime env, which a hook does
not run in), so this file uses only the standard library and Ray: a RayJob's hook runs its
source with `python -c`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Optional


def this_node(address: str, ip: str) -> str:
    """The id of the alive Ray node at `ip`: a pod's own."""
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n.get("NodeManagerAddress") == ip]
    finally:
        ray.shutdown()
    if len(nodes) != 1:
        raise SystemExit(f"drain: {len(nodes)} alive Ray nodes at {ip}, not one: name it with --node-id")
    return nodes[0]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="drain", description=__doc__.split("\n")[0])
    parser.add_argument("--deadline-s", type=int, required=True, help="seconds until the node goes")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS"), help="the GCS (default: $RAY_ADDRESS)")
    parser.add_argument("--node-id", help="default: the node at this pod's IP ($MY_POD_IP, or the host's)")
    parser.add_argument("--reason", default="the pod is terminating")
    parser.add_argument("--no-wait", action="store_true", help="return once the drain is accepted")
    args = parser.parse_args(argv)
    if not args.address:
        parser.error("no --address and no RAY_ADDRESS")
    started = time.monotonic()
    node = args.node_id or this_node(args.address, os.environ.get("MY_POD_IP") or
                                     socket.gethostbyname(socket.gethostname()))
    left = max(1, int(args.deadline_s - (time.monotonic() - started)))
    beside = os.path.join(os.path.dirname(sys.executable), "ray")  # this Python's Ray
    ray = beside if os.path.exists(beside) else shutil.which("ray") or "ray"
    drained = subprocess.run([ray, "drain-node", "--address", args.address, "--node-id", node,
                              "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", args.reason,
                              "--deadline-remaining-seconds", str(left)], capture_output=True, text=True)
    if drained.returncode:
        print(f"drain: ray drain-node failed: {(drained.stderr or drained.stdout).strip()[-300:]}", file=sys.stderr)
        return drained.returncode
    print(f"drain: node {node[:12]} drained, {left}s to its deadline", flush=True)
    if not args.no_wait:
        time.sleep(max(0.0, args.deadline_s - (time.monotonic() - started)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
