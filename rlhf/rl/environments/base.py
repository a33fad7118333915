"""Multi-turn environments: the interface a user implements, and the runner contract the rollout loop uses.

A user's environment, named on the command line as `rollout.env=my_pkg.envs:Calculator`:

    class Calculator(Environment):
        def reset(self, row):                 # the prompt row (its dict) -> an optional first observation
            return None
        def step(self, text):                 # the model's turn as text -> Step
            if "<call>" not in text:
                return Step(None, {"env": 0.0})           # observation None = the episode is done
            return Step(f"<result>{evaluate(text)}</result>")

One environment instance lives for one episode (reset, then step after every model turn). The rollout loop
never calls an environment directly: it goes through a runner (`make_runner`, pool.py), which returns a `Reply` per
episode and never raises for the environment's faults: an environment that raises, hangs past
`timeout_s`, returns something that is not a `Step`, or kills its worker gives `Reply.error` set (the
episode ends, masked and counted by the loop) while the other episodes go on.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from rlhf.core.errors import ConfigError
from rlhf.core.plugins import load_function

# Reply.error kinds, counted by the rollout loop as env_errors / env_timeouts
ERROR_RAISED = "raised"            # reset/step raised an exception
ERROR_TIMEOUT = "timeout"          # the call took longer than timeout_s (the worker is replaced)
ERROR_GARBAGE = "garbage"          # returned something that is not a Step / str / None (or non-finite reward)
ERROR_WORKER_DIED = "worker_died"  # the worker process died during the call (killed, segfault, OOM)


@dataclass
class Step:
    """What an environment's `step` returns: the observation to insert (None = the episode is done), the
    reward parts it adds (summed over the episode per name; finite floats), and free-form info (logged)."""

    observation: str | None
    reward: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


class Environment:
    """Base class of a multi-turn environment (one instance per episode). Subclasses override `step`
    and optionally `reset` and `close`."""

    def reset(self, row: dict[str, Any]) -> str | None:
        """Start an episode on the prompt row (the dataset row's fields); an observation to insert before
        the first model turn, or None."""
        return None

    def step(self, text: str) -> Step:
        raise NotImplementedError(f"{type(self).__name__}.step(text) -> Step is not implemented")

    def close(self) -> None:
        """Release what the episode holds (a subprocess, a scratch dir)."""


@dataclass
class Reply:
    """A runner's answer for one episode's reset or step call."""

    observation: str | None = None
    reward: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    done: bool = False           # the environment ended the episode (observation None) or it faulted
    error: str | None = None     # None, or one of the ERROR_* kinds above
    message: str = ""            # the fault, one line (exception type and text, or what was returned)
    seconds: float = 0.0         # wall time of the call


def load_environment(spec: str | None, key: str = "rollout.env") -> type[Environment]:
    """`module:Class` -> the Environment subclass (ConfigError naming `key` otherwise)."""
    cls = load_function(spec, key)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"{key}={spec!r} is not a subclass of rlhf.rl.environments.Environment "
                          f"(got {cls!r}); subclass it and implement step(text) -> Step")
    return cls


def as_reply(result: Any, seconds: float, *, reset: bool) -> Reply:
    """An environment's return value as a Reply: reset -> str | None; step -> Step. Anything else (or a
    non-finite / non-number reward part, a non-str observation) is ERROR_GARBAGE naming what came back."""
    if reset:
        if result is None or isinstance(result, str):
            return Reply(observation=result, seconds=seconds)
        return Reply(done=True, error=ERROR_GARBAGE, seconds=seconds,
                     message=f"reset returned {type(result).__name__} {result!r:.80}, not str | None")
    if not isinstance(result, Step):
        return Reply(done=True, error=ERROR_GARBAGE, seconds=seconds,
                     message=f"step returned {type(result).__name__} {result!r:.80}, not a Step")
    if result.observation is not None and not isinstance(result.observation, str):
        return Reply(done=True, error=ERROR_GARBAGE, seconds=seconds,
                     message=f"step's observation is {type(result.observation).__name__}, not str | None")
    reward: dict[str, float] = {}
    for name, value in dict(result.reward or {}).items():
        if isinstance(value, (str, bytes)) or not hasattr(value, "__float__") or not math.isfinite(float(value)):
            return Reply(done=True, error=ERROR_GARBAGE, seconds=seconds,
                         message=f"step's reward part {name!r} is {value!r:.80}, not a finite number")
        reward[str(name)] = float(value)
    return Reply(observation=result.observation, reward=reward, info=dict(result.info or {}),
                 done=result.observation is None, seconds=seconds)


class InlineRunner:
    """`rollout.env_workers=0`: every environment in this process, one call after another, no timeout
    (for debugging an environment; a hang hangs the run). Same contract as the process pool."""

    def __init__(self, env_cls: type[Environment]):
        self.env_cls = env_cls
        self.envs: dict[int, Environment] = {}

    def reset(self, episodes: list[int], rows: list[dict[str, Any]]) -> list[Reply]:
        """Start episodes `episodes` (ids chosen by the caller, unique among the open ones) on `rows`."""
        return [self._call(e, "reset", row) for e, row in zip(episodes, rows, strict=True)]

    def step(self, episodes: list[int], texts: list[str]) -> list[Reply]:
        return [self._call(e, "step", text) for e, text in zip(episodes, texts, strict=True)]

    def close(self, episodes: list[int] | None = None) -> None:
        """End episodes (all when None), calling each environment's close()."""
        for e in list(self.envs) if episodes is None else episodes:
            env = self.envs.pop(e, None)
            if env is not None:
                try:
                    env.close()
                except Exception:  # an environment's cleanup fault must not end the run
                    pass

    def shutdown(self) -> None:
        """End every open episode (the process pool's shutdown also stops its workers)."""
        self.close()

    def _call(self, episode: int, method: str, arg: Any) -> Reply:
        start = time.perf_counter()
        try:
            if method == "reset":
                self.close([episode])
                self.envs[episode] = self.env_cls()
                result = self.envs[episode].reset(arg)
            else:
                result = self.envs[episode].step(arg)
        except Exception as e:
            self.close([episode])
            return Reply(done=True, error=ERROR_RAISED, seconds=time.perf_counter() - start,
                         message=f"{method} raised {type(e).__name__}: {str(e)[:200]}")
        reply = as_reply(result, time.perf_counter() - start, reset=method == "reset")
        if reply.done:
            self.close([episode])
        return reply
