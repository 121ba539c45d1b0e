"""Commands for jobs on a profile's cluster, whatever its engine: `submit`, `status`, `logs`,
`stop`, `list`; `cluster up|down|status`; and the engines' own job files (`slurm render`,
`k8s render`)."""

from __future__ import annotations

import os
import sys

import click

from raytrain_app.cli.base import (
    EXIT_FAILED,
    MAX_FAILURES,
    SCRIPT_ARGS,
    SET,
    CountOrRange,
    engine_of,
    exit_codes,
    main,
    profile_at,
    warn,
)

PROFILE = click.option("--cluster", "profile_file", required=True, metavar="PROFILE", type=click.Path(dir_okay=False),
                       help="A cluster profile, e.g. cluster/local.yaml.")


def _job_on_cluster(command):
    """The arguments that place a job on a profile's cluster: `submit`'s, and the renderers'."""
    for option in reversed([
        click.argument("config_file", metavar="CONFIG", type=click.Path(dir_okay=False)),
        SCRIPT_ARGS,
        PROFILE,
        click.option("--nodes", type=CountOrRange("nodes"), help="Nodes to use, or a range MIN:MAX for an "
                                                                 "elastic run (default: the profile's)."),
        click.option("--gpus-per-node", type=int, help="GPUs per node; one worker per GPU (default: the profile's)."),
        click.option("--cpus-per-node", type=int, help="CPUs per node (default: the profile's)."),
        click.option("--workers-per-node", type=int, help="Workers per node on a CPU cluster (default 1)."),
        click.option("--name", help="Job name (default: the config's name)."),
        SET,
        MAX_FAILURES,
        click.option("--skip-checks", is_flag=True, help="Do not build the model and data here first (for data "
                                                         "or packages that exist only on the cluster)."),
        click.option("--resume", metavar="RUN_DIR", help="Continue this run (a directory the cluster reaches: the "
                                                         "profile's storage, or a bucket) from its latest checkpoint."),
    ]):
        command = option(command)
    return command


def placed(profile, config_file, script_args, nodes, gpus_per_node, cpus_per_node, workers_per_node, name,
          overrides, max_failures, skip_checks, resume):
    """The job placed on the profile's cluster (`submission.plan_submission`), its warnings said."""
    from raytrain_app.api import job_config
    from raytrain_app.config import flag_overrides
    from raytrain_app.launch.submission import plan_submission

    overrides = [*overrides, *flag_overrides(max_failures=max_failures)]
    _, config = job_config(config_file, overrides, script_args)
    sub = plan_submission(profile, config, nodes, gpus_per_node, cpus_per_node, workers_per_node, name,
                          overrides, check_builders=not skip_checks, resume=resume)
    for warning in sub.warnings:
        warn(warning)
    return sub


FOLLOW = click.option("--follow/--no-wait", default=True, help="Stream the logs and exit with the job's result "
                                                                  "(default), or print the id and return.")


DRY_RUN = click.option("--dry-run", is_flag=True, help="Print the plan and submit nothing.")


@main.command()
@_job_on_cluster
@click.option("--smoke", is_flag=True, help="First run the job's smoke run here (train --smoke, in local mode), "
                                            "and submit only if it passes.")
@FOLLOW
@DRY_RUN
def submit(follow, dry_run, smoke, **job):
    """Submit CONFIG as a job to the cluster described by PROFILE: a Ray job, or under a SLURM
    profile an sbatch job that starts Ray in its allocation.

    CONFIG may instead be a torchrun-style SCRIPT.py, run unchanged on every worker with the
    arguments after --; it travels in the profile's working_dir, or its own folder.

    \b
    Examples:
      raytrain-app submit examples/digits.yaml --cluster cluster/aws-gpu.yaml --nodes 2 --gpus-per-node 4
      raytrain-app submit examples/iris.yaml --cluster cluster/slurm.yaml --nodes 2 --dry-run
      raytrain-app submit examples/torchrun_script/train.py --cluster cluster/aws-gpu.yaml --no-wait -- --epochs 4
    """
    with exit_codes():
        profile = profile_at(job.pop("profile_file"))
        engine = engine_of(profile)
        if not dry_run:
            engine.check_ready()
        planned = placed(profile, **job)
        if smoke:
            import tempfile

            from raytrain_app.api import fit

            # Outside the launch folder: it is the job's working_dir, which ships to the cluster.
            scratch = os.path.join(tempfile.mkdtemp(prefix="raytrain-smoke-"), "run")
            tried = fit(job["config_file"], overrides=job["overrides"], script_args=job["script_args"], smoke=True,
                        local=True, echo=click.echo, run_dir=scratch)
            click.echo(f"smoke run passed ({tried.run_dir}): submitting")
        send(engine, planned, follow, dry_run)


def send(engine, sub, follow: bool, dry_run: bool) -> None:
    """`submit`'s and `sweep --cluster`'s end: the plan shown, or the job sent to the profile's
    engine and followed to its end (exit code 1 unless it succeeded)."""
    from raytrain_app.console import summary_table

    if dry_run:
        click.echo(summary_table(sub.describe()))
        return
    submitted = engine.submit(sub)
    for line in submitted.warnings:
        warn(line)
    for line in submitted.said:
        click.echo(line)
    if follow:
        status = engine.follow(submitted.job_id, _chunk)
        click.echo(f"job {submitted.job_id} {status.lower()}")
        if status != engine.success:
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
    with exit_codes():
        click.echo(f"{job_id}: {engine_of(profile_at(profile_file)).status(job_id)}")


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
    with exit_codes():
        engine = engine_of(profile_at(profile_file))
        if follow:
            engine.follow(job_id, _chunk)
        else:
            click.echo(engine.logs(job_id), nl=False)


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
    with exit_codes():
        click.echo(f"{job_id}: {engine_of(profile_at(profile_file)).stop(job_id)}")


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

    from raytrain_app.console import jobs_table

    with exit_codes():
        rows = engine_of(profile_at(profile_file)).jobs(statuses)
        click.echo(json.dumps(rows, indent=1) if as_json else jobs_table(rows))


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
    from raytrain_app.cluster.localnodes import cluster_up

    with exit_codes():
        cluster_up(profile_at(profile_file), click.echo)


@cluster.command("down")
@click.argument("profile_file", metavar="PROFILE", type=click.Path(dir_okay=False))
def cluster_down(profile_file):
    """Stop exactly the nodes `cluster up` started.

    \b
    Examples:
      raytrain-app cluster down cluster/local.yaml
      raytrain-app cluster down cluster/aws-gpu.yaml
    """
    from raytrain_app.cluster.localnodes import cluster_down

    with exit_codes():
        cluster_down(profile_at(profile_file), click.echo)


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
    with exit_codes():
        for line in engine_of(profile_at(profile_file)).describe():
            click.echo(line)


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
      raytrain-app slurm render examples/digits.yaml --cluster cluster/slurm.yaml --nodes 2 > job.sbatch
      # then, on a login node: sbatch job.sbatch
    """
    with exit_codes():
        profile = profile_at(job.pop("profile_file"), "slurm render", "slurm")
        click.echo(engine_of(profile).render(placed(profile, **job), warn), nl=False)


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
      raytrain-app k8s render examples/digits.yaml --cluster cluster/kuberay.yaml --nodes 2 > rayjob.yaml
      # then: kubectl apply -f rayjob.yaml
    """
    with exit_codes():
        profile = profile_at(job.pop("profile_file"), "k8s render", "kuberay")
        click.echo(engine_of(profile).render(placed(profile, **job), warn), nl=False)


def _chunk(text: str) -> None:
    click.echo(text, nl=False)
