"""The `rlhf` command: `rlhf <command> [args ...]` runs `python -m rlhf.<command> [args ...]`.

    rlhf sft train.max_steps=20                  # = python -m rlhf.sft train.max_steps=20
    rlhf ppo algorithm=grpo                      # = python -m rlhf.ppo algorithm=grpo
    rlhf env                                     # = python -m rlhf.env
    rlhf --help                                  # the commands; rlhf <command> --help: its keys
    rlhf --version                               # the package's version (and, from a checkout, its commit)
    python -m rlhf sft ...                       # the same, without the console script on PATH

The command module runs as `python -m` runs it (runpy, as `__main__`, with sys.argv = the module's path
and the arguments): Hydra sees the same argv, a stage writes the same run directory and log file, and a
process pool or torchrun child finds the same main module. So `rlhf ppo ...` and `python -m rlhf.ppo ...`
are one code path, and `torchrun -m rlhf.ppo ...` stays the way to launch several ranks.
There is no `rlhf pipeline`: scripts/run_all.sh is the checkout's reproduction of the documented figures
(it reads scripts/ and the tool task's and extra reward-model pairs' files, which the package does not
carry); installed, the stages run one after another as README.md shows.
"""
from __future__ import annotations

import runpy
import sys

from rlhf.core.provenance import DISTRIBUTION, describe, provenance

# command -> what it does (one line of `rlhf --help`); each is the module rlhf.<command>
COMMANDS = {
    "sft": "stage 1: supervised fine-tuning on demonstrations",
    "reward": "stage 2: a pairwise reward model",
    "ppo": "stage 3: RL (PPO; algorithm=grpo|rloo|reinforce_pp|gspo|online_dpo|distill)",
    "dpo": "offline preference optimisation (DPO, IPO, SimPO, KTO, ...)",
    "evaluate": "score any model on held-out data as the stages do",
    "plan": "a run's memory per rank, before any weights load",
    "env": "versions, devices and the paths a run would take (--check: the fast paths vs references)",
    "report": "the run explorer: one HTML page over runs",
    "serve": "serve a reward over HTTP",
    "check": "check stages' configs without running them (what run_all.sh runs before its first stage)",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()]
    return ("usage: rlhf <command> [key=value ...]   (the same as python -m rlhf.<command> ...)\n\ncommands:\n"
            + "\n".join(lines) + "\n\nrlhf <command> --help lists the command's keys, their values and what they do; "
            "rlhf --version names this package's version.\n")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), end="", file=sys.stdout if args else sys.stderr)
        raise SystemExit(0 if args else 2)
    if args[0] == "--version":
        print(f"{DISTRIBUTION} {describe(provenance())}")
        raise SystemExit(0)
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        hint = "; the whole pipeline is bash scripts/run_all.sh in a checkout" if command in ("pipeline", "run_all") else ""
        print(f"rlhf: unknown command {command!r} (commands: {', '.join(COMMANDS)}; rlhf --help{hint})", file=sys.stderr)
        raise SystemExit(2)
    sys.argv = [f"rlhf {command}", *rest]  # runpy replaces argv[0] with the module's path, as -m does
    runpy.run_module(f"rlhf.{command}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
