"""A real SLURM on loopback: munged, slurmctld and one slurmd, with a config written here.

Debian's `slurm-wlm` and `munge` packages (what `.ci/run` installs). Everything runs as root from
a temp dir: its own munge key and socket, its own ports, state and spool directories. SLURM's
commands find this cluster through $SLURM_CONF. Every daemon is stopped by its PID at the end.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.objectstore import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "sinfo", "scancel")
NODE = "rt1"
PARTITION = "debug"


@dataclass
class Slurm:
    conf: str
    folder: Path
    cpus: int

    @property
    def env(self) -> dict:
        return {**os.environ, "SLURM_CONF": self.conf}

    def run(self, *cmd: str) -> str:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=True, timeout=30).stdout


def missing() -> str:
    """Why no SLURM can run here; empty when one can."""
    if os.geteuid() != 0:
        return "needs root to run slurmd"
    absent = [d for d in DAEMONS if not shutil.which(d, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")]
    return f"needs SLURM and munge ({', '.join(absent)} missing): apt-get install slurm-wlm munge" if absent else ""


def start(folder: Path, cpus: int = 2) -> tuple[Slurm, list[psutil.Popen]]:
    for sub in ("state", "spool", "log", "munge"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    (folder / "munge").chmod(0o755)  # munged: clients need to reach its socket
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    sock = folder / "munge" / "socket"
    conf = folder / "slurm.conf"
    conf.write_text(f"""ClusterName=raytrain-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/log/slurmctld.log
SlurmdLogFile={folder}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
MinJobAge=600
KillWait=5
NodeName={NODE} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName={PARTITION} Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
""")
    cluster = Slurm(str(conf), folder, cpus)
    log = open(folder / "log" / "daemons.out", "ab")
    sbin = "/usr/sbin"
    procs = [psutil.Popen([shutil.which("munged", path=sbin) or "munged", "--foreground", "--force",
                           f"--socket={sock}", f"--key-file={key}", f"--pid-file={folder}/munge/pid",
                           f"--seed-file={folder}/munge/seed", f"--log-file={folder}/log/munged.log"],
                          stdout=log, stderr=subprocess.STDOUT)]
    try:
        _wait(lambda: sock.exists(), "munged's socket", folder)
        procs.append(psutil.Popen([shutil.which("slurmctld", path=sbin) or "slurmctld", "-D", "-f", str(conf)],
                                  stdout=log, stderr=subprocess.STDOUT, env=cluster.env))
        procs.append(psutil.Popen([shutil.which("slurmd", path=sbin) or "slurmd", "-D", "-N", NODE, "-f", str(conf)],
                                  stdout=log, stderr=subprocess.STDOUT, env=cluster.env))
        _wait(lambda: _idle(cluster), "an idle node in sinfo", folder)
    except BaseException:
        stop(cluster, procs)
        raise
    return cluster, procs


def stop(cluster: Slurm, procs: list[psutil.Popen]) -> None:
    """Cancel what is still queued, then stop the daemons this module started, by PID."""
    subprocess.run(["scancel", "--user=root"], env=cluster.env, capture_output=True, timeout=30)
    for proc in reversed(procs):
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except psutil.TimeoutExpired:
            proc.kill()


def _idle(cluster: Slurm) -> bool:
    try:
        return "idle" in cluster.run("sinfo", "--noheader", "--format=%t")
    except subprocess.SubprocessError:
        return False


def _wait(ready, what: str, folder: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            logs = (folder / "log" / "daemons.out").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"SLURM did not come up: no {what} within {timeout_s}s\n{logs}")
        time.sleep(0.3)
