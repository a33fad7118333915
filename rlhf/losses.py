"""The RL stage's losses, one per trained role: the actor's (clipped surrogate + KL term + ptx) and the
critic's (clipped value loss). Each returns (loss summed over its weight units, the weight, stats), as
`engine.TrainEngine.train_step` takes it; the math is in rlhf/ppo_math.py."""
from __future__ import annotations

import torch

from rlhf import ppo_math
from rlhf.config import PPOConfig
from rlhf.rollout import token_logprobs, token_values
from rlhf.sft import sft_loss


def make_actor_loss(cliprange: float, temperature: float, ptx_coef: float, *, cliprange_low: float | None = None,
                    cliprange_high: float | None = None, loss_agg: str = "token_mean", horizon: float | None = None,
                    kl_loss_coef: float = 0.0, kl_loss_estimator: str = "k3"):
    """The actor's loss: the clipped surrogate (ratio clipped to [1 - low, 1 + high]; low/high
    default to cliprange), aggregated by `loss_agg` (ppo_math.aggregate_loss: sum over its weight
    units, so micro-batches and ranks combine into the whole mini-batch's aggregate), + kl_loss_coef
    x KL to the reference (aggregated alike), + ptx_coef x the SFT loss (weighted like the rest)."""
    low = cliprange if cliprange_low is None else cliprange_low

    def actor_loss(model: torch.nn.Module, mb: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
        logp, entropy = token_logprobs(model, mb, temperature, with_entropy=True)
        mask = mb["response_mask"]
        loss, stats = ppo_math.policy_loss(logp, mb["logp_old"], mb["advantages"], mask, low,
                                           cliprange_high=cliprange_high, loss_agg=loss_agg, horizon=horizon)
        n = ppo_math.loss_weight(mask, loss_agg)  # tokens (token_mean) or rows
        if kl_loss_coef:
            kl_sum, kl_n = ppo_math.aggregate_loss(ppo_math.kl_loss_tokens(logp, mb["logp_ref"], mask, kl_loss_estimator),
                                                   mask, loss_agg, horizon)
            kl = kl_sum / kl_n.clamp(min=1)
            loss = loss + kl_loss_coef * kl
            stats["kl_loss"] = kl.detach()
        total = loss * n
        stats["entropy"] = ppo_math.masked_mean(entropy, mask)
        if ptx_coef:
            device = mb["sequences"].device
            ptx_sum, ptx_n, _ = sft_loss(model, {k: v.to(device) for k, v in mb["ptx"].items()})
            ptx = ptx_sum / ptx_n.clamp(min=1)
            total = total + ptx_coef * ptx * n  # its mean enters the mini-batch mean like a token loss
            stats["ptx_loss"] = ptx.detach()
        return total, n, stats

    return actor_loss


def make_critic_loss(cliprange_value: float):
    def critic_loss(model: torch.nn.Module, mb: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
        mask = mb["response_mask"]
        loss, stats = ppo_math.value_loss(token_values(model, mb), mb["values"], mb["returns"], mask, cliprange_value)
        return loss * mask.sum(), mask.sum(), stats

    return critic_loss


def actor_loss(cfg: PPOConfig):
    """The actor loss of `cfg`'s algorithm (make_actor_loss with the ppo.* keys)."""
    p, r = cfg.ppo, cfg.rollout
    return make_actor_loss(p.cliprange, r.temperature, p.ptx_coef, cliprange_low=p.cliprange_low,
                           cliprange_high=p.cliprange_high, loss_agg=p.loss_agg, horizon=r.max_new_tokens,
                           kl_loss_coef=p.kl_loss_coef, kl_loss_estimator=p.kl_loss_estimator)
