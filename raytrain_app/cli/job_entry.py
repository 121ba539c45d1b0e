"""A submitted job's first Python on the cluster: `python -m raytrain_app.cli.job_entry train - ...`.

The node may never have seen raytrain-app: a job on Ray brought it (`launch/package.py`). Ray is
imported before the command runs (the command line's own modules need neither), so that Ray's own
psutil (`ray/thirdparty_files`, which `import ray` puts on the path) serves a node whose image has
none. Then the node's versions are checked against those the
submitting machine recorded in the job, where no cluster could be asked before (a RayJob's
cluster, a SLURM allocation): a mismatch is one line and exit 2, as it would have been there.
Under SLURM the node's own installed raytrain-app runs, and another version than the submitting
machine's is said.
"""

import os

import ray  # noqa: F401 - before the command: its vendored psutil for what the command imports

from raytrain_app.cli import exit_codes, run
from raytrain_app.cli.base import warn
from raytrain_app.launch.package import PROJECT
from raytrain_app.launch.versions import SUBMITTED_WITH_ENV, Versions, check, other_raytrain_app


def main() -> None:
    if os.environ.get(SUBMITTED_WITH_ENV):
        with exit_codes():
            submitted, node = Versions.from_env(os.environ[SUBMITTED_WITH_ENV]), Versions.here()
            check(submitted, node, "this node", here="the submitting machine")
            installed = other_raytrain_app(submitted, node)
            if installed:  # a SLURM job's environment: a job on Ray brings its own, which this sees
                warn(f"this node runs raytrain-app {installed}, and the job was submitted with "
                     f"{submitted.packages[PROJECT]}: install that one in slurm.setup's environment")
    run()


if __name__ == "__main__":
    main()
