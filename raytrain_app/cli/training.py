"""Commands that train: `train`, `sweep`, and `config` (a config as it would run)."""

from __future__ import annotations

import sys

import click

from raytrain_app.cli.base import (
    GPUS_PER_WORKER,
    MAX_FAILURES,
    MIN_NODES,
    NODE_TIMEOUT,
    SCRIPT_ARGS,
    SET,
    STARTED,
    VERBOSE,
    WORKERS,
    engine_of,
    exit_codes,
    main,
    profile_at,
)
from raytrain_app.cli.jobs import DRY_RUN, FOLLOW, send
from raytrain_app.errors import UserError


@main.command()
@click.argument("config_file", metavar="CONFIG", type=click.Path(dir_okay=False, allow_dash=True))
@SCRIPT_ARGS
@WORKERS
@GPUS_PER_WORKER
@click.option("--run-dir", help="Where config, metrics, checkpoints and logs go (path or URI). "
                                "Default: runs/NAME-TIMESTAMP.")
@SET
@click.option("--resume", is_flag=True, help="Continue the run in --run-dir (default: the latest run of this "
                                             "job) from its latest checkpoint.")
@click.option("--resume-if-any", is_flag=True, help="Continue the run in --run-dir if it holds a checkpoint, else "
                                                    "start it (for jobs a scheduler may run again).")
@click.option("--address", help="Join the running cluster at this GCS address (HOST:PORT; 'auto' reads "
                                "$RAY_ADDRESS, as set inside Ray jobs); 'local' always starts an embedded "
                                "cluster. Default: the cluster at $RAY_ADDRESS if it holds a HOST:PORT; else "
                                "a local cluster `cluster up` started, if one is up and large enough; else "
                                "local mode (see --local), or with --ray an embedded cluster.")
@MIN_NODES
@NODE_TIMEOUT
@MAX_FAILURES
@click.option("--smoke", is_flag=True, help="A few batches of one epoch through every path (checkpoint, "
                                            "evaluation, report; trackers off unless --set turns them on), into "
                                            "runs/NAME-smoke-*: what to run before submitting.")
@click.option("--local/--ray", "local", default=None,
              help="--local: no Ray cluster, through Ray Train's local mode (one worker in this process, more as "
                   "torchrun's processes); --ray: on a Ray cluster. Default: scaling.local (auto: local where "
                   "nothing Ray brings is asked for).")
@VERBOSE
def train(config_file, script_args, workers, gpus_per_worker, run_dir, overrides, max_failures, resume,
          resume_if_any, address, min_nodes, node_timeout, smoke, local, verbose):
    """Train CONFIG (a YAML file, or - for standard input) with Ray Train: on one machine in its
    local mode (no cluster) where nothing Ray brings is asked for, else on a Ray cluster.

    CONFIG may instead be a torchrun-style SCRIPT.py, run unchanged on every worker with the
    arguments after --.

    \b
    Examples:
      raytrain-app train examples/digits.yaml --workers 2 --local
      raytrain-app train examples/digits.yaml --run-dir s3://bucket/runs/d1 --set optimizer.lr=0.05
      raytrain-app train examples/torchrun_script/train.py --workers 4 --max-failures 2 -- --epochs 3
    """
    from raytrain_app.api import fit
    from raytrain_app.config import flag_overrides

    with exit_codes():
        result = fit(config_file, overrides=[*overrides, *flag_overrides(max_failures=max_failures)], workers=workers,
                     gpus_per_worker=gpus_per_worker, run_dir=run_dir, address=address,
                     resume="if_any" if resume_if_any else resume,
                     verbose=verbose, progress=sys.stdout.isatty(), echo=click.echo, started=STARTED,
                     script_args=script_args, min_nodes=min_nodes, node_timeout_s=node_timeout, local=local,
                     smoke=smoke)
        from raytrain_app.driver.result import summary

        click.echo(summary(result))


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
@SET
@click.option("--workers", type=int, help="Each trial's workers (overrides scaling.workers).")
@click.option("--address", help="Run on the cluster at this GCS address, as for train; default: the cluster "
                                "train would use.")
@MIN_NODES
@NODE_TIMEOUT
@click.option("--cluster", "profile_file", metavar="PROFILE", type=click.Path(dir_okay=False),
              help="Submit the sweep as one job to this profile's cluster (a Ray job, or a SLURM job), its "
                   "directory in the profile's storage; status, logs, stop and list manage it.")
@click.option("--nodes", type=int, help="With --cluster: the nodes the sweep's trials share (default: the "
                                        "profile's; under SLURM, the allocation).")
@click.option("--skip-checks", is_flag=True, help="With --cluster: do not build the model and data here first.")
@FOLLOW
@DRY_RUN
@VERBOSE
def sweep(config_file, params, samples, max_concurrent, scheduler, metric, mode, sweep_dir, resume_dir, overrides,
          workers, address, min_nodes, node_timeout, profile_file, nodes, skip_checks, follow, dry_run, verbose):
    """Sweep hyper-parameters with Ray Tune: trials of CONFIG with sampled settings, each an
    ordinary run under the sweep directory; at the end a table of the trials and best.yaml, the
    best trial's config.

    \b
    Examples:
      raytrain-app sweep examples/digits.yaml --param optimizer.lr=loguniform:1e-4:1e-1 --samples 8
      raytrain-app sweep --resume sweeps/digits-20261124-101500
      raytrain-app sweep examples/digits.yaml --param optimizer.lr=loguniform:1e-4:1e-1 --cluster cluster/slurm.yaml
    """
    from raytrain_app.api import job_config
    from raytrain_app.config import flag_overrides
    from raytrain_app.driver import sweep_plan

    with exit_codes():
        if bool(config_file) == bool(resume_dir):
            raise UserError("give CONFIG to start a sweep, or --resume SWEEP_DIR to continue one (not both)")
        if profile_file and (address or min_nodes > 1):
            raise UserError("--cluster submits the sweep to the profile's cluster, --address (and --min-nodes) run "
                            "it from here: give one")
        for flag, given in (("--nodes", nodes is not None), ("--skip-checks", skip_checks), ("--no-wait", not follow),
                            ("--dry-run", dry_run)):
            if given and not profile_file:
                raise UserError(f"{flag} is for a sweep submitted with --cluster PROFILE")
        profile = profile_at(profile_file) if profile_file else None
        if resume_dir:
            plan, directory = sweep_plan.Sweep.load(resume_dir), resume_dir
        else:
            _, config = job_config(config_file, [*overrides, *flag_overrides(workers=workers)])
            plan = sweep_plan.plan_for(config, params, samples, scheduler, metric, mode, max_concurrent, profile,
                                       check=not skip_checks)
            directory = sweep_dir or (None if profile else sweep_plan.new_sweep_dir(config.name))
        if profile:
            engine = engine_of(profile)
            if not dry_run:
                engine.check_ready()
            send(engine, sweep_plan.submission(plan, profile, directory, nodes, bool(resume_dir)), follow, dry_run)
            return
        from raytrain_app.driver.sweep import how_to_continue, run

        outcome = run(plan, directory, bool(resume_dir), address, verbose, click.echo, min_nodes, node_timeout)
        if outcome.interrupted:
            click.echo(f"interrupted: {how_to_continue(directory)}", err=True)
            sys.exit(130)


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
@SET
@WORKERS
@GPUS_PER_WORKER
def config_show(config_file, overrides, workers, gpus_per_worker):
    """Print CONFIG resolved: every default filled in, every `auto` decided.

    \b
    Examples:
      raytrain-app config show examples/digits.yaml
      raytrain-app config show examples/charlm.yaml --gpus-per-worker 1
    """
    from raytrain_app.config import dump_yaml, flag_overrides, load_config
    from raytrain_app.config.resolve import resolve_auto

    sets = [*overrides, *flag_overrides(workers=workers, gpus_per_worker=gpus_per_worker)]
    with exit_codes():
        click.echo(dump_yaml(resolve_auto(load_config(config_file, sets))), nl=False)
