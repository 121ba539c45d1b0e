"""Builders by name: a built-in table, or any user callable named "pkg.module:attr".

Models and datasets share this so both accept the same `{name, args}` shape and give the same
errors. The driver checks a builder and its args before Ray starts (`check`), and each worker
calls it (`build`) with the same rules.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from typing import Any, Callable

from raytrain_app.config import check_scalar
from raytrain_app.errors import ConfigError, UserError


def resolve(name: str, builtins: dict[str, Callable], key: str) -> Callable:
    if ":" not in name:
        if name in builtins:
            return builtins[name]
        known = ", ".join(sorted(builtins))
        raise ConfigError(f"{key}: unknown name '{name}' (built-ins: {known}; or an import path 'pkg.module:build')")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a user module may fail to import in any way
        raise ConfigError(f"{key}: cannot import '{module_name}': {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}: '{module_name}' has no callable '{attr}'")
    return fn


def bind(fn: Callable, args: dict, key: str, context: dict) -> dict:
    """The keyword arguments to call `fn` with: user args, plus the context values it accepts.

    Unknown args and, where the builder annotates them, wrongly typed ones are config errors.
    """
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for name in args:
        if name not in params and not takes_any:
            accepted = ", ".join(n for n in params if n not in context) or "none"
            raise ConfigError(f"{key}.args: unknown argument '{name}' (accepted: {accepted})")
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    for name, value in args.items():
        tp = hints.get(name)
        if tp in (bool, int, float, str):
            args = {**args, name: check_scalar(tp, value, f"{key}.args.{name}", "")}
    kwargs = {k: v for k, v in context.items() if k in params or takes_any}
    kwargs.update(args)
    missing = [n for n, p in params.items() if p.default is p.empty and n not in kwargs
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        raise ConfigError(f"{key}.args: missing argument '{missing[0]}'")
    return kwargs


def build(name: str, args: dict, builtins: dict[str, Callable], key: str, context: dict) -> Any:
    fn = resolve(name, builtins, f"{key}.name")
    kwargs = bind(fn, args, key, context)
    try:
        return fn(**kwargs)
    except UserError:
        raise
    except Exception as e:  # a builder refusing its arguments is the user's to fix, not a crash
        detail = str(e).splitlines()[0] if str(e) else ""
        raise UserError(f"{key}: '{name}' could not be built: {type(e).__name__}: {detail}") from None
