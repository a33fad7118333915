"""On-policy distillation in the RL stage: `python -m rlhf.ppo algorithm=distill teacher.model=<dir>`.

The student (the actor) samples; a frozen teacher scores the student's own tokens; the per-token
reverse KL (student || teacher), estimated on the sampled tokens by k1 = log p_student(y_t) -
log p_teacher(y_t), is the negative per-token reward of the RL estimator:

    reward_t = -ppo.kl_coef x (log p_student(y_t | y_<t) - log p_teacher(y_t | y_<t))    (score 0)
    A_t      = reward_t          (ppo.advantage_estimator=reinforce with ppo.gamma=0: each next token)

and the actor's clipped surrogate (one on-policy pass: ratio 1) follows its policy gradient,
E[k1_t grad log p_student(y_t)], the gradient of the per-token reverse KL. This is the recipe of
Thinking Machines' "On-Policy Distillation" (Lu et al., 2025: reverse KL per token as the advantage,
discount 0) and of verl's; GKD (Agarwal et al. 2024, "On-Policy Distillation of Language Models:
Learning from Self-Generated Mistakes"; TRL's GKDTrainer) trains on the same student samples with a
full-vocabulary divergence instead (its beta=1 is this reverse KL, summed over the vocabulary), which
needs the teacher's whole distribution in the loss: not offered here.

No new machinery: the teacher takes the reference's place (`Models.reference`: built, sharded and
offloaded as the reference is, `teacher.offload`), so the step's `kl` metric and the held-out `kl`
are the reverse KL to the teacher (summed over the response, k1), and no reward source is built (a
zero score, `NoReward`); nothing else of the loop changes (generation path, engine, alarms, eval).
The teacher may be larger than the student; it must share the student's tokenizer (checked here,
before any weights load: its ids are the student's).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rlhf.config import PPOConfig
from rlhf.core.errors import ConfigError
from rlhf.core.hub import check_local
from rlhf.modeling.load import check_causal_lm, load_tokenizer, tokenizer_mismatch


def is_distill(cfg: PPOConfig) -> bool:
    return cfg.ppo.objective == "distill"


def reference_path(cfg: PPOConfig) -> str:
    """The frozen model in the reference's place: teacher.model for distillation, else reference.model
    (null: the actor's)."""
    if is_distill(cfg):
        return cfg.teacher.model
    return cfg.reference.model or cfg.actor.model


def check_teacher(cfg: PPOConfig, tok: Any, model_cfg) -> None:
    """teacher.model: a local (or cached) causal LM whose saved tokenizer is the student's, `tok`
    (even with model.tokenizer forcing one: the teacher's ids must mean the student's tokens).
    ConfigError naming teacher.model otherwise. `model_cfg(cfg, path)`: the ModelConfig to load it."""
    path = cfg.teacher.model
    check_local(path, "teacher.model")
    check_causal_lm(path, "teacher")
    own = load_tokenizer(model_cfg(cfg, path), key="teacher") if cfg.model.tokenizer is None else None
    if own is None:  # a forced tokenizer: read the one saved with the teacher, when it has one
        try:
            own = load_tokenizer(dataclasses.replace(model_cfg(cfg, path), tokenizer=None), key="teacher")
        except Exception:  # noqa: BLE001 - a teacher saved without a tokenizer: the forced one is its
            own = None
    if own is not None and (why := tokenizer_mismatch(tok, own)):
        raise ConfigError(f"teacher.model={path!r} was saved with another tokenizer than the student "
                          f"(actor.model={cfg.actor.model!r}): {why}. On-policy distillation scores the student's "
                          "token ids with the teacher, so both must share one tokenizer")


class NoReward:
    """The reward source of distillation: a score of 0 for every row (the per-token reverse KL to the
    teacher, in the rewards through ppo.kl_coef, is the only signal)."""

    def score(self, rollout) -> torch.Tensor:
        return torch.zeros(rollout.sequences.shape[0], dtype=torch.float32, device=rollout.sequences.device)
