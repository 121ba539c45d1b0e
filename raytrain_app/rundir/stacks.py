"""Every rank's stack on request: `raytrain-app stack RUN_DIR` leaves a request in the run
directory, and the live run's driver, which holds each rank's latest heartbeat, answers beside
it. The run directory is the one address both know, whatever the engine and wherever the driver
runs (a cluster's head, a SLURM node); the request costs the driver a look every few seconds."""

from __future__ import annotations

import time
import uuid
from typing import Callable, Optional

from raytrain_app import storage
from raytrain_app.errors import UserError
from raytrain_app.rundir import read_record
from raytrain_app.rundir.layout import STACK_REQUEST, STACKS

ANSWER_WITHIN_S = 20.0


def request(run_dir: str, wait_s: float = ANSWER_WITHIN_S) -> str:
    """Ask the live run for every rank's stack and wait for its answer (the text)."""
    status = read_record(run_dir).get("status")
    if status is None:
        raise UserError(f"{run_dir} is not a run directory (it has no run.json)")
    if status != "running":
        raise UserError(f"the run in {run_dir} is not training now (run.json says {status}): no stacks to show")
    token = uuid.uuid4().hex
    storage.write_text(storage.join(run_dir, STACK_REQUEST), token)
    deadline = time.monotonic() + wait_s
    answer = storage.join(run_dir, STACKS)
    while time.monotonic() < deadline:
        if storage.exists(answer):
            first, _, text = storage.read_text(answer).partition("\n")
            if first == f"# {token}":
                return text
        time.sleep(0.5)
    storage.remove(storage.join(run_dir, STACK_REQUEST))  # unanswered: no driver finds it later
    raise UserError(f"no live run answered in {run_dir} within {wait_s:.0f}s: is it training now "
                    "(`raytrain-app runs` says)?")


def answer_if_asked(run_dir: str, stacks: Callable[[], str]) -> Optional[str]:
    """The driver's side: where a request waits, write `stacks()` as its answer; the request's token."""
    path = storage.join(run_dir, STACK_REQUEST)
    if not storage.exists(path):
        return None
    token = storage.read_text(path).strip()
    storage.write_text(storage.join(run_dir, STACKS), f"# {token}\n{stacks()}")
    storage.remove(path)
    return token
