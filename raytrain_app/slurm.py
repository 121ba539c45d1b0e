"""Jobs on a SLURM cluster: `submit` writes an sbatch script that starts Ray inside the job's
allocation and runs the same `train - --address auto` entrypoint as a Ray job; `status`, `logs`,
`stop` and `list` ask SLURM (squeue, sacct, scancel) and read the job's output file.

Ray starts head-then-workers with `srun`, not with `ray symmetric-run`: symmetric-run refuses to
start on a node where any Ray runs (it greps for gcs_server processes) and ends with `ray stop`,
which kills every Ray process on the node by name, so two jobs sharing a node would break each
other. Here each job's Ray has its own ports, temp dir and token, and stops with its job steps.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from raytrain_app import storage
from raytrain_app.console import count
from raytrain_app.errors import UserError, last_line
from raytrain_app.jobs import CONFIG_ENV, Submission, write_files
from raytrain_app.profiles import PORT_BLOCK, ClusterProfile

ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
          "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"}
COMMAND_TIMEOUT_S = 30
SCRIPT_NAME = "job.sbatch"


def render(sub: Submission) -> str:
    """The sbatch script for `sub`: one task per node holds that node's Ray; the batch step, on the
    first node, runs the training entrypoint once every node has joined."""
    p, s = sub.profile.slurm, sub.config.scaling
    cpus, gpus = per_node(sub)
    memory_gb = s.memory_per_worker_gb * sub.workers_per_node if s.memory_per_worker_gb else None
    options = [f"--job-name={sub.submission_id}", f"--nodes={sub.nodes}", "--ntasks-per-node=1",
               f"--cpus-per-task={cpus}",
               *([f"--gpus-per-node={gpus}"] if gpus else []),
               *([f"--mem={memory_gb + 2:g}G"] if memory_gb else []),  # + the Ray node and the driver
               *([f"--partition={p.partition}"] if p.partition else []),
               *([f"--account={p.account}"] if p.account else []),
               *([f"--time={p.time_limit}"] if p.time_limit else []),
               f"--output={os.path.join(log_dir(sub.profile), 'raytrain-%j.out')}",
               f"--comment=raytrain:{sub.run_dir}",
               *([f"--chdir={sub.runtime_env['working_dir']}"] if "working_dir" in sub.runtime_env else []),
               *p.sbatch_options]
    env = {**sub.runtime_env["env_vars"],
           **({"NCCL_SOCKET_IFNAME": p.socket_ifname, "GLOO_SOCKET_IFNAME": p.socket_ifname}
              if p.socket_ifname else {})}
    config = env.pop(CONFIG_ENV, None)  # as written, in a quoted here-document
    exports = "\n".join([*(f"export {name}={shlex.quote(str(value))}" for name, value in env.items()),
                         *([f"{CONFIG_ENV}=$(cat <<'{CONFIG_ENV}'\n{config.rstrip()}\n{CONFIG_ENV}\n)",
                            f"export {CONFIG_ENV}"] if config else [])])
    workers = (f"""srun --nodes={sub.nodes - 1} --ntasks={sub.nodes - 1} --exclude="$head" \\
  bash -c 'ray_node --address=$RAY_ADDRESS' >> "$ray_log" 2>&1 &
steps+=($!)
""" if sub.nodes > 1 else "")
    cleanup = (f'srun --overlap --nodes={sub.nodes - 1} --ntasks={sub.nodes - 1} --exclude="$SLURMD_NODENAME" '
               'rm -rf "$RAY_TMP" >> "$ray_log" 2>&1 || true\n  ' if sub.nodes > 1 else "")
    node_ip = (f'--node-ip-address="$(ip -o -4 addr show dev {p.socket_ifname} | '
               "awk '{sub(\"/.*\", \"\", $4); print $4; exit}')\"" if p.socket_ifname else "")
    slots = (p.port_max - p.port_min + 1) // PORT_BLOCK
    what = f"a sweep, {sub.sweep}," if sub.sweep else count(s.workers, "worker")
    return f"""#!/bin/bash
# {sub.config.name}: {what} on {count(sub.nodes, "node")}, written by raytrain-app.
# Submit with: mkdir -p {log_dir(sub.profile)} && sbatch {SCRIPT_NAME}
# The run directory: {sub.run_dir}
{chr(10).join(f"#SBATCH {shlex.quote(option)}" for option in options)}
set -euo pipefail

{chr(10).join(p.setup) if p.setup else "# (no slurm.setup lines: python, ray and raytrain_app come from PATH)"}

# The profile's variables (and a training job's resolved config); srun hands them to every node.
{exports}

# This job's own Ray: a fresh token, a block of {PORT_BLOCK} ports picked by the job id (two jobs sharing
# a node never collide), and a temp dir on node-local disk, short enough for Ray's socket paths.
export RAY_AUTH_MODE=token
RAY_AUTH_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(32))')
export RAY_AUTH_TOKEN
export RAY_PORT=$(( {p.port_min} + SLURM_JOB_ID % {slots} * {PORT_BLOCK} ))
export RAY_TMP={p.node_tmp.rstrip("/")}/rt-$SLURM_JOB_ID
ray_log={shlex.quote(log_dir(sub.profile))}/raytrain-$SLURM_JOB_ID-ray.out  # Ray's own output, off the job's
ray_node() {{  # on each node: Ray with this job's ports, until the step ends
  exec ray start --block --disable-usage-stats --temp-dir="$RAY_TMP" --num-cpus="$SLURM_CPUS_PER_TASK" \\
    --num-gpus={gpus} --dashboard-agent-listen-port=$((RAY_PORT + 3)) \\
    --min-worker-port=$((RAY_PORT + 10)) --max-worker-port=$((RAY_PORT + {PORT_BLOCK - 1})) {node_ip} "$@"
}}
export -f ray_node
steps=()
finish() {{  # also when scancel'ed, within SLURM's KillWait: Ray's steps stopped, its temp dirs removed
  [ ${{#steps[@]}} -eq 0 ] || kill "${{steps[@]}}" 2>/dev/null || true
  {cleanup}rm -rf "$RAY_TMP"
  wait || true
}}
trap finish EXIT
trap 'exit 143' TERM

head=$SLURMD_NODENAME  # the batch step runs on the allocation's first node
srun --nodes=1 --ntasks=1 --nodelist="$head" bash -c 'ray_node --head --port=$RAY_PORT \\
  --ray-client-server-port=$((RAY_PORT + 1)) --dashboard-port=$((RAY_PORT + 2)) --dashboard-host=0.0.0.0' \\
  >> "$ray_log" 2>&1 &
steps+=($!)
deadline=$((SECONDS + {p.node_wait_s:.0f}))
until [ -s "$RAY_TMP/ray_current_cluster" ]; do
  if ! kill -0 "${{steps[0]}}" 2>/dev/null || [ $SECONDS -gt $deadline ]; then
    echo "raytrain: the Ray head did not start on $head (its output: $ray_log)" >&2; exit 1
  fi
  sleep 1
done
export RAY_ADDRESS=$(cat "$RAY_TMP/ray_current_cluster")
echo "raytrain: Ray head at $RAY_ADDRESS, dashboard http://${{RAY_ADDRESS%:*}}:$((RAY_PORT + 2))"
{workers}
{sub.entrypoint}
"""


def per_node(sub: Submission) -> tuple[int, int]:
    """The CPUs and GPUs the job asks SLURM for on each node: a GPU node's CPUs whole, or its CPU
    workers' share."""
    s = sub.config.scaling
    gpus = int(s.gpus_per_worker) * sub.workers_per_node
    return (sub.profile.cpus_per_node if gpus else int(s.cpus_per_worker) * sub.workers_per_node), gpus


def log_dir(profile: ClusterProfile) -> str:
    """Where SLURM writes jobs' output: a shared directory the submitting machine reads too."""
    return os.path.expanduser(profile.slurm.log_dir or os.path.join(profile.storage, "slurm-logs"))


def log_file(profile: ClusterProfile, job_id: str) -> str:
    return os.path.join(log_dir(profile), f"raytrain-{job_id}.out")


def check_commands() -> None:
    missing = [c for c in ("sbatch", "squeue", "sinfo", "scancel") if not shutil.which(c)]
    if missing:
        raise UserError(f"kind: slurm needs SLURM's commands on this machine, and {', '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} not on PATH (run from a login node)")


@dataclass
class SlurmNode:
    name: str
    partition: str  # sinfo marks the default partition with *
    cpus: int
    gpus: int
    state: str


def partition_nodes(profile: ClusterProfile) -> tuple[str, list[SlurmNode]]:
    """The profile's partition (or SLURM's default) and its nodes, as sinfo sees them."""
    lines = _output(["sinfo", "--noheader", "--Node", "--format=%N|%P|%c|%G|%t"]).splitlines()
    nodes = [SlurmNode(name, part, int(cpus), _gpus(gres), state)
             for name, part, cpus, gres, state in (line.split("|") for line in lines if line.strip())]
    partitions = sorted({n.partition for n in nodes})
    wanted = profile.slurm.partition or next((p for p in partitions if p.endswith("*")), None)
    if wanted is None:
        raise UserError(f"SLURM has no default partition: set slurm.partition in {profile.source} "
                        f"(sinfo lists: {', '.join(partitions) or 'none'})")
    chosen = [n for n in nodes if n.partition.rstrip("*") == wanted.rstrip("*")]
    if not chosen:
        raise UserError(f"SLURM has no partition '{wanted}' ({profile.source}: slurm.partition; sinfo lists: "
                        f"{', '.join(partitions) or 'none'})")
    return wanted.rstrip("*"), chosen


def check_fits(sub: Submission) -> None:
    """The partition has the nodes the job asks for, before sbatch queues a job that never starts."""
    partition, nodes = partition_nodes(sub.profile)
    cpus, gpus = per_node(sub)
    if gpus and max(n.gpus for n in nodes) < gpus:
        raise UserError(f"SLURM partition '{partition}' has at most {max(n.gpus for n in nodes)} GPUs per node, "
                        f"and the job asks for {gpus} (--gpus-per-node)")
    if max(n.cpus for n in nodes) < cpus:
        raise UserError(f"SLURM partition '{partition}' has at most {max(n.cpus for n in nodes)} CPUs per node, "
                        f"and the job asks for {cpus} (--cpus-per-node)")
    if len(nodes) < sub.nodes:
        raise UserError(f"SLURM partition '{partition}' has {len(nodes)} nodes, and the job asks for "
                        f"{sub.nodes} (--nodes)")


def submit(sub: Submission) -> str:
    """Check that the partition holds the job and the run directory takes files, write the script
    there and hand it to sbatch; returns SLURM's job id."""
    check_fits(sub)
    storage.check_writable(sub.run_dir)
    script = render(sub)
    write_files(sub)
    storage.write_text(storage.join(sub.run_dir, SCRIPT_NAME), script)
    os.makedirs(log_dir(sub.profile), exist_ok=True)
    return _output(["sbatch", "--parsable"], stdin=script).strip().split(";")[0]


@dataclass
class SlurmJob:
    job_id: str
    name: str
    state: str  # SLURM's own: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ...
    reason: str
    start: Optional[float]
    elapsed_s: Optional[float]
    nodes: str
    run_dir: str

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def row(self) -> dict:
        """As `list` shows a job (the Ray Jobs table's columns)."""
        return {"id": self.job_id, "name": self.name, "status": self.state, "start": self.start,
                "duration_s": self.elapsed_s, "workers": f"{self.nodes} nodes", "run_dir": self.run_dir}


_SQUEUE_FORMAT = "%i|%j|%T|%r|%S|%M|%D|%k"


def job(job_id: str) -> SlurmJob:
    """A job as SLURM sees it: the controller while it remembers the job, else accounting."""
    _check_id(job_id)
    found = _squeue(["--jobs", job_id]) or _sacct(["--jobs", job_id])
    if not found:
        raise UserError(f"SLURM knows no job {job_id} (squeue and sacct)")
    return found[0]


# `list --status` speaks Ray's job states; these are SLURM's for each.
AS_RAY_STATUS = {"PENDING": {"PENDING", "CONFIGURING", "REQUEUED", "SUSPENDED"},
                 "RUNNING": {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING"},
                 "SUCCEEDED": {"COMPLETED"}, "STOPPED": {"CANCELLED", "PREEMPTED"},
                 "FAILED": {"FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}}


def jobs(statuses: Sequence[str] = ()) -> list[SlurmJob]:
    """This user's jobs, oldest first: what the controller holds, plus accounting's older ones;
    only those in `statuses` (Ray's names, see AS_RAY_STATUS) when given."""
    current = _squeue(["--me"])
    known = {j.job_id for j in current}
    older = [j for j in _sacct(["--starttime", "now-7days"]) if j.job_id not in known]
    wanted = set().union(*(AS_RAY_STATUS[s.upper()] for s in statuses))
    return sorted((j for j in older + current if not wanted or j.state in wanted), key=lambda j: int(j.job_id))


def stop(job_id: str, timeout_s: float = 60) -> str:
    """scancel the job (SLURM signals every step: Ray's nodes and the driver), then wait for SLURM to
    call it ended; returns its final state."""
    if job(job_id).active:
        _output(["scancel", job_id])
    return wait(job_id, timeout_s).state


def wait(job_id: str, timeout_s: float) -> SlurmJob:
    deadline = time.monotonic() + timeout_s
    while True:
        current = job(job_id)
        if not current.active or time.monotonic() > deadline:
            return current
        time.sleep(1)


def follow(profile: ClusterProfile, job_id: str, echo: Callable[[str], None], poll_s: float = 1.0) -> str:
    """Print the job's output as it grows, from the start, until the job ends; returns its state."""
    path, offset = log_file(profile, job_id), 0
    while True:
        ended = not job(job_id).active  # read before the file: nothing written after it is missed
        if os.path.exists(path):
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            if chunk:
                echo(chunk.decode(errors="replace"))
        if ended:
            return job(job_id).state
        time.sleep(poll_s)


def logs(profile: ClusterProfile, job_id: str) -> str:
    current = job(job_id)
    path = log_file(profile, job_id)
    if not os.path.exists(path):
        if current.state == "PENDING":
            return ""
        raise UserError(f"no output file for SLURM job {job_id}: {path} does not exist (slurm.log_dir of "
                        f"{profile.source})")
    with open(path, errors="replace") as f:
        return f.read()


def _squeue(selection: list[str]) -> list[SlurmJob]:
    proc = _run(["squeue", "--noheader", "--states=all", f"--format={_SQUEUE_FORMAT}", *selection])
    if proc.returncode:  # "Invalid job id specified": the controller has forgotten it
        return []
    jobs_ = []
    for line in proc.stdout.splitlines():
        job_id, name, state, reason, start, elapsed, nodes, comment = line.split("|", 7)
        run_dir = comment[len("raytrain:"):] if comment.startswith("raytrain:") else "-"
        jobs_.append(SlurmJob(job_id, name, state, "" if reason == "None" else reason, _time(start),
                              _duration(elapsed), nodes, run_dir))
    return jobs_


def _sacct(selection: list[str]) -> list[SlurmJob]:
    """Accounting (slurmdbd) knows jobs the controller has forgotten; without it, sacct answers
    nothing useful and this returns no jobs."""
    if not shutil.which("sacct"):
        return []
    proc = _run(["sacct", "--noheader", "--parsable2", "--allocations",
                 "--format=JobID,JobName,State,Start,ElapsedRaw,NNodes,Comment", *selection])
    if proc.returncode:
        return []
    jobs_ = []
    for line in proc.stdout.splitlines():
        job_id, name, state, start, elapsed, nodes, comment = (line.split("|", 6) + [""] * 7)[:7]
        if job_id.isdigit():
            run_dir = comment[len("raytrain:"):] if comment.startswith("raytrain:") else "-"
            jobs_.append(SlurmJob(job_id, name, state.split()[0], "", _time(start),
                                  float(elapsed) if elapsed.isdigit() else None, nodes, run_dir))
    return jobs_


def _output(cmd: list[str], stdin: Optional[str] = None) -> str:
    """A SLURM command's output; its failure is one line naming the command and SLURM's own words."""
    proc = _run(cmd, stdin)
    if proc.returncode:
        said = last_line(proc.stderr.strip() or proc.stdout.strip() or f"exit code {proc.returncode}")
        raise UserError(f"{cmd[0]} failed: {said}")
    return proc.stdout


def _run(cmd: list[str], stdin: Optional[str] = None) -> subprocess.CompletedProcess:
    check_commands()
    try:
        return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UserError(f"`{cmd[0]}` did not answer within {COMMAND_TIMEOUT_S}s: is slurmctld reachable?") from None


def _check_id(job_id: str) -> None:
    if not re.fullmatch(r"\d+", job_id):
        raise UserError(f"'{job_id}' is not a SLURM job id (a number, as `submit` and `list` print)")


def _gpus(gres: str) -> int:
    """GPUs in sinfo's GRES column: gpu:4, gpu:a100:4(S:0-1), or (null)."""
    return sum(int(m.group(1)) for m in re.finditer(r"gpu(?::[^:,(]+)?:(\d+)", gres))


def _time(text: str) -> Optional[float]:
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:  # N/A, Unknown, None
        return None


def _duration(text: str) -> Optional[float]:
    """squeue's %M: [days-][hours:]minutes:seconds."""
    days, _, clock = text.rpartition("-")
    try:
        parts = [int(x) for x in clock.split(":")]
    except ValueError:
        return None
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + part
    return seconds + int(days or 0) * 86400
