"""algos: pure tensor math and the registries: RL advantages and policy/value losses (rl.py), the
DPO-family preference losses (preference.py), the pairwise reward-model loss (reward_model.py).
Imports torch only: nothing from rlhf, engine, transformers or hydra."""
