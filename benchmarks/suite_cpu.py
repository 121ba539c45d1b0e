"""Where the test suite's time goes: a pytest plugin that counts the machine's busy CPU-seconds
over each test (its setup, call and teardown: the Ray clusters, servers and processes it starts
included) and prints them per module at the end, with the wall time.

On a machine whose cores the suite keeps busy, the CPU-seconds, not the wall time of a test,
say what a change saves: a test that sleeps costs the other process nothing. The count is the
whole machine's, so run it in one process on an otherwise idle machine, each test's count then
its own:

    python -m pytest -n 0 -p benchmarks.suite_cpu                  # the whole suite, about 40 min on 2 cores
    python -m pytest -n 0 -p benchmarks.suite_cpu tests/test_sweep.py

Each test's row is also appended to suite-cpu.jsonl (SUITE_CPU_FILE), to compare two runs. The
summary ends with the tests whose `slow` marker the count contradicts.
"""

from __future__ import annotations

import collections
import json
import os
import time

import psutil
import pytest

FILE = os.environ.get("SUITE_CPU_FILE", "suite-cpu.jsonl")
SLOW_CPU_S = 10  # what `@pytest.mark.slow` means (pyproject.toml)
_rows: list[dict] = []


def _busy_s() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _busy_s(), time.monotonic()
    yield
    row = {"test": item.nodeid, "cpu_s": round(_busy_s() - cpu, 1), "wall_s": round(time.monotonic() - wall, 1),
           "slow": item.get_closest_marker("slow") is not None}
    _rows.append(row)
    with open(FILE, "a") as f:
        f.write(json.dumps(row) + "\n")


def pytest_terminal_summary(terminalreporter):
    if not _rows:
        return
    modules: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for row in _rows:
        m = modules[row["test"].split("::")[0]]
        m[0], m[1], m[2] = m[0] + row["cpu_s"], m[1] + row["wall_s"], m[2] + 1
    cpu, wall, cores = sum(r["cpu_s"] for r in _rows), sum(r["wall_s"] for r in _rows), psutil.cpu_count()
    say = terminalreporter.write_line
    terminalreporter.section("CPU-seconds per module (benchmarks/suite_cpu.py)")
    say(f"{'CPU s':>8} {'share':>6} {'wall s':>8} {'tests':>6}  module")
    for name, (c, w, n) in sorted(modules.items(), key=lambda kv: -kv[1][0]):
        say(f"{c:8.0f} {c / cpu:6.1%} {w:8.0f} {n:6d}  {name}")
    say(f"{cpu:8.0f} {'':6} {wall:8.0f} {len(_rows):6d}  in all; on {cores} cores that is at least "
        f"{cpu / cores / 60:.1f} min of wall time, whatever the processes")
    # The `slow` marker keeps `-m "not slow"` an inner loop only while it names the costly tests.
    for row in _rows:
        if row["slow"] != (row["cpu_s"] >= SLOW_CPU_S):
            say(f"{row['cpu_s']:8.1f} CPU s, {'' if row['slow'] else 'not '}marked slow: {row['test']}")
