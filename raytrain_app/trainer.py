"""Plan -> Ray Train: build the TorchTrainer, run it, and collect what the workers report.

The driver listens on a Ray queue for rank 0's events (per-epoch metrics, in-epoch progress)
while `fit()` runs, prints them, and keeps `metrics.jsonl` in the run directory up to date.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Optional

import ray
import ray.train
from ray.train.torch import TorchConfig, TorchTrainer
from ray.util.queue import Empty, Queue

from raytrain_app import storage
from raytrain_app.config import CheckpointConfig, JobConfig, dump_yaml
from raytrain_app.console import Progress, epoch_line, startup_line, startup_phases
from raytrain_app.errors import TrainingFailed, UserError, last_line
from raytrain_app.loop import train_loop_per_worker
from raytrain_app.plan import RunPlan

# Ray Train polls its workers every 2 s by default, which adds up to that much to every start
# and finish; polling a handful of local actors more often is cheap.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


@dataclass
class RunResult:
    run_dir: str
    history: list[dict]
    best_checkpoint: Optional[str]
    best_metrics: Optional[dict]
    last_checkpoint: Optional[str]
    wall_s: float
    metrics: dict = field(default_factory=dict)


def run_training(plan: RunPlan, progress: bool = False, echo=print, marks: Optional[dict] = None) -> RunResult:
    """Run the plan on the Ray cluster this process is connected to.

    `marks` are the caller's wall-clock start-up marks ("start", "planned", "cluster"); with the
    workers' own they become the start-up breakdown printed at the first step and kept in
    `startup.json`.
    """
    config = plan.config
    check_resources(plan)
    storage.write_text(storage.join(plan.run_dir, "config.yaml"), dump_yaml(config))
    history = MetricsLog(storage.join(plan.run_dir, "metrics.jsonl"), resume=plan.resume)

    # One timeout for both layers: torch's process group (TorchConfig below) and Ray Train's own
    # collectives such as the barrier inside ray.train.report, which has none by default.
    os.environ["RAY_TRAIN_COLLECTIVE_TIMEOUT_S"] = str(config.scaling.timeout_s)
    events = Queue()
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"job": config.to_dict(), "events": events, "progress": progress,
                           "log_dir": plan.log_dir, "cwd": os.getcwd()},
        scaling_config=ray.train.ScalingConfig(num_workers=config.scaling.workers, use_gpu=plan.use_gpu,
                                               resources_per_worker=plan.resources_per_worker,
                                               placement_strategy=config.scaling.placement),
        torch_config=TorchConfig(backend=config.scaling.backend, timeout_s=config.scaling.timeout_s),
        run_config=ray.train.RunConfig(
            name=os.path.basename(plan.run_dir),
            storage_path=os.path.dirname(plan.run_dir),
            failure_config=ray.train.FailureConfig(max_failures=config.failure.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=config.checkpoint.keep,
                checkpoint_score_attribute=config.checkpoint.metric,
                checkpoint_score_order=config.checkpoint.mode,
            ),
        ),
    )
    marks = {**(marks or {}), "fit": time.time()}
    listener = EventListener(events, history, Progress(progress), config.train.epochs, echo, marks,
                             storage.join(plan.run_dir, "startup.json"))
    listener.start()
    t0 = time.perf_counter()
    try:
        result = trainer.fit()
    except ray.train.TrainingFailedError as e:
        raise _explain(e, config) from None
    except (SystemExit, ray.exceptions.RayActorError):
        # Ray Train's own SIGINT handler aborts the run by killing its controller, then exits 0.
        # An interrupted run is not a successful one.
        raise KeyboardInterrupt from None
    finally:
        listener.stop()
        ray.kill(events.actor)
    best_checkpoint, best_metrics = _best(result.best_checkpoints or [], config.checkpoint)
    return RunResult(
        run_dir=plan.run_dir,
        history=history.rows(),
        best_checkpoint=best_checkpoint,
        best_metrics=best_metrics,
        last_checkpoint=result.checkpoint.path if result.checkpoint else None,
        wall_s=time.perf_counter() - t0,
        metrics=result.metrics or {},
    )


def _best(checkpoints: list, config: CheckpointConfig) -> tuple[Optional[str], Optional[dict]]:
    if not checkpoints:
        return None, None
    scored = [(c, m) for c, m in checkpoints if m.get(config.metric) == m.get(config.metric)]  # not NaN
    if not scored:
        return None, None
    pick = max if config.mode == "max" else min
    checkpoint, metrics = pick(scored, key=lambda cm: cm[1][config.metric])
    return checkpoint.path, metrics


def check_resources(plan: RunPlan) -> None:
    """Fail now if the cluster cannot place the workers, rather than wait forever for them."""
    s = plan.config.scaling
    have = ray.cluster_resources()
    for resource, per_worker in plan.resources_per_worker.items():
        need = per_worker * s.workers
        if have.get(resource, 0) < need:
            raise UserError(f"the cluster has {have.get(resource, 0):g} {resource}s but {s.workers} workers x "
                            f"{per_worker:g} {resource} need {need:g}")


class MetricsLog:
    """metrics.jsonl, one object per epoch; a re-run epoch (after a restart) replaces its row."""

    def __init__(self, path: str, resume: bool):
        self.path = path
        self._rows: dict[int, dict] = {}
        if resume and storage.exists(path):
            for line in storage.read_text(path).splitlines():
                if line.strip():
                    row = json.loads(line)
                    self._rows[row["epoch"]] = row

    def add(self, row: dict) -> None:
        self._rows[row["epoch"]] = row
        self._rows = {e: r for e, r in self._rows.items() if e <= row["epoch"]}
        storage.write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.rows()))

    def rows(self) -> list[dict]:
        return [self._rows[e] for e in sorted(self._rows)]


class EventListener(threading.Thread):
    """Drains rank 0's events while fit() blocks the main thread."""

    def __init__(self, events: Queue, log: MetricsLog, progress: Progress, epochs: int, echo, marks: dict,
                 startup_file: str):
        super().__init__(daemon=True)
        self.events, self.log, self.progress, self.epochs, self.echo = events, log, progress, epochs, echo
        self.marks, self.startup_file = marks, startup_file
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            with suppress(Empty, ray.exceptions.RayError):  # nothing queued within 0.2 s
                self._handle(*self.events.get(timeout=0.2))

    def stop(self) -> None:
        """Stop listening, then handle what is still queued (the last epoch's event may be)."""
        self._stop_event.set()
        self.join()
        with suppress(Empty, ray.exceptions.RayError):  # drained
            while True:
                self._handle(*self.events.get_nowait())
        self.progress.close()

    def _handle(self, kind: str, payload) -> None:
        if kind == "progress":
            self.progress.update(*payload)
        elif kind == "startup":
            phases = startup_phases({**self.marks, **payload})
            storage.write_text(self.startup_file, json.dumps(phases, indent=1) + "\n")
            self.progress.close()
            self.echo(startup_line(phases))
        elif kind == "notice":
            self.progress.close()
            self.echo(f"warning: {payload}")
        else:
            self.log.add(payload)
            self.progress.close()
            self.echo(epoch_line(payload, self.epochs))


def _explain(error: ray.train.TrainingFailedError, config: JobConfig) -> Exception:
    """One clause per failed rank: where it ran and its last error line, not Ray's nested tracebacks."""
    failures = getattr(error, "worker_failures", None) or {}
    if failures and all(isinstance(e, UserError) for e in failures.values()):
        return UserError(last_line(next(iter(failures.values()))))
    if not failures:
        return TrainingFailed(_describe(getattr(error, "controller_failure", error)))
    clauses = [f"rank {rank}{_where(e)}: {_describe(e)}" for rank, e in sorted(failures.items())]
    waiting = sorted(rank for rank, e in failures.items() if _TIMEOUT.search(str(e)))
    if waiting:
        stalled = sorted(set(range(config.scaling.workers)) - set(failures))
        clauses.insert(0, f"a collective timed out after {config.scaling.timeout_s}s (scaling.timeout_s): "
                          f"rank(s) {_ranks(waiting)} were waiting; "
                          f"rank(s) {_ranks(stalled) if stalled else 'unknown'} stalled")
    return TrainingFailed("; ".join(clauses))


_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _where(e: BaseException) -> str:
    """" on IP (pid N)" from what Ray's worker errors say about the process."""
    text = str(e)
    ip = re.search(r"\bip[=:]\s*([0-9a-fA-F.:]+[0-9a-fA-F])", text)
    pid = re.search(r"\bpid[=:]\s*(\d+)", text)
    return (f" on node {ip.group(1)}" if ip else "") + (f" (pid {pid.group(1)})" if pid else "")


def _describe(e: BaseException) -> str:
    """`Type: message` for a plain exception; the last line for one that carries a traceback;
    Ray's exit detail for a worker process that died."""
    died = re.search(r"Worker exit detail: ([^\n]+?)(?: The (?:process|worker)|$)", str(e), re.MULTILINE)
    if died:
        return f"worker process died: {died.group(1).strip()}"
    line = last_line(e)
    return line if "\n" in str(e).strip() else f"{type(e).__name__}: {line}"
