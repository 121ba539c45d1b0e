"""One real Ray cluster for the whole session, on loopback, reused by every distributed test; and
one torchrun run of the tutorial-style script, the reference its other launchers must match."""

import atexit
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Ray starts its workers at niceness 15, below every other process of the suite. Beside the other
# xdist process's local-mode ranks and commands, a Ray test's workers got a few percent of a core:
# a sweep's resume ran past pytest's 300 s, every trial's worker starved (a CI rehearsal, and
# twice of two with the machine kept busy). Every Ray the tests start (the session's, `train`'s
# embedded ones, `cluster up`'s nodes, SLURM's) inherits this, and shares the cores evenly.
os.environ.setdefault("RAY_worker_niceness", "0")


# Modules whose every test runs Ray itself (a cluster of its own, the Jobs API, SLURM's Ray, Tune,
# Ray Data, a script under Ray Train's controller); elsewhere a test that needs Ray asks for the
# session's cluster (`ray_cluster`). Both are marked `ray`: `pytest -m "not ray"` runs the rest.
# They are marked `slow` too, as are the not-ray tests that take over 10 CPU-seconds (a whole run
# with a restart, a compile, seventy commands): `pytest -m "not slow"` is the inner loop.
RAY_MODULES = {"test_submit", "test_slurm", "test_sweep", "test_shutdown", "test_two_hosts", "test_local_clusters",
               "test_raydata", "test_scripts", "test_rayinternals", "test_preemption", "test_bare_cluster"}


# The `soak` tier: every slow test (the Ray ones among them) but the docs' own, which run every
# command and code block the documentation shows. Its tests are the costliest joins (clusters,
# restarts, kills, preemptions, SLURM, sweeps): CI runs `-m soak` after the README's test
# command, `-m "not soak"`, which runs the fast tests and the docs' in about 10 minutes.
DOCS_MODULES = {"test_shown_commands", "test_docs"}


# The suite runs in two processes (pytest-xdist, `-n 2 --dist loadfile`: a module's tests, and its fixtures,
# stay in one of them), each with its own session cluster. The modules that use that cluster start first,
# so that it can stop when they are done (see `pytest_runtest_teardown`); within each group, the longest
# start first, so that neither process is left with a long one at the end.
LONGEST_FIRST = ["test_submit", "test_preemption", "test_sweep", "test_slurm", "test_bare_cluster", "test_local_mode",
                 "test_raydata", "test_shutdown", "test_reliability", "test_scripts", "test_cli", "test_distributed"]
SESSION_CLUSTER_MODULES: set[str] = set()  # the modules with a test that asks for `ray_cluster`


def pytest_collection_modifyitems(items):
    for item in items:
        # (a test parametrized by engine asks for the cluster when its engine is "ray")
        on_cluster = "ray_cluster" in item.fixturenames or getattr(item, "callspec", None) and \
            item.callspec.params.get("engine") == "ray"
        if on_cluster:
            SESSION_CLUSTER_MODULES.add(_module(item))
        if on_cluster or _module(item) in RAY_MODULES:
            item.add_marker(pytest.mark.ray)
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("slow") and _module(item) not in DOCS_MODULES:
            item.add_marker(pytest.mark.soak)
    items.sort(key=lambda item: _start_order(_module(item)))


def pytest_collection_finish(session):
    """The environment of test_bare_cluster's cluster takes a minute or two to build the first
    time (tests/barecluster.py): when the module is to run, it starts now, beside the first tests,
    and the module's fixture waits for it (a lock) when it comes."""
    if not any(_module(item) == "test_bare_cluster" for item in session.items):
        return
    log = open(os.path.join(tempfile.gettempdir(), f"raytrain-bare-venv-{os.getpid()}.log"), "wb")
    subprocess.Popen([sys.executable, "-c", "from tests.barecluster import bare_venv; bare_venv()"], cwd=REPO,
                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def _start_order(module: str) -> tuple[bool, int]:
    longest = LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)
    return module not in SESSION_CLUSTER_MODULES, longest


def _module(item) -> str:
    return item.module.__name__.rsplit(".", 1)[-1]


@pytest.fixture(scope="session", autouse=True)
def fork_server():
    """The fork server of `tests.commands`, up before any local-mode run starts it otherwise."""
    from tests import commands

    commands.start()


@pytest.fixture(scope="session", autouse=True)
def running_clusters(tmp_path_factory):
    """`train` joins local clusters that `cluster up` recorded here: the tests' own, never a user's."""
    os.environ["RAYTRAIN_RUNNING_DIR"] = str(tmp_path_factory.mktemp("running"))


@pytest.fixture(scope="module")
def ray_cluster(s3):
    """The session's cluster, started for the first module that asks for it and kept for the next
    ones; `pytest_runtest_teardown` stops it once this process has no more of them."""
    import ray

    if not ray.is_initialized():
        os.chdir(REPO)  # workers import "tests.helpers" from the driver's working directory
        # Workers inherit this environment: the object store's endpoint and credentials, and what the
        # embedded cluster of `train` turns off (Ray Train's preemption watcher and metrics).
        os.environ.update(s3.env, RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="0", RAY_TRAIN_METRICS_ENABLED="0")
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
    return ray


@pytest.hookimpl(trylast=True)  # after the module's own fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    """An idle session cluster and this process's connection to it cost about 4 CPU-seconds a
    minute, taken from the tests that run meanwhile: stop it before a module that does not use it,
    and at the end. The modules that do use it come first (`pytest_collection_modifyitems`), so it
    stops once; one that came later would start it again."""
    if "ray" in sys.modules and (nextitem is None or _module(nextitem) != _module(item)
                                 and _module(nextitem) not in SESSION_CLUSTER_MODULES):
        import ray

        ray.shutdown()


def short_temp_dir() -> str:
    """A temp dir for Ray, whose Unix socket paths under it must fit in 107 bytes (pytest's tmp
    paths are too long); removed when the session ends."""
    path = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    atexit.register(shutil.rmtree, path, True)
    return path


def running(pid: int) -> bool:
    """Alive and not a zombie (an exited process that init has not collected yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3-compatible server (moto) on loopback, with one bucket and real credential checks."""
    from tests.objectstore import start_moto

    proc, store = start_moto(str(tmp_path_factory.mktemp("moto") / "moto.log"))
    yield store
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on loopback (SQLite store, artifacts served through it); its URI."""
    import psutil
    import requests

    from tests.objectstore import free_port

    home = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", f"sqlite:///{home}/mlflow.db",
                             "--artifacts-destination", str(home / "artifacts")],
                            stdout=open(home / "server.log", "wb"), stderr=subprocess.STDOUT, cwd=home)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if requests.get(f"{uri}/health", timeout=2).ok:
                break
        except requests.RequestException:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, (home / "server.log").read_text()[-2000:]
        time.sleep(0.5)
    yield uri
    server = psutil.Process(proc.pid)  # the server and the web workers it started
    for p in [*server.children(recursive=True), server]:
        p.terminate()
    psutil.wait_procs([server], timeout=30)


TUTORIAL_SCRIPT = "tests/scripts/tutorial_ddp.py"


@pytest.fixture(scope="session")
def torchrun_reference(tmp_path_factory) -> tuple[list[str], str]:
    """The tutorial-style script under plain `torchrun --nproc_per_node 2`: rank 0's epoch lines
    and its checkpoint, for the launchers that must give the same."""
    from raytrain_app.data.parquet import DIGITS_FILE

    checkpoint = str(tmp_path_factory.mktemp("torchrun") / "model.pt")
    for _ in range(2):  # torch's Gloo has aborted at process exit here once ("terminate called without an
        # active exception", after the script had finished): a second launch tells that from a broken script
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               TUTORIAL_SCRIPT, "--data", str(DIGITS_FILE), "--checkpoint", checkpoint], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        if proc.returncode == 0:
            break
    assert proc.returncode == 0, proc.stderr
    return epoch_lines(proc.stdout), checkpoint


def epoch_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("epoch ")]


def sweep_table(stdout: str) -> dict[str, list[str]]:
    """A sweep's table: each trial's row (parameters, best metric, epochs, status) by its name."""
    lines = stdout[stdout.index("TRIAL "):].splitlines()[1:]
    return {line.split()[0]: line.split(None, 4)[1:] for line in lines if line.startswith("trial-")}
