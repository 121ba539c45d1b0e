"""Pictures of a run: real metrics.jsonl and restarts.jsonl files, drawn in process (no Ray)."""

import json
import struct

import pytest

from raytrain_app.errors import UserError
from raytrain_app.rundir import plots

START = 1_700_000_000.0


def epoch_rows(epochs: int = 6, workers: int = 2, slower: float = 1.0) -> list[dict]:
    """A classification run's rows as the loop writes them: the loss falls, accuracy rises."""
    rows, now = [], START
    for epoch in range(1, epochs + 1):
        seconds = 20.0 * slower
        now += seconds
        rows.append({
            "epoch": epoch, "step": 50 * epoch, "train_loss": 2.0 / epoch, "eval_loss": 2.2 / epoch + 0.05,
            "eval_samples": 1000, "eval_accuracy": 0.95 - 0.45 / epoch, "eval_top5": 0.99 - 0.2 / epoch,
            "samples_per_s": 3000.0 / slower, "samples_per_s_per_worker": 3000.0 / slower / workers,
            "data_wait_frac": 0.05, "comm_frac": 0.15, "compute_frac": 0.8, "epoch_time_s": seconds,
            "world_size": workers, "lr": 0.1 * (1 - epoch / (epochs + 1)), "time": now,
        })
    return rows


def run_dir(tmp_path, name: str, rows: list[dict], restarts: list[dict] = ()) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if restarts:
        (path / "restarts.jsonl").write_text("".join(json.dumps(event) + "\n" for event in restarts))
    return str(path)


def panels(fig) -> dict:
    """Titled panels by title: twin axes and the figure's legend have none."""
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def test_every_curve_is_the_runs_metrics(tmp_path):
    """What is drawn is what metrics.jsonl holds: each line's points are the rows' values by epoch."""
    rows = epoch_rows()
    by_title = panels(plots.figure([run_dir(tmp_path, "resnet", rows)]))
    epochs = [row["epoch"] for row in rows]
    for title, keys in (("loss", ["train_loss", "eval_loss"]), ("accuracy", ["eval_accuracy"]),
                        ("top5", ["eval_top5"]), ("learning rate", ["lr"])):
        lines = by_title[title].get_lines()
        assert [list(line.get_xdata()) for line in lines] == [epochs] * len(keys), title
        assert [list(line.get_ydata()) for line in lines] == [[row[k] for row in rows] for k in keys], title
    samples = {line.get_linestyle(): list(line.get_ydata()) for line in by_title["samples/s"].get_lines()}
    assert samples == {"-": [r["samples_per_s"] for r in rows], ":": [r["samples_per_s_per_worker"] for r in rows]}


def test_classification_run_has_one_panel_per_question(tmp_path):
    fig = plots.figure([run_dir(tmp_path, "resnet", epoch_rows())])
    assert list(panels(fig)) == ["loss", "accuracy", "top5", "learning rate", "samples/s", "time split",
                                 "progress over time"]
    by_title = panels(fig)
    assert [line.get_linestyle() for line in by_title["loss"].get_lines()] == ["-", "--"]  # train, eval
    assert {line.get_linestyle() for line in by_title["samples/s"].get_lines()} == {"-", ":"}  # global, per worker
    assert len(by_title["time split"].patches) == 6 * 3  # data, comm, compute per epoch


def test_several_runs_share_the_axes(tmp_path):
    fast = run_dir(tmp_path, "fast", epoch_rows())
    slow = run_dir(tmp_path, "slow", epoch_rows(slower=2.0))
    fig = plots.figure([fast, slow])
    loss = panels(fig)["loss"]
    assert {line.get_label() for line in loss.get_lines()} == {"fast", "slow"}
    assert len(loss.get_lines()) == 4
    assert [text.get_text() for text in fig.legends[0].get_texts()] == ["fast", "slow"]


def test_restarts_are_marked_on_the_time_axis(tmp_path):
    restarts = [{"time": START + 50, "kind": "restart", "reason": "rank 1 on node 10.0.0.2: worker process died"},
                {"time": START + 300, "kind": "resume", "reason": "--resume"}]
    fig = plots.figure([run_dir(tmp_path, "run", epoch_rows(), restarts)])
    progress = panels(fig)["progress over time"]
    vertical = [line for line in progress.get_lines() if list(line.get_ydata()) == [0, 1]]
    assert [line.get_xdata()[0] for line in vertical] == pytest.approx([50 / 60, 300 / 60])
    assert [text.get_text() for text in progress.texts] == ["restart", "resume"]


def test_write_saves_a_screenshot_sized_png(tmp_path):
    output = plots.write([run_dir(tmp_path, "run", epoch_rows())], str(tmp_path / "out" / "report.png"))
    data = open(output, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (1200, 940)  # 12 in x (3 rows of 3 in + the legend's 0.4 in), 100 dpi


def test_script_run_draws_a_panel_per_reported_number(tmp_path):
    rows = [{"report": n, "epoch": n - 1, "loss": 1.0 / n, "acc": 0.1 * n, "grad_norm": 2.0 + n,
             **({"checkpoint": f"/runs/x/checkpoint_{n}"} if n % 2 == 0 else {})} for n in range(1, 6)]
    rows[2]["late_metric"] = 0.5  # reported once: still a panel, with one point
    fig = plots.figure([run_dir(tmp_path, "script", rows)])
    assert list(panels(fig)) == ["loss", "acc", "grad_norm", "late_metric"]
    assert list(panels(fig)["grad_norm"].get_lines()[0].get_xdata()) == [0, 1, 2, 3, 4]  # by epoch


def test_script_panels_are_capped(tmp_path):
    rows = [{"report": n, **{f"k{i}": float(i * n) for i in range(plots.MAX_SCRIPT_PANELS + 2)}} for n in (1, 2)]
    fig = plots.figure([run_dir(tmp_path, "many", rows)])
    assert len(panels(fig)) == plots.MAX_SCRIPT_PANELS
    assert fig.texts[0].get_text() == f"not drawn: k{plots.MAX_SCRIPT_PANELS}, k{plots.MAX_SCRIPT_PANELS + 1}"


def test_a_directory_that_is_no_run_is_named(tmp_path):
    good = run_dir(tmp_path, "good", epoch_rows())
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty has no metrics.jsonl"):
        plots.figure([good, str(tmp_path / "empty")])
    with pytest.raises(UserError, match="blank: metrics.jsonl has no rows"):
        plots.figure([run_dir(tmp_path, "blank", [])])


def test_each_ranks_step_time_is_a_line_of_its_own(tmp_path):
    """A run's rows with per-rank times: one line per rank, in milliseconds, labelled with its rank."""
    rows = [{**row, "rank_step_s": [0.004, 0.004 + 0.01 * row["epoch"], 0.005]} for row in epoch_rows()]
    ax = panels(plots.figure([run_dir(tmp_path, "run", rows)]))["each rank's ms per step (data + forward)"]
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [
        pytest.approx([row["rank_step_s"][rank] * 1e3 for row in rows]) for rank in range(3)]
    assert [text.get_text() for text in ax.texts] == ["0", "1", "2"]
