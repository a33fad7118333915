"""A user's own code named on the command line as `module:function` (reward.function=mypkg.mod:score)."""
from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable
from typing import Any

from rlhf.core.errors import ConfigError


def load_function(spec: str | None, key: str = "reward.function") -> Callable[..., Any]:
    """`module:function` -> the callable; ConfigError (naming `key`) if it cannot be imported or called."""
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
