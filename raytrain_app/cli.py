"""The `raytrain-app` command line: thin wrappers over the library, with exit codes

    0  success    1  training failed    2  user error (bad config, missing file, ...)
    130  interrupted (Ctrl-C)    141  the output pipe closed (`| head`)
"""

from __future__ import annotations

import os
import sys
import time

import click

STARTED = time.time()  # start-up is measured from here: Python itself has run ~0.1 s before

from raytrain_app.errors import TrainingFailed, UserError, last_line

EXIT_FAILED, EXIT_USAGE, EXIT_BROKEN_PIPE = 1, 2, 141  # 141: what a shell reports for SIGPIPE


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="raytrain-app")
def main() -> None:
    """Data-parallel PyTorch training on Ray clusters.

    \b
    Examples:
      raytrain-app train examples/digits.yaml
      raytrain-app submit job.yaml --cluster cluster/gpu.yaml --nodes 2 --gpus-per-node 4
      raytrain-app runs
    """


MAX_FAILURES = click.option("--max-failures", type=int, help="Restart the worker group this often before the "
                                                               "run fails (overrides failure.max_failures).")
SCRIPT_ARGS = click.argument("script_args", metavar="[-- SCRIPT_ARGS]", nargs=-1, type=click.UNPROCESSED)


@main.command()
@click.argument("config_file", metavar="CONFIG", type=click.Path(dir_okay=False, allow_dash=True))
@SCRIPT_ARGS
@click.option("--workers", type=int, help="Training workers (overrides scaling.workers).")
@click.option("--gpus-per-worker", type=float, help="GPUs per worker (overrides scaling.gpus_per_worker).")
@click.option("--run-dir", help="Where config, metrics, checkpoints and logs go (path or URI). "
                                "Default: runs/NAME-TIMESTAMP.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config field; repeatable.")
@click.option("--resume", is_flag=True, help="Continue the run in --run-dir (default: the latest run of this "
                                             "job) from its latest checkpoint.")
@click.option("--resume-if-any", is_flag=True, help="Continue the run in --run-dir if it holds a checkpoint, else "
                                                    "start it (for jobs a scheduler may run again).")
@click.option("--address", help="Join the running cluster at this GCS address (HOST:PORT; 'auto' reads "
                                "$RAY_ADDRESS, as set inside Ray jobs); 'local' always starts an embedded "
                                "cluster. Default: a local cluster `cluster up` started, if one is up and "
                                "large enough, else an embedded one.")
@click.option("--min-nodes", type=click.IntRange(min=1), default=1, help="Wait until the cluster at --address has "
                                                                         "this many nodes (its nodes are still "
                                                                         "starting, as in a SLURM job).")
@click.option("--node-timeout", type=click.FloatRange(min=0), default=600, show_default=True,
              help="Seconds to wait for --min-nodes.")
@MAX_FAILURES
@click.option("--verbose", is_flag=True, help="Show Ray's own logs and worker output.")
def train(config_file, script_args, workers, gpus_per_worker, run_dir, overrides, max_failures, resume,
          resume_if_any, address, min_nodes, node_timeout, verbose):
    """Train CONFIG (a YAML file, or - for standard input) on Ray.

    CONFIG may instead be a torchrun-style SCRIPT.py, run unchanged on every worker with the
    arguments after --.

    \b
    Examples:
      raytrain-app train examples/digits.yaml --workers 2
      raytrain-app train examples/digits.yaml --run-dir s3://bucket/runs/d1 --set optimizer.lr=0.05
      raytrain-app train train.py --workers 4 --max-failures 2 -- --epochs 3
    """
    from raytrain_app.api import fit

    sys.path.insert(0, os.getcwd())  # "mypkg.models:build" resolves from here, as on the workers
    with _command():
        result = fit(config_file, overrides=[*overrides, *_failures(max_failures)], workers=workers,
                     gpus_per_worker=gpus_per_worker, run_dir=run_dir, address=address,
                     resume="if_any" if resume_if_any else resume,
                     verbose=verbose, progress=sys.stdout.isatty(), echo=click.echo, started=STARTED,
                     script_args=script_args, min_nodes=min_nodes, node_timeout_s=node_timeout)
        from raytrain_app.report import summary

        click.echo(summary(result))


def _failures(max_failures):
    return [] if max_failures is None else [f"failure.max_failures={max_failures}"]


PROFILE = click.option("--cluster", "profile_file", required=True, metavar="PROFILE", type=click.Path(dir_okay=False),
                       help="A cluster profile, e.g. cluster/local.yaml.")


def _job_on_cluster(command):
    """The arguments that place a job on a profile's cluster: `submit`'s, and the renderers'."""
    for option in reversed([
        click.argument("config_file", metavar="CONFIG", type=click.Path(dir_okay=False)),
        SCRIPT_ARGS,
        PROFILE,
        click.option("--nodes", type=int, help="Nodes to use (default: the profile's)."),
        click.option("--gpus-per-node", type=int, help="GPUs per node; one worker per GPU (default: the profile's)."),
        click.option("--cpus-per-node", type=int, help="CPUs per node (default: the profile's)."),
        click.option("--workers-per-node", type=int, help="Workers per node on a CPU cluster (default 1)."),
        click.option("--name", help="Job name (default: the config's name)."),
        click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                     help="Override a config field; repeatable."),
        MAX_FAILURES,
        click.option("--skip-checks", is_flag=True, help="Do not build the model and data here first (for data "
                                                         "or packages that exist only on the cluster)."),
    ]):
        command = option(command)
    return command


def _plan(profile, config_file, script_args, nodes, gpus_per_node, cpus_per_node, workers_per_node, name,
          overrides, max_failures, skip_checks):
    """The job placed on the profile's cluster (`jobs.plan_submission`), its warnings said."""
    from raytrain_app import jobs
    from raytrain_app.api import job_config

    sys.path.insert(0, os.getcwd())  # "mypkg.models:build" resolves from here, as for `train`
    overrides = [*overrides, *_failures(max_failures)]
    _, config = job_config(config_file, overrides, script_args)
    sub = jobs.plan_submission(profile, config, nodes, gpus_per_node, cpus_per_node, workers_per_node, name,
                               overrides, check_builders=not skip_checks)
    for warning in sub.warnings:
        click.echo(f"warning: {warning}", err=True)
    return sub


FOLLOW = click.option("--follow/--no-wait", default=True, help="Stream the logs and exit with the job's result "
                                                                  "(default), or print the id and return.")
DRY_RUN = click.option("--dry-run", is_flag=True, help="Print the plan and submit nothing.")


@main.command()
@_job_on_cluster
@FOLLOW
@DRY_RUN
def submit(follow, dry_run, **job):
    """Submit CONFIG as a job to the cluster described by PROFILE: a Ray job, or under a SLURM
    profile an sbatch job that starts Ray in its allocation.

    CONFIG may instead be a torchrun-style SCRIPT.py, run unchanged on every worker with the
    arguments after --; it travels in the profile's working_dir, or its own folder.

    \b
    Examples:
      raytrain-app submit job.yaml --cluster cluster/aws-gpu.yaml --nodes 2 --gpus-per-node 4
      raytrain-app submit job.yaml --cluster cluster/slurm.yaml --nodes 2 --dry-run
      raytrain-app submit train.py --cluster cluster/aws-gpu.yaml --no-wait -- --lr 0.1
    """
    from raytrain_app import slurm

    with _command():
        profile = _profile(job.pop("profile_file"))
        if profile.kind == "slurm" and not dry_run:
            slurm.check_commands()
        _send(_plan(profile, **job), follow, dry_run)


def _send(sub, follow: bool, dry_run: bool) -> None:
    """`submit`'s and `sweep --cluster`'s end: the plan shown, or the job sent to SLURM or to the
    Jobs API, and followed to its end."""
    from raytrain_app.console import count, summary_table
    from raytrain_app.dashboard import Dashboard
    from raytrain_app import jobs, slurm

    if dry_run:
        click.echo(summary_table(sub.describe()))
        return
    what = "a sweep" if sub.sweep else count(sub.config.scaling.workers, "worker")
    if sub.profile.kind == "slurm":
        job_id = slurm.submit(sub)
        click.echo(f"submitted SLURM job {job_id} ({what} on {count(sub.nodes, 'node')}); run directory {sub.run_dir}")
        click.echo(f"output: {slurm.log_file(sub.profile, job_id)}")
        if follow:
            _exit_with(job_id, slurm.follow(sub.profile, job_id, _chunk), "COMPLETED")
        return
    dashboard = Dashboard.for_profile(sub.profile)
    jobs.check_cluster_can_run(sub, dashboard)
    job_id = jobs.submit(sub, dashboard)
    click.echo(f"submitted {job_id} to {sub.profile.jobs_address} ({what}); run directory {sub.run_dir}")
    click.echo(f"dashboard: {sub.profile.jobs_address}/#/jobs/{job_id}")
    if follow:
        _exit_with(job_id, jobs.follow(dashboard, job_id, _chunk), "SUCCEEDED")


def _chunk(text: str) -> None:
    click.echo(text, nl=False)


def _exit_with(job_id: str, status: str, success: str) -> None:
    """The end of a followed job: its status said, and exit code 1 unless it succeeded."""
    click.echo(f"job {job_id} {status.lower()}")
    if status != success:
        sys.exit(EXIT_FAILED)


@main.command()
@click.argument("job_id")
@PROFILE
def status(job_id, profile_file):
    """Show a job's status.

    \b
    Examples:
      raytrain-app status digits-20261123-101500-1a2b --cluster cluster/local.yaml
      raytrain-app status JOB_ID --cluster cluster/aws-gpu.yaml
    """
    from raytrain_app import jobs, slurm
    from raytrain_app.dashboard import Dashboard

    with _command():
        profile = _profile(profile_file)
        if profile.kind == "slurm":
            found = slurm.job(job_id)
            click.echo(f"{job_id}: {found.state}" + (f" ({found.reason})" if found.reason else ""))
            return
        info = jobs.job_info(Dashboard.for_profile(profile), job_id)
        click.echo(f"{job_id}: {info.status.value}" + (f" ({info.message})" if info.message else ""))


@main.command()
@click.argument("job_id")
@PROFILE
@click.option("--follow", is_flag=True, help="Keep streaming until the job ends.")
def logs(job_id, profile_file, follow):
    """Print a job's logs.

    \b
    Examples:
      raytrain-app logs JOB_ID --cluster cluster/local.yaml
      raytrain-app logs JOB_ID --cluster cluster/local.yaml --follow
    """
    from raytrain_app import jobs, slurm
    from raytrain_app.dashboard import Dashboard

    with _command():
        profile = _profile(profile_file)
        if profile.kind == "slurm":
            if follow:
                slurm.follow(profile, job_id, _chunk)
            else:
                click.echo(slurm.logs(profile, job_id), nl=False)
            return
        dashboard = Dashboard.for_profile(profile)
        if follow:
            jobs.job_info(dashboard, job_id)
            jobs.follow(dashboard, job_id, _chunk)
        else:
            click.echo(jobs.logs(dashboard, job_id), nl=False)


@main.command()
@click.argument("job_id")
@PROFILE
def stop(job_id, profile_file):
    """Stop a running job and wait for it to end.

    \b
    Examples:
      raytrain-app stop JOB_ID --cluster cluster/local.yaml
      raytrain-app list --cluster cluster/local.yaml --status running
    """
    from raytrain_app import jobs, slurm
    from raytrain_app.dashboard import Dashboard

    with _command():
        profile = _profile(profile_file)
        ended = slurm.stop(job_id) if profile.kind == "slurm" else jobs.stop(Dashboard.for_profile(profile), job_id)
        click.echo(f"{job_id}: {ended}")


@main.command("list")
@PROFILE
@click.option("--status", "statuses", multiple=True, metavar="STATUS",
              type=click.Choice(["PENDING", "RUNNING", "STOPPED", "SUCCEEDED", "FAILED"], case_sensitive=False),
              help="Only jobs in this state; repeatable.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per job, with its user and config hash.")
def list_(profile_file, statuses, as_json):
    """List the cluster's jobs, oldest first: ID, NAME, STATUS, START, DURATION, WORKERS, RUN DIR.

    \b
    Examples:
      raytrain-app list --cluster cluster/local.yaml
      raytrain-app list --cluster cluster/aws-gpu.yaml --status running --json
    """
    import json

    from raytrain_app import jobs, slurm
    from raytrain_app.dashboard import Dashboard

    with _command():
        profile = _profile(profile_file)
        if profile.kind == "slurm":
            rows = [j.row() for j in slurm.jobs(statuses)]
        else:
            rows = [jobs.job_row(j) for j in jobs.list_jobs(Dashboard.for_profile(profile), statuses)]
        click.echo(json.dumps(rows, indent=1) if as_json else jobs.jobs_table(rows))


@main.command()
@click.argument("config_file", metavar="[CONFIG]", required=False, type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--param", "params", multiple=True, metavar="KEY=KIND:ARGS",
              help="A setting to sweep; repeatable. KIND: loguniform:LOW:HIGH, uniform:LOW:HIGH, "
                   "randint:LOW:HIGH, choice:A,B,C or grid:A,B,C (every value, times --samples).")
@click.option("--samples", type=int, default=8, show_default=True, help="Trials to sample (for grid: repeats).")
@click.option("--max-concurrent", type=int, help="Trials at once (default: what the cluster holds: its GPUs, or "
                                                 "CPUs, over one trial's).")
@click.option("--scheduler", type=click.Choice(["asha", "fifo"]), default="asha", show_default=True,
              help="asha stops weak trials after their first epochs; fifo runs every trial to the end.")
@click.option("--metric", help="What ranks trials (default: the job's checkpoint.metric).")
@click.option("--mode", type=click.Choice(["max", "min"]), help="Whether higher --metric is better (default: by "
                                                                "the metric).")
@click.option("--sweep-dir", help="Where the sweep and its trials' run directories go (path or URI). "
                                  "Default: sweeps/NAME-TIMESTAMP.")
@click.option("--resume", "resume_dir", metavar="SWEEP_DIR", help="Continue the sweep in SWEEP_DIR (its settings "
                                                                  "are in it: no CONFIG or --param).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config field; repeatable.")
@click.option("--workers", type=int, help="Each trial's workers (overrides scaling.workers).")
@click.option("--address", help="Run on the cluster at this GCS address, as for train; default: the cluster "
                                "train would use.")
@click.option("--min-nodes", type=click.IntRange(min=1), default=1, help="Wait until the cluster at --address has "
                                                                         "this many nodes.")
@click.option("--node-timeout", type=click.FloatRange(min=0), default=600, show_default=True,
              help="Seconds to wait for --min-nodes.")
@click.option("--cluster", "profile_file", metavar="PROFILE", type=click.Path(dir_okay=False),
              help="Submit the sweep as one job to this profile's cluster (a Ray job, or a SLURM job), its "
                   "directory in the profile's storage; status, logs, stop and list manage it.")
@click.option("--nodes", type=int, help="With --cluster: the nodes the sweep's trials share (default: the "
                                        "profile's; under SLURM, the allocation).")
@click.option("--skip-checks", is_flag=True, help="With --cluster: do not build the model and data here first.")
@FOLLOW
@DRY_RUN
@click.option("--verbose", is_flag=True, help="Show Ray's and Tune's own logs.")
def sweep(config_file, params, samples, max_concurrent, scheduler, metric, mode, sweep_dir, resume_dir, overrides,
          workers, address, min_nodes, node_timeout, profile_file, nodes, skip_checks, follow, dry_run, verbose):
    """Sweep hyper-parameters with Ray Tune: trials of CONFIG with sampled settings, each an
    ordinary run under the sweep directory; at the end a table of the trials and best.yaml, the
    best trial's config.

    \b
    Examples:
      raytrain-app sweep job.yaml --param optimizer.lr=loguniform:1e-4:1e-1 --param train.batch_size=choice:32,64,128
      raytrain-app sweep --resume sweeps/digits-20261124-101500
      raytrain-app sweep job.yaml --param optimizer.lr=loguniform:1e-4:1e-1 --cluster cluster/slurm.yaml --nodes 4
    """
    from raytrain_app import jobs, slurm
    from raytrain_app import sweep as sweeps
    from raytrain_app.api import job_config

    sys.path.insert(0, os.getcwd())  # "mypkg.models:build" resolves from here, as for `train`
    with _command():
        if bool(config_file) == bool(resume_dir):
            raise UserError("give CONFIG to start a sweep, or --resume SWEEP_DIR to continue one (not both)")
        if profile_file and (address or min_nodes > 1):
            raise UserError("--cluster submits the sweep to the profile's cluster, --address (and --min-nodes) run "
                            "it from here: give one")
        for flag, given in (("--nodes", nodes is not None), ("--skip-checks", skip_checks), ("--no-wait", not follow),
                            ("--dry-run", dry_run)):
            if given and not profile_file:
                raise UserError(f"{flag} is for a sweep submitted with --cluster PROFILE")
        profile = _profile(profile_file) if profile_file else None
        if resume_dir:
            plan, directory = sweeps.Sweep.load(resume_dir), resume_dir
        else:
            sets = [*overrides, *([f"scaling.workers={workers}"] if workers is not None else [])]
            _, config = job_config(config_file, sets)
            with jobs.running_in(jobs.job_folder(profile) if profile else None):  # as the trials will run
                plan = sweeps.plan_sweep(sweeps.on_cluster(config, profile) if profile else config, params, samples,
                                         scheduler, metric, mode, max_concurrent, check=not skip_checks)
            directory = sweep_dir or (None if profile else sweeps.new_sweep_dir(config.name))
        if profile:
            if profile.kind == "slurm" and not dry_run:
                slurm.check_commands()
            _send(sweeps.submission(plan, profile, directory, nodes, bool(resume_dir)), follow, dry_run)
            return
        trials, interrupted = sweeps.launch(plan, directory, bool(resume_dir), address, verbose, click.echo,
                                            min_nodes, node_timeout)
        click.echo(sweeps.table(plan, trials))
        best = sweeps.write_best(plan, directory, trials)
        if best:
            click.echo(f"best: {trials[0].name}, {plan.metric} {trials[0].best:.4f}; its config: {best}")
        if interrupted:
            click.echo(f"interrupted: `raytrain-app sweep --resume {directory}` continues", err=True)
            sys.exit(130)


CHECKPOINT = click.option("--checkpoint", "which", metavar="best|latest|NAME",
                          help="Which of the run's checkpoints: the best by checkpoint.metric (ties: the earliest "
                               "epoch), the latest, or a checkpoint_* directory's name. Default: best, or latest "
                               "when no checkpoint has a score; the command names the one it used.")
ADDRESS = click.option("--address", help="Run on the cluster at this GCS address (as for train); default: the "
                                         "cluster train would use.")


@main.command()
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path())
@CHECKPOINT
@click.option("--data-set", type=click.Choice(["eval", "train"]), default="eval", show_default=True,
              help="The run's split to score.")
@click.option("--data", "data_file", metavar="FILE", help="Score this labelled Parquet or CSV file instead (path "
                                                          "or URI), with the columns the run trained on.")
@click.option("--workers", type=int, help="Workers (default: the run's); the metrics are exact at any number.")
@ADDRESS
@click.option("--verbose", is_flag=True, help="Show Ray's own logs.")
def evaluate(run_dir, which, data_set, data_file, workers, address, verbose):
    """Score a run's checkpoint with the training loop's exact distributed evaluation, on a split
    of its data or on any labelled file; the metrics are printed and written to
    RUN_DIR/evaluations/CHECKPOINT-SPLIT.json, for classification with per-class precision,
    recall, F1 and a confusion matrix (also drawn as a PNG beside it).

    \b
    Examples:
      raytrain-app evaluate runs/digits-20261123-101500
      raytrain-app evaluate runs/digits-20261123-101500 --checkpoint latest --data-set train --workers 4
      raytrain-app evaluate runs/churn-20261123-101500 --data new-customers-with-outcomes.csv
    """
    from raytrain_app import inference

    with _command():
        metrics = inference.evaluate(run_dir, which, data_set, workers, address, verbose, click.echo, data_file)
        for name, value in metrics.items():
            click.echo(f"{name:<24} {value:.6g}")


@main.command()
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path())
@click.option("--input", "input_path", required=True, metavar="FILE", help="Rows to predict: Parquet or CSV (path "
                                                                        "or URI) with the columns the run trained "
                                                                        "on, by name, raw values.")
@click.option("--output", required=True, metavar="PARQUET", help="Where the predictions go (path or URI).")
@CHECKPOINT
@click.option("--workers", type=int, help="Parallel tasks (default: the run's workers).")
@click.option("--batch-size", type=int, default=1024, show_default=True, help="Rows per forward pass.")
@ADDRESS
@click.option("--verbose", is_flag=True, help="Show Ray's own logs.")
def predict(run_dir, input_path, output, which, workers, batch_size, address, verbose):
    """Write a run's predictions for a Parquet or CSV file, row by row in the input's order: `row`
    (and the input's `id`), `prediction`, and for classification its `probability`. The rows hold
    raw values, as the training data stored them; the model preprocesses them as training did.

    \b
    Examples:
      raytrain-app predict runs/digits-20261123-101500 --input new.parquet --output preds.parquet
      raytrain-app predict runs/churn-20261123-101500 --input new-customers.csv --output preds.parquet
      raytrain-app predict s3://bucket/runs/r1 --input s3://bucket/new.parquet --output s3://bucket/preds.parquet --workers 8
    """
    from raytrain_app import inference

    with _command():
        rows = inference.predict(run_dir, input_path, output, which, workers, batch_size, address, verbose,
                                 click.echo)
        click.echo(f"{rows} predictions in {output}")


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
    from raytrain_app.export import export as export_

    with _command():
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
    from raytrain_app import runs as runs_

    with _command():
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
    from raytrain_app import plots, storage

    with _command():
        one = len(run_dirs) == 1
        click.echo(plots.write(list(run_dirs), output or (storage.join(run_dirs[0], "report.png") if one else
                                                          "report.png")))


@main.group("config")
def config_():
    """Inspect job configs: the JSON Schema, and a config as it would run."""


@config_.command("schema")
def config_schema():
    """Print the job config's JSON Schema (for editors' YAML completion and checks).

    \b
    Examples:
      raytrain-app config schema > raytrain-job.schema.json
      # then in a job file: # yaml-language-server: $schema=raytrain-job.schema.json
    """
    import json

    from raytrain_app.config import JobConfig

    click.echo(json.dumps(JobConfig.model_json_schema(), indent=2))


@config_.command("show")
@click.argument("config_file", metavar="CONFIG", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config field; repeatable.")
@click.option("--workers", type=int, help="Training workers (overrides scaling.workers).")
@click.option("--gpus-per-worker", type=float, help="GPUs per worker (overrides scaling.gpus_per_worker).")
def config_show(config_file, overrides, workers, gpus_per_worker):
    """Print CONFIG resolved: every default filled in, every `auto` decided.

    \b
    Examples:
      raytrain-app config show examples/digits.yaml
      raytrain-app config show job.yaml --gpus-per-worker 1
    """
    from raytrain_app.config import dump_yaml, load_config
    from raytrain_app.plan import resolve_auto

    sets = [*overrides, *(f"scaling.{key}={value}" for key, value in
                          (("workers", workers), ("gpus_per_worker", gpus_per_worker)) if value is not None)]
    with _command():
        click.echo(dump_yaml(resolve_auto(load_config(config_file, sets))), nl=False)


@main.group()
def cluster():
    """Start, stop and inspect the cluster a profile describes."""


@cluster.command("up")
@click.argument("profile_file", metavar="PROFILE", type=click.Path(dir_okay=False))
def cluster_up(profile_file):
    """Start the profile's cluster (local nodes, or Ray's launcher).

    \b
    Examples:
      raytrain-app cluster up cluster/local.yaml
      raytrain-app cluster up cluster/aws-gpu.yaml
    """
    from raytrain_app.localnodes import cluster_up

    with _command():
        cluster_up(_profile(profile_file), click.echo)


@cluster.command("down")
@click.argument("profile_file", metavar="PROFILE", type=click.Path(dir_okay=False))
def cluster_down(profile_file):
    """Stop exactly the nodes `cluster up` started.

    \b
    Examples:
      raytrain-app cluster down cluster/local.yaml
      raytrain-app cluster down cluster/aws-gpu.yaml
    """
    from raytrain_app.localnodes import cluster_down

    with _command():
        cluster_down(_profile(profile_file), click.echo)


@cluster.command("status")
@click.argument("profile_file", metavar="PROFILE", type=click.Path(dir_okay=False))
def cluster_status(profile_file):
    """Show the cluster's nodes, their free and total CPUs and GPUs, and the running jobs (for a
    SLURM profile: the partition's nodes and your jobs).

    \b
    Examples:
      raytrain-app cluster status cluster/local.yaml
      raytrain-app cluster status cluster/aws-gpu.yaml
    """
    from raytrain_app import jobs, slurm
    from raytrain_app.console import count
    from raytrain_app.dashboard import Dashboard

    with _command():
        profile = _profile(profile_file)
        if profile.kind == "slurm":
            partition, slurm_nodes = slurm.partition_nodes(profile)
            click.echo(f"SLURM partition '{partition}': {len(slurm_nodes)} nodes")
            for n in slurm_nodes:
                click.echo(f"  node {n.name:<12} {n.state:<6}  {n.cpus} CPUs  {n.gpus} GPUs")
            active = [j.row() for j in slurm.jobs(("PENDING", "RUNNING"))]
            click.echo(f"your running and pending jobs: {len(active)}")
            if active:
                click.echo(jobs.jobs_table(active))
            return
        dashboard = Dashboard.for_profile(profile)
        nodes, free = dashboard.alive_nodes(), dashboard.free()

        def available(kind: str, nodes) -> str:
            return f"{sum(max(free[n.node_id][kind], 0.0) for n in nodes):g}"

        click.echo(f"cluster '{profile.name}' at {profile.jobs_address}: {count(len(nodes), 'node')}, "
                   f"{available('CPU', nodes)}/{sum(n.cpus for n in nodes):g} CPUs free, "
                   f"{available('GPU', nodes)}/{sum(n.gpus for n in nodes):g} GPUs free")
        for n in nodes:
            click.echo(f"  node {n.node_id[:12]}  {n.ip:<15} {'head' if n.is_head else 'worker':<6}  "
                       f"{available('CPU', [n])}/{n.cpus:g} CPUs free  {available('GPU', [n])}/{n.gpus:g} GPUs free")
        running = [jobs.job_row(j) for j in jobs.list_jobs(dashboard, ("PENDING", "RUNNING"))]
        click.echo(f"running jobs: {len(running)}")
        if running:
            click.echo(jobs.jobs_table(running))


@main.group("slurm")
def slurm_():
    """SLURM clusters (profiles of kind: slurm)."""


@slurm_.command("render")
@_job_on_cluster
def slurm_render(**job):
    """Print the sbatch script `submit` would hand to SLURM, for submitting by hand: it starts Ray
    on the allocation's nodes and trains there. Nothing is checked against SLURM or written.

    \b
    Examples:
      raytrain-app slurm render job.yaml --cluster cluster/slurm.yaml --nodes 2 --gpus-per-node 4 > job.sbatch
      # then, on a login node: sbatch job.sbatch
    """
    from raytrain_app import slurm

    with _command():
        profile = _profile(job.pop("profile_file"), "slurm render", "slurm")
        click.echo(slurm.render(_plan(profile, **job)), nl=False)


@main.group("k8s")
def k8s():
    """Kubernetes through KubeRay (profiles of kind: kuberay)."""


@k8s.command("render")
@_job_on_cluster
def k8s_render(**job):
    """Print a KubeRay RayJob (ray.io/v1) that runs the job on a cluster of its own: a head and
    --nodes worker pods of --gpus-per-node GPUs each, deleted when the job ends. Retries run on a
    new cluster and resume from the run directory in the profile's storage.

    \b
    Examples:
      raytrain-app k8s render job.yaml --cluster cluster/kuberay.yaml --nodes 2 --gpus-per-node 4 > rayjob.yaml
      # then: kubectl apply -f rayjob.yaml
    """
    from raytrain_app import kuberay

    with _command():
        profile = _profile(job.pop("profile_file"), "k8s render", "kuberay")
        sub = _plan(profile, **job)
        manifest = kuberay.render(sub)
        for warning in kuberay.warnings(sub):
            click.echo(f"warning: {warning}", err=True)
        click.echo(kuberay.to_yaml(manifest), nl=False)


def _profile(path: str, command: str = "", kind: str = ""):
    """The profile at `path`; a `command` that needs one `kind` refuses the others in one line."""
    from raytrain_app.profiles import load_profile

    profile = load_profile(path)
    if kind and profile.kind != kind:
        raise UserError(f"{profile.source} is a profile of kind: {profile.kind}; {command} needs kind: {kind}")
    return profile


class _command:
    """Every command's frame: Ray's client-side loggers kept off the console (commands that run
    training re-route them to the run's log file), and the library's exceptions mapped to one
    line on stderr and the documented exit code."""

    def __enter__(self):
        from raytrain_app.console import route_ray_logs

        route_ray_logs(None, verbose=False)
        return self

    def __exit__(self, kind, error, tb):
        if isinstance(error, UserError):
            for line in error.lines:
                click.echo(_bounded(f"error: {line}"), err=True)
            sys.exit(EXIT_USAGE)
        if isinstance(error, TrainingFailed):
            click.echo(_bounded(f"training failed: {error}"), err=True)
            sys.exit(EXIT_FAILED)
        if isinstance(error, KeyboardInterrupt):
            how = getattr(error, "how_to_continue", "")
            click.echo(f"interrupted: {how}" if how else "interrupted", err=True)
            sys.exit(130)
        if isinstance(error, BrokenPipeError):  # the reader left (`| head`): stop quietly, as Unix tools do
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else the exit's flush fails again
            sys.exit(EXIT_BROKEN_PIPE)
        if isinstance(error, Exception):  # a bug: still one line, with the traceback kept in a file
            import traceback

            frames = traceback.extract_tb(tb)
            where = f"at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}; " if frames else ""
            kept = _keep("crash", "".join(traceback.format_exception(kind, error, tb)))
            click.echo(f"error: internal error, {type(error).__name__}: {_bounded(last_line(error), 200)} "
                       f"({where}traceback in {kept})", err=True)
            sys.exit(EXIT_FAILED)
        return False


# Longer lines go to a file, and the line names it: a terminal shows a line, not a page.
MAX_LINE = 500


def _bounded(line: str, limit: int = MAX_LINE) -> str:
    if len(line) <= limit:
        return line
    return f"{line[:limit - 100]}... (the whole message in {_keep('message', line + chr(10))})"


def _keep(kind: str, text: str) -> str:
    """`text` in a file of this user's temp folder; its path."""
    import tempfile

    folder = os.path.join(tempfile.gettempdir(), f"raytrain-{os.getuid()}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")
    with open(path, "w") as f:
        f.write(text)
    return path


def run() -> None:
    """The console script: click's own usage errors become one line too, like every user error."""
    try:
        code = main(prog_name="raytrain-app", standalone_mode=False)
    except click.UsageError as e:
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(EXIT_USAGE)
    except click.Abort:
        click.echo("interrupted", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    run()
