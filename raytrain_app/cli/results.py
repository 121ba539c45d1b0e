"""Commands that use a run's results: `evaluate`, `predict`, `export`, `runs`, `report`, and `stack`
for a run under way."""

from __future__ import annotations

import click

from raytrain_app.cli.base import VERBOSE, exit_codes, main

CHECKPOINT = click.option("--checkpoint", "which", metavar="best|latest|NAME",
                          help="Which of the run's checkpoints: the best by checkpoint.metric (ties: the earliest "
                               "epoch), the latest, or a checkpoint_* directory's name. Default: best, or latest "
                               "when no checkpoint has a score; the command names the one it used.")


ADDRESS = click.option("--address", help="Run on the cluster at this GCS address (as for train); default: the "
                                         "cluster train would use.")
LOCAL = click.option("--local/--ray", "local", default=None,
                     help="--local: one worker in this process, through Ray Train's local mode, with no Ray cluster "
                          "(the answer in seconds); --ray: on a Ray cluster. Default: local where nothing is lost "
                          "(no --workers or --address, no cluster up to use, a run without GPUs), else Ray.")


@main.command()
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path())
@CHECKPOINT
@click.option("--data-set", type=click.Choice(["eval", "train"]), default="eval", show_default=True,
              help="The run's split to score.")
@click.option("--data", "data_file", metavar="FILE", help="Score this labelled Parquet or CSV file instead (path "
                                                          "or URI), with the columns the run trained on.")
@click.option("--workers", type=int, help="Workers on Ray (default: the run's); the metrics are exact at any number.")
@ADDRESS
@LOCAL
@VERBOSE
def evaluate(run_dir, which, data_set, data_file, workers, address, local, verbose):
    """Score a run's checkpoint with the training loop's exact distributed evaluation, on a split
    of its data or on any labelled file; the metrics are printed and written to
    RUN_DIR/evaluations/CHECKPOINT-SPLIT.json, for classification with per-class precision,
    recall, F1 and a confusion matrix (also drawn as a PNG beside it).

    \b
    Examples:
      raytrain-app evaluate runs/digits-20261123-101500
      raytrain-app evaluate runs/digits-20261123-101500 --checkpoint latest --data-set train --workers 4
      raytrain-app evaluate runs/iris-20261123-101500 --data examples/iris.csv
    """
    from raytrain_app.inference import scoring

    with exit_codes():
        metrics = scoring.evaluate(run_dir, which, data_set, workers, address, verbose, click.echo, data_file, local)
        for name, value in metrics.items():
            click.echo(f"{name:<24} {value:.6g}")


@main.command()
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path())
@click.option("--input", "input_path", required=True, metavar="FILE", help="Rows to predict: Parquet or CSV (path "
                                                                        "or URI) with the columns the run trained "
                                                                        "on, by name, raw values.")
@click.option("--output", required=True, metavar="FILE", help="Where the predictions go (path or URI): CSV for a "
                                                            "name ending in .csv, Parquet for .parquet, .pq or no "
                                                            "suffix.")
@CHECKPOINT
@click.option("--workers", type=int, help="Parallel Ray tasks (default: the run's workers).")
@click.option("--batch-size", type=int, default=1024, show_default=True, help="Rows per forward pass.")
@ADDRESS
@LOCAL
@VERBOSE
def predict(run_dir, input_path, output, which, workers, batch_size, address, local, verbose):
    """Write a run's predictions for a Parquet or CSV file, row by row in the input's order: `row`
    (and the input's `id`), `prediction`, and for classification its `probability`. The rows hold
    raw values, as the training data stored them; the model preprocesses them as training did.

    \b
    Examples:
      raytrain-app predict runs/digits-20261123-101500 --input raytrain_app/data/digits.parquet --output preds.parquet
      raytrain-app predict runs/iris-20261123-101500 --input examples/iris-new.csv --output preds.csv
      raytrain-app predict s3://b/runs/r1 --input s3://b/new.parquet --output s3://b/preds.parquet --workers 8
    """
    from raytrain_app.inference import scoring

    with exit_codes():
        rows = scoring.predict(run_dir, input_path, output, which, workers, batch_size, address, verbose,
                               click.echo, local)
        click.echo(f"{rows} prediction{'' if rows == 1 else 's'} in {output}")


@main.command()
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path())
@click.option("--format", "format_", required=True, type=click.Choice(["safetensors", "pt", "torchscript", "onnx"]),
              help="safetensors (needs the [export] extra) or a plain state_dict (pt), of the model as built; a "
                   "traced TorchScript module or an ONNX graph (the [onnx] extra), which preprocess raw rows "
                   "themselves.")
@click.option("-o", "--output", metavar="FILE", help="The weights file (path or URI; a directory gets the format's "
                                                     "default name). Default: RUN_DIR/export/model.EXT.")
@CHECKPOINT
def export(run_dir, format_, output, which):
    """Write a checkpoint's weights, with FILE.json beside them (builder, args, input shape, the
    data's columns and preprocessing), for use without raytrain-app; formats share a folder.
    `raytrain_app.load_model(FILE)` reads it back.

    \b
    Examples:
      raytrain-app export runs/digits-20261123-101500 --format safetensors
      raytrain-app export runs/digits-20261123-101500 --format torchscript --checkpoint latest -o lenet.pt
      raytrain-app export runs/digits-20261123-101500 --format onnx -o exports/
    """
    from raytrain_app.inference.export import export as export_

    with exit_codes():
        done = export_(run_dir, format_, output, which)
        click.echo(f"exported {done.chosen.name} ({done.chosen.why}) to {done.weights} (+ {done.manifest})")
        if done.check:
            click.echo(f"checked: {done.check}")


@main.command()
@click.argument("directory", metavar="[DIR]", default="runs", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per run, for scripts.")
def runs(directory, as_json):
    """List the run directories under DIR (default runs/), newest first: name, start, epochs
    done, best metric, and status (finished, running, resumable, failed, interrupted).

    \b
    Examples:
      raytrain-app runs
      raytrain-app runs /data/experiments --json
    """
    from raytrain_app.rundir import listing as runs_

    with exit_codes():
        found = runs_.find_runs(directory)
        click.echo(runs_.as_json(found) if as_json else runs_.table(found) if found else f"no runs in {directory}")


@main.command("report")
@click.argument("run_dirs", metavar="RUN_DIR...", nargs=-1, required=True, type=click.Path())
@click.option("-o", "--output", help="Where the PNG goes (path or URI). Default: RUN_DIR/report.png for one run, "
                                     "report.png here for several.")
def report_(run_dirs, output):
    """Draw runs' curves into one PNG: loss, the task's metrics, learning rate, samples/s, the
    data/comm/compute split, and restarts on a time axis; several runs share the axes.

    \b
    Examples:
      raytrain-app report runs/digits-20261123-101500
      raytrain-app report runs/digits-* -o compare.png
    """
    from raytrain_app import storage
    from raytrain_app.rundir import plots

    with exit_codes():
        one = len(run_dirs) == 1
        click.echo(plots.write(list(run_dirs), output or (storage.join(run_dirs[0], "report.png") if one else
                                                          "report.png")))


@main.command()
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path())
def stack(run_dir):
    """Print every rank's current Python stack, phase and step for a run that is training now,
    in local mode or on a Ray cluster: what a rank that seems stuck is doing. The run's driver
    answers from the ranks' heartbeats, within a few seconds.

    \b
    Examples:
      raytrain-app stack runs/digits-20261123-101500
      raytrain-app stack s3://bucket/runs/d1          # a run on a cluster, from any machine
    """
    from raytrain_app.rundir import stacks

    with exit_codes():
        click.echo(stacks.request(run_dir), nl=False)
