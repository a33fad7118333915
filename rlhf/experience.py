"""The RL step's experience, as named steps: generate -> score -> rewards -> advantages -> (update).

    rollout = generate(actor_engine, prompts, group, sampling, eos_id, pad_id)   # sample responses
    scored = score_rollout(...)                                                   # rlhf/rollout.py: 4 models
    exp = build_experience(rollout..., scored, kl_coef=..., estimator="gae", ...) # rewards + advantages
    exp.rows([0, 3])                                                              # a micro-batch dict

Every tensor is one rank's rows. Layout (P = prompt width, T = response width):
    sequences, attention_mask, position_ids   [B, P+T]  prompts LEFT-padded, responses right-padded
    response_mask, logp_old, logp_ref, values,
    rewards, kl, advantages, returns          [B, T]    column t = response token t
    score, group                              [B]       reward model's score; the prompt answered
`values`/`returns` are None when the advantage estimator needs no critic (ppo_math registry).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from engine.distributed import all_reduce_sum
from rlhf import ppo_math


@dataclass
class Rollout:
    """What generation mode returns for one rank's prompts."""

    sequences: torch.Tensor      # [B, P+T]
    attention_mask: torch.Tensor  # [B, P+T]
    response_mask: torch.Tensor  # [B, T] real response tokens; empty responses masked out entirely
    responses: torch.Tensor      # [B, T]
    prompt_len: int
    group: torch.Tensor          # [B] the dataset row of each prompt
    empty: torch.Tensor          # [B] bool: nothing said before the EOS (dropped from the update)
    truncated: torch.Tensor      # [B] bool: hit max_new_tokens without an EOS


def empty_responses(responses: torch.Tensor, response_mask: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """[B] bool: rows whose response has no token before its EOS (nothing was said)."""
    first_is_eos = torch.isin(responses[:, 0], torch.tensor(eos_ids, device=responses.device))
    return (response_mask.sum(1) == 0) | first_is_eos


@torch.no_grad()
def generate(actor, prompts: dict, group: torch.Tensor, sampling, eos_id: int, pad_id: int) -> Rollout:
    """Sample responses to `prompts` (collated, left-padded) in the actor engine's generation mode."""
    device = actor.info.device
    with actor.generation() as gen:
        g = gen.generate(prompts["input_ids"].to(device), prompts["attention_mask"].to(device), sampling,
                         eos_token_id=eos_id, pad_token_id=pad_id)
    empty = empty_responses(g.responses, g.response_mask, [eos_id])
    eos = torch.tensor([eos_id], device=g.responses.device)
    truncated = (~empty) & (g.response_mask.sum(1) == sampling.max_new_tokens) & ~torch.isin(g.responses[:, -1], eos)
    return Rollout(sequences=g.sequences, attention_mask=g.attention_mask,
                   response_mask=g.response_mask.masked_fill(empty[:, None], 0), responses=g.responses,
                   prompt_len=g.prompt_len, group=group.to(g.sequences.device), empty=empty, truncated=truncated)


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
) -> Experience:
    """Rewards (KL penalty per token + clipped score on the last), then advantages and returns by
    the registered `estimator` (optionally whitened over every rank's response tokens)."""
    mask = response_mask.float()
    rewards, kl = ppo_math.compute_rewards(scored["logp_old"], scored["logp_ref"], scored["score"], mask,
                                           kl_coef, clip_reward_value, kl_estimator)
    group = torch.arange(mask.shape[0], device=mask.device) if group is None else group
    values = scored.get("values")
    advantages, returns = ppo_math.advantage_estimator(estimator).fn(
        ppo_math.AdvantageInputs(rewards=rewards, score=scored["score"], values=values, mask=mask, group=group),
        gamma=gamma, lam=lam)
    if whiten:
        world_whiten_(advantages, mask)
    return Experience(
        sequences=sequences, attention_mask=attention_mask, position_ids=scored["position_ids"], response_mask=mask,
        logp_old=scored["logp_old"], logp_ref=scored["logp_ref"], values=values, score=scored["score"], group=group,
        rewards=rewards, kl=kl, advantages=advantages, returns=returns, prompt_len=prompt_len,
    )


def world_whiten_(advantages: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Advantages to mean 0, std 1 over the response tokens of every rank (in place)."""
    m = mask.bool()
    a = torch.where(m, advantages, torch.zeros_like(advantages)).double()
    stats = all_reduce_sum(torch.stack([a.sum(), (a * a).sum(), m.sum().double()]))
    n = stats[2].clamp(min=2)
    mean = stats[0] / n
    var = (stats[1] / n - mean * mean) * n / (n - 1)
    advantages.copy_(torch.where(m, ((a - mean) * torch.rsqrt(var + eps)).float(), torch.zeros_like(advantages)))
    return advantages
