"""The `raytrain-app` command line: thin wrappers over the library, with exit codes

    0  success    1  training failed    2  user error (bad config, missing file, ...)
    130  interrupted (Ctrl-C)    141  the output pipe closed (`| head`)

`base.py` holds what commands share; the commands live by what they work on: `training.py`,
`jobs.py` (a profile's cluster), `results.py` (a run's results), `convert.py` (a user's files).
"""

from raytrain_app.cli import convert, jobs, results, training  # noqa: F401 - each registers its commands on `main`
from raytrain_app.cli.base import exit_codes, main, run

__all__ = ["main", "run", "exit_codes"]
