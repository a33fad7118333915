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
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

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


def compute_rewards(logp_old: torch.Tensor, logp_ref: torch.Tensor, score: torch.Tensor,
                    mask: torch.Tensor, kl_coef: float, clip_reward_value: float,
                    kl_estimator: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: a KL penalty on every response token plus the clipped score at the end.

    logp_old, logp_ref, mask: [B, T]; score: [B] (reward model's value at the last response token).
    clip_reward_value must be > 0; pass float('inf') to disable clipping.
    Returns (rewards [B, T], kl [B, T]), both 0 outside the mask:
        kl      = kl_estimate(logp_old, logp_ref, kl_estimator) on masked tokens
        rewards = -kl_coef * kl, plus clamp(score, -clip, clip) at index mask.sum(1) - 1
    Rows with an empty mask get no score (all zeros).
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
    last = (lengths - 1).clamp(min=0).unsqueeze(1)                            # [B, 1]
    clipped = _f32(score).to(rewards.dtype).clamp(-clip_reward_value, clip_reward_value)
    clipped = torch.where(lengths > 0, clipped, torch.zeros_like(clipped))   # empty rows: no score
    rewards = rewards.scatter_add(1, last, clipped.unsqueeze(1))
    return rewards, kl


# ----------------------------------------------------------------------------- advantages

@torch.no_grad()
def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   gamma: float = 1.0, lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens, vectorised over the batch.

    rewards, values, mask: [B, T]. The episode ends at each row's last masked token, so the value
    after it is 0; rewards/values outside the mask are treated as 0.
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
        last_gae = delta + gamma * lam * last_gae
        advantages[:, t] = last_gae
        next_value = v[:, t]
    advantages = torch.where(m, advantages, zero)
    returns = torch.where(m, advantages + v, zero)
    return advantages, returns


# ----------------------------------------------------------------------------- losses

def policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cliprange: float = 0.2
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss for the actor.

    logp: [B, T] current log-probs (with grad); logp_old, advantages: [B, T] (detached here);
    mask: [B, T].
        ratio = exp(logp - logp_old)
        loss  = masked_mean(max(-A * ratio, -A * clamp(ratio, 1 - c, 1 + c)))   (0-d)
    Stats (detached 0-d tensors, so callers can all-reduce them):
        clipfrac   fraction of masked tokens where the clipped branch is strictly larger
        approx_kl  masked mean of 0.5 * (logp - logp_old)^2
        ratio_mean masked mean of ratio
    """
    _check_shapes(logp=logp, logp_old=logp_old, advantages=advantages, mask=mask)
    m = mask.bool()
    adv = _f32(advantages).detach()
    # NOTE: zero the log-ratio outside the mask *before* exp: garbage padding could overflow to
    # inf, and where() would then backpropagate 0 * inf = NaN.
    zero = torch.zeros((), dtype=torch.float32, device=m.device)
    log_ratio = torch.where(m, _f32(logp) - _f32(logp_old).detach(), zero)                  # [B, T]
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.maximum(pg_unclipped, pg_clipped), mask)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((pg_clipped > pg_unclipped).float(), mask),
            "approx_kl": masked_mean(0.5 * log_ratio ** 2, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


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
        value *= 1 + proportional_error * n_steps / horizon
    `n_steps` is the number of samples (episodes) the KL was measured over.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if not init_kl_coef >= 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef!r}")
        if not (target > 0 and horizon > 0):
            raise ValueError(f"target and horizon must be > 0, got target={target!r}, "
                             f"horizon={horizon!r}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move `value` toward keeping `current_kl` (a float or 0-d tensor) at `target`; a non-finite
        KL (nothing measured, or a fault upstream) leaves `value` as it is."""
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            return
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def __repr__(self) -> str:
        return (f"AdaptiveKLController(value={self.value}, target={self.target}, "
                f"horizon={self.horizon})")

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, d: dict) -> None:
        self.value = float(d["value"])
        self.target = float(d["target"])
        self.horizon = float(d["horizon"])


def make_kl_controller(kl_coef: float, adaptive: bool, target: float | None = None,
                       horizon: float | None = None) -> FixedKLController | AdaptiveKLController:
    """FixedKLController(kl_coef), or AdaptiveKLController(kl_coef, target, horizon) if adaptive."""
    if adaptive:
        if target is None or horizon is None:
            raise ValueError("adaptive KL control needs both target and horizon")
        return AdaptiveKLController(kl_coef, target, horizon)
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


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage(name: str, *, needs_critic: bool):
    """Register `fn(x: AdvantageInputs, *, gamma, lam) -> (advantages, returns | None)` as `name`."""
    def deco(fn):
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(fn, needs_critic)
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
