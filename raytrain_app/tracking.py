"""Where a run's numbers go besides metrics.jsonl: TensorBoard event files, an MLflow run, a W&B run.

Rank 0 writes them from inside its worker, so step-level numbers never cross Ray's queue and a
submitted job logs from the cluster with the cluster's credentials. The trackers' run ids are kept
in RUN_DIR/tracking.json: a restarted or resumed run continues the same runs, and each tracker
drops what the restart repeats, so a run shows one curve, not two overlapping ones:
TensorBoard purges the events after the restored step; MLflow and W&B skip the steps they already
hold (resume is exact, so the repeated values would be the same).

The driver closes the runs (`finish`): only it knows the outcome and the best checkpoint, which
Ray's checkpoint index keeps.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import time
from typing import Optional

from raytrain_app import storage
from raytrain_app.config import JobConfig
from raytrain_app.config.sections import MlflowConfig, TrackingConfig
from raytrain_app.errors import UserError

TRACKING_FILE = "tracking.json"
EXTRAS = {"mlflow": "mlflow", "wandb": "wandb"}


def check(config: TrackingConfig, run_dir: str, timeout_s: float = 10.0, env: Optional[dict] = None,
          packages: bool = True) -> None:
    """Before Ray starts: the trackers' packages import, an MLflow server answers, and online W&B
    has its key in `env` (this process's environment; for `submit`, with the profile's env_vars,
    and without the package check: the cluster, not this machine, needs them)."""
    env = os.environ if env is None else env
    for name, package in EXTRAS.items():
        if packages and getattr(config, name) is not None:
            try:
                __import__(package)
            except ImportError:
                raise UserError(f"tracking.{name} needs the {package} package: pip install 'raytrain-app[{name}]'")
    if config.mlflow is not None:
        uri = mlflow_uri(config.mlflow, run_dir, env)
        if uri.startswith(("http://", "https://")):
            import requests

            try:
                requests.get(uri.rstrip("/") + "/health", timeout=timeout_s).raise_for_status()
            except requests.RequestException as e:
                raise UserError(f"tracking.mlflow.tracking_uri {uri} does not answer: {type(e).__name__}") from None
    if config.wandb is not None and config.wandb.mode == "online" and not env.get("WANDB_API_KEY"):
        raise UserError("tracking.wandb.mode online needs WANDB_API_KEY in the environment (or the profile's "
                        "runtime_env.env_vars); mode: offline needs none")


def mlflow_uri(config: MlflowConfig, run_dir: str, env: Optional[dict] = None) -> str:
    uri = config.tracking_uri or (os.environ if env is None else env).get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    if not storage.is_local(run_dir):
        raise UserError("tracking.mlflow.tracking_uri is needed with a run directory on object storage "
                        "(a local MLflow database lives in the run directory)")
    return f"sqlite:///{os.path.abspath(os.path.join(run_dir, 'mlflow.db'))}"


class Trackers:
    """Rank 0's open tracker runs (other ranks hold none, and every call is then a no-op), and the
    step-level stream: rank 0's mean loss, the lr, and samples/s since the last point."""

    def __init__(self, job: JobConfig, run_dir: str, rank: int, world_size: int, state):
        """`state`: the TrainState as restored (or fresh); a restart continues its step and, inside
        an epoch, takes its next point from the restored position."""
        t = job.tracking
        self.every, self.world_size, self.run_dir = t.log_every_steps, world_size, run_dir
        self.writers: list[Tracker] = []
        if rank != 0:
            return
        ids_file = storage.join(run_dir, TRACKING_FILE)
        recorded = json.loads(storage.read_text(ids_file)) if storage.exists(ids_file) else {}
        name = os.path.basename(run_dir.rstrip("/"))
        if t.tensorboard:
            self.writers.append(TensorBoard(run_dir, state.step))
        if t.mlflow is not None:
            self.writers.append(MLflow(t.mlflow, run_dir, job.name, name, recorded.get("mlflow")))
        if t.wandb is not None:
            self.writers.append(WandB(t.wandb, run_dir, name, recorded.get("wandb")))
        ids = {w.key: record for w in self.writers if (record := w.record()) is not None}
        if ids != recorded:
            storage.write_text(ids_file, json.dumps(ids, indent=1) + "\n")
        if not recorded:  # the config once per run, not once per restart
            for w in self.writers:
                w.config(_flat(job.to_dict()), job)
        inside = state.batch and state.totals  # restored inside an epoch
        self._mark = ((state.totals.samples, float(state.totals.sums[0]), state.clock.elapsed()) if inside else
                      (0, 0.0, 0.0))  # samples, loss sum, seconds: where the last point was taken

    def step(self, state) -> None:
        """After an optimizer step (a TrainState): every `log_every_steps` steps, one point from
        rank 0's epoch-to-date totals (read only then: reading them waits for the device)."""
        if not self.writers or not self.every or state.step % self.every:
            return
        step, samples, loss_sum = state.step, state.totals.samples, float(state.totals.sums[0])
        seconds, lr = state.clock.elapsed(), state.optimizer.param_groups[0]["lr"]
        if samples < self._mark[0]:  # a new epoch: its totals started again from zero
            self._mark = (0, 0, 0.0)
        n, total, spent = samples - self._mark[0], loss_sum - self._mark[1], seconds - self._mark[2]
        self._mark = (samples, loss_sum, seconds)
        if n:
            self._scalars({"step/train_loss": total / n, "step/lr": lr,
                           "step/samples_per_s": n * self.world_size / max(spent, 1e-9)}, step)

    def startup(self, phases: dict) -> None:
        self._scalars({f"startup/{re.sub(r'[^0-9A-Za-z]+', '_', k)}_s": v for k, v in phases.items()}, 1)

    def epoch(self, metrics: dict) -> None:
        self._scalars({f"epoch/{k}": v for k, v in metrics.items()}, metrics["step"])
        self.sync()

    def sync(self) -> None:
        """Before each checkpoint and after each epoch: the curves are durable as far as any
        checkpoint a restart resumes from (which purges what came after it)."""
        for w in self.writers:
            w.sync()

    def close(self) -> None:
        for w in self.writers:
            w.close()

    def _scalars(self, values: dict, step: int) -> None:
        numbers = {k: float(v) for k, v in values.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        for w in self.writers:
            w.scalars(numbers, step)


def finish(config: TrackingConfig, run_dir: str, status: str, best_checkpoint: Optional[str] = None,
           best_metrics: Optional[dict] = None) -> None:
    """On the driver at the end: mark the MLflow run FINISHED, FAILED or KILLED, and point it at
    the best checkpoint (a reference, or a copy with `log_checkpoint`)."""
    ids_file = storage.join(run_dir, TRACKING_FILE)
    if config.mlflow is None or not storage.exists(ids_file):
        return
    recorded = json.loads(storage.read_text(ids_file)).get("mlflow")
    if not recorded:
        return
    from mlflow import MlflowClient

    client = MlflowClient(recorded["tracking_uri"])
    run_id = recorded["run_id"]
    if best_checkpoint:
        client.set_tag(run_id, "best_checkpoint", best_checkpoint)
        client.log_dict(run_id, {"uri": best_checkpoint, "metrics": best_metrics}, "best_checkpoint.json")
        if config.mlflow.log_checkpoint:
            with tempfile.TemporaryDirectory() as local:
                copy = os.path.join(local, os.path.basename(best_checkpoint.rstrip("/")))
                storage.download(best_checkpoint, copy)
                client.log_artifacts(run_id, copy, "best_checkpoint")
    client.set_terminated(run_id, status)


class Tracker:
    """What every tracker does; each overrides what it needs."""

    key: str  # its entry in tracking.json

    def record(self) -> Optional[dict]:
        """What a restart needs to continue this run (tracking.json), if anything."""
        return None

    def config(self, flat: dict, job: JobConfig) -> None:
        """The resolved config, once per run."""

    def scalars(self, values: dict, step: int) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        """After every epoch: make what was written durable."""

    def close(self) -> None:
        """When the loop ends; the driver sets a run's final status (`finish`)."""


class TensorBoard(Tracker):
    """Event files in RUN_DIR/tensorboard; on object storage, written locally and uploaded after
    every epoch. `purge_step` makes TensorBoard drop a failed attempt's events past the restored step."""

    key = "tensorboard"

    def __init__(self, run_dir: str, restored_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.target = storage.join(run_dir, "tensorboard")
        self.remote = not storage.is_local(run_dir)
        local = tempfile.mkdtemp(prefix="raytrain-tb-") if self.remote else self.target
        self.writer = SummaryWriter(local, purge_step=restored_step + 1)

    def config(self, flat: dict, job: JobConfig) -> None:
        from torch.utils.tensorboard.summary import hparams

        for summary in hparams(flat, {"epoch/eval_loss": float("nan")}):
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("config", "```\n" + json.dumps(job.to_dict(), indent=1) + "\n```", 0)

    def scalars(self, values: dict, step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def sync(self) -> None:
        self.writer.flush()
        if self.remote:
            storage.upload(self.writer.log_dir, self.target)

    def close(self) -> None:
        self.sync()
        self.writer.close()


class MLflow(Tracker):
    """An MLflow run through `MlflowClient` (no global active run to leak into user code)."""

    key = "mlflow"

    def __init__(self, config: MlflowConfig, run_dir: str, job_name: str, name: str, recorded: Optional[dict]):
        from mlflow import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)
        self.uri = recorded["tracking_uri"] if recorded else mlflow_uri(config, run_dir)
        self.client = MlflowClient(self.uri)
        self.logged_until = -1  # the last step this run already holds
        if recorded:
            self.run_id = recorded["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            held = [m.step for key in ("step/train_loss", "epoch/train_loss")
                    for m in self.client.get_metric_history(self.run_id, key)]
            self.logged_until = max(held, default=-1)
            return
        experiment = config.experiment or job_name
        found = self.client.get_experiment_by_name(experiment)
        local = self.uri.startswith("sqlite:") and storage.is_local(run_dir)  # artifacts beside the database
        experiment_id = found.experiment_id if found else self.client.create_experiment(
            experiment, artifact_location=os.path.join(os.path.dirname(self.uri[len("sqlite:///"):]), "mlartifacts")
            if local else None)
        run = self.client.create_run(experiment_id, run_name=config.run_name or name, tags={"run_dir": run_dir})
        self.run_id = run.info.run_id

    def record(self) -> dict:
        return {"tracking_uri": self.uri, "run_id": self.run_id}

    def config(self, flat: dict, job: JobConfig) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in flat.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_dict(self.run_id, job.to_dict(), "config.json")

    def scalars(self, values: dict, step: int) -> None:
        from mlflow.entities import Metric

        if step <= self.logged_until and not any(k.startswith("startup/") for k in values):
            return
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])


class WandB(Tracker):
    """A W&B run; offline mode writes RUN_DIR/wandb (local run directories) for `wandb sync`."""

    key = "wandb"

    def __init__(self, config, run_dir: str, name: str, recorded: Optional[dict]):
        import wandb

        self.remote = None if storage.is_local(run_dir) else storage.join(run_dir, "wandb")
        local = tempfile.mkdtemp(prefix="raytrain-wandb-") if self.remote else os.path.abspath(run_dir)
        self.local = os.path.join(local, "wandb")
        self.run = wandb.init(project=config.project, entity=config.entity, mode=config.mode, name=name,
                              id=recorded["id"] if recorded else None, resume="allow", dir=local,
                              settings=wandb.Settings(console="off", silent=True))
        self.logged_until = self.run.step - 1 if recorded else -1

    def record(self) -> dict:
        return {"id": self.run.id, "project": self.run.project}

    def config(self, flat: dict, job: JobConfig) -> None:
        self.run.config.update(flat, allow_val_change=True)

    def scalars(self, values: dict, step: int) -> None:
        if step > self.logged_until:
            self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
        if self.remote:
            storage.upload(self.local, self.remote)


def _flat(tree: dict, prefix: str = "") -> dict:
    """Dotted keys and scalar values, as trackers take hyper-parameters."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else json.dumps(value)
    return flat
