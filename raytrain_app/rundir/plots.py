"""Pictures of a run, for `raytrain-app report`.

A run is easier to judge from its curves than from its console lines: whether the loss still
falls, whether eval parts from train, where throughput dropped and what the time went to
(waiting for data, communication), and how much a restart cost. The usual question is which of
two runs is better, so several runs are drawn on the same axes, one colour each.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import pyarrow as pa

from raytrain_app import rundir, storage
from raytrain_app.console import PERCENTAGES
from raytrain_app.errors import UserError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

COLUMNS = 3
WIDTH_IN, ROW_IN, LEGEND_IN, DPI = 12.0, 3.0, 0.4, 100  # 1200 px wide: a screenshot, not a poster
MAX_SCRIPT_PANELS = 12  # a script may report dozens of numbers; beyond this the panels are too small to read
TIME_SPLIT = [("data_wait_frac", "data", "#fdae61"), ("comm_frac", "comm", "#abd9e9"),
              ("compute_frac", "compute", "#d9d9d9")]  # pale, so the runs' colours stay theirs
INDEX_KEYS = {"report", "epoch", "time", "checkpoint"}  # a script row's position, not its values


@dataclass
class Run:
    name: str  # the run directory's basename, as the legend shows it
    rows: list[dict]  # metrics.jsonl, by epoch (or report)
    restarts: list[dict]  # restarts.jsonl: {"time", "kind", "reason"}
    color: str


def write(run_dirs: list[str], output: str) -> str:
    """Save `figure(run_dirs)` as a PNG at `output` (a local path or URI); returns where it is."""
    return _save(figure(run_dirs), output)


def _save(fig: Figure, output: str) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    try:
        storage.write_bytes(output, buffer.getvalue())
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"cannot write {output}: {storage.explain(e)}") from None
    return storage.normalize(output)


def figure(run_dirs: list[str]) -> Figure:
    """One panel per question (loss, each metric, learning rate, throughput, time split, progress),
    each run a colour on every panel; panels whose data no run has are left out."""
    Figure, FigureCanvasAgg = _matplotlib()
    from matplotlib.lines import Line2D

    if not run_dirs:
        raise UserError("a report needs at least one run directory")
    runs = [_load(run_dir, f"C{i}") for i, run_dir in enumerate(run_dirs)]
    panels, left_out = _panels(runs)
    grid_rows = -(-len(panels) // COLUMNS)
    fig = Figure(figsize=(WIDTH_IN, LEGEND_IN + ROW_IN * grid_rows), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # Agg on this figure only: nothing global (pyplot's backend) changes
    for i, (title, draw) in enumerate(panels):
        ax = fig.add_subplot(grid_rows, COLUMNS, i + 1)
        ax.set_title(title)
        draw(ax)
    fig.legend(handles=[Line2D([], [], color=run.color, label=run.name) for run in runs],
               loc="outside upper center", ncols=len(runs), frameon=False)
    if left_out:
        fig.text(0.005, 0.005, f"not drawn: {', '.join(left_out)}", fontsize="small", color="gray")
    return fig


def confusion(matrix: list[list[int]], title: str, output: str, names: Optional[list[str]] = None) -> str:
    """The confusion matrix of an evaluation as a PNG at `output` (rows: true class, columns:
    predicted, by `names` where the classes have names; each cell's count written in it, up to
    30 classes); returns where it is."""
    Figure, FigureCanvasAgg = _matplotlib()
    classes = len(matrix)
    side = min(12.0, 2.5 + 0.45 * classes)
    fig = Figure(figsize=(side, side), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(matrix, cmap="Blues")
    fig.colorbar(image, ax=ax, shrink=0.8)
    ax.set(title=title, xlabel="predicted class", ylabel="true class")
    if classes <= 30:
        ax.set_xticks(range(classes), **({"labels": names, "rotation": 90} if names else {}))
        ax.set_yticks(range(classes), labels=names)
        peak = max(max(row) for row in matrix) or 1
        for t, row in enumerate(matrix):
            for p, count in enumerate(row):
                ax.text(p, t, str(count), ha="center", va="center", fontsize="small",
                        color="white" if count > peak / 2 else "black")
    return _save(fig, output)


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("report.png needs matplotlib: pip install 'raytrain-app[report]'") from None
    return Figure, FigureCanvasAgg


def _panels(runs: list[Run]) -> tuple[list[tuple[str, Callable[[Axes], None]]], list[str]]:
    """(title, draw) per panel, and the script keys past the cap. A script's rows name their own
    numbers; those the fixed panels do not draw get a panel each."""
    keys = dict.fromkeys(k for run in runs for row in run.rows for k in row)
    index = "epoch" if all("epoch" in row for run in runs for row in run.rows) else "report"
    panels: list[tuple[str, Callable[[Axes], None]]] = []
    drawn: set[str] = set()

    def curves(title: str, series: list[tuple[str, str, str]], percent: bool = False) -> None:
        if any(key in keys for key, _, _ in series):
            panels.append((title, lambda ax: _curves(ax, runs, series, index, percent)))
            drawn.update(key for key, _, _ in series)

    curves("loss", [("train_loss", "train", "-"), ("eval_loss", "eval", "--")])
    metrics = dict.fromkeys(k.split("_", 1)[1] for k in keys if k.startswith(("eval_", "train_")))
    for name in [name for name in metrics if name not in ("loss", "samples")]:
        curves(name, [(f"train_{name}", "train", "-"), (f"eval_{name}", "eval", "--")],
               percent=f"eval_{name}" in PERCENTAGES)
    curves("learning rate", [("lr", "", "-")])
    curves("samples/s", [("samples_per_s", "global", "-"), ("samples_per_s_per_worker", "per worker", ":")])
    if "compute_frac" in keys:
        panels.append(("time split", lambda ax: _time_split(ax, runs, index)))
    if "rank_step_s" in keys:
        panels.append(("each rank's ms per step (data + forward)", lambda ax: _ranks(ax, runs, index)))
    if "time" in keys:
        panels.append(("progress over time", lambda ax: _progress(ax, runs, index)))
    scripts = [run for run in runs if "report" in run.rows[0]]
    extra = [k for k in dict.fromkeys(k for run in scripts for row in run.rows for k in row
                                       if _number(row[k]) and k not in INDEX_KEYS | drawn)]
    for key in extra[:MAX_SCRIPT_PANELS]:
        curves(key, [(key, "", "-")])
    return panels, extra[MAX_SCRIPT_PANELS:]


def _curves(ax: Axes, runs: list[Run], series: list[tuple[str, str, str]], index: str, percent: bool) -> None:
    """A colour per run, a line style per series (train solid, eval dashed); the styles' key is
    the panel's legend, the runs' the figure's."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    styles = []
    for key, label, style in series:
        points = [(run, *_points(run.rows, key)) for run in runs]
        for run, xs, ys in points:
            if xs:
                ax.plot(xs, ys, style, marker=".", markersize=4, color=run.color, label=run.name)
        if any(xs for _, xs, _ in points):
            styles.append(Line2D([], [], linestyle=style, color="gray", label=label))
    if len(styles) > 1:
        ax.legend(handles=styles, fontsize="small")
    ax.set_xlabel(index)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if percent:
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))


def _time_split(ax: Axes, runs: list[Run], index: str) -> None:
    """Each epoch's shares stacked; several runs side by side within an epoch, edged in their colour."""
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    split = [(run, [row for row in run.rows if "compute_frac" in row]) for run in runs]
    split = [(run, rows) for run, rows in split if rows]
    width = 0.8 / len(split)
    for i, (run, rows) in enumerate(split):
        xs = [_index(row) - 0.4 + width * (i + 0.5) for row in rows]
        bottom = [0.0] * len(rows)
        for key, label, color in TIME_SPLIT:
            heights = [row.get(key, 0.0) for row in rows]
            ax.bar(xs, heights, width, bottom=bottom, color=color, edgecolor=run.color, linewidth=0.8,
                   label=label if i == 0 else f"_{label}")
            bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylim(0, 1.3)  # room for the legend above the bars
    ax.set_yticks([0, 0.25, 0.5, 0.75, 1])
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(index)
    ax.legend(loc="upper center", ncols=len(TIME_SPLIT), fontsize="small")


def _ranks(ax: Axes, runs: list[Run], index: str) -> None:
    """A line per rank in its run's colour, labelled at its end: a straggler stands above the rest
    (its own work per step, which no collective evens out; see worker/metrics.per_rank)."""
    from matplotlib.ticker import MaxNLocator

    for run in runs:
        rows = [row for row in run.rows if isinstance(row.get("rank_step_s"), list)]
        for rank in range(max((len(row["rank_step_s"]) for row in rows), default=0)):
            have = [row for row in rows if rank < len(row["rank_step_s"])]
            xs, ys = [_index(row) for row in have], [row["rank_step_s"][rank] * 1e3 for row in have]
            ax.plot(xs, ys, "-", marker=".", markersize=3, linewidth=0.8, color=run.color)
            ax.annotate(str(rank), (xs[-1], ys[-1]), fontsize="x-small", color=run.color,
                        xytext=(3, 0), textcoords="offset points", va="center")
    ax.set_xlabel(index)
    ax.set_ylabel("ms")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _progress(ax: Axes, runs: list[Run], index: str) -> None:
    """Epochs against minutes since the run started (its first epoch's end less that epoch's
    time): a flat stretch is time lost, and the restarts and resumes drawn across it say to what."""
    for run in runs:
        timed = [row for row in run.rows if _number(row.get("time"))]
        if not timed:
            continue
        start = timed[0]["time"] - timed[0].get("epoch_time_s", 0.0)
        ax.plot([(row["time"] - start) / 60 for row in timed], [_index(row) for row in timed], ".-",
                color=run.color, label=run.name)
        for event in run.restarts:
            if _number(event.get("time")):
                minute = (event["time"] - start) / 60
                kind = str(event.get("kind", "restart"))
                ax.axvline(minute, color=run.color, linestyle="-.", linewidth=1, label=f"{run.name} {kind}")
                ax.annotate(kind, (minute, 0.98), xycoords=("data", "axes fraction"), rotation=90,
                            ha="right", va="top", fontsize="small", color=run.color)
    ax.set_xlabel("minutes")
    ax.set_ylabel(index)


def _load(run_dir: str, color: str) -> Run:
    if not storage.exists(storage.join(run_dir, rundir.METRICS)):
        raise UserError(f"{run_dir} has no metrics.jsonl: not a run directory, or its run never finished an epoch")
    rows = rundir.read_metrics(run_dir)
    if not rows:
        raise UserError(f"{run_dir}: metrics.jsonl has no rows yet")
    return Run(os.path.basename(storage.normalize(run_dir)), sorted(rows, key=_index), rundir.read_restarts(run_dir),
               color)


def _points(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """The rows that have `key` as a number: a script need not report every key every time."""
    have = [row for row in rows if _number(row.get(key))]
    return [_index(row) for row in have], [row[key] for row in have]


def _index(row: dict) -> int:
    """A row's place, as metrics.jsonl orders them: its epoch, or a script's report count."""
    return row.get("epoch", row.get("report", 0))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
