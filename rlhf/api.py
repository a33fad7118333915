"""Run a stage from Python (a notebook, a script of your own) and get its summary back.

    from rlhf import api

    sft = api.run("sft", "train.max_steps=20", "output_dir=runs/sft")          # = python -m rlhf.sft ...
    print(sft["gold_score_after"])
    grpo = api.run("ppo", "algorithm=grpo", "actor.model=runs/sft", "output_dir=runs/grpo",
                   "reward.sources=[function]", reward_function=my_reward)     # a Python function, no module file

`run(stage, *overrides)` is the command line's code path: the stage's own `main()` runs with sys.argv =
the overrides (Hydra composes them, the run writes the same output_dir, config.yaml, metrics.jsonl and
model), in this process. What differs is only the ending: a mistake in the config or the data raises
the error the command line prints after `error (...)` (ConfigError, DataFormatError, ...; the same text)
instead of exiting with code 2, and the process goes on. It returns summary.json as a dict.

Functions and classes are passed as objects: `reward_function` (reward.function: fn(prompt, response,
row) -> float, or TRL's batched convention), `judge` (eval.judge: fn(prompt, response, row) -> score)
and `env` (rollout.env: an Environment subclass). The config names each by a `module:function` string as
before (rlhf/core/plugins.py `registered`): a function in a module file by its own name, one from a
notebook or a script as `__main__:<name>`, found in this process only; an environment class defined there
therefore needs rollout.env_workers=0 (the pool's workers import theirs by name).

Under torchrun (`torchrun --nproc_per_node 2 my_script.py`, which calls `run` on every rank) each call
joins the job's process group, which stays up for the next call; every rank gets the summary.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from engine.distributed import barrier
from rlhf import dpo, evaluate, ppo, reward, sft
from rlhf.core.errors import ConfigError
from rlhf.core.plugins import registered
from rlhf.run.app import in_process
from rlhf.run.runlog import SUMMARY

# the stages a call runs to an end (the commands rlhf.plan, env, report and serve are not runs: they
# print, or serve until stopped)
STAGES = {"sft": sft, "reward": reward, "dpo": dpo, "ppo": ppo, "evaluate": evaluate}
# run()'s keyword -> the config key that names the object
OBJECT_KEYS = {"reward_function": "reward.function", "judge": "eval.judge", "env": "rollout.env"}


def run(stage: str, *overrides: str, reward_function: Callable[..., Any] | None = None,
        judge: Callable[..., Any] | None = None, env: type | None = None) -> dict[str, Any]:
    """`python -m rlhf.<stage> *overrides` in this process, with the objects given; returns its
    summary.json (what the command line prints last) as a dict. Raises the command line's one-line error
    (ConfigError, DataFormatError, TrainingError, ...) for a mistake in the config or the data."""
    if stage not in STAGES:
        raise ConfigError(f"rlhf.api.run: unknown stage {stage!r} (stages: {', '.join(STAGES)})")
    bad = [o for o in overrides if not isinstance(o, str)]
    if bad:
        raise ConfigError(f"rlhf.api.run: overrides are 'key=value' strings as on the command line, got {bad[0]!r}")
    objects = {OBJECT_KEYS[k]: v for k, v in
               (("reward_function", reward_function), ("judge", judge), ("env", env)) if v is not None}
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    if twice := sorted(given & set(objects)):
        raise ConfigError(f"{twice[0]} is given twice: as an override and as an object (pass one)")
    module = STAGES[stage]
    saved_argv = sys.argv
    with registered(objects) as specs, in_process() as done:
        sys.argv = [module.__file__, *overrides, *(f"{key}={spec}" for key, spec in specs.items())]
        try:
            module.main()
        finally:
            sys.argv = saved_argv
    if done.config is None:  # --help, --cfg: printed, nothing ran
        return {}
    if dist.is_initialized():  # torchrun: the main rank writes summary.json
        barrier()
    path = os.path.join(done.config.output_dir, SUMMARY)
    with open(path) as f:
        return json.load(f)
