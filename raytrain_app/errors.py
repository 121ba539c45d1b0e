"""The one exception type that means "the user asked for something impossible", and the one place
that reads Ray's error texts.

The CLI turns a `UserError` into a one-line message and exit code 2; anything else that goes
wrong during training is a training failure (exit code 1). Workers raise it too: it survives
pickling across Ray, so a bad label found inside a worker still reads as a user error.
"""

import re
from typing import Optional


class UserError(Exception):
    """A problem the user can fix: bad config, missing file, impossible request. Each of `lines`
    is one problem on one line (a config file may hold several)."""

    def __init__(self, *lines: str):
        self.lines = [one_line(line) for line in lines] or [""]
        super().__init__("\n".join(self.lines))

    def __reduce__(self):  # across Ray, as the lines they are
        return type(self), tuple(self.lines)


class ConfigError(UserError):
    """A job config or profile that does not parse, type-check or validate."""


class TrainingFailed(Exception):
    """Training started and did not finish; the message names the rank and its last error."""

    def __init__(self, message: str = ""):
        super().__init__(one_line(message))


class Stopped(Exception):
    """The workers stopped on a request (SIGUSR1), each after a checkpoint: the run continues with
    --resume (exit code 75, EX_TEMPFAIL: "try again later")."""

    def __init__(self, message: str = ""):
        super().__init__(one_line(message))


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run: how to continue it (`train` prints it after "interrupted")."""

    def __init__(self, how_to_continue: str = ""):
        self.how_to_continue = how_to_continue
        super().__init__(how_to_continue)


class CheckpointNotWritten(Exception):
    """A worker could not write a checkpoint (a full disk, a store refusing it): where, and why."""

    def __init__(self, step: int, where: str, cause: str):
        self.step, self.where, self.cause = step, where, cause
        super().__init__(f"checkpoint at step {step} could not be written to {where}: {cause}")

    def __reduce__(self):  # across Ray
        return type(self), (self.step, self.where, self.cause)


class RestartsSpent(Exception):
    """Raised in Ray Train's controller when the workers' failures spend a restart budget that Ray
    Train does not keep apart itself (`driver/controller.py`, RestartNotices): the failures, by rank,
    for the driver to word as Ray Train's own."""

    def __init__(self, worker_failures: dict, hang: Optional[str] = None):
        self.worker_failures, self.hang = worker_failures, hang  # the hang that killed a rank, in its words
        super().__init__(f"the restart budget is spent: ranks {', '.join(map(str, sorted(worker_failures)))} failed")

    def __reduce__(self):  # across Ray
        return type(self), (self.worker_failures, self.hang)


class RankFailed(Exception):
    """A worker's own account of its failure, with the node it ran on (a script's exception says
    nothing of where it ran), for `describe_rank`."""

    def __init__(self, node: str, what: str):
        self.node, self.what = node, what
        super().__init__(f"on node {node}: {one_line(what)}")

    def __reduce__(self):  # across Ray
        return type(self), (self.node, self.what)


def one_line(message: str) -> str:
    """Messages quote user text (keys, names, paths), which may hold line breaks: keep them visible
    but on one line, so every error stays one line."""
    return str(message).replace("\r", "\\r").replace("\n", "\\n")


def last_line(e: BaseException) -> str:
    """The last non-empty line of an error: the message under a nested traceback."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


# ---- Ray's worker errors, read once --------------------------------------------------------
# Ray reports a failed worker as an exception whose text nests tracebacks and, for a process that
# died, an "exit detail" and the worker's node_ip and pid; these turn that into one clause.

_EXIT_DETAIL = re.compile(r"Worker exit detail: ([^\n]+?)(?: The (?:process|worker)| Some common causes|$)",
                          re.MULTILINE)
_IP = re.compile(r"(?<![A-Za-z])ip[=:]\s*'?([0-9a-fA-F.:]+[0-9a-fA-F])")
_PID = re.compile(r"\bpid[=:]\s*(\d+)")
# Ray's exit detail for a worker whose connection ended with no word from it: no exception, no exit
# of its own. Ray has no exit status to give (its raylet lets the kernel reap the worker), so
# the signal is not known: a SIGKILL (`kill -9`, the OOM killer) or a crash (SIGSEGV).
_VANISHED = re.compile(r"connection error code 2\. End of file")
_NODE_DIED = re.compile(r"its node has died")
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
# A collective that broke because a peer's process went away: Gloo's and NCCL's words for it.
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited|"
                        r"communicator was aborted", re.IGNORECASE)


def process_died(e: BaseException) -> bool:
    """The worker's process is gone (killed, crashed, OOM, or with its node), as opposed to raising
    an exception."""
    return bool(_EXIT_DETAIL.search(str(e)) or _NODE_DIED.search(str(e)))


def peer_gone(e: BaseException) -> bool:
    """The exception is a collective's, broken by a peer that died: an effect, not the cause."""
    return bool(_PEER_GONE.search(str(e)))


def timed_out(e: BaseException) -> bool:
    return bool(_TIMEOUT.search(str(e)))


def describe(e: BaseException) -> str:
    """`Type: message` for a plain exception; the last line for one that carries a traceback;
    Ray's exit detail for a worker process that died, in plain words where it vanished."""
    died = _EXIT_DETAIL.search(str(e))
    if died and _VANISHED.search(died.group(1)):
        return ("worker process died without an exception (Ray gives no exit status: a signal such as SIGKILL, from "
                "kill -9 or the OOM killer, or a crash)")
    if died:
        return f"worker process died: {died.group(1).strip()}"
    line = last_line(e)
    return line if "\n" in str(e).strip() else f"{type(e).__name__}: {line}"


def describe_rank(rank: int, e: BaseException) -> str:
    """"rank R on node IP (pid N): what happened", with whatever of node and pid Ray's text names."""
    if isinstance(e, RankFailed):
        return f"rank {rank} on node {e.node}: {e.what}"
    text = str(e)
    ip, pid = _IP.search(text), _PID.search(text)
    where = (f" on node {ip.group(1)}" if ip else "") + (f" (pid {pid.group(1)})" if pid else "")
    return f"rank {rank}{where}: {describe(e)}"
