"""What the user sees: one line per epoch, a progress bar on terminals, a final summary.

Ray's own INFO/WARNING chatter goes to `logs/driver.log` in the run directory unless
`--verbose`; worker output stays in Ray's log files (copied into the run directory).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Optional


def route_ray_logs(log_file: Optional[str], verbose: bool) -> None:
    """Send the `ray` loggers to a file instead of the console (or show them, with --verbose)."""
    ray_logger = logging.getLogger("ray")
    for handler in list(ray_logger.handlers):
        ray_logger.removeHandler(handler)
    if verbose:
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        ray_logger.propagate = True
    elif log_file:
        os.makedirs(os.path.dirname(log_file), exist_ok=True)
        handler = logging.FileHandler(log_file)
        ray_logger.propagate = False
    else:
        handler = logging.NullHandler()
        ray_logger.propagate = False
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    ray_logger.addHandler(handler)
    ray_logger.setLevel(logging.INFO if verbose or log_file else logging.ERROR)


def epoch_line(m: dict, epochs: int, nodes: Optional[dict] = None) -> str:
    """One line per epoch; the time split reads "data 2%, comm ~9%": communication is an estimate.
    Slow ranks are named last, on their node (`nodes`: rank -> host, as far as the driver knows)."""
    width = len(str(epochs))
    per_worker = f" ({m['samples_per_s_per_worker']:,.0f}/worker)" if m["world_size"] > 1 else ""
    mfu = f", MFU {m['mfu']:.1%}" if "mfu" in m else ""
    slow = "".join(f" | slow: {slow_rank(s, nodes or {})}" for s in m.get("slow_ranks", ()))
    return (f"epoch {m['epoch']:>{width}}/{epochs} | train_loss {m['train_loss']:.4f} | eval_loss {m['eval_loss']:.4f}"
            f"{''.join(f' | {SHORT.get(name, name)} {text}' for name, text in eval_metrics(m))}"
            f" | {m['samples_per_s']:,.0f} samples/s"
            f"{per_worker}"
            f" | lr {m['lr']:.2e} | {m['epoch_time_s']:.1f}s: data {m['data_wait_frac']:.0%},"
            f" comm ~{m['comm_frac']:.0%}, compute {m['compute_frac']:.0%}{mfu}{slow}")


def slow_rank(s: dict, nodes: dict) -> str:
    """"rank 3 on node X: 1.8x the median step, 62% waiting for data"."""
    where = f" on node {nodes[s['rank']]}" if s["rank"] in nodes else ""
    return f"rank {s['rank']}{where}: {s['x_median']:.1f}x the median step, {s['data_wait_frac']:.0%} waiting for data"


def eval_metrics(m: dict) -> list[tuple[str, str]]:
    """The task's eval metrics of a metrics row, as shown: shares as percentages, the rest as numbers."""
    shown = []
    for key, value in m.items():
        if key.startswith("eval_") and key not in ("eval_loss", "eval_samples"):
            shown.append((key, metric_value(key, value).rjust(7 if key in PERCENTAGES else 0)))
    return shown


def count(n: int, noun: str) -> str:
    """"1 worker", "2 workers"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def metric_value(key: str, value: float) -> str:
    """A metric as the console shows it everywhere: shares as percentages, the rest as numbers."""
    return f"{value * 100:.2f}%" if key in PERCENTAGES else f"{value:.4f}"


PERCENTAGES = {"eval_accuracy", "eval_top5"}
SHORT = {"eval_accuracy": "eval_acc"}

STARTUP_PHASES = [
    ("imports+checks", "start", "planned"),
    ("cluster", "planned", "cluster"),
    ("worker group", "fit", "loop"),
    ("data+model", "loop", "ready"),
    ("first step", "ready", "first_step"),
]


def startup_phases(marks: dict) -> dict:
    """Seconds per start-up phase, from wall-clock marks taken on the driver and on rank 0."""
    phases = {name: marks[b] - marks[a] for name, a, b in STARTUP_PHASES if a in marks and b in marks}
    if "start" in marks and "first_step" in marks:
        phases["total"] = marks["first_step"] - marks["start"]
    return {k: round(v, 3) for k, v in phases.items()}


def startup_line(phases: dict) -> str:
    parts = ", ".join(f"{k} {v:.1f}s" for k, v in phases.items() if k != "total")
    return f"first step after {phases.get('total', 0):.1f}s ({parts})"


class Progress:
    """A tqdm bar per epoch, driven by rank 0's progress events; silent when not on a terminal."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None

    def update(self, epoch: int, done: int, total: int) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        if self.bar is None or self.bar.desc != f"epoch {epoch}":
            self.close()
            self.bar = tqdm(total=total, desc=f"epoch {epoch}", unit="step", leave=False, file=sys.stdout)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def columns(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """The one table printer: aligned columns under a header, two spaces apart, the last one
    unpadded (it may be long: a path)."""
    lines = [header, *rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join("  ".join([*(cell.ljust(w) for cell, w in zip(line, widths)), line[-1]]) for line in lines)


JOB_COLUMNS = ("ID", "NAME", "STATUS", "START", "DURATION", "WORKERS", "RUN DIR")


def jobs_table(rows: list[dict]) -> str:
    """`list`'s table of an engine's jobs (`Backend.jobs` rows)."""
    return columns(JOB_COLUMNS, [(r["id"], r["name"], r["status"],
                                  time.strftime("%Y-%m-%d %H:%M", time.localtime(r["start"])) if r["start"] else "-",
                                  duration(r["duration_s"]), r["workers"], r["run_dir"]) for r in rows])


def duration(seconds: Optional[float]) -> str:
    """A job's running time as `list` shows it: 4m05s, 2h03m."""
    if seconds is None:
        return "-"
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{s:02d}s"


def summary_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    rule = "-" * (width + 2 + max(len(v) for _, v in rows))
    return "\n".join([rule, *(f"{k:<{width}}  {v}" for k, v in rows), rule])
