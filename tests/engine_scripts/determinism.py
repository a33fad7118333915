"""Stage runs for tests/test_determinism.py: SFT -> reward, DPO, PPO and GRPO from that SFT, one after
the other in this process (or on every rank under torchrun), each with engine.deterministic=true, into
<out>/<stage>. The test launches it twice per world size and compares the two runs' outputs.

    python determinism.py <out>                                  one process
    torchrun --nproc_per_node 2 determinism.py <out>             2 gloo ranks

Each stage is its app's `run(config)` on the composed config (what `python -m rlhf.<stage>` does after
parsing its command line), so the five runs share one interpreter start.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from engine import exit_process, init_distributed  # noqa: E402
from rlhf import dpo, ppo, reward, sft  # noqa: E402
from rlhf.config import compose, to_config  # noqa: E402
from rlhf.config.schema import SCHEMAS  # noqa: E402

SMALL_MODEL = ["model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=2",
               "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2"]
# engine.precision=fp32 on every host: the equalities the tests assert are fp32's (auto would run bf16 on a CPU
# with native bf16, whose rounding differs with the partition across ranks)
COMMON = ["engine.deterministic=true", "engine.precision=fp32", "train.max_steps=2", "train.eval_every=0",
          "train.save_every=0", "data.num_eval_prompts=4", "data.eval_size=8"]
RL = ["rollout.prompts_per_step=4", "rollout.mini_batch_size=4", "rollout.micro_batch_size=2",
      "rollout.max_new_tokens=6", "engine.deterministic_rows=8", "eval.max_new_tokens=6"]

# 8 of the training pairs held out instead of the shipped 400 held-out pairs (evaluated twice per run)
PAIRS = ["train.global_batch_size=8", "train.micro_batch_size=2", "data.eval_path=null"]


def stages(out: str) -> list[tuple[str, str, list[str]]]:
    """(name, app, overrides) in order; every later stage starts from the SFT output."""
    model = f"{out}/sft/model"
    return [
        ("sft", "sft", [*SMALL_MODEL, "train.global_batch_size=8", "train.micro_batch_size=4", "eval.max_new_tokens=6"]),
        ("reward", "reward", [f"model.name_or_path={model}", "model.fallback_to_config=false", *PAIRS]),
        ("dpo", "dpo", [f"model.name_or_path={model}", "model.fallback_to_config=false", *PAIRS,
                        "eval.max_new_tokens=6"]),
        ("ppo", "ppo", [f"actor.model={model}", f"critic.model={out}/reward/model", *RL]),
        ("grpo", "ppo", ["algorithm=grpo", f"actor.model={model}", "reward.sources=[judge]", *RL,
                         "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=4"]),
    ]


APPS = {"sft": sft, "reward": reward, "dpo": dpo, "ppo": ppo}

if __name__ == "__main__":
    out = sys.argv[1]
    info = init_distributed()
    for name, app, overrides in stages(out):
        cfg = to_config(compose(app, [f"output_dir={out}/{name}", *overrides, *COMMON]), SCHEMAS[app])
        APPS[app].run(cfg)
    exit_process(0)  # not a plain exit: see engine.distributed.exit_process
