"""torch.compile's work kept in the run directory (worker/compile_cache.py): a restart on a
machine that never compiled the model (an empty Inductor cache) takes every graph from the run's
archive and compiles none; an archive from another torch is skipped with one line and replaced
by the restart's. Local mode:
two worker processes, each with its own Inductor counters (no Ray under test)."""

import io
import json
import platform
import re
import tarfile

import pytest
import torch

from raytrain_app.config import updated
from raytrain_app.driver.plan import make_plan
from raytrain_app.driver.trainer import run_training
from tests.test_distributed import job, run


def first_steps(run_dir) -> list[tuple[int, int]]:
    """Each rank's (graphs compiled, graphs taken from the cache) at its latest first step."""
    found = []
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        compiled, cached = re.findall(r"first step: Inductor compiled (\d+) graphs and took (\d+) from its cache",
                                      log)[-1]
        found.append((int(compiled), int(cached)))
    return found


def resume(config, run_dir, epochs: int) -> list[str]:
    lines = []
    run_training(make_plan(updated(config, {"train": {"epochs": epochs}}), run_dir=str(run_dir), resume=True,
                           local=True), echo=lines.append)
    return lines


@pytest.mark.slow
def test_a_restart_where_nothing_was_compiled_takes_every_graph_from_the_runs_compile_cache(tmp_path, monkeypatch):
    # Ten batches an epoch, all of one shape: the graphs the test needs, without the ones a short
    # last batch would add.
    config = job(data={"name": "digits"}, train={"epochs": 1, "compile": "default", "limit_batches": 10,
                                                 "limit_eval_batches": 2})
    run_dir = tmp_path / "run"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "machine-1"))
    run(config, run_dir)
    assert all(compiled > 0 and cached == 0 for compiled, cached in first_steps(run_dir))
    archive = run_dir / "compile_cache.bin"
    with tarfile.open(archive) as tar:
        assert json.load(tar.extractfile(tar.next())) == {"torch": torch.__version__,
                                                          "device": f"cpu ({platform.machine()})"}
        assert any(name.endswith(".so") for name in tar.getnames())  # the compiled kernels, not only graphs

    # Compiled by another torch: skipped with one line (on the first machine, whose own cache
    # still has every graph, so this resume costs no compile).
    with tarfile.open(archive) as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    with tarfile.open(archive, "w:gz") as tar:
        old = json.dumps({"torch": "2.4.0", "device": f"cpu ({platform.machine()})"}).encode()
        members[0][0].size = len(old)
        members[0] = (members[0][0], old)
        for member, data in members:
            tar.addfile(member, io.BytesIO(data) if data is not None else None)
    lines = resume(config, run_dir, 2)
    assert [line for line in lines if "compile cache" in line] == [
        f"warning: compile cache ignored: compiled by torch 2.4.0 for cpu ({platform.machine()}), and this worker "
        f"runs torch {torch.__version__} on cpu ({platform.machine()})"]

    with tarfile.open(archive) as tar:  # replaced by the restart, which had what this torch compiled
        assert json.load(tar.extractfile(tar.next()))["torch"] == torch.__version__

    # Another machine, which compiled nothing: every graph of every rank from the run's archive.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "machine-2"))
    lines = resume(config, run_dir, 3)
    assert any(re.fullmatch(rf"compile cache: \d+ compiled files from {archive}", line) for line in lines)
    assert all(compiled == 0 and cached > 0 for compiled, cached in first_steps(run_dir))
