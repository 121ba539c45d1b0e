"""Ctrl-C at any moment of `raytrain-app train examples/digits.yaml`'s start-up, in local mode (the
default on one machine): one line on stderr, `interrupted...`, exit 130, no traceback from any
process (the command, its fork server, the ranks, torch's launcher), and none of them left. The
handler behind it, against an import that loses the interrupt; and the fork server's end with a
command that ends during start-up.

A terminal's Ctrl-C signals its whole foreground process group: the command starts in a session of
its own, as a terminal's job, and gets SIGINT through os.killpg. Each moment is found by what can
be seen from outside (a process, the libraries it has mapped, a line, a log file), not by a
sleep. Real subprocesses: a command forked from `tests.commands`' server would share that
server's process group, and not start up as a command does."""

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from raytrain_app.driver.signals import KEYBOARD_INTERRUPT
from tests.conftest import REPO


def _maps(pid: int, library: str) -> bool:
    """Whether process `pid` has `library` loaded (an extension module: its import is under way or done)."""
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _fork_servers(proc) -> list[psutil.Process]:
    """The command's fork server (a rank it forks has its command line until it runs)."""
    try:
        return [p for p in psutil.Process(proc.pid).children() if "forkserver" in " ".join(p.cmdline())]
    except psutil.Error:
        return []


def _waits_on_a_pipe(pid: int) -> bool:
    try:
        return "pipe_read" in Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False


def _rank_log(run_dir: Path) -> str:
    log = run_dir / "logs" / "rank-0.log"
    return log.read_text() if log.exists() else ""


# What each moment looks like from outside: a function of (command, its stdout lines so far, run dir).
MOMENTS = {
    # Before the fork server starts: the command waits for its config on standard input (`train -`).
    "reading its config": lambda proc, out, run_dir: _waits_on_a_pipe(proc.pid),
    # Before it too: `import raytrain_app` (the package's exports) loads the config's pydantic.
    "importing": lambda proc, out, run_dir: _maps(proc.pid, "pydantic_core") and not _fork_servers(proc),
    # The command and its fork server import torch (the command's, until its first line).
    "importing torch": lambda proc, out, run_dir: (_maps(proc.pid, "libtorch_cpu") and not out
                                                   and any(_maps(s.pid, "libtorch_cpu") for s in _fork_servers(proc))),
    "workers starting": lambda proc, out, run_dir: any(s.children() for s in _fork_servers(proc)),
    "before the first step": lambda proc, out, run_dir: "rank 0/2 on node" in _rank_log(run_dir)
                                                         and "first step" not in _rank_log(run_dir),
    "training": lambda proc, out, run_dir: any(line.startswith("epoch ") for line in out),
}

# The launcher's stop waits this long for a rank that ignores its SIGINT, then kills it.
LAUNCHER_GRACE_S = 30


def _command(args: list, tag: str) -> subprocess.Popen:
    """`raytrain-app ARGS` in a session of its own, as a terminal's job, its processes marked by `tag`."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAYTRAIN_TEST_TAG"] = tag
    return subprocess.Popen([sys.executable, "-m", "raytrain_app.cli", *args], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def _left(tag: str, within_s: float) -> list[psutil.Process]:
    """The command's processes still there `within_s` after it ended (none, once they all end)."""
    left, deadline = _ours(tag), time.monotonic() + within_s
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _ours(tag)
    return left


def _ours(tag: str) -> list[psutil.Process]:
    """Every process whose environment the command started with (the command, its fork server and
    resource tracker, the ranks, each in a session of its own): it carries `tag`."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("RAYTRAIN_TEST_TAG") == tag:
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.mark.parametrize("moment", [
    "reading its config",
    "importing",
    pytest.param("importing torch", marks=pytest.mark.slow),
    pytest.param("workers starting", marks=pytest.mark.slow),
    pytest.param("before the first step", marks=pytest.mark.slow),
    pytest.param("training", marks=pytest.mark.slow),
])
def test_ctrl_c_at_any_moment_of_start_up_is_one_line_and_exit_130_and_leaves_nothing(tmp_path, moment):
    tag, run_dir = uuid.uuid4().hex, tmp_path / "run"
    config = "-" if moment == "reading its config" else "examples/digits.yaml"
    proc = _command(["train", config, "--local", "--run-dir", str(run_dir), "--set", "train.epochs=50"], tag)
    out, err = [], []
    readers = [threading.Thread(target=lines.extend, args=(stream,), daemon=True)
               for lines, stream in ((out, proc.stdout), (err, proc.stderr))]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 180
        while not MOMENTS[moment](proc, out, run_dir):
            assert proc.poll() is None and time.monotonic() < deadline, (moment, out, err, proc.poll())
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)  # the terminal signals the whole foreground process group
        signalled = time.monotonic()
        proc.wait(timeout=90)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    # Nothing left: the ranks end with the command (they watch it), the fork server and its resource tracker too.
    left = _left(tag, within_s=10)
    assert not left, [(p.pid, p.cmdline()) for p in left]
    for reader in readers:
        reader.join(timeout=10)  # (a pipe closes once every process that holds it has ended)
    assert proc.returncode == 130, (proc.returncode, err)
    assert len(err) == 1 and err[0].startswith("interrupted"), err  # that line alone, from every process
    assert not [line for line in out if "Traceback" in line or "KeyboardInterrupt" in line], out
    if moment in ("workers starting", "before the first step", "training"):  # ranks stopped when the launcher asked
        assert took < LAUNCHER_GRACE_S, took


def test_a_ctrl_c_in_the_middle_of_an_import_waits_for_its_end(tmp_path, monkeypatch):
    """What the command's SIGINT handler does (`driver/signals.after_imports`), against a module
    that loses an exception raised in the middle of its import, as torch's C++ start loses one
    while it imports NumPy: the KeyboardInterrupt comes once the import is done, not never."""
    (tmp_path / "swallowing.py").write_text(
        "import os, signal, time\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, in the middle of this import\n"
        "    time.sleep(0.5)\n"
        "except BaseException:\n"
        "    pass\n"
        "DONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = signal.signal(signal.SIGINT, KEYBOARD_INTERRUPT)
    try:
        with pytest.raises(KeyboardInterrupt):
            import swallowing  # noqa: F401
            time.sleep(5)  # the signal comes again
        assert sys.modules["swallowing"].DONE
    finally:
        signal.signal(signal.SIGINT, before)
        sys.modules.pop("swallowing", None)


def test_a_command_that_ends_during_start_up_takes_its_fork_server_with_it(tmp_path):
    """Refused after its fork server started (nothing to resume): the server, in the middle of its
    imports, ends with the command, not seconds later once done with them."""
    tag = uuid.uuid4().hex
    proc = _command(["train", "examples/digits.yaml", "--local", "--resume", "--run-dir", str(tmp_path / "none")], tag)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "no checkpoint to resume" in err, err
    left = _left(tag, within_s=2)
    assert not left, [(p.pid, p.cmdline()) for p in left]
