"""`python -m rlhf.plan`: a run's device memory per rank, planned before any weights load.

    python -m rlhf.plan stage=sft world_size=8 budget_gib=80 model=llama model.name_or_path=/models/Llama-3.2-1B
    python -m rlhf.plan stage=ppo world_size=2 budget_gib=24 actor.model=outputs/sft critic.model=outputs/reward

The planner and its estimates: rlhf/run/plan.py (`--help` prints them). Exit code: 0 (fits, or no
budget), 1 (does not fit), 2 (a bad input: one line naming it).
"""
from __future__ import annotations

import sys

from rlhf.run import plan
from rlhf.run.app import user_errors


def main() -> None:
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(plan.__doc__)
        return
    with user_errors():
        report, change = plan.run_plan(sys.argv[1:])
    print(plan.format_plan(report, change))
    sys.exit(1 if report["fits"] is False else 0)


if __name__ == "__main__":
    main()
