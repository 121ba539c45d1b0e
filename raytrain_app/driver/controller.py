"""What runs in Ray Train's controller: the run's callbacks. Ray Train hands the run's config,
these callbacks in it, to every worker too, and a script's workers load no torch
(`worker/script_on_ray.py`), so this module loads without it.
"""

from __future__ import annotations

import time
from typing import Optional

from ray.train.v2.api.callback import UserCallback
from ray.util.queue import Queue

from raytrain_app import rundir, storage
from raytrain_app.config.sections import FailureConfig
from raytrain_app.driver.hangs import who
from raytrain_app.errors import RestartsSpent, describe_rank, process_died
from raytrain_app.worker import preemption
from raytrain_app.worker.script import combined


class RestartNotices(UserCallback):
    """In Ray Train's controller: one console line when a worker fails and the group restarts, and
    the count of failures against `failure.max_failures` apart from preemptions.

    Ray's own account of a dead worker is a paragraph printed by the driver (kept in driver.log);
    this says which rank failed, where, why, and which checkpoint the restart continues from.

    Ray Train charges a preemption to `max_preemption_failures` only when the node went after its
    drain's deadline (Ray then marks its workers' deaths `preempted`, or stops the group itself);
    a node stopped before it (a cloud that reclaims early, a pod's shorter grace) kills the
    workers in what Ray Train counts as a plain failure. Its policy is not ours to set, so Ray
    Train gets both budgets as one (`failure_config`) and this keeps them apart: ranks that died
    within a notice the workers answered (`preemption.ANSWERED`, in the report of the checkpoint
    they wrote for it) count as a preemption, others as a failure. A budget spent ends the run
    from here (`RestartsSpent`, which Ray Train raises as a controller error: `explain_failure`
    words it as it words Ray Train's own).
    """

    def __init__(self, events: Queue, run_dir: str, failure: FailureConfig, restarts=None, stop_flag=None):
        self.events, self.run_dir, self.stop_flag = events, run_dir, stop_flag
        self.budgets = {"restart": failure.max_failures, "preemption": failure.max_preemption_failures}
        self.grace_ms = failure.preemption_grace_s * 1000
        self.restarts = restarts  # a script run's RestartCount
        self.spent = {"restart": 0, "preemption": 0}
        self.latest: Optional[str] = None
        self.answered: Optional[dict] = None  # the latest notice the workers answered: its ranks and deadline

    def after_report(self, run_context, metrics, checkpoint) -> None:
        if checkpoint is not None:
            self.latest = storage.checkpoint_uri(self.run_dir, checkpoint)
        self.answered = metrics[0].get(preemption.ANSWERED) or self.answered

    def after_exception(self, run_context, worker_exceptions: dict) -> None:
        self.events.put(("ended", None))
        # A rank whose process died is the cause; the others' broken collectives are the effect.
        died = [r for r, e in worker_exceptions.items() if process_died(e)]
        rank = min(died or worker_exceptions)
        what = describe_rank(rank, worker_exceptions[rank])
        hang = self.stop_flag.take_hang() if self.stop_flag is not None else None
        then = f"restarting from {self.latest or 'the start'}"
        if hang:  # the driver's hang watch killed the rank (and said why): a failure, said as the hang it was
            what = who(hang)
        if any(_preempted_by_ray(e) for e in worker_exceptions.values()):  # Ray Train counts it itself
            kind, said = "preemption", f"its node was preempted: {then}"
        else:
            kind = "preemption" if self._drained(died) else "restart"
            self.answered = None  # the next group's notices are its own
            self.spent[kind] += 1
            budget = self.budgets[kind]
            if budget != -1 and self.spent[kind] > budget:
                raise RestartsSpent(worker_exceptions, hang)
            drained = "its node was being drained (a preemption); " if kind == "preemption" else ""
            said = f"{drained}{then} ({kind} {self.spent[kind]} of {'unlimited' if budget == -1 else budget})"
        if self.restarts is not None:
            self.restarts.add.remote()
        self.events.put(("notice", f"{what}; {said}"))
        rundir.record_restart(self.run_dir, "hang" if hang and kind == "restart" else kind, hang or what)

    def _drained(self, died: list[int]) -> bool:
        """The ranks died within the notice the workers answered: before its deadline (and grace),
        which Ray Train would have waited out, on the nodes it named."""
        notice = self.answered
        if not (notice and died and set(died) <= set(notice["ranks"])):
            return False
        return not notice["deadline_ms"] or time.time() * 1000 <= notice["deadline_ms"] + self.grace_ms


def _preempted_by_ray(e: BaseException) -> bool:
    """Ray marked the worker's death a preemption (its node went at its drain's deadline), as
    Ray Train's policy reads it: a health check's failure wrapping a `RayActorError.preempted`."""
    return bool(getattr(getattr(e, "health_check_failure", e), "preempted", False))


class ScriptReports(UserCallback):
    """In Ray Train's controller: each `raytrain_app.report` of a script, all ranks' values
    combined (`script.combined`), to the driver's metrics.jsonl."""

    def __init__(self, events: Queue, run_dir: str):
        self.events, self.run_dir = events, run_dir

    def after_report(self, run_context, metrics, checkpoint) -> None:
        row = combined(metrics)
        row.pop(preemption.ANSWERED, None)  # the restart accounting's (RestartNotices), not the script's
        if checkpoint is not None:
            row["checkpoint"] = storage.checkpoint_uri(self.run_dir, checkpoint)
        self.events.put(("report", row))
