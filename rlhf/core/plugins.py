"""A user's own code named on the command line as `module:function` (reward.function=mypkg.mod:score), or
passed from Python (rlhf/api.py) as the object itself, which `register` names."""
from __future__ import annotations

import contextlib
import importlib
import math
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

from rlhf.core.errors import ConfigError


# Functions and classes passed from Python for this process's runs: `module:name` -> the object. The
# config still holds a `module:function` string (what config.yaml, the checkpoints and a resume compare),
# and load_function returns the object for it without importing anything.
_REGISTERED: dict[str, Any] = {}


@contextlib.contextmanager
def registered(objects: dict[str, Any]) -> Iterator[dict[str, str]]:
    """{config key: function or class} -> {config key: the `module:function` spec that names it} for the
    `with` block. An object that its own `module:qualname` imports back (a function in a module file) is
    named by that, so that a fresh process (the environment pool's workers) can load it too; one defined
    in `__main__` (a notebook, a script) or a closure gets that name made safe for a command line
    (`__main__:_lambda_`, suffixed _2, _3... when taken) and is found only in this process."""
    specs, added = {}, []
    try:
        for key, obj in objects.items():
            if not callable(obj):
                raise ConfigError(f"{key}: {obj!r} is a {type(obj).__name__}, not a function or class")
            module, name = getattr(obj, "__module__", None) or "__main__", getattr(obj, "__qualname__", "object")
            spec = f"{module}:{name}"
            if module != "__main__" and _imports_back(spec, obj):
                specs[key] = spec
                continue
            base = f"{module}:{re.sub(r'[^A-Za-z0-9_.]', '_', name)}"
            spec, n = base, 1
            while _REGISTERED.get(spec, obj) is not obj:
                n += 1
                spec = f"{base}_{n}"
            _REGISTERED[spec] = obj
            added.append(spec)
            specs[key] = spec
        yield specs
    finally:
        for spec in added:
            _REGISTERED.pop(spec, None)


def _imports_back(spec: str, obj: Any) -> bool:
    module_name, _, attr = spec.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            found = getattr(found, part)
    except Exception:  # noqa: BLE001 - not importable by that name (or raising on import): registered instead
        return False
    return found is obj


def load_function(spec: str | None, key: str = "reward.function") -> Callable[..., Any]:
    """`module:function` -> the callable (one passed from Python: the object itself); ConfigError (naming
    `key`) if it cannot be imported or called."""
    if spec in _REGISTERED:
        return _REGISTERED[spec]
    if not spec or spec.count(":") != 1 or not all(spec.split(":")):
        raise ConfigError(f"{key} must be 'module:function' (e.g. mypkg.rewards:score), got {spec!r}")
    module_name, attr = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module raising on import
        raise ConfigError(f"{key}={spec!r}: cannot import {module_name!r} ({type(e).__name__}: {e}); "
                          f"is it on PYTHONPATH? (sys.path[0]={sys.path[0]!r})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"{key}={spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(f"{key}={spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def as_score(value: Any) -> float:
    """A reward function's result as a finite float: numbers, bools and 0-d tensors; else TypeError (a
    string, None, a list) or ValueError (NaN, inf), naming what was returned."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"returned {type(value).__name__} {value!r:.80}, not a number")
    if not math.isfinite(float(value)):
        raise ValueError(f"returned {float(value)}")
    return float(value)
