"""raytrain-app: data-parallel PyTorch training on Ray clusters.

The public API; the `raytrain-app` command is a thin layer over it. Its names load on first use
(PEP 562), not at `import raytrain_app`: the command line, which imports this package first,
takes Ctrl-C only once it runs, and loads what a command needs then.
"""

import importlib

_WHERE = {"fit": "raytrain_app.api", "Result": "raytrain_app.driver.result", "UserError": "raytrain_app.errors",
          "ConfigError": "raytrain_app.errors", "TrainingFailed": "raytrain_app.errors",
          "load_model": "raytrain_app.inference.load", "report": "raytrain_app.worker.script_api",
          "latest_checkpoint": "raytrain_app.worker.script_api"}
__all__ = ["fit", "load_model", "Result", "UserError", "ConfigError", "TrainingFailed", "report",
           "latest_checkpoint"]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'raytrain_app' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__() -> list:
    return sorted([*globals(), *__all__])
