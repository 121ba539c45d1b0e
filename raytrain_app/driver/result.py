"""What a finished run returns, and its end-of-run summary table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raytrain_app.config import JobConfig
from raytrain_app.console import eval_metrics, metric_value, summary_table


@dataclass
class Result:
    """What a finished run leaves: where it is, its epochs' metrics, and its checkpoints (URIs)."""

    config: JobConfig  # resolved: every default and `auto` decided
    run_dir: str
    metrics: list[dict]  # one row per epoch, as in metrics.jsonl
    best_checkpoint: Optional[str]  # by checkpoint.metric
    best_metrics: Optional[dict]  # that checkpoint's row
    final_checkpoint: Optional[str]
    wall_s: float  # the command's, from its start
    report: Optional[str] = None  # report.png, the run's curves
    stopped_early: Optional[str] = None  # why train.early_stopping ended it before train.epochs


def summary(result: Result) -> str:
    last = result.metrics[-1] if result.metrics else {}
    best = result.best_metrics or {}
    c = result.config
    if c.script:  # the script printed its own story; this is where it is kept
        return summary_table([
            ("run", result.run_dir),
            ("script", " ".join([c.script.path, *c.script.args])),
            ("workers", c.scaling.describe_workers()),
            ("reports", f"{len(result.metrics)} in metrics.jsonl" + (f", last: {_values(last)}" if last else "")),
            ("final checkpoint", result.final_checkpoint or "-"),
            ("report", result.report or "-"),
            ("wall time", f"{result.wall_s:.1f}s"),
        ])
    rows = [
        ("run", result.run_dir),
        ("workers", f"{c.scaling.describe_workers()} x {c.scaling.backend}, {c.train.precision}"),
        ("epochs", f"{last.get('epoch', 0)} of {c.train.epochs}"),
        *((("stopped early", result.stopped_early.split(": ", 1)[1]),) if result.stopped_early else ()),
        ("final train_loss", f"{last.get('train_loss', float('nan')):.4f}"),
        ("final eval_loss", f"{last.get('eval_loss', float('nan')):.4f}"),
        *((f"final {name}", text.strip()) for name, text in eval_metrics(last)),
        (f"best {c.checkpoint.metric}",
         f"{metric_value(c.checkpoint.metric, best.get(c.checkpoint.metric, float('nan')))} "
         f"(epoch {best.get('epoch', '-')})"),
        ("best checkpoint", result.best_checkpoint or "-"),
        ("throughput", f"{last.get('samples_per_s', 0):,.0f} samples/s"),
    ]
    if "comm_frac" in last:
        rows.append(("last epoch's time", f"data {last['data_wait_frac']:.0%}, comm ~{last['comm_frac']:.0%}, "
                                          f"compute {last['compute_frac']:.0%}"))
    if "mfu" in last:
        rows.append(("MFU", f"{last['mfu']:.1%} ({last['tflops_per_worker']:.1f} TFLOP/s per GPU)"))
    rows.append(("report", result.report or "-"))
    rows.append(("wall time", f"{result.wall_s:.1f}s"))
    return summary_table(rows)


def _values(row: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                     if k not in ("report", "checkpoint", "time"))
