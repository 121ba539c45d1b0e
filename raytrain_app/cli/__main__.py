"""`python -m raytrain_app.cli`, as the `raytrain-app` script."""

from raytrain_app.cli import run

run()
