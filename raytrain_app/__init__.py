"""raytrain-app: data-parallel PyTorch training on Ray clusters.

The public API; the `raytrain-app` command is a thin layer over it.
"""

from raytrain_app.api import fit
from raytrain_app.driver.result import Result
from raytrain_app.errors import ConfigError, TrainingFailed, UserError
from raytrain_app.inference.load import load_model
from raytrain_app.worker.script_api import latest_checkpoint, report

__all__ = ["fit", "load_model", "Result", "UserError", "ConfigError", "TrainingFailed", "report",
           "latest_checkpoint"]
