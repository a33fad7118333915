"""Check stages' configs without running them: what each stage checks before any model loads, for several
stages at once, so that a pipeline whose third stage would stop stops in its first seconds.

    python -m rlhf.check sft train.epochs=2 --- reward model.name_or_path=outputs/sft --- ppo ppo.kl_coef=0.05
    python -m rlhf.check --world 2 sft engine=zero3                # as under torchrun with 2 ranks

Per stage (sft, reward, dpo, ppo), in order: the overrides' keys, values' types and config-group choices
(as `python -m rlhf.<stage>` checks its command line: rlhf/config/cli.py), `engine.ds_config`'s mapping,
the composed config typed as the stage's dataclass, then the stage's own validation (rlhf/config/
validate.py: ranges, batch arithmetic for the world size, the choices that conflict) on the device the
stage would run on. Model directories that earlier stages will write need not exist yet. The first
stage that would stop ends the check with its one line, naming the stage and the key, and exit code 2;
nothing is printed otherwise. scripts/run_all.sh runs it before its first stage, DRY_RUN=1 included.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from engine.distributed import DistInfo
from rlhf.config import SCHEMAS, cli, compose, to_config
from rlhf.config.ds_config import ds_overrides
from rlhf.config.validate import validate_dpo, validate_ppo, validate_reward, validate_sft
from rlhf.core.errors import ConfigError, DataFormatError
from rlhf.core.paths import CONF_DIR

VALIDATORS = {"sft": validate_sft, "reward": validate_reward, "dpo": validate_dpo, "ppo": validate_ppo}
SEPARATOR = "---"  # between stages on the command line (no Hydra override can be this word)


def check_stage(stage: str, overrides: list[str], info: DistInfo) -> None:
    """ConfigError (or DataFormatError) when `python -m rlhf.<stage> overrides...` would stop before loading a
    model for its configuration; returns quietly when it would start."""
    if stage not in VALIDATORS:
        raise ConfigError(f"rlhf.check checks the stages {', '.join(VALIDATORS)}, got {stage!r}")
    schema, module = SCHEMAS[stage], f"rlhf.{stage}"
    rewrites = cli.check_overrides(overrides, schema, CONF_DIR, module)
    ds_args, _ = ds_overrides(overrides, schema, CONF_DIR, module)
    if ds_args:
        cli.check_overrides(ds_args, schema, CONF_DIR, module)
    cfg = to_config(compose(stage, ds_args + [rewrites.get(o, o) for o in overrides]), schema)
    VALIDATORS[stage](cfg, info)


def split_stages(words: list[str]) -> list[tuple[str, list[str]]]:
    """`stage overrides... --- stage overrides...` -> [(stage, overrides), ...]."""
    groups, current = [], []
    for w in [*words, SEPARATOR]:
        if w != SEPARATOR:
            current.append(w)
        elif current:
            groups.append((current[0], current[1:]))
            current = []
    return groups


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rlhf.check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=1, help="the ranks the stages will run on (torchrun's)")
    ap.add_argument("stages", nargs=argparse.REMAINDER, help="stage overrides... [--- stage overrides...]")
    args = ap.parse_args(argv)
    os.environ["WORLD_SIZE"] = str(max(args.world, 1))  # what engine.ds_config's mapping reads, as under torchrun
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    info = DistInfo(rank=0, world_size=max(args.world, 1), local_rank=0, device=device, is_main=True)
    for stage, overrides in split_stages(args.stages):
        try:
            check_stage(stage, overrides, info)
        except (ConfigError, DataFormatError, FileNotFoundError) as e:
            out = next((o.partition("=")[2] for o in reversed(overrides) if o.startswith("output_dir=")), None)
            where = f" (output_dir={out})" if out else ""  # which of several stages of a kind (reward_2)
            print(f"error (configuration/data): the {stage} stage{where} would stop: {' '.join(str(e).split())}",
                  file=sys.stderr, flush=True)
            raise SystemExit(2) from None


if __name__ == "__main__":
    main()
