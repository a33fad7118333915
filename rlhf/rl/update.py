"""The RL update: the actor's loss (clipped surrogate + KL term + ptx) and the critic's (clipped value
loss), and the mini-batch steps that apply them (`update`). Each loss returns (loss summed over its
weight units, the weight, stats), as `engine.TrainEngine.train_step` takes it; the math is in
rlhf/algos/rl.py."""
from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from rlhf.algos import rl as rl_math
from rlhf.config import PPOConfig
from rlhf.config.validate import rollout_rows, trainer_truncation
from rlhf.data import collate_sft
from rlhf.data.stage import StepOrder
from rlhf.modeling.forward import sft_loss, token_logprobs, token_values
from rlhf.rl.experience import Experience
from rlhf.rl.models import Models


def make_actor_loss(cliprange: float, temperature: float, ptx_coef: float, *, cliprange_low: float | None = None,
                    cliprange_high: float | None = None, loss_agg: str = "token_mean", horizon: float | None = None,
                    kl_loss_coef: float | Callable[[], float] = 0.0, kl_loss_estimator: str = "k3", policy_loss: str = "clip",
                    is_correction: str = "none", is_cap: float = 2.0, is_low: float = 0.5, is_high: float = 2.0,
                    is_level: str = "token", truncate: tuple[int, float] | None = None):
    """The actor's loss: the registered `policy_loss` (rl_math.POLICY_LOSSES: clip, the clipped
    surrogate, ratio clipped to [1 - low, 1 + high], low/high defaulting to cliprange; gspo; cispo),
    aggregated by `loss_agg` (rl_math.aggregate_loss: sum over its weight units, so micro-batches and
    ranks combine into the whole mini-batch's aggregate; a per-sequence loss weighs rows), +
    kl_loss_coef x KL to the reference (aggregated alike; a callable: its value at each call, what
    ppo.adaptive_kl moves when the KL is in the loss), + ptx_coef x the SFT loss (weighted like
    the rest). `is_correction` tis|mis: the policy loss's per-token terms are weighted by
    rl_math.is_weights(logp_old vs the sampler's logp_gen), detached (rl_math.is_weighted_advantages).
    `truncate` (ppo.trainer_logprobs=sampler): (top_k, top_p) the new log-probs are taken under, as the old."""
    low = cliprange if cliprange_low is None else cliprange_low
    pl = rl_math.policy_loss_fn(policy_loss)
    given = {"cliprange_low": low, "cliprange_high": cliprange_high, "loss_agg": loss_agg, "horizon": horizon}
    options = {k: given[k] for k in pl.options}
    weight_agg = "seq_mean_token_mean" if pl.per_sequence else loss_agg

    def actor_loss(model: torch.nn.Module, mb: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
        logp, entropy = token_logprobs(model, mb, temperature, with_entropy=True, truncate=truncate)
        mask = mb["response_mask"]
        advantages = mb["advantages"]
        if is_correction != "none":
            if mb.get("logp_gen") is None:
                raise ValueError(f"ppo.is_correction={is_correction} needs the sampler's log-probs (logp_gen) "
                                 "in the experience; the rollout has none")
            w = rl_math.is_weights(is_correction, mb["logp_old"], mb["logp_gen"], mask, cap=is_cap, low=is_low,
                                   high=is_high, level=is_level)
            advantages = rl_math.is_weighted_advantages(advantages, w)
        loss, stats = pl.fn(logp, mb["logp_old"], advantages, mask, **options)
        n = rl_math.loss_weight(mask, weight_agg)  # tokens (token_mean) or rows
        coef = kl_loss_coef() if callable(kl_loss_coef) else kl_loss_coef
        if coef:
            kl_sum, kl_n = rl_math.aggregate_loss(rl_math.kl_loss_tokens(logp, mb["logp_ref"], mask, kl_loss_estimator),
                                                   mask, loss_agg, horizon)
            kl = kl_sum / kl_n.clamp(min=1)
            loss = loss + coef * kl
            stats["kl_loss"] = kl.detach()
        total = loss * n
        stats["entropy"] = rl_math.masked_mean(entropy, mask)
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
        loss, stats = rl_math.value_loss(token_values(model, mb), mb["values"], mb["returns"], mask, cliprange_value)
        return loss * mask.sum(), mask.sum(), stats

    return critic_loss


def actor_loss(cfg: PPOConfig, kl_loss_coef: Callable[[], float] | None = None):
    """The actor loss of `cfg`'s algorithm (make_actor_loss with the ppo.* keys; `kl_loss_coef`: the adaptive
    KL-loss coefficient instead of ppo.kl_loss_coef)."""
    p, r = cfg.ppo, cfg.rollout
    return make_actor_loss(p.cliprange, r.temperature, p.ptx_coef, cliprange_low=p.cliprange_low,
                           cliprange_high=p.cliprange_high, loss_agg=p.loss_agg, horizon=r.max_new_tokens,
                           kl_loss_coef=p.kl_loss_coef if kl_loss_coef is None else kl_loss_coef,
                           kl_loss_estimator=p.kl_loss_estimator,
                           policy_loss=p.policy_loss, is_correction=p.is_correction, is_cap=p.is_cap,
                           is_low=p.is_low, is_high=p.is_high, is_level=p.is_level, truncate=trainer_truncation(cfg))


def update(models: Models, exp: Experience, cfg: PPOConfig, losses: tuple, ptx_batches, run) -> tuple[list, list]:
    """The "update" step: `ppo.ppo_epochs` passes over shuffled mini-batches of this rank's rows, one
    actor (and critic) optimizer step per mini-batch; `ptx_batches()` gives each micro-batch's SFT rows."""
    r, p, info = cfg.rollout, cfg.ppo, models.info
    rows = rollout_rows(r)  # prompts_per_step x n_samples_per_prompt; the batch sizes count rows
    per_rank, mini_rows = rows // info.world_size, r.mini_batch_size // info.world_size
    a_stats, c_stats = [], []
    for _ in range(p.ppo_epochs):
        perm = torch.randperm(per_rank).tolist()
        for k in range(rows // r.mini_batch_size):
            rows_k = perm[k * mini_rows : (k + 1) * mini_rows]
            micro = [exp.rows(rows_k[i : i + r.micro_batch_size]) for i in range(0, mini_rows, r.micro_batch_size)]
            for mb in micro:
                mb["pack_length"] = models.pack_length  # the losses' forwards pack like the scoring's
                mb["shared_prompts"] = models.shared_prompts_update  # and share prompts (Models)
            if ptx_batches is not None:
                for mb in micro:
                    mb["ptx"] = ptx_batches()
            a_stats.append(models.actor.train_step(micro, losses[0]))
            if models.critic is not None:
                c_stats.append(models.critic.train_step(micro, losses[1]))
            run.check(a_stats[-1], *c_stats[-1:])  # the critic's skips count toward the limit too
            if models.ema is not None:
                models.ema.update()
    return a_stats, c_stats


def ptx_batches(feats: list, order: StepOrder, first: int, info, pad_id: int) -> Callable[[], dict]:
    """The SFT micro-batches of one step's ptx loss, from position `first` on (a function of the step,
    so a resumed run reads the same rows)."""
    position = itertools.count(first)
    return lambda: collate_sft([feats[i] for i in order.rank_rows(next(position), info.rank, info.world_size, 1)[0]],
                               pad_id)
