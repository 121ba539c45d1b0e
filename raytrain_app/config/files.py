"""Config files: YAML read as ML users write it, `--set` overrides, and validation against a
pydantic model that reports every problem, one line each, with the YAML line it comes from.

YAML 1.2, not PyYAML's 1.1: `lr: 1e-3` is a number (1.1 needs a dot, so nearly every learning
rate would load as a string), and only true/false are booleans (`on`, `off`, `yes`, `no` stay the
words they are). Job files, `--set` values and cluster profiles all load through here.

Why PyYAML with two resolvers changed, not ruamel.yaml: ruamel's round-trip loader would give
YAML 1.2 and positions by itself, but it too hands aliases back as shared references with no
bound (a ten-level "billion laughs" loads in milliseconds, then expands when walked), so the
bounded alias expansion here (`MAX_NODES`) is needed with either; PyYAML comes with Ray already,
and the resolvers are a dozen lines.
"""

from __future__ import annotations

import copy
import difflib
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from raytrain_app.errors import ConfigError

Model = TypeVar("Model", bound=BaseModel)


class Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2's core schema for booleans, floats and integers: no base-60
    integers, so `workers: 2:8` is the range it reads as, not 128."""


Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in ("tag:yaml.org,2002:bool",
                                                                      "tag:yaml.org,2002:int")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                             list("-+0123456789"))
Loader.add_constructor("tag:yaml.org,2002:int", lambda loader, node: (
    lambda text: int(text, 0) if text[:2] in ("0o", "0x") else int(text, 10))(loader.construct_scalar(node)))
Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                             list("tTfF"))
Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


# A config, profile or --set value is a few hundred nodes; aliases may repeat a node, but what
# they expand to is bounded, so that a few hundred bytes naming each other ("billion laughs")
# are refused at once instead of growing without end in the line index, pydantic and copies.
MAX_NODES = 100_000


class Refused(yaml.YAMLError):
    """Well-formed YAML that is not read: aliases that expand too far, or into themselves."""


def loads(text: str) -> Any:
    """A YAML document's data (None for an empty one); raises yaml.YAMLError, also for one whose
    aliases expand past MAX_NODES or into themselves."""
    return _load(text)[0]


def _load(text: str) -> tuple[Any, Optional[yaml.Node]]:
    """The data and its node tree, the expansion checked before any Python object is made."""
    loader = Loader(text)  # checks the characters first
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        _expanded_size(node, {}, set())
        return loader.construct_document(node), node
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_: set[int]) -> int:
    """How many nodes `node` stands for once every alias is copied out, counted once per distinct
    node (so the count itself is linear in the file)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise Refused("an alias refers to a node that contains it (a recursive alias)")
    open_.add(key)
    children = (node.value if isinstance(node, yaml.SequenceNode) else
                [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
    size = 1
    for child in children:
        size += _expanded_size(child, sizes, open_)
        if size > MAX_NODES:
            raise Refused(f"its aliases expand to more than {MAX_NODES:,} values (a file naming itself "
                                 "over and over?)")
    open_.discard(key)
    sizes[key] = size
    return size


def dumps(value: Any) -> str:
    return yaml.safe_dump(value, sort_keys=False)


class ConfigDoc:
    """A config's raw data, where it came from, and which line each key is on."""

    def __init__(self, data: Any, source: str, lines: Optional[dict[tuple, int]] = None):
        self.data, self.source = data, source
        self.lines = lines or {}
        self.overridden: set[tuple] = set()

    def override(self, expr: str, defaults: Optional[dict] = None) -> None:
        """Apply one `a.b.c=value`; the value is YAML (`3`, `true`, `[1, 2]`, `{k: v}`), and a
        number in the key indexes a list (`optimizer.betas.0=0.8`). A section or list the file
        does not hold starts from its value in `defaults`."""
        key, sep, text = expr.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or not key or not all(p.strip() for p in parts):
            raise ConfigError(f"bad --set expression {expr!r}: expected KEY=VALUE, e.g. train.epochs=5")
        try:
            value = loads(text) if text.strip() else ""
        except Refused as e:
            raise ConfigError(f"bad --set expression {_show(expr)}: YAML refused: {e}") from None
        except yaml.YAMLError:
            raise ConfigError(f"bad --set expression {expr!r}: the value is not valid YAML") from None
        if not isinstance(self.data, dict):
            self.data = {}
        node: Any = self.data
        for i, part in enumerate(parts):
            parent = ".".join(parts[:i])
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"{self.source}: --set {key}: {parent} is a list of {len(node)}; "
                                      f"{part!r} is not one of its indexes")
                part = int(part)
            elif not isinstance(node, dict):
                raise ConfigError(f"{self.source}: --set {key}: {parent} is not a section")
            if i == len(parts) - 1:
                node[part] = value
            else:
                if isinstance(node, dict) and part not in node:
                    node[part] = copy.deepcopy(_at(defaults, parts[: i + 1], {}))
                node = node[part]
        self.overridden.add(tuple(parts))

    def where(self, path: tuple) -> str:
        """`FILE:LINE` for a key the file holds, `FILE (--set)` for an override, else `FILE`."""
        path = tuple(str(p) for p in path)
        if any(path[: len(o)] == o for o in self.overridden):
            return f"{self.source} (--set)"
        while path:
            if path in self.lines:
                return f"{self.source}:{self.lines[path]}"
            path = path[:-1]
        return self.source


def read_yaml(path: str | Path) -> ConfigDoc:
    """A YAML config file ("-": standard input) whose top level is a mapping, or a ConfigError
    naming the file and the problem."""
    source = str(path)
    try:
        text = sys.stdin.read() if source == "-" else Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {source}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {source}: {e}") from None
    try:
        data, node = _load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        what = "YAML refused" if isinstance(e, Refused) else "malformed YAML"
        raise ConfigError(f"{source}{where}: {what}: {problem}") from None
    if data is None:
        raise ConfigError(f"{source}: the config is empty" if source != "-" else "-: standard input is empty")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {_kind(data)}")
    lines: dict[tuple, int] = {}
    _key_lines(node, (), lines)
    return ConfigDoc(data, source, lines)


def validated(model: type[Model], doc: ConfigDoc) -> Model:
    """`model` built from the doc, or a ConfigError with one line per problem:
    `FILE:LINE: KEY: what is wrong`."""
    try:
        return model.model_validate(doc.data)
    except ValidationError as e:
        problems = [line for error in e.errors() for line in _messages(model, error)]
        raise ConfigError(*[f"{doc.where(path)}: {'.'.join(map(str, path)) or 'config'}: {message}"
                            for path, message in problems]) from None


# A tagged union's branches, which pydantic names in an error's location like keys (see
# ScalingConfig.workers): left out of the key a message names.
NUMBER, RANGE = "<number>", "<range>"
UNION_BRANCHES = {NUMBER, RANGE}


def _messages(model: type[BaseModel], error: dict) -> list[tuple[tuple, str]]:
    """(key path, message) pairs for one pydantic error; a rule spanning fields may report several."""
    loc = tuple(part for part in error["loc"] if part not in UNION_BRANCHES)
    kind, value = error["type"], error.get("input")
    ctx = error.get("ctx", {})
    if kind == "value_error":
        text = str(ctx.get("error", error["msg"]))
        if _fields_at(model, loc) is None:  # a field's own validator
            return [(loc, text)]
        # A model validator's rules, one per line: "key.relative.to.the.model: message".
        return [(loc + tuple(key.split(".")), message) for key, _, message in
                (line.partition(": ") for line in text.splitlines())]
    if kind == "extra_forbidden":
        known = _fields_at(model, loc[:-1]) or []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        prefix = ".".join(map(str, loc[:-1]))
        hint = f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""
        return [(loc, f"unknown key{hint}")]
    messages = {
        "int_type": "must be an integer", "float_type": "must be a number", "finite_number": "must be a finite number",
        "bool_type": "must be true or false", "string_type": "must be a string", "dict_type": "must be a mapping",
        "model_type": "must be a mapping", "list_type": "must be a list", "missing": "is required",
    }
    if kind in messages:
        got = _kind(value) if kind in ("dict_type", "model_type", "list_type") else _show(value)
        return [(loc, f"{messages[kind]}, got {got}")]
    if kind == "literal_error":
        choices = ctx["expected"].replace(" or ", ", ").replace("'", "")
        return [(loc, f"must be one of {choices}; got {_show(value)}")]
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return [(loc, f"must be {bounds[kind]} {limit:g}, got {_show(value)}")]
    if kind in ("too_short", "too_long"):
        return [(loc, f"must be a list of {ctx.get('min_length', ctx.get('max_length'))} values, got {_show(value)}")]
    return [(loc, f"{error['msg'][0].lower()}{error['msg'][1:]}, got {_show(value)}")]


def _fields_at(model: type[BaseModel], path: tuple) -> Optional[list[str]]:
    """The field names of the model at `path` inside `model`, as files spell them (a field's
    alias, where a Python keyword needs one); None when `path` is no model."""
    for part in path:
        field = next((f for name, f in model.model_fields.items() if (f.alias or name) == str(part)), None)
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return [field.alias or name for name, field in model.model_fields.items()]


def _at(tree: Any, path: Sequence[str], missing: Any) -> Any:
    for part in path:
        if isinstance(tree, dict) and part in tree:
            tree = tree[part]
        elif isinstance(tree, list) and part.isdigit() and int(part) < len(tree):
            tree = tree[int(part)]
        else:
            return missing
    return tree


def _key_lines(node, path: tuple, lines: dict) -> None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            child = path + (str(key.value),)
            lines[child] = key.start_mark.line + 1
            _key_lines(value, child, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[path + (str(i),)] = item.start_mark.line + 1
            _key_lines(item, path + (str(i),), lines)


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "nothing"}.get(type(value),
                                                                                         type(value).__name__)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
