"""One writer per run directory: a lease that every command writing into it holds.

`train` (and a job's or a sweep trial's training), `evaluate` and a sweep's driver take
RUN_DIR/lease.json before anything else touches the directory, and give it back when they end.
It names the holder (host, pid, command, since when) and carries a heartbeat, renewed every
HEARTBEAT_S by a thread of the holder. A second writer is refused in one line naming the
holder, before Ray starts. The lease is taken over, with a warning, when:

- its heartbeat is older than STALE_S (the holder was killed, or its machine went away), or
  at once when the holder was on this machine and its process is gone;
- the taker is the same scheduler job (a SLURM requeue keeps SLURM_JOB_ID; a retried Ray job, as
  KubeRay retries a RayJob, keeps its submission id): the same run, started again.

Taking it is atomic where the store allows: a hard link that fails if the file exists (local
and network filesystems), S3's conditional writes (If-None-Match to create, If-Match on the
version read to renew or take over). Other stores (gs://, hdfs://) are written, then read back.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from contextlib import suppress
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import psutil
import pyarrow as pa

from raytrain_app import storage
from raytrain_app.errors import UserError

LEASE = "lease.json"
HEARTBEAT_S = 10.0
STALE_S = 60.0
SAME_JOB_WAIT_S = 3 * HEARTBEAT_S  # how long a job started again waits for its earlier attempt's heartbeat to stop


@dataclass(frozen=True)
class Holder:
    token: str  # this holding, unique
    host: str
    pid: int
    command: str  # train, evaluate, sweep
    job: Optional[str]  # the scheduler job it runs in (slurm:ID, ray-job:ID), which a restart keeps
    since: float
    heartbeat: float

    def describe(self) -> str:
        return (f"pid {self.pid} on host {self.host} ({self.command}) "
                f"since {time.strftime('%H:%M', time.localtime(self.since))}")


def scheduler_job() -> Optional[str]:
    """The scheduler job this process runs in, as it is after a requeue or a retry."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm:{os.environ['SLURM_JOB_ID']}"
    config = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")  # set by the Jobs API for an entrypoint
    if config:
        try:
            return f"ray-job:{json.loads(config)['metadata']['job_submission_id']}"
        except (ValueError, KeyError, TypeError):
            return None
    return None


class Lease:
    """A held lease: renewed by a heartbeat thread until `release`."""

    def __init__(self, run_dir: str, holder: Holder, warn: Callable[[str], None]):
        self.run_dir, self.path = run_dir, storage.join(run_dir, LEASE)
        self.holder, self.warn = holder, warn
        self.made_dir = False  # the run directory did not exist before this lease
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="raytrain-lease")

    @classmethod
    def acquire(cls, run_dir: str, command: str, warn: Callable[[str], None]) -> "Lease":
        """Take the run directory's lease, or a UserError naming who holds it."""
        try:
            return cls._acquire(run_dir, command, warn)
        except Exception as e:  # an unwritable folder; a store refusing the credentials or the bucket
            if isinstance(e, (OSError, pa.ArrowException)) or type(e).__module__.startswith("botocore"):
                raise UserError(f"storage {run_dir} is not writable: {storage.explain(e)}") from None
            raise

    @classmethod
    def _acquire(cls, run_dir: str, command: str, warn: Callable[[str], None]) -> "Lease":
        path = storage.join(run_dir, LEASE)
        now = time.time()
        mine = Holder(uuid.uuid4().hex, socket.gethostname(), os.getpid(), command, scheduler_job(), now, now)
        fresh = storage.is_local(run_dir) and not os.path.isdir(storage.normalize(run_dir))
        patience = time.monotonic() + SAME_JOB_WAIT_S
        for _ in range(1000):
            if _create(path, mine):
                held = cls(run_dir, mine, warn)
                held.made_dir = fresh
                return held._started()
            found, version = _read(path)
            if found is None and not storage.exists(path):
                continue  # released between our two looks: create it again
            why = "its file is unreadable" if found is None else _stale(found, mine)
            if why is None and found.job is not None and found.job == mine.job and time.monotonic() < patience:
                time.sleep(1)  # the same job started again: its earlier attempt's heartbeat is about to stop
                continue
            if why is None:  # the way back for this command: train's and sweep's is --resume
                again = "--resume" if command in ("train", "sweep") else f"`{command}` again"
                raise UserError(f"run dir {run_dir} is in use by {found.describe()}; if that process is gone, "
                                f"{again} takes over after {STALE_S:.0f} s")
            if not _take_over(path, mine, found, version):
                raise UserError(f"run dir {run_dir} was just taken by another command as well; try again")
            warn(f"took over the lease of {run_dir}" + (f" from {found.describe()}" if found else "") + f": {why}")
            return cls(run_dir, mine, warn)._started()
        raise UserError(f"run dir {run_dir}: its lease keeps changing hands; try again")

    def release(self) -> None:
        """Stop the heartbeat and remove the lease, if it is still ours; a run directory the lease
        made and nothing else filled (a command refused in its checks) goes too. Once."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        held, _ = _read(self.path)
        if held is not None and held.token == self.holder.token:
            _delete(self.path)
        if self.made_dir:
            with suppress(OSError):
                os.rmdir(storage.normalize(self.run_dir))

    def _started(self) -> "Lease":
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                held, version = _read(self.path)
                if held is None or held.token != self.holder.token:  # this process was stopped past STALE_S
                    self.warn(f"lost the lease of {self.run_dir}" + (f" to {held.describe()}" if held else "") +
                              ": another command may write there too")
                    return
                self.holder = Holder(**{**asdict(self.holder), "heartbeat": time.time()})
                _renew(self.path, self.holder, version)
            except Exception:  # noqa: BLE001 - a store that hiccups: the next beat tries again
                continue


def give_back_abandoned(run_dir: str) -> bool:
    """Take over and remove the run directory's lease where its holder ran on this host and its
    process is gone (Ray Tune kills the actors of the trials still running at a sweep's end, and
    a killed process gives back nothing); whether the directory is free of a lease now. A holder
    on another host is left to its heartbeat's staleness."""
    path = storage.join(run_dir, LEASE)
    held, version = _read(path)
    if held is None:
        return not storage.exists(path)
    if held.host != socket.gethostname() or process_alive(held.pid, held.since):
        return False
    now = time.time()
    mine = Holder(uuid.uuid4().hex, held.host, os.getpid(), "sweep", scheduler_job(), now, now)
    if _take_over(path, mine, held, version):  # one taker only, as a command's own takeover
        _delete(path)
    return not storage.exists(path)


def live_holder(run_dir: str) -> Optional[Holder]:
    """Who holds the run directory's lease now, by its heartbeat (from any host), or None."""
    held, _ = _read(storage.join(run_dir, LEASE))
    return held if held is not None and time.time() - held.heartbeat <= STALE_S else None


def _stale(held: Holder, taker: Holder) -> Optional[str]:
    """Why `held` may be taken over, or None while it stands."""
    age = time.time() - held.heartbeat
    if held.job is not None and held.job == taker.job and age > 2 * HEARTBEAT_S:
        return f"the same {held.job.split(':')[0]} job, started again"
    if age > STALE_S:
        return f"no heartbeat for {age:.0f} s"
    if held.host == socket.gethostname() and not process_alive(held.pid, held.since):
        return "its process is gone"
    return None


def process_alive(pid: Optional[int], since: float) -> bool:
    """The process that wrote a record at `since` still runs: it existed then (a process created
    later under the pid is another; the second covers the clock's granularity), and is no zombie."""
    if not pid:
        return False
    try:
        process = psutil.Process(pid)
        return process.create_time() <= since + 1 and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---- the store: create if absent, read with a version, replace if unchanged ------------------

def _encode(holder: Holder) -> bytes:
    return (json.dumps(asdict(holder)) + "\n").encode()


def _read(path: str) -> tuple[Optional[Holder], Optional[str]]:
    """The holder (None for no lease, or one that does not parse) and the version read (S3's ETag)."""
    if _is_s3(path):
        bucket, key = _s3_key(path)
        try:
            got = _s3().get_object(Bucket=bucket, Key=key)
        except _s3().exceptions.NoSuchKey:
            return None, None
        return _decode(got["Body"].read()), got["ETag"]
    if not storage.exists(path):
        return None, None
    try:
        return _decode(storage.read_bytes(path)), None
    except FileNotFoundError:
        return None, None


def _decode(data: bytes) -> Optional[Holder]:
    try:
        return Holder(**json.loads(data))
    except (ValueError, TypeError):  # torn or foreign: nobody's lease
        return None


def _create(path: str, holder: Holder) -> bool:
    """Write the lease if there is none; False when one exists."""
    if _is_s3(path):
        return _s3_put(path, holder, IfNoneMatch="*")
    if storage.is_local(path):
        local = storage.normalize(path)
        os.makedirs(os.path.dirname(local), exist_ok=True)
        staged = _staged(local, holder)
        try:
            os.link(staged, local)  # fails if the lease exists: atomic, also on network filesystems
            return True
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: the exclusive create of the file itself
            try:
                with open(local, "xb") as f:
                    f.write(_encode(holder))
                return True
            except FileExistsError:
                return False
        finally:
            os.unlink(staged)
    if storage.exists(path):
        return False
    return _written(path, holder)


def _take_over(path: str, holder: Holder, stale: Optional[Holder], version: Optional[str]) -> bool:
    """Replace the stale lease (`stale`, read at `version`); False when another command got there
    first. On a local path the file is renamed aside, which only one taker can do; if what it
    moved is no longer the stale lease (another taker's, just made), it goes back."""
    if _is_s3(path):
        return _renew(path, holder, version)
    if storage.is_local(path):
        local = storage.normalize(path)
        aside = f"{local}.{holder.token}.stale"
        try:
            os.rename(local, aside)
        except FileNotFoundError:
            return False
        with open(aside, "rb") as f:
            moved = _decode(f.read())
        if (moved.token if moved else None) != (stale.token if stale else None):
            with suppress(OSError):
                os.link(aside, local)  # back, unless a third command made one meanwhile
            os.unlink(aside)
            return False
        os.unlink(aside)
        return _create(path, holder)
    return _written(path, holder)


def _s3_put(path: str, holder: Holder, **condition) -> bool:
    """A conditional PUT (If-None-Match, If-Match): False when S3 refuses it for the condition."""
    bucket, key = _s3_key(path)
    try:
        _s3().put_object(Bucket=bucket, Key=key, Body=_encode(holder), **condition)
        return True
    except _s3().exceptions.ClientError as e:
        if _precondition(e):
            return False
        raise


def _renew(path: str, holder: Holder, version: Optional[str]) -> bool:
    """Write our lease over the one read at `version` (S3: only if unchanged since)."""
    if _is_s3(path):
        return _s3_put(path, holder, IfMatch=version)
    if storage.is_local(path):
        local = storage.normalize(path)
        os.replace(_staged(local, holder), local)  # whole, under a name of its own until then
        return True
    return _written(path, holder)


def _written(path: str, holder: Holder) -> bool:
    """gs://, hdfs://: no conditional write through pyarrow; written, then read back."""
    storage.write_text(path, _encode(holder).decode())
    current, _ = _read(path)
    return current is not None and current.token == holder.token


def _staged(local: str, holder: Holder) -> str:
    staged = f"{local}.{holder.token}.tmp"
    with open(staged, "wb") as f:
        f.write(_encode(holder))
    return staged


def _delete(path: str) -> None:
    fs, inner = storage.filesystem_for(path)
    try:
        fs.delete_file(inner)
    except (OSError, FileNotFoundError):
        pass


def _is_s3(path: str) -> bool:
    return path.startswith("s3://")


def _s3_key(path: str) -> tuple[str, str]:
    bucket, _, key = path.removeprefix("s3://").partition("/")
    return bucket, key


_clients: dict = {}


def _s3():
    """boto3's S3 client, from the environment pyarrow reads too (keys, region, AWS_ENDPOINT_URL)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or None
    if endpoint not in _clients:
        import boto3

        _clients[endpoint] = boto3.client("s3", endpoint_url=endpoint)
    return _clients[endpoint]


def _precondition(e) -> bool:
    return e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict", "412")
