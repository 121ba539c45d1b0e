"""Builders by name: a built-in table, or any user callable named "pkg.module:attr".

Models and datasets share this so both accept the same `{name, args}` shape and give the same
errors. `build` resolves the name, binds `args` against the builder's signature (unknown and
missing arguments, and wrongly typed ones where the builder annotates them, are config errors,
all reported at once) and calls it; the driver does it before Ray starts, each worker again.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import typing
from typing import Any, Callable

from pydantic import ConfigDict, TypeAdapter, ValidationError

from raytrain_app.errors import ConfigError, UserError

# Scalars are checked strictly (no "3" for 3); containers as YAML gives them (a list for a tuple).
_STRICT = ConfigDict(strict=True)
_SCALAR_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def resolve(name: str | Callable, builtins: dict[str, Callable], key: str) -> Callable:
    if callable(name):  # given as a function, from Python
        return name
    if ":" not in name:
        if name in builtins:
            return builtins[name]
        known = ", ".join(sorted(builtins))
        raise ConfigError(f"{key}: unknown name '{name}' (built-ins: {known}; or an import path 'pkg.module:build')")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a user module may fail to import in any way
        raise _cannot_import(key, module_name, e) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}: '{module_name}' has no callable '{attr}'")
    return fn


def check_findable(name: str | Callable | None, key: str) -> None:
    """Where a user's builder lives in a module that this process cannot find, the error that
    `resolve` would give, without importing the module (and torch with it): for commands whose
    workers import it, so that a missing module is one line before a cluster and its workers
    start, not after."""
    if not isinstance(name, str) or ":" not in name:
        return
    module_name = name.partition(":")[0]
    try:
        found = importlib.util.find_spec(module_name)
    except Exception as e:  # noqa: BLE001 - a parent package that is missing, or fails to import
        raise _cannot_import(key, module_name, e) from None
    if found is None:
        raise _cannot_import(key, module_name, ModuleNotFoundError(f"No module named '{module_name}'"))


def _cannot_import(key: str, module_name: str, e: Exception) -> ConfigError:
    return ConfigError(f"{key}: cannot import '{module_name}': {type(e).__name__}: {e}")


def bind(fn: Callable, args: dict, key: str, context: dict) -> dict:
    """The keyword arguments to call `fn` with: user args, plus the context values it accepts."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: check names only
        hints = {}
    problems, kwargs = [], {k: v for k, v in context.items() if k in params or takes_any}
    for name, value in args.items():
        if name not in params and not takes_any:
            accepted = ", ".join(n for n in params if n not in context) or "none"
            problems.append(f"{key}.args.{name}: unknown argument (accepted: {accepted})")
            continue
        tp = hints.get(name)
        try:
            kwargs[name] = value if tp is None else TypeAdapter(
                tp, config=_STRICT if tp in _SCALAR_NAMES else None).validate_python(value)
        except ValidationError as e:
            what = f"must be {_SCALAR_NAMES[tp]}" if tp in _SCALAR_NAMES else e.errors()[0]["msg"].lower()
            problems.append(f"{key}.args.{name}: {what}, got {value!r}")
        except Exception:  # noqa: BLE001 - an annotation pydantic cannot check: pass the value on
            kwargs[name] = value
    missing = [n for n, p in params.items() if p.default is p.empty and n not in kwargs
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    problems += [f"{key}.args.{n}: missing argument" for n in missing]
    if problems:
        raise ConfigError(*problems)
    return kwargs


def label(name: str | Callable) -> str:
    """How errors name a builder: its config name, or a function's import path."""
    return name if isinstance(name, str) else f"{name.__module__}:{name.__qualname__}"


def build(name: str | Callable, args: dict, builtins: dict[str, Callable], key: str, context: dict) -> Any:
    fn = resolve(name, builtins, f"{key}.name")
    kwargs = bind(fn, args, key, context)
    try:
        return fn(**kwargs)
    except UserError:
        raise
    except Exception as e:  # a builder refusing its arguments is the user's to fix, not a crash
        detail = str(e).splitlines()[0] if str(e) else ""
        raise UserError(f"{key}: '{label(name)}' could not be built: {type(e).__name__}: {detail}") from None
