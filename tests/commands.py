"""`raytrain-app` commands in processes of their own, without paying Python's and torch's start-up
for each: a multiprocessing fork server imports the command line (and torch) once, and every
command runs in a child forked from it, through the console script's own entry point, with its
own arguments, environment, working directory, stdout, stderr and exit code.

The fork server is a fresh interpreter, not a fork of pytest, so no test's Ray connection or
threads leak into the commands. Tests that time a command's whole start-up use a real subprocess.

The child writes its exit code to a file as well: under load, CPython's fork server can lose a
child's status and report 255 for a command that exited 2 (cpython#140867; seen once in CI).
"""

import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

_context = multiprocessing.get_context("forkserver")
# The command line, torch, and the dynamo settings DDP's constructor reads: what every command,
# local mode's worker processes and `tests.gloo`'s ranks (which fork from this process's one fork
# server too) would otherwise import each. Not Ray (nor the worker's modules, which import it): a
# command that starts a cluster must load Ray itself, after its auth settings (cluster/session.py).
_context.set_forkserver_preload(["raytrain_app.cli", "torch", "torch._dynamo"])


def start() -> None:
    """Start the fork server now (conftest does, once): local mode's workers fork from this
    process's one fork server too, and would otherwise start it without the command line, leaving
    every command to import it itself. Not at import: a command's own process imports this module
    too."""
    multiprocessing.forkserver.ensure_running()


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def _child(args: list, env: dict, cwd: str, out: str, err: str, status: str) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's when it started
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.argv = ["raytrain-app", *args]
    code = 0
    try:
        from raytrain_app.cli import run

        run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    with open(status, "w") as f:
        f.write(str(code))
    os._exit(code)


def command(args: list, cwd, env: Optional[dict] = None, timeout: float = 60) -> Finished:
    """Run `raytrain-app ARGS` in a forked child, in `cwd` with `env` (default: this process's
    environment), as `subprocess.run` would."""
    with tempfile.TemporaryDirectory(prefix="command-") as scratch:
        out, err, status = (os.path.join(scratch, name) for name in ("stdout", "stderr", "status"))
        start = time.monotonic()
        child = _context.Process(target=_child, args=(list(args), dict(os.environ if env is None else env), str(cwd),
                                                      out, err, status))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            raise subprocess.TimeoutExpired(["raytrain-app", *args], timeout)
        took = time.monotonic() - start
        code = int(open(status).read()) if os.path.exists(status) else child.exitcode  # none if it was killed
        with open(out) as o, open(err) as e:
            return Finished(code, o.read(), e.read(), took)
