"""PPO math for RLHF as pure functions over tensors and masks (no model, no config, no I/O).

Conventions (every per-token tensor):
    shape [B, T], response-aligned: column 0 is the first response token (callers slice off the
    left-padded prompt). `mask` [B, T] (bool or 0/1 float) is true on real response tokens,
    contiguous from column 0 up to the row's length, false after (right padding). A row may be
    empty (all-false mask); no function returns NaN for it. Everything is computed in float32
    (bf16/fp16 inputs are cast up; float64 stays float64), and values outside the mask never leak
    into a result (they are selected away with `torch.where`, so NaN/inf padding is harmless).

The step, with the DeepSpeed-Chat defaults:
    kl        = logp_old - logp_ref                     (k1; k2/k3 optional)      [B, T]
    rewards   = -kl_coef * kl, + clip(score, ±5) on the last response token         [B, T]
    adv, ret  = GAE(rewards, values), gamma=1.0, lam=0.95; ret = adv + values       [B, T]
                (the estimator is named by ppo.advantage_estimator: see ADVANTAGE_ESTIMATORS)
    actor     = masked_mean(max(-A * r, -A * clip(r, 1 ± 0.2))), r = exp(logp - logp_old)
    critic    = 0.5 * masked_mean(max((v - R)^2, (v_old + clip(v - v_old, ±0.2) - R)^2))
    kl_coef   fixed, or adaptive (Ziegler et al. 2019)

Critic-free estimators (registered: grpo, rloo, reinforce_pp, reinforce), per prompt group of a row:
    grpo      A_i = (s_i - mean_g) / (std_g + eps)       (norm_by_std=False: s_i - mean_g, Dr. GRPO)
    rloo      A_i = s_i - mean of the others in g
    reinforce_pp  A = whiten over the batch (all ranks) of the discounted returns of the rewards
    reinforce A = the discounted returns of the rewards (no baseline; on-policy distillation's, gamma 0)
with the KL as a loss term (`kl_loss_tokens`, k3) or in the score (`kl_shaped_score`), and the loss
aggregated by `aggregate_loss`.

Policy losses (registered: clip, gspo, cispo; `ppo.policy_loss`, see POLICY_LOSSES):
    clip      agg(max(-A r, -A clip(r, 1 - lo, 1 + hi)))                    (PPO, DAPO's clip-higher)
    gspo      -mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log r_t)  (GSPO, sequence ratio)
    cispo     agg(-sg(clip(r, 1 - lo, 1 + hi)) A logp)                      (CISPO, MiniMax-M1)
DAPO's overlong shaping adds `overlong_penalty(lengths, ...)` to the score.

Sampler vs trainer (`ppo.is_correction`), rho = exp(logp_old - logp_gen) per token (or the response's
geometric mean), multiplying the per-token policy loss, detached:
    tis       w = min(rho, C)                                               (Yao et al. 2025; TRL, verl)
    mis       w = rho * 1[lo <= rho <= hi]                                  (IcePop; TRL, verl)
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf.core.errors import ConfigError

KL_ESTIMATORS = ("k1", "k2", "k3")


# ----------------------------------------------------------------------------- helpers

def _f32(x: torch.Tensor) -> torch.Tensor:
    """Cast floating inputs below float32 (bf16, fp16) and integers up to float32."""
    return x if x.dtype == torch.float64 else x.float()


def _check_shapes(**tensors: torch.Tensor) -> None:
    """ValueError naming every shape when the given tensors do not all share one shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        desc = ", ".join(f"{name} {list(s)}" for name, s in shapes.items())
        raise ValueError(f"shape mismatch: {desc}")


def _check_2d(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be [B, T], got shape {list(x.shape)}")


# ----------------------------------------------------------------------------- masked reductions

def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` over the entries where `mask` is true.

    x, mask: same shape (any). dim=None sums everything (0-d result); an int reduces that dim.
    """
    _check_shapes(x=x, mask=mask)
    x = _f32(x)
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over the entries where `mask` is true; 0 where nothing is masked in.

    x, mask: same shape. dim=None -> 0-d mean over all masked entries; dim=1 on [B, T] -> [B].
    """
    total = masked_sum(x, mask, dim)
    count = masked_sum(torch.ones(x.shape, dtype=total.dtype, device=x.device), mask, dim)
    # NOTE: total is exactly 0 where count is 0, so clamping the count only avoids 0/0.
    return total / count.clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries of `x` (whole tensor, 0-d result).

    unbiased=True applies Bessel's correction n/(n-1). With fewer than 2 masked entries
    (unbiased) or none (biased) the variance is returned as 0 rather than NaN/inf.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((_f32(x) - mean) ** 2, mask)
    if unbiased:
        n = mask.bool().sum()
        var = torch.where(n > 1, var * n / (n - 1).clamp(min=1), torch.zeros_like(var))
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """Normalise the masked entries of `x` over the whole batch to mean 0, (unbiased) std 1.

    x, mask: same shape. shift_mean=False adds the mean back (scale only). Entries outside the
    mask are 0 in the result.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    out = (_f32(x) - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out))


# ----------------------------------------------------------------------------- rewards

def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs.

    logp, ref_logp: [B, T] log-probs of the sampled tokens under the policy / reference.
    Returns [B, T] (no masking):
        k1 = logp - ref_logp                                   (unbiased, can be negative)
        k2 = 0.5 * (logp - ref_logp)^2                         (biased, non-negative)
        k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1      (unbiased, non-negative; Schulman)
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    _check_shapes(logp=logp, ref_logp=ref_logp)
    log_ratio = _f32(logp) - _f32(ref_logp)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    # NOTE: expm1(-d) + d == exp(-d) - 1 + d, but without cancellation for small d.
    return torch.expm1(-log_ratio) + log_ratio


def kl_loss_tokens(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor,
                   estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(policy || reference) as a loss term (GRPO puts it in the loss, not the reward).

    logp: [B, T] current log-probs (with grad); logp_ref: [B, T] (detached here); mask: [B, T].
    k3 (default) is non-negative and its gradient pulls the policy toward the reference. Returns
    [B, T] float32, exactly 0 (and with a zero gradient) outside the mask, whatever the padding holds.
    """
    _check_shapes(logp=logp, logp_ref=logp_ref, mask=mask)
    ref = _f32(logp_ref).detach()
    # NOTE: the padding's log-probs are replaced by the reference's *before* the estimate, so an
    # overflowing exp there cannot backpropagate 0 * inf = NaN.
    return kl_estimate(torch.where(mask.bool(), _f32(logp), ref), ref, estimator)


def compute_rewards(logp_old: torch.Tensor, logp_ref: torch.Tensor, score: torch.Tensor,
                    mask: torch.Tensor, kl_coef: float, clip_reward_value: float,
                    kl_estimator: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: a KL penalty on every response token plus the clipped score at the end.

    logp_old, logp_ref, mask: [B, T]; score: [B] (reward model's value at the last response token).
    clip_reward_value must be > 0; pass float('inf') to disable clipping.
    Returns (rewards [B, T], kl [B, T]), both 0 outside the mask:
        kl      = kl_estimate(logp_old, logp_ref, kl_estimator) on masked tokens
        rewards = -kl_coef * kl, plus clamp(score, -clip, clip) at the row's last masked token
    Rows with an empty mask get no score (all zeros). A mask with holes (a multi-turn episode: the
    observations between the policy's turns masked out, rlhf/rl/multiturn.py) gets the score on its
    last policy token.
    """
    _check_2d("mask", mask)
    _check_shapes(logp_old=logp_old, logp_ref=logp_ref, mask=mask)
    if tuple(score.shape) != (mask.shape[0],):
        raise ValueError(f"score must be [B] = [{mask.shape[0]}], got shape {list(score.shape)}")
    if clip_reward_value is None or not clip_reward_value > 0:
        raise ValueError(f"clip_reward_value must be > 0 (float('inf') disables clipping), "
                         f"got {clip_reward_value!r}")
    m = mask.bool()
    kl = kl_estimate(logp_old, logp_ref, kl_estimator)
    kl = torch.where(m, kl, torch.zeros_like(kl))
    rewards = -kl_coef * kl                                                   # [B, T]
    lengths = m.sum(1)                                                        # [B]
    last = last_masked(m).unsqueeze(1)                                        # [B, 1]
    clipped = _f32(score).to(rewards.device, rewards.dtype).clamp(-clip_reward_value, clip_reward_value)
    clipped = torch.where(lengths > 0, clipped, torch.zeros_like(clipped))   # empty rows: no score
    rewards = rewards.scatter_add(1, last, clipped.unsqueeze(1))
    return rewards, kl


def last_masked(m: torch.Tensor) -> torch.Tensor:
    """[B, T] bool -> [B] long: the column of each row's last true entry (0 for an empty row). For a
    contiguous mask from column 0 this is mask.sum(1) - 1."""
    T = m.shape[1]
    cols = torch.arange(T, device=m.device).expand_as(m)
    if not T:
        return torch.zeros(m.shape[0], dtype=torch.long, device=m.device)
    return torch.where(m, cols, torch.zeros_like(cols)).amax(1)


# ----------------------------------------------------------------------------- advantages

@torch.no_grad()
def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   gamma: float = 1.0, lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens, vectorised over the batch.

    rewards, values, mask: [B, T]. The episode ends at each row's last masked token, so the value
    after it is 0; rewards/values outside the mask are treated as 0. Columns outside the mask inside a
    row (a multi-turn episode's observation tokens, rlhf/rl/multiturn.py) are skipped: the recursion
    runs over the masked tokens only, V_{t+1} being the next *masked* token's value (for a contiguous
    mask this is the plain recursion).
        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
    Returns (advantages [B, T], returns = advantages + values [B, T]), 0 outside the mask, no grad.
    """
    _check_2d("mask", mask)
    _check_shapes(rewards=rewards, values=values, mask=mask)
    m = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    r = torch.where(m, _f32(rewards), zero)
    v = torch.where(m, _f32(values), zero)
    B, T = m.shape
    advantages = torch.zeros_like(r)
    last_gae = torch.zeros(B, dtype=r.dtype, device=r.device)
    next_value = torch.zeros(B, dtype=r.dtype, device=r.device)
    # NOTE: padding is on the right, so for t past a row's end r = v = 0 and last_gae stays 0;
    # at the last real token next_value (the padded column's v) is 0, ending the episode.
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        gae = delta + gamma * lam * last_gae
        advantages[:, t] = gae
        # NOTE: a hole (masked-out column before the row's end) carries the recursion over unchanged
        last_gae = torch.where(m[:, t], gae, last_gae)
        next_value = torch.where(m[:, t], v[:, t], next_value)
    advantages = torch.where(m, advantages, zero)
    returns = torch.where(m, advantages + v, zero)
    return advantages, returns


# ----------------------------------------------------------------------------- critic-free estimators
#
# Outcome estimators (GRPO, RLOO) see one score per response and the prompt group of each row; a
# row's advantage is the same on every one of its response tokens. A group's statistics are taken
# over its rows that said something (mask not all 0): an empty or dropped row neither gets an
# advantage nor moves its group's baseline. Groups are whatever equal `group` ids say, within the
# tensors given: the RL stage keeps every group's rows on one rank (rlhf/rl/rollout.py), so no
# gather is needed.

def _group_stats(score: torch.Tensor, group: torch.Tensor, valid: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: (n, sum, sum of squares) of the valid scores in the row's group, float64, [B] each."""
    _, inv = torch.unique(group, return_inverse=True)                         # [B] -> 0..G-1
    G = int(inv.max()) + 1 if inv.numel() else 0
    s = torch.where(valid, score.double(), torch.zeros((), dtype=torch.float64, device=score.device))
    zeros = torch.zeros(G, dtype=torch.float64, device=score.device)
    n = zeros.index_add(0, inv, valid.double())
    total = zeros.index_add(0, inv, s)
    squares = zeros.index_add(0, inv, s * s)
    return n[inv], total[inv], squares[inv]


def _outcome_inputs(score: torch.Tensor, group: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_2d("mask", mask)
    B = mask.shape[0]
    if tuple(score.shape) != (B,) or tuple(group.shape) != (B,):
        raise ValueError(f"score and group must be [B] = [{B}], got {list(score.shape)} and {list(group.shape)}")
    m = mask.bool()
    return m, m.any(1)                                                         # [B, T], valid rows [B]


def _per_token(adv: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """[B] (float64) -> [B, T] float32 on the masked tokens, 0 elsewhere."""
    return torch.where(m, adv.float()[:, None], torch.zeros((), dtype=torch.float32, device=m.device))


@torch.no_grad()
def grpo_advantages(score: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, *, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO's group-normalised outcome advantage (Shao et al. 2024), on every response token.

    score: [B] one score per response; group: [B] int64, rows answering one prompt share an id;
    mask: [B, T]. Over the valid rows (mask not empty) of each group:
        A_i = (score_i - mean) / (std + eps)      (std unbiased: Bessel's n - 1)
        A_i = score_i - mean                      (norm_by_std=False: Dr. GRPO, Liu et al. 2025)
    A group of one valid row has advantage 0 (no baseline); so has a group of equal scores.
    Returns [B, T] float32, A_i on row i's masked tokens, 0 elsewhere; no grad.
    """
    m, valid = _outcome_inputs(score, group, mask)
    n, total, squares = _group_stats(score, group, valid)
    mean = total / n.clamp(min=1)
    adv = score.double() - mean
    if norm_by_std:
        var = ((squares - n * mean * mean) / (n - 1).clamp(min=1)).clamp(min=0)  # unbiased
        adv = adv / (var.sqrt() + eps)
    adv = torch.where(valid & (n > 1), adv, torch.zeros_like(adv))
    return _per_token(adv, m)


@torch.no_grad()
def rloo_advantages(score: torch.Tensor, group: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): each response's baseline is the mean score
    of the other valid responses to its prompt.

    score: [B]; group: [B] int64; mask: [B, T].
        A_i = score_i - (sum_group - score_i) / (n_group - 1)   (= n/(n-1) * (score_i - mean))
    A group of one valid row has advantage 0. Returns [B, T] float32 (0 outside the mask); no grad.
    """
    m, valid = _outcome_inputs(score, group, mask)
    n, total, _ = _group_stats(score, group, valid)
    s = score.double()
    adv = s - (total - s) / (n - 1).clamp(min=1)
    adv = torch.where(valid & (n > 1), adv, torch.zeros_like(adv))
    return _per_token(adv, m)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = sum_{k >= t} gamma^(k - t) r_k over each row's response tokens.

    rewards, mask: [B, T]; rewards outside the mask count as 0. Returns [B, T] float32, 0 outside
    the mask.
    """
    _check_2d("mask", mask)
    _check_shapes(rewards=rewards, mask=mask)
    m = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=m.device)
    r = torch.where(m, _f32(rewards), zero)
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for t in reversed(range(r.shape[1])):
        # a masked-out column inside a row (multi-turn observations) is skipped, not discounted over
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        out[:, t] = running
    return torch.where(m, out, zero)


def whiten_across(x: torch.Tensor, mask: torch.Tensor, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  eps: float = 1e-8) -> torch.Tensor:
    """`masked_whiten` over the masked entries of every rank: mean 0, (unbiased) std 1.

    x, mask: [B, T] (this rank's); `all_reduce_sum(t)` returns t summed over the ranks (None: one
    process). Returns float32, 0 outside the mask; equal to masked_whiten on the concatenated rows.
    """
    _check_shapes(x=x, mask=mask)
    m = mask.bool()
    a = torch.where(m, x.double(), torch.zeros((), dtype=torch.float64, device=x.device))
    stats = torch.stack([a.sum(), (a * a).sum(), m.sum().double()])
    if all_reduce_sum is not None:
        stats = all_reduce_sum(stats)
    n = stats[2].clamp(min=2)
    mean = stats[0] / n
    var = ((stats[1] / n - mean * mean) * n / (n - 1)).clamp(min=0)
    return torch.where(m, ((a - mean) * torch.rsqrt(var + eps)).float(), torch.zeros((), device=x.device))


@torch.no_grad()
def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, *,
                            all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): discounted returns of the token-level rewards, whitened over the batch.

    rewards: [B, T] per-token rewards (`compute_rewards`: -kl_coef * KL on every token, + the
    clipped score on the last); mask: [B, T]. `all_reduce_sum`: see `whiten_across` (the whitening
    is over every rank's response tokens).
        A = whiten(G),  G_t = sum_{k >= t} gamma^(k - t) r_k
    Returns [B, T] float32 (0 outside the mask); no grad.
    """
    return whiten_across(discounted_returns(rewards, mask, gamma), mask, all_reduce_sum)


# ----------------------------------------------------------------------------- group filtering

def uniform_groups(score: torch.Tensor, group: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows whose group's valid rows all have the same score (DAPO's dynamic sampling
    drops them: an outcome estimator gives them advantage 0, so they only dilute the loss).

    score, group, valid: [B] (valid: the rows that take part). A group with no valid row, or one,
    counts as uniform. Exact equality: with a verifiable (0/1) reward, all right or all wrong.
    """
    n, _, _ = _group_stats(score, group, valid)
    _, inv = torch.unique(group, return_inverse=True)
    G = int(inv.max()) + 1 if inv.numel() else 0
    big = torch.tensor(float("inf"), dtype=torch.float64, device=score.device)
    s = score.double()
    lo = torch.full((G,), float("inf"), dtype=torch.float64, device=score.device).scatter_reduce(
        0, inv, torch.where(valid, s, big), "amin")
    hi = torch.full((G,), -float("inf"), dtype=torch.float64, device=score.device).scatter_reduce(
        0, inv, torch.where(valid, s, -big), "amax")
    return (n <= 1) | (lo[inv] == hi[inv])


# ----------------------------------------------------------------------------- losses

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")


def aggregate_loss(x: torch.Tensor, mask: torch.Tensor, loss_agg: str = "token_mean",
                   horizon: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-token loss reduced to (sum, weight), so that sum / weight is the loss and the engine's
    global mean over micro-batches and ranks (rows split anyhow) is the same mean of the whole batch.

    x, mask: [B, T]. Empty rows (mask all 0) count in no weight.
        token_mean          sum over every masked token / number of tokens (PPO, DAPO)
        seq_mean_token_mean mean over rows of each row's token mean (GRPO's original)
        seq_mean_token_sum  mean over rows of each row's token sum / `horizon` (Dr. GRPO: a constant,
                            the generation budget, so a long response weighs no less per token)
    Returns (sum 0-d, weight 0-d); both keep x's graph (weight is a count, no grad).
    """
    _check_shapes(x=x, mask=mask)
    if loss_agg == "token_mean":
        return masked_sum(x, mask), loss_weight(mask, loss_agg)
    if loss_agg == "seq_mean_token_mean":
        per_row = masked_mean(x, mask, dim=1)
    elif loss_agg == "seq_mean_token_sum":
        if not horizon or horizon <= 0:
            raise ValueError(f"seq_mean_token_sum needs a horizon > 0 (the generation budget), got {horizon!r}")
        per_row = masked_sum(x, mask, dim=1) / horizon
    else:
        raise ValueError(f"unknown loss aggregation {loss_agg!r}; valid: {', '.join(LOSS_AGGREGATIONS)}")
    return per_row.sum(), loss_weight(mask, loss_agg)


def loss_weight(mask: torch.Tensor, loss_agg: str = "token_mean") -> torch.Tensor:
    """The weight units of `aggregate_loss`: masked tokens (token_mean; `mask.sum()` as given, so
    PPO's token mean is what it always was) or rows with at least one masked token (seq_mean_*)."""
    return mask.sum() if loss_agg == "token_mean" else mask.bool().any(1).sum().to(torch.float32)


# ----------------------------------------------------------------------------- policy losses, by name
#
# `ppo.policy_loss` names one. Every loss is a pure function of the current and old log-probs, the
# advantages and the mask ([B, T] each, response-aligned), with keyword options it declares, and
# returns (loss 0-d, stats: detached 0-d tensors, at least approx_kl and ratio_mean, clipfrac where a
# clip applies). A new loss is one function here:
#
#     @register_policy_loss("name", options=("cliprange_low", "cliprange_high", "loss_agg", "horizon"))
#     def name(logp, logp_old, advantages, mask, *, cliprange_low, ...) -> tuple[Tensor, dict]: ...
#
# `per_sequence=True`: the loss is a mean over the responses (rows), whatever ppo.loss_agg says, so the
# actor loss weighs its micro-batches by rows (`loss_weight(mask, "seq_mean_token_mean")`).

POLICY_LOSS_OPTIONS = ("cliprange_low", "cliprange_high", "loss_agg", "horizon")


@dataclass(frozen=True)
class PolicyLoss:
    fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    options: tuple[str, ...]  # keyword arguments it takes, from POLICY_LOSS_OPTIONS
    per_sequence: bool = False  # a mean over rows (its weight units are rows, not tokens)
    row_stats: tuple[str, ...] = ()  # its stats that are means over the valid rows (the others: over tokens)


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, *, options: tuple[str, ...] = (), per_sequence: bool = False,
                         row_stats: tuple[str, ...] = ()):
    """Register `fn(logp, logp_old, advantages, mask, **options) -> (loss, stats)` as `name`
    (`ppo.policy_loss=name`). `options` names the keyword arguments it takes, among
    POLICY_LOSS_OPTIONS: cliprange_low / cliprange_high (ppo.cliprange_low / _high, resolved),
    loss_agg (ppo.loss_agg) and horizon (rollout.max_new_tokens, for seq_mean_token_sum). `row_stats`: the
    stats that are means over the valid rows (the others are means over the masked tokens), so that a
    mini-batch's stat is the mean of its rows or tokens whatever the micro-batching (rlhf/rl/update.py)."""
    unknown = set(options) - set(POLICY_LOSS_OPTIONS)
    if unknown:
        raise ValueError(f"policy loss {name!r}: unknown options {sorted(unknown)}; valid: {POLICY_LOSS_OPTIONS}")

    def deco(fn):
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = PolicyLoss(fn, tuple(options), per_sequence, tuple(row_stats))
        return fn
    return deco


def policy_loss_fn(name: str) -> PolicyLoss:
    """The registered policy loss `name`; ConfigError naming ppo.policy_loss and the registered names."""
    if name not in POLICY_LOSSES:
        raise ConfigError(f"ppo.policy_loss must be one of {tuple(POLICY_LOSSES)} (registered in "
                          f"rlhf/algos/rl.py), got {name!r}")
    return POLICY_LOSSES[name]


def _log_ratio(logp: torch.Tensor, logp_old: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """logp - logp_old (old detached) on the masked tokens, 0 elsewhere, float32.

    NOTE: zeroed outside the mask *before* any exp: garbage padding could overflow to inf, and
    where() would then backpropagate 0 * inf = NaN."""
    zero = torch.zeros((), dtype=torch.float32, device=m.device)
    return torch.where(m, _f32(logp) - _f32(logp_old).detach(), zero)


def _aggregate(x: torch.Tensor, mask: torch.Tensor, loss_agg: str, horizon: float | None) -> torch.Tensor:
    """`aggregate_loss`'s sum / weight (token_mean: the masked mean, as PPO always had it)."""
    if loss_agg == "token_mean":
        return masked_mean(x, mask)
    total, weight = aggregate_loss(x, mask, loss_agg, horizon)
    return total / weight.clamp(min=1)


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-A * ratio, -A * clamp(ratio, 1 - low, 1 + high)) elementwise (high None = low), and where the
    clipped branch is strictly the larger: the surrogate of `clip` (per token) and `gspo` (per sequence)."""
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - low, 1.0 + (low if high is None else high))
    return torch.maximum(pg_unclipped, pg_clipped), pg_clipped > pg_unclipped


@register_policy_loss("clip", options=POLICY_LOSS_OPTIONS)
def clip_policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, *, cliprange_low: float = 0.2, cliprange_high: float | None = None,
                     loss_agg: str = "token_mean", horizon: float | None = None,
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7),
    with DAPO's clip-higher (Yu et al. 2025, §3.1): `ppo.policy_loss=clip`, the default.

    logp: [B, T] current log-probs (with grad); logp_old, advantages: [B, T] (detached here);
    mask: [B, T].
        ratio = exp(logp - logp_old)
        loss  = agg(max(-A * ratio, -A * clamp(ratio, 1 - c_low, 1 + c_high)))   (0-d)
    `cliprange_high` (None = cliprange_low): an asymmetric range that lets unlikely tokens with a
    positive advantage grow further. `agg` is `aggregate_loss(loss_agg, horizon)`'s sum / weight;
    token_mean is the masked mean (PPO's).
    Stats (detached 0-d tensors, so callers can all-reduce them):
        clipfrac   fraction of masked tokens where the clipped branch is strictly larger
        approx_kl  masked mean of 0.5 * (logp - logp_old)^2
        ratio_mean masked mean of ratio
    """
    _check_shapes(logp=logp, logp_old=logp_old, advantages=advantages, mask=mask)
    m = mask.bool()
    adv = _f32(advantages).detach()
    log_ratio = _log_ratio(logp, logp_old, m)                                                # [B, T]
    ratio = torch.exp(log_ratio)
    pg, clipped = _clipped_surrogate(ratio, adv, cliprange_low, cliprange_high)
    loss = _aggregate(pg, mask, loss_agg, horizon)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean(clipped.float(), mask),
            "approx_kl": masked_mean(0.5 * log_ratio ** 2, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


def policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cliprange: float = 0.2, *, cliprange_high: float | None = None,
                loss_agg: str = "token_mean", horizon: float | None = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss for the actor: the registered `clip` loss (`clip_policy_loss`),
    with the ratio clipped to [1 - cliprange, 1 + (cliprange_high or cliprange)]."""
    return clip_policy_loss(logp, logp_old, advantages, mask, cliprange_low=cliprange,
                            cliprange_high=cliprange_high, loss_agg=loss_agg, horizon=horizon)


@register_policy_loss("gspo", options=("cliprange_low", "cliprange_high"), per_sequence=True,
                      row_stats=("clipfrac", "ratio_mean"))
def gspo_policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, *, cliprange_low: float = 3e-4, cliprange_high: float | None = 4e-4,
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 5-7): the importance ratio and
    its clip are per sequence, length-normalised: `ppo.policy_loss=gspo`.

    logp: [B, T] (with grad); logp_old, advantages: [B, T] (detached); mask: [B, T]. Over the valid
    rows i (mask not empty), with |y_i| the row's token count:
        s_i  = exp((1/|y_i|) * sum_t (logp_t - logp_old_t))        (the sequence ratio, with grad)
        A_i  = masked mean of the row's advantages (an outcome estimator's per-token value)
        loss = -(1/N) * sum_i min(s_i * A_i, clamp(s_i, 1 - c_low, 1 + c_high) * A_i)   (0-d)
    The sequence form (the gradient through s_i: d s_i / d logp_t = s_i / |y_i| on every token); the
    paper's GSPO-token form has the same value and, with A_{i,t} = A_i, the same gradient. The paper's
    clip ranges are far smaller than PPO's (3e-4 / 4e-4; conf/algorithm/gspo.yaml); cliprange_high
    None = cliprange_low. A mean over the rows whatever ppo.loss_agg says (registered per_sequence).
    Stats (detached 0-d): clipfrac (fraction of valid rows where the clipped branch is strictly the
    smaller objective), approx_kl (token masked mean of 0.5 * (logp - logp_old)^2), ratio_mean (mean s_i).
    """
    _check_shapes(logp=logp, logp_old=logp_old, advantages=advantages, mask=mask)
    m = mask.bool()
    valid = m.any(1)                                                                         # [B]
    log_ratio = _log_ratio(logp, logp_old, m)
    seq_ratio = torch.exp(masked_mean(log_ratio, m, dim=1))                                  # [B], 1 if empty
    adv = masked_mean(_f32(advantages).detach(), m, dim=1)                                   # [B]
    pg, clipped = _clipped_surrogate(seq_ratio, adv, cliprange_low, cliprange_high)          # [B]
    loss = masked_mean(pg, valid)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean(clipped.float(), valid),
            "approx_kl": masked_mean(0.5 * log_ratio ** 2, mask),
            "ratio_mean": masked_mean(seq_ratio, valid),
        }
    return loss, stats


@register_policy_loss("cispo", options=POLICY_LOSS_OPTIONS)
def cispo_policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, *, cliprange_low: float = 0.2, cliprange_high: float | None = None,
                      loss_agg: str = "token_mean", horizon: float | None = None,
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention", §3.1, eq. 4-5): clip the importance-sampling weight, not the update, so every token
    keeps a gradient: `ppo.policy_loss=cispo`.

    logp: [B, T] (with grad); logp_old, advantages: [B, T] (detached); mask: [B, T].
        r_t  = exp(logp_t - logp_old_t)
        w_t  = sg(clamp(r_t, 1 - c_low, 1 + c_high))                (stop-gradient)
        loss = agg(-w_t * A_t * logp_t)                              (0-d; agg as in `clip`)
    so d loss / d logp_t = -w_t * A_t (times agg's weight): a REINFORCE gradient with a clipped IS
    weight. The report sets no lower bound in practice (a large c_low) and tunes c_high;
    cliprange_high None = cliprange_low. The value is that of the report's objective (it depends on
    logp itself, not only on the ratio).
    Stats (detached 0-d): clipfrac (fraction of masked tokens whose weight is clipped), approx_kl,
    ratio_mean (as in `clip`).
    """
    _check_shapes(logp=logp, logp_old=logp_old, advantages=advantages, mask=mask)
    m = mask.bool()
    adv = _f32(advantages).detach()
    log_ratio = _log_ratio(logp, logp_old, m)
    ratio = torch.exp(log_ratio.detach())
    high = cliprange_low if cliprange_high is None else cliprange_high
    weight = torch.clamp(ratio, 1.0 - cliprange_low, 1.0 + high)                             # no grad
    zero = torch.zeros((), dtype=torch.float32, device=m.device)
    lp = torch.where(m, _f32(logp), zero)  # padding's log-probs (maybe -inf) never enter the value or grad
    loss = _aggregate(-weight * adv * lp, mask, loss_agg, horizon)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((weight != ratio).float(), mask),
            "approx_kl": masked_mean(0.5 * log_ratio ** 2, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


# ----------------------------------------------------------------------------- sampler vs trainer
#
# The sampler (generation mode) and the trainer's scoring pass compute the same policy's log-probs of
# the same tokens in two implementations; they differ by rounding at best, by a bug at worst (a weight
# that did not reach the sampler, a temperature applied in one and not the other), and by design when
# top-k/top-p truncate the sampler's distribution. With rho_t = pi_trainer(y_t) / pi_sampler(y_t) =
# exp(logp_old_t - logp_gen_t), the update's data is off-policy by rho; `ppo.is_correction` reweights
# (tis) or rejects (mis) it. The weights multiply the per-token policy loss, detached.

IS_CORRECTIONS = ("none", "tis", "mis")
IS_LEVELS = ("token", "sequence")


def sampler_log_ratio(logp_old: torch.Tensor, logp_gen: torch.Tensor, mask: torch.Tensor,
                      level: str = "token") -> torch.Tensor:
    """log rho, detached, float32, 0 outside the mask. logp_old (the trainer's scoring pass), logp_gen
    (the sampler's), mask: [B, T].
        token     log rho_t = logp_old_t - logp_gen_t
        sequence  log rho_i = (1/|y_i|) sum_t (logp_old_t - logp_gen_t), the log of the row's
                  geometric-mean ratio, on every token of the row (GSPO's length-normalised sequence
                  ratio; verl's "geometric" rejection). TRL's sequence modes use the product
                  prod_t rho_t instead, whose range grows with the length; the geometric mean keeps one
                  pair of bounds meaningful for a 10-token and a 1000-token response.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; valid: {', '.join(IS_LEVELS)}")
    _check_shapes(logp_old=logp_old, logp_gen=logp_gen, mask=mask)
    m = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=m.device)
    log_rho = torch.where(m, _f32(logp_old).detach() - _f32(logp_gen).detach(), zero)       # [B, T]
    if level == "sequence":
        log_rho = torch.where(m, masked_mean(log_rho, m, dim=1)[:, None], zero)
    return log_rho


def tis_weights(logp_old: torch.Tensor, logp_gen: torch.Tensor, mask: torch.Tensor, *, cap: float = 2.0,
                level: str = "token") -> torch.Tensor:
    """Truncated importance sampling, TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
    You Off-Policy RL Training"; TRL `vllm_importance_sampling_mode=token_truncate`, verl
    `rollout_is=token` with `rollout_is_threshold`):
        w = min(rho, C)        rho from `sampler_log_ratio(level)`, C = `cap` > 0 (ppo.is_cap)
    [B, T] float32, detached, 0 outside the mask. The loss becomes sum_t w_t * loss_t: the truncation
    trades the bias of the capped tail for a bounded variance."""
    if not cap > 0:
        raise ValueError(f"the TIS cap must be > 0, got {cap}")
    log_rho = sampler_log_ratio(logp_old, logp_gen, mask, level)
    w = torch.exp(torch.clamp(log_rho, max=math.log(cap)))  # clamp in log space: no overflow to inf
    return torch.where(mask.bool(), w, torch.zeros_like(w))


def mis_weights(logp_old: torch.Tensor, logp_gen: torch.Tensor, mask: torch.Tensor, *, low: float = 0.5,
                high: float = 2.0, level: str = "token") -> torch.Tensor:
    """Masked importance sampling, MIS (IcePop: Ling Team 2025, "Every Step Evolves: Scaling
    Reinforcement Learning for Trillion-Scale Thinking Model", arXiv:2510.18855, its masking function
    M(k) = k if alpha <= k <= beta else 0; TRL `vllm_importance_sampling_mode=token_mask|sequence_mask`,
    whose lower bound is 0; verl `rollout_rs=token|geometric`):
        w = rho * 1[low <= rho <= high]          (0 <= low < 1 < high: ppo.is_low, ppo.is_high)
    A token (level=token) or a whole response (level=sequence: rho is the row's geometric mean) whose
    ratio leaves [low, high] is rejected: weight 0, no gradient, still counted in the loss's
    denominator (as TRL does), so a step's scale does not jump with the rejections. [B, T] float32,
    detached, 0 outside the mask."""
    if not (0 <= low < 1 < high):
        raise ValueError(f"the MIS bounds must satisfy 0 <= low < 1 < high, got [{low}, {high}]")
    log_rho = sampler_log_ratio(logp_old, logp_gen, mask, level)
    rho = torch.exp(log_rho)
    keep = mask.bool() & (rho >= low) & (rho <= high)
    return torch.where(keep, rho, torch.zeros_like(rho))


def is_weights(correction: str, logp_old: torch.Tensor, logp_gen: torch.Tensor, mask: torch.Tensor, *,
               cap: float = 2.0, low: float = 0.5, high: float = 2.0, level: str = "token") -> torch.Tensor:
    """The weights of `ppo.is_correction`: none (1 on the mask), tis (`tis_weights`), mis (`mis_weights`).
    [B, T] float32, detached, 0 outside the mask."""
    if correction == "none":
        _check_shapes(logp_old=logp_old, logp_gen=logp_gen, mask=mask)
        return mask.bool().float()
    if correction == "tis":
        return tis_weights(logp_old, logp_gen, mask, cap=cap, level=level)
    if correction == "mis":
        return mis_weights(logp_old, logp_gen, mask, low=low, high=high, level=level)
    raise ValueError(f"unknown importance-sampling correction {correction!r}; valid: {', '.join(IS_CORRECTIONS)}")


def is_weighted_advantages(advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """advantages * weights (both [B, T]; the weights detached): how the correction enters every
    registered policy loss. Because w >= 0, max(-A w r, -A w clip(r)) = w * max(-A r, -A clip(r)), so
    for `clip` and `cispo` (-sg(clip(r)) (A w) logp = w * their term) this *is* the per-token loss times
    w, as verl (`pg_losses * rollout_is_weights`) and TRL (`per_token_loss * importance_sampling_ratio`)
    apply it. For `gspo` (one ratio per response) the row's advantage becomes mean_t(w_t A_t): with an
    outcome advantage, the response's loss times the mean of its token weights (times w_i itself at
    level=sequence)."""
    _check_shapes(advantages=advantages, weights=weights)
    return _f32(advantages).detach() * weights.detach()


# ----------------------------------------------------------------------------- reward shaping

def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's overlong reward shaping (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
    Learning System at Scale", §3.4, eq. 13): a linear penalty for responses in the last `buffer`
    tokens of the budget, added to the score.

    lengths: [B] response lengths |y|; max_len: L_max (rollout.max_new_tokens); buffer: L_cache
    (ppo.overlong_buffer, 0 = off); factor: the largest penalty (ppo.overlong_penalty).
        0                                       |y| <= L_max - L_cache
        (L_max - L_cache - |y|) / L_cache * f   L_max - L_cache < |y| <= L_max   (down to -f)
        -f                                      |y| > L_max
    Returns [B] float32 (<= 0); all zeros when buffer is 0.
    """
    x = _f32(lengths)
    if buffer <= 0:
        return torch.zeros_like(x)
    ramp = (max_len - buffer - x) / buffer
    return ramp.clamp(min=-1.0, max=0.0) * factor


def kl_shaped_score(score: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """An outcome estimator's per-response reward with the KL penalty in it (RLOO as Ahmadian et al.
    2024, TRL and OpenRLHF define it): score_i - kl_coef * sum_t kl_{i,t} over the response's tokens.

    score: [B]; kl: [B, T] per-token KL estimate (`compute_rewards`'s, k1 by default); mask: [B, T].
    Returns `score` itself when kl_coef is 0 (today's numbers exactly), else [B] float32.
    """
    if not kl_coef:
        return score
    return _f32(score) - kl_coef * masked_sum(kl, mask, dim=1)


def value_loss(values: torch.Tensor, values_old: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, cliprange_value: float = 0.2
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped value loss for the critic.

    values: [B, T] current critic values (with grad); values_old, returns: [B, T] (detached here);
    mask: [B, T].
        v_clipped = values_old + clamp(values - values_old, -c, c)
        loss      = 0.5 * masked_mean(max((values - R)^2, (v_clipped - R)^2))   (0-d)
    Stats (detached 0-d tensors):
        vf_clipfrac  fraction of masked tokens where the clipped branch is strictly larger
        value_error  masked mean of (values - R)^2
    """
    _check_shapes(values=values, values_old=values_old, returns=returns, mask=mask)
    v = _f32(values)
    v_old = _f32(values_old).detach()
    ret = _f32(returns).detach()
    v_clipped = v_old + torch.clamp(v - v_old, -cliprange_value, cliprange_value)
    vf_unclipped = (v - ret) ** 2
    vf_clipped = (v_clipped - ret) ** 2
    loss = 0.5 * masked_mean(torch.maximum(vf_unclipped, vf_clipped), mask)
    with torch.no_grad():
        stats = {
            "vf_clipfrac": masked_mean((vf_clipped > vf_unclipped).float(), mask),
            "value_error": masked_mean(vf_unclipped, mask),
        }
    return loss, stats


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: [..., V] -> [...].

    H = logsumexp(z) - sum(softmax(z) * z), in float32. -inf logits (tokens masked out by
    top-k/top-p) contribute 0 instead of 0 * -inf = NaN.
    """
    z = _f32(logits)
    # NOTE: shifting by the row max keeps lse and sum(p * z) small, so their difference does not
    # cancel (with logits ~1000 the unshifted form loses ~3e-5 in float32). Entropy is
    # shift-invariant, so the max is detached.
    z_max = z.detach().amax(dim=-1, keepdim=True)
    z = z - torch.where(torch.isfinite(z_max), z_max, torch.zeros_like(z_max))
    p = torch.softmax(z, dim=-1)
    z_finite = z.masked_fill(torch.isneginf(z), 0.0)
    return torch.logsumexp(z, dim=-1) - (p * z_finite).sum(-1)


# ----------------------------------------------------------------------------- KL controllers

class FixedKLController:
    """Constant KL coefficient; `update` is a no-op."""

    def __init__(self, kl_coef: float):
        if not kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef!r}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept for interface parity with AdaptiveKLController)."""

    def __repr__(self) -> str:
        return f"FixedKLController(value={self.value})"

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, d: dict) -> None:
        self.value = float(d["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences").

        proportional_error = clip(current_kl / target - 1, -0.2, 0.2)
        value = max(min_value, value * (1 + proportional_error * n_steps / horizon))
    `n_steps` is the number of samples (episodes) the KL was measured over.

    `min_value` (ppo.kl_coef_min) is a floor. Ziegler's controller also lowers the coefficient while
    the KL is under the target, which it is at the start of every run (the actor is the reference):
    on the embedded default (seed 1234, target 0.4) the coefficient fell from 0.8 to 0.31 by step 24, so
    that the KL then overshot to 0.55 before the controller caught up. With min_value = init_kl_coef
    the controller only adds to the penalty while the KL is over the target: a KL budget, the dual
    ascent of the constraint KL <= target on a multiplier kept >= min_value.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float, min_value: float = 0.0):
        if not init_kl_coef >= 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef!r}")
        if not (target > 0 and horizon > 0):
            raise ValueError(f"target and horizon must be > 0, got target={target!r}, "
                             f"horizon={horizon!r}")
        if not 0 <= min_value <= init_kl_coef:
            raise ValueError(f"min_value must be in [0, init_kl_coef={init_kl_coef!r}], got {min_value!r}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)
        self.min_value = float(min_value)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move `value` toward keeping `current_kl` (a float or 0-d tensor) at `target`; a non-finite
        KL (nothing measured, or a fault upstream) leaves `value` as it is."""
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            return
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value = max(self.min_value, self.value * (1.0 + proportional_error * n_steps / self.horizon))

    def __repr__(self) -> str:
        return (f"AdaptiveKLController(value={self.value}, target={self.target}, "
                f"horizon={self.horizon}, min_value={self.min_value})")

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, d: dict) -> None:
        self.value = float(d["value"])
        self.target = float(d["target"])
        self.horizon = float(d["horizon"])


def make_kl_controller(kl_coef: float, adaptive: bool, target: float | None = None,
                       horizon: float | None = None, min_value: float = 0.0) -> FixedKLController | AdaptiveKLController:
    """FixedKLController(kl_coef), or AdaptiveKLController(kl_coef, target, horizon, min_value) if adaptive."""
    if adaptive:
        if target is None or horizon is None:
            raise ValueError("adaptive KL control needs both target and horizon")
        return AdaptiveKLController(kl_coef, target, horizon, min_value)
    if min_value:
        raise ValueError("a KL coefficient floor (min_value) applies to adaptive KL control only")
    return FixedKLController(kl_coef)


# ----------------------------------------------------------------------------- advantage estimators, by name
#
# `ppo.advantage_estimator` names one. Every estimator gets the same inputs (`AdvantageInputs`) and
# returns (advantages [B, T], returns [B, T] or None); returns are the critic's targets, so an
# estimator registered with needs_critic=False returns None and the run builds no critic at all.
# A new estimator (GRPO, RLOO, ...) is one function here:
#
#     @register_advantage("name", needs_critic=False)
#     def name(x: AdvantageInputs, *, gamma: float, lam: float) -> tuple[Tensor, Tensor | None]: ...


@dataclass(frozen=True)
class AdvantageInputs:
    """One rank's rollout rows, as every estimator sees them.

    rewards: [B, T] per-token rewards (-kl_coef * KL, + the clipped score at the last token);
    score:   [B] the reward model's score of each response (unclipped);
    values:  [B, T] critic values, or None when the estimator needs no critic;
    mask:    [B, T] response tokens (rows with nothing said are all 0);
    group:   [B] the prompt each row answers (rows of one prompt share it; the dataset row index).
    """

    rewards: torch.Tensor
    score: torch.Tensor
    values: torch.Tensor | None
    mask: torch.Tensor
    group: torch.Tensor


@dataclass(frozen=True)
class AdvantageEstimator:
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    needs_critic: bool
    token_rewards: bool  # reads x.rewards (so the KL penalty in the reward, ppo.kl_coef, reaches it)
    options: tuple[str, ...]  # extra keyword arguments it takes (see `build_experience`)
    needs_group: bool = False  # a response against the others of its prompt: groups of one give advantage 0


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage(name: str, *, needs_critic: bool, token_rewards: bool = True, options: tuple[str, ...] = (),
                       needs_group: bool = False):
    """Register `fn(x: AdvantageInputs, *, gamma, lam, **options) -> (advantages, returns | None)` as
    `name`. `token_rewards=False`: it reads only x.score (an outcome estimator), so a KL penalty in
    the reward would be ignored (the config then refuses ppo.kl_coef > 0). `options` names the
    keyword arguments besides gamma and lam it takes: `norm_by_std` (ppo.norm_by_std),
    `all_reduce_sum` (a sum over every rank's tensors, identity in one process). `needs_group=True`:
    a response's advantage is relative to the other responses to its prompt (x.group), so a group of
    one has advantage 0 and nothing is learnt (the config then refuses rollout.n_samples_per_prompt=1)."""
    def deco(fn):
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(fn, needs_critic, token_rewards, tuple(options), needs_group)
        return fn
    return deco


def advantage_estimator(name: str) -> AdvantageEstimator:
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {', '.join(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


@register_advantage("gae", needs_critic=True)
def gae(x: AdvantageInputs, *, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's default: GAE over the per-token rewards with the critic's values (`gae_advantages`)."""
    if x.values is None:
        raise ValueError("gae needs critic values")
    return gae_advantages(x.rewards, x.values, x.mask, gamma, lam)


@register_advantage("grpo", needs_critic=False, token_rewards=False, options=("norm_by_std",), needs_group=True)
def grpo(x: AdvantageInputs, *, gamma: float, lam: float, norm_by_std: bool = True) -> tuple[torch.Tensor, None]:
    """GRPO (`grpo_advantages`); ppo.norm_by_std=false is Dr. GRPO."""
    return grpo_advantages(x.score, x.group, x.mask, norm_by_std=norm_by_std), None


@register_advantage("rloo", needs_critic=False, token_rewards=False, needs_group=True)
def rloo(x: AdvantageInputs, *, gamma: float, lam: float) -> tuple[torch.Tensor, None]:
    """RLOO (`rloo_advantages`)."""
    return rloo_advantages(x.score, x.group, x.mask), None


@register_advantage("reinforce_pp", needs_critic=False, options=("all_reduce_sum",))
def reinforce_pp(x: AdvantageInputs, *, gamma: float, lam: float,
                 all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, None]:
    """REINFORCE++ (`reinforce_pp_advantages`), whitened over every rank's response tokens."""
    return reinforce_pp_advantages(x.rewards, x.mask, gamma, all_reduce_sum=all_reduce_sum), None


@register_advantage("reinforce", needs_critic=False)
def reinforce(x: AdvantageInputs, *, gamma: float, lam: float) -> tuple[torch.Tensor, None]:
    """REINFORCE without a baseline: A_t = the discounted return of the token-level rewards
    (`discounted_returns`), neither whitened nor centred (ppo.whiten_advantages whitens it). With
    gamma = 0 and the reward -kl_coef x k1 per token (score 0) it is on-policy distillation's
    per-token advantage, -(log p_student - log p_teacher) (algorithm=distill; Thinking Machines,
    "On-Policy Distillation", 2025: discount 0, the student optimises each next token)."""
    return discounted_returns(x.rewards, x.mask, gamma), None
