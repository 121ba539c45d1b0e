"""The `raytrain-app` command line: thin wrappers over the library, with exit codes

    0  success    1  training failed    2  user error (bad config, missing file, ...)
"""

from __future__ import annotations

import os
import sys

import click

from raytrain_app.errors import TrainingFailed, UserError

EXIT_FAILED, EXIT_USAGE = 1, 2


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="raytrain-app")
def main() -> None:
    """Data-parallel PyTorch training on Ray clusters."""


@main.command()
@click.argument("config_file", metavar="CONFIG", type=click.Path(dir_okay=False))
@click.option("--workers", type=int, help="Training workers (overrides scaling.workers).")
@click.option("--gpus-per-worker", type=float, help="GPUs per worker (overrides scaling.gpus_per_worker).")
@click.option("--run-dir", help="Where config, metrics, checkpoints and logs go (path or URI). "
                                "Default: runs/NAME-TIMESTAMP.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config field; repeatable.")
@click.option("--resume", is_flag=True, help="Continue the run in --run-dir (default: the latest run of this "
                                             "job) from its latest checkpoint.")
@click.option("--verbose", is_flag=True, help="Show Ray's own logs and worker output.")
def train(config_file, workers, gpus_per_worker, run_dir, overrides, resume, verbose):
    """Train CONFIG on an embedded local Ray cluster."""
    from raytrain_app.config import load_config
    from raytrain_app.plan import make_plan

    sys.path.insert(0, os.getcwd())  # "mypkg.models:build" resolves from here, as on the workers
    sets = list(overrides)
    if workers is not None:
        sets.append(f"scaling.workers={workers}")
    if gpus_per_worker is not None:
        sets.append(f"scaling.gpus_per_worker={gpus_per_worker}")
    with _exit_codes():
        plan = make_plan(load_config(config_file, sets), run_dir=run_dir, resume=resume, source=config_file)
        click.echo(f"run {plan.run_dir}: {plan.config.scaling.workers} workers, {plan.config.scaling.backend}, "
                   f"{plan.config.train.precision}")
        from raytrain_app.cluster import embedded_cluster
        from raytrain_app.report import summary
        from raytrain_app.trainer import run_training

        s = plan.config.scaling
        cpus = max(os.cpu_count() or 1, int(s.workers * s.cpus_per_worker + 0.999))
        with embedded_cluster(num_cpus=cpus, log_dir=plan.log_dir, verbose=verbose):
            result = run_training(plan, progress=sys.stdout.isatty(), echo=click.echo)
        click.echo(summary(plan, result))


class _exit_codes:
    """Map the library's exceptions to one line on stderr and the documented exit code."""

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if isinstance(error, UserError):
            click.echo(f"error: {error}", err=True)
            sys.exit(EXIT_USAGE)
        if isinstance(error, TrainingFailed):
            click.echo(f"training failed: {error}", err=True)
            sys.exit(EXIT_FAILED)
        if isinstance(error, KeyboardInterrupt):
            click.echo("interrupted", err=True)
            sys.exit(130)
        return False


if __name__ == "__main__":
    main()
