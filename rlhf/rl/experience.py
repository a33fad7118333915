"""The RL step's experience: rewards per response token (KL penalty + the clipped score on the last),
then advantages and returns by the registered estimator (rlhf/algos/rl.py).

    exp = build_experience(rollout..., scored, kl_coef=..., estimator="gae", ...)  # one rank's rows
    exp.rows([0, 3, 5])                                                            # a micro-batch dict

The RL step, in order (rlhf/ppo.py): generate and score (rlhf/rl/rollout.py, rlhf/rl/models.py) ->
build_experience (here) -> update (rlhf/rl/update.py) -> step_metrics (rlhf/rl/metrics.py).

Every tensor is one rank's rows. Layout (P = prompt width, T = response width):
    sequences, attention_mask, position_ids   [B, P+T]  prompts LEFT-padded, responses right-padded
    response_mask, logp_old, logp_ref, values,
    rewards, kl, advantages, returns,
    logp_gen                                  [B, T]    column t = response token t
    score, group                              [B]       the reward source's score; the prompt answered
`values`/`returns` are None when the advantage estimator needs no critic (the rlhf/algos/rl.py registry);
`logp_gen` (the sampler's log-probs, scored["logp_gen"]) is None when the rollout has none.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from engine.distributed import all_reduce_sum
from rlhf.algos import rl as rl_math


@dataclass
class Experience:
    sequences: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    logp_old: torch.Tensor
    logp_ref: torch.Tensor
    values: torch.Tensor | None
    score: torch.Tensor
    group: torch.Tensor
    rewards: torch.Tensor
    kl: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor | None
    prompt_len: int
    logp_gen: torch.Tensor | None = None

    def rows(self, idx: list[int]) -> dict:
        """A micro-batch dict of the given rows (every tensor field sliced), with `prompt_len`."""
        out = {f.name: getattr(self, f.name)[idx] for f in fields(self)
               if f.name != "prompt_len" and getattr(self, f.name) is not None}
        out["prompt_len"] = self.prompt_len
        return out


def build_experience(
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    prompt_len: int,
    scored: dict[str, torch.Tensor],
    *,
    kl_coef: float,
    kl_estimator: str,
    clip_reward_value: float,
    gamma: float,
    lam: float,
    estimator: str = "gae",
    group: torch.Tensor | None = None,
    whiten: bool = False,
    norm_by_std: bool = True,
    max_len: int | None = None,
    overlong_buffer: int = 0,
    overlong_penalty: float = 1.0,
) -> Experience:
    """Rewards (KL penalty per token + clipped score on the last), then advantages and returns by
    the registered `estimator` (optionally whitened over every rank's response tokens). The
    estimator's declared options (rl_math.register_advantage) get `norm_by_std` and a sum over ranks.

    `overlong_buffer` > 0 (DAPO's overlong shaping, rl_math.overlong_penalty with L_max = `max_len`,
    rollout.max_new_tokens): the score gets the length penalty before anything reads it. An outcome
    estimator (token_rewards=False) with kl_coef > 0 sees the score minus kl_coef x the response's
    summed KL (rl_math.kl_shaped_score, the KL penalty in the reward as RLOO defines it); with
    kl_coef = 0 it sees the score unchanged. `Experience.score` stays the reward source's score."""
    mask = response_mask.float()
    score = scored["score"]
    if overlong_buffer:
        if max_len is None:
            raise ValueError("overlong_buffer needs max_len (rollout.max_new_tokens)")
        score = score + rl_math.overlong_penalty(mask.sum(1), max_len, overlong_buffer,
                                                 overlong_penalty).to(score.dtype)
    rewards, kl = rl_math.compute_rewards(scored["logp_old"], scored["logp_ref"], score, mask,
                                           kl_coef, clip_reward_value, kl_estimator)
    group = torch.arange(mask.shape[0], device=mask.device) if group is None else group
    values = scored.get("values")
    est = rl_math.advantage_estimator(estimator)
    if not est.token_rewards:
        score = rl_math.kl_shaped_score(score, kl, mask, kl_coef)
    options = {"norm_by_std": norm_by_std, "all_reduce_sum": all_reduce_sum}
    advantages, returns = est.fn(
        rl_math.AdvantageInputs(rewards=rewards, score=score, values=values, mask=mask, group=group),
        gamma=gamma, lam=lam, **{k: options[k] for k in est.options})
    if whiten:
        world_whiten_(advantages, mask)
    return Experience(
        sequences=sequences, attention_mask=attention_mask, position_ids=scored["position_ids"], response_mask=mask,
        logp_old=scored["logp_old"], logp_ref=scored["logp_ref"], values=values, score=scored["score"], group=group,
        rewards=rewards, kl=kl, advantages=advantages, returns=returns, prompt_len=prompt_len,
        logp_gen=scored.get("logp_gen"),
    )


def world_whiten_(advantages: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Advantages to mean 0, std 1 over the response tokens of every rank (in place)."""
    return advantages.copy_(rl_math.whiten_across(advantages, mask, all_reduce_sum, eps))


# ----------------------------------------------------------------------------- the engines and the update
