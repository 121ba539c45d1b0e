"""What every command shares: the `raytrain-app` group, the options several commands take, the
profile's engine, and the frame that turns the library's exceptions into one line and an exit code."""

from __future__ import annotations

import gc
import os
import re
import signal
import sys
import time

import click

STARTED = time.time()  # start-up is measured from here: Python itself has run ~0.1 s before

from raytrain_app.driver.signals import KEYBOARD_INTERRUPT, after_imports  # noqa: E402
from raytrain_app.errors import Stopped, TrainingFailed, UserError, last_line  # noqa: E402

EXIT_FAILED, EXIT_USAGE, EXIT_BROKEN_PIPE = 1, 2, 141  # 141: what a shell reports for SIGPIPE
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request after a checkpoint, to be resumed


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="raytrain-app")
def main() -> None:
    """Data-parallel PyTorch training on Ray clusters.

    \b
    Examples:
      raytrain-app train examples/digits.yaml
      raytrain-app submit examples/digits.yaml --cluster cluster/aws-gpu.yaml --nodes 2 --gpus-per-node 4
      raytrain-app runs
    """
    # The launch directory on the import path, as `python -m` has it and as the workers run
    # there: "mypkg.models:build" resolves from here, for every command.
    sys.path.insert(0, os.getcwd())


# Options several commands share, declared once.
MAX_FAILURES = click.option("--max-failures", type=int, help="Restart the worker group this often before the "
                                                               "run fails (overrides failure.max_failures).")


SCRIPT_ARGS = click.argument("script_args", metavar="[-- SCRIPT_ARGS]", nargs=-1, type=click.UNPROCESSED)


SET = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config field; "
                                                                                  "repeatable.")


class CountOrRange(click.ParamType):
    """N, or MIN:MAX for an elastic run; the config (or the cluster's shape) says what is wrong
    with the numbers themselves."""

    name = "N|MIN:MAX"

    def __init__(self, what: str):
        self.what = what

    def convert(self, value, param, ctx):
        text = str(value).strip()
        if not re.fullmatch(r"-?\d+|\d+:\d+", text):
            self.fail(f"{value!r} is not a number of {self.what} or a range MIN:MAX", param, ctx)
        return text


WORKERS = click.option("--workers", type=CountOrRange("workers"), help="Training workers, or a range MIN:MAX for "
                                                                       "an elastic run (overrides scaling.workers).")


GPUS_PER_WORKER = click.option("--gpus-per-worker", type=float, help="GPUs per worker (overrides "
                                                                     "scaling.gpus_per_worker).")


VERBOSE = click.option("--verbose", is_flag=True, help="Show Ray's (and Tune's) own logs and the workers' output.")


MIN_NODES = click.option("--min-nodes", type=click.IntRange(min=1), default=1,
                         help="Wait until the cluster at --address has this many nodes (its nodes are still "
                              "starting, as in a SLURM job).")


NODE_TIMEOUT = click.option("--node-timeout", type=click.FloatRange(min=0), default=600, show_default=True,
                            help="Seconds to wait for --min-nodes.")


def warn(line: str) -> None:
    click.echo(f"warning: {line}", err=True)


def engine_of(profile):
    """The backend that runs the profile's jobs (`launch.engines`)."""
    from raytrain_app.launch.engines import for_profile

    return for_profile(profile)


def profile_at(path: str, command: str = "", kind: str = ""):
    """The profile at `path`; a `command` that needs one `kind` refuses the others in one line."""
    from raytrain_app.cluster.profiles import load_profile

    profile = load_profile(path)
    if kind and profile.kind != kind:
        raise UserError(f"{profile.source} is a profile of kind: {profile.kind}; {command} needs kind: {kind}")
    return profile


class exit_codes:
    """Every command's frame: Ray's client-side loggers kept off the console (commands that run
    training re-route them to the run's log file), and the library's exceptions mapped to one
    line on stderr and the documented exit code."""

    def __enter__(self):
        from raytrain_app.console import route_ray_logs

        route_ray_logs(None, verbose=False)
        if signal.getsignal(signal.SIGINT) is _BEFORE_FRAME:  # from here a Ctrl-C unwinds what the command started
            signal.signal(signal.SIGINT, KEYBOARD_INTERRUPT)
        return self

    def __exit__(self, kind, error, tb):
        if isinstance(error, UserError):
            for line in error.lines:
                click.echo(_bounded(f"error: {line}"), err=True)
            sys.exit(EXIT_USAGE)
        if isinstance(error, TrainingFailed):
            click.echo(_bounded(f"training failed: {error}"), err=True)
            sys.exit(EXIT_FAILED)
        if isinstance(error, Stopped):
            click.echo(_bounded(f"stopped: {error}"), err=True)
            sys.exit(EXIT_STOPPED)
        if isinstance(error, KeyboardInterrupt):
            how = getattr(error, "how_to_continue", "")
            click.echo(f"interrupted: {how}" if how else "interrupted", err=True)
            sys.exit(130)
        if isinstance(error, BrokenPipeError):  # the reader left (`| head`): stop quietly, as Unix tools do
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else the exit's flush fails again
            sys.exit(EXIT_BROKEN_PIPE)
        if isinstance(error, Exception):  # a bug: still one line, with the traceback kept in a file
            import traceback

            frames = traceback.extract_tb(tb)
            where = f"at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}; " if frames else ""
            kept = _keep("crash", "".join(traceback.format_exception(kind, error, tb)))
            click.echo(f"error: internal error, {type(error).__name__}: {_bounded(last_line(error), 200)} "
                       f"({where}traceback in {kept})", err=True)
            sys.exit(EXIT_FAILED)
        return False


# Longer lines go to a file, and the line names it: a terminal shows a line, not a page.
MAX_LINE = 500


def _bounded(line: str, limit: int = MAX_LINE) -> str:
    if len(line) <= limit:
        return line
    return f"{line[:limit - 100]}... (the whole message in {_keep('message', line + chr(10))})"


def _keep(kind: str, text: str) -> str:
    """`text` in a file of this user's temp folder; its path."""
    import tempfile

    folder = os.path.join(tempfile.gettempdir(), f"raytrain-{os.getuid()}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")
    with open(path, "w") as f:
        f.write(text)
    return path


def run() -> None:
    """The console script: click's own usage errors become one line too, like every user error,
    and so does a Ctrl-C before the command's frame (`exit_codes`) is up."""
    signal.signal(signal.SIGINT, _BEFORE_FRAME)
    try:
        code = main(prog_name="raytrain-app", standalone_mode=False)
    except click.UsageError as e:
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(EXIT_USAGE)
    except (click.Abort, _Interrupted):
        click.echo("interrupted", err=True)
        sys.exit(130)
    finally:
        # Python's last collection at exit walks every object torch and Ray made: a second after
        # the command's output, for nothing (what must run at exit runs from atexit).
        gc.freeze()
    sys.exit(code if isinstance(code, int) else 0)


class _Interrupted(BaseException):
    """Ctrl-C while the command line loads and parses, before the command's frame: it has started
    nothing. Not a KeyboardInterrupt, which click answers with a blank line before its Abort."""


def _interrupt(signum, frame) -> None:
    raise _Interrupted


_BEFORE_FRAME = after_imports(_interrupt)
