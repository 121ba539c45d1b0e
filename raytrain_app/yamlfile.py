"""YAML as ML users write it: `lr: 1e-3` is a number.

PyYAML follows YAML 1.1, where a float needs a dot: `1e-3` and `3e4` would load as strings, and
that is how nearly everyone writes a learning rate. This loader reads floats as YAML 1.2, JSON
and Python do. Job files, `--set` values and cluster profiles all load through it.
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2's float syntax (exponent without a dot)."""


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def loads(text: str) -> Any:
    return yaml.load(text, Loader=Loader)  # noqa: S506 - Loader is a SafeLoader


def dumps(value: Any) -> str:
    return yaml.safe_dump(value, sort_keys=False)
