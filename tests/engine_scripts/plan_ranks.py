"""The engine's measured memory report per rank, for tests/test_plan.py: python plan_ranks.py OUT overrides...

Under torchrun (2 gloo ranks) or as one process: for ZeRO stages 0-3, the model of the SFT config that
the overrides compose (rlhf/config/schema.py) is loaded as the SFT stage loads it, one optimizer step is taken
on a 2 x 8-token batch, and `TrainEngine.memory_report()` is written to OUT/rank<r>_stage<s>.json.
"""
import json
import os
import sys

import torch

from engine import TrainEngine, init_distributed
from rlhf.config import SFTConfig, compose, to_config
from rlhf.config.validate import engine_config, optim_config
from rlhf.modeling.load import load_causal_lm, load_tokenizer
from rlhf.modeling.roles import Policy


def main(out: str, overrides: list[str]) -> None:
    info = init_distributed()
    for stage in range(4):
        cfg = to_config(compose("sft", [*overrides, f"engine.stage={stage}", "engine.precision=fp32"]), SFTConfig)
        tok = load_tokenizer(cfg.model)
        model = Policy(load_causal_lm(cfg.model, tok, seed=0))
        engine = TrainEngine(model, engine_config(cfg.engine, info), optim_config(cfg.train), total_steps=2, info=info)
        ids = torch.randint(3, len(tok), (2, 8), generator=torch.Generator().manual_seed(info.rank))

        def loss_fn(m, mb):
            return m(mb["ids"], torch.ones_like(mb["ids"]), targets=mb["ids"][:, 1:], reduction="sum"), 14.0, {}

        engine.train_step([{"ids": ids}], loss_fn)
        with open(os.path.join(out, f"rank{info.rank}_stage{stage}.json"), "w") as f:
            json.dump(engine.memory_report(), f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
