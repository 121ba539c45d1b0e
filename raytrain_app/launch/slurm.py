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
from dataclasses import dataclass, replace
from typing import Iterator, Optional, Sequence

import jinja2

from raytrain_app import storage
from raytrain_app.cluster.profiles import PORT_BLOCK, ClusterProfile
from raytrain_app.console import count, jobs_table
from raytrain_app.errors import UserError, last_line
from raytrain_app.launch.backend import Echo, Submitted
from raytrain_app.launch.submission import CONFIG_ENV, Submission, write_files
from raytrain_app.waiting import poll

ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
          "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"}
COMMAND_TIMEOUT_S = 30
SCRIPT_NAME = "job.sbatch"
# The script's text is a template beside this module; only its values are computed here.
_TEMPLATES = jinja2.Environment(loader=jinja2.PackageLoader("raytrain_app.launch"), keep_trailing_newline=True,
                                undefined=jinja2.StrictUndefined, autoescape=False)


def sbatch_script(sub: Submission) -> str:
    """The sbatch script for `sub`: one task per node holds that node's Ray; the batch step, on the
    first node, runs the training entrypoint once every node has joined."""
    p, s = sub.profile.slurm, sub.config.scaling
    cpus, gpus = per_node(sub)
    # A job checkpoints at the signal (a script's own handler, given script.stop_signal); a sweep's trials do not.
    requeue = bool(p.signal_s) and not sub.sweep
    memory_gb = s.memory_per_worker_gb * sub.workers_per_node if s.memory_per_worker_gb else None
    options = [f"--job-name={sub.submission_id}", f"--nodes={sub.node_range}", "--ntasks-per-node=1",
               f"--cpus-per-task={cpus}",
               *([f"--gpus-per-node={gpus}"] if gpus else []),
               *([f"--mem={memory_gb + 2:g}G"] if memory_gb else []),  # + the Ray node and the driver
               *([f"--partition={p.partition}"] if p.partition else []),
               *([f"--account={p.account}"] if p.account else []),
               *([f"--time={p.time_limit}"] if p.time_limit else []),
               *([f"--signal=B:USR1@{p.signal_s}", "--requeue"] if requeue else []),
               f"--output={os.path.join(log_dir(sub.profile), 'raytrain-%j.out')}",
               "--open-mode=append",  # a requeued job's second attempt adds to its first's output
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
    node_ip = (f'--node-ip-address="$(ip -o -4 addr show dev {p.socket_ifname} | '
               "awk '{sub(\"/.*\", \"\", $4); print $4; exit}')\"" if p.socket_ifname else "")
    return _TEMPLATES.get_template("job.sbatch.j2").render(
        name=sub.config.name, what=f"a sweep, {sub.sweep}," if sub.sweep else s.describe_workers(),
        nodes_said=f"{sub.node_range} nodes" if sub.max_nodes else count(sub.nodes, "node"),
        log_dir=log_dir(sub.profile), script_name=SCRIPT_NAME,
        run_dir=sub.run_dir, options=[shlex.quote(option) for option in options], setup=p.setup,
        exports=exports, port_block=PORT_BLOCK, port_min=p.port_min,
        slots=(p.port_max - p.port_min + 1) // PORT_BLOCK, node_tmp=p.node_tmp.rstrip("/"),
        ray_log_dir=shlex.quote(log_dir(sub.profile)), gpus=gpus, node_ip=node_ip,
        node_wait_s=f"{p.node_wait_s:.0f}", entrypoint=sub.entrypoint, requeue=requeue)


def per_node(sub: Submission) -> tuple[int, int]:
    """The CPUs and GPUs the job asks SLURM for on each node: a GPU node's CPUs whole, or its CPU
    workers' share."""
    s = sub.config.scaling
    gpus = int(s.gpus_per_worker) * sub.workers_per_node
    return (sub.profile.cpus_per_node if gpus else int(s.cpus_per_worker) * sub.workers_per_node), gpus


def log_dir(profile: ClusterProfile) -> str:
    """Where SLURM writes jobs' output: a shared directory the submitting machine reads too."""
    return os.path.expanduser(profile.slurm.log_dir or os.path.join(profile.storage, "slurm-logs"))


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
    requeued: int = 0  # times SLURM started it again (preemption, `scontrol requeue`, its own at SIGUSR1)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @property
    def status(self) -> str:
        return self.state + (f", requeued {self.requeued}x" if self.requeued else "")

    def row(self) -> dict:
        """As `list` shows a job (the Ray Jobs table's columns)."""
        return {"id": self.job_id, "name": self.name, "status": self.status, "start": self.start,
                "duration_s": self.elapsed_s, "workers": f"{self.nodes} nodes", "run_dir": self.run_dir}


_SQUEUE_FORMAT = "%i|%j|%T|%r|%S|%M|%D|%k"


# `list --status` speaks Ray's job states; these are SLURM's for each.
AS_RAY_STATUS = {"PENDING": {"PENDING", "CONFIGURING", "REQUEUED", "SUSPENDED"},
                 "RUNNING": {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING"},
                 "SUCCEEDED": {"COMPLETED"}, "STOPPED": {"CANCELLED", "PREEMPTED"},
                 "FAILED": {"FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}}


def job(job_id: str) -> SlurmJob:
    """A job as SLURM sees it: the controller while it remembers the job, else accounting."""
    _check_id(job_id)
    found = _squeue(["--jobs", job_id]) or _sacct(["--jobs", job_id])
    if not found:
        raise UserError(f"SLURM knows no job {job_id} (squeue and sacct)")
    return found[0]


class Slurm:
    """Jobs under SLURM: each an sbatch job that starts its own Ray in its allocation."""

    success = "COMPLETED"

    def __init__(self, profile: ClusterProfile):
        self.profile = profile

    def check_ready(self) -> None:
        check_commands()

    def submit(self, sub: Submission) -> Submitted:
        """Check that the partition holds the job and the run directory takes files, write the
        script there and hand it to sbatch."""
        check_fits(sub)
        storage.check_writable(sub.run_dir)
        script = sbatch_script(sub)
        write_files(sub)
        storage.write_text(storage.join(sub.run_dir, SCRIPT_NAME), script)
        os.makedirs(log_dir(sub.profile), exist_ok=True)
        job_id = _output(["sbatch", "--parsable"], stdin=script).strip().split(";")[0]
        what = "a sweep" if sub.sweep else sub.config.scaling.describe_workers()
        return Submitted(job_id, [f"submitted SLURM job {job_id} ({what} on {sub.node_range} node(s)); run "
                                  f"directory {sub.run_dir}", f"output: {self._log_file(job_id)}"])

    def follow(self, job_id: str, echo: Echo, poll_s: float = 1.0) -> str:
        """Print the job's output as it grows, from the start, until the job ends."""
        path, offset = self._log_file(job_id), 0
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

    def status(self, job_id: str) -> str:
        found = job(job_id)
        return found.status + (f" ({found.reason})" if found.reason else "")

    def logs(self, job_id: str) -> str:
        current = job(job_id)
        path = self._log_file(job_id)
        if not os.path.exists(path):
            if current.state == "PENDING":
                return ""
            raise UserError(f"no output file for SLURM job {job_id}: {path} does not exist (slurm.log_dir of "
                            f"{self.profile.source})")
        with open(path, errors="replace") as f:
            return f.read()

    def stop(self, job_id: str, timeout_s: float = 60) -> str:
        """scancel the job (SLURM signals every step: Ray's nodes and the driver), then wait for
        SLURM to call it ended."""
        if job(job_id).active:
            _output(["scancel", job_id])
        return poll(lambda: job(job_id), lambda current: not current.active, timeout_s).state

    def jobs(self, statuses: Sequence[str] = ()) -> list[dict]:
        """This user's jobs: what the controller holds, plus accounting's older ones; `statuses`
        in Ray's names (see AS_RAY_STATUS)."""
        current = _squeue(["--me"])
        known = {j.job_id for j in current}
        older = [j for j in _sacct(["--starttime", "now-7days"]) if j.job_id not in known]
        wanted = set().union(*(AS_RAY_STATUS[s.upper()] for s in statuses))
        found = sorted((j for j in older + current if not wanted or j.state in wanted), key=lambda j: int(j.job_id))
        return [j.row() for j in found]

    def describe(self) -> Iterator[str]:
        partition, nodes = partition_nodes(self.profile)
        yield f"SLURM partition '{partition}': {len(nodes)} nodes"
        yield from (f"  node {n.name:<12} {n.state:<6}  {n.cpus} CPUs  {n.gpus} GPUs" for n in nodes)
        active = self.jobs(("PENDING", "RUNNING"))
        yield f"your running and pending jobs: {len(active)}"
        if active:
            yield jobs_table(active)

    def render(self, sub: Submission, warn: Echo) -> str:
        return sbatch_script(sub)

    def _log_file(self, job_id: str) -> str:
        return os.path.join(log_dir(self.profile), f"raytrain-{job_id}.out")


def _squeue(selection: list[str]) -> list[SlurmJob]:
    proc = _run(["squeue", "--noheader", "--states=all", f"--format={_SQUEUE_FORMAT}", *selection])
    if proc.returncode:  # "Invalid job id specified": the controller has forgotten it
        return []
    jobs_ = []
    for line in proc.stdout.splitlines():
        job_id, name, state, reason, start, elapsed, nodes, comment = line.split("|", 7)
        run_dir = comment[len("raytrain:"):] if comment.startswith("raytrain:") else "-"
        jobs_.append(SlurmJob(job_id, name, state, "" if reason == "None" else reason, _time(start),
                              _seconds(elapsed), nodes, run_dir))
    requeued = _restart_counts(selection) if jobs_ else {}
    return [replace(j, requeued=requeued.get(j.job_id, 0)) for j in jobs_]


def _restart_counts(selection: list[str]) -> dict[str, int]:
    """squeue's RestartCnt, which only its long --Format names (and which --format cannot join)."""
    proc = _run(["squeue", "--noheader", "--states=all", "--Format=JobID:24,RestartCnt:12", *selection])
    rows = (line.split() for line in proc.stdout.splitlines()) if not proc.returncode else ()
    return {row[0]: int(row[1]) for row in rows if len(row) == 2 and row[1].isdigit()}


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


def check_commands() -> None:
    missing = [c for c in ("sbatch", "squeue", "sinfo", "scancel") if not shutil.which(c)]
    if missing:
        raise UserError(f"kind: slurm needs SLURM's commands on this machine, and {', '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} not on PATH (run from a login node)")


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


def _seconds(text: str) -> Optional[float]:
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
