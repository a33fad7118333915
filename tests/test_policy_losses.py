"""The policy-loss registry of #33 (rlhf/algos/rl.py: clip, gspo, cispo), DAPO's overlong reward
shaping and the KL in an outcome estimator's reward (RLOO as TRL/OpenRLHF define it): each against its
published formula on hand-made tensors, values and gradients. Pure tensors, no model."""
from __future__ import annotations

import math

import pytest
import torch

from rlhf.algos import rl as rl_math
from rlhf.algos.rl import (
    POLICY_LOSSES,
    cispo_policy_loss,
    clip_policy_loss,
    gspo_policy_loss,
    overlong_penalty,
    policy_loss,
    policy_loss_fn,
    rloo_advantages,
)
from rlhf.core.errors import ConfigError
from rlhf.rl.experience import build_experience


def close(actual, expected, atol=1e-6):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, f"shape {list(actual.shape)} != {list(expected.shape)}"
    assert torch.allclose(actual, expected, rtol=1e-5, atol=atol), f"\n{actual}\n!=\n{expected}"


def old_policy_loss(logp, logp_old, advantages, mask, cliprange=0.2, *, cliprange_high=None,
                    loss_agg="token_mean", horizon=None):
    """rlhf/algos/rl.py's policy_loss before the registry (#33), verbatim but for its name."""
    m = mask.bool()
    adv = advantages.float().detach()
    zero = torch.zeros((), dtype=torch.float32)
    log_ratio = torch.where(m, logp.float() - logp_old.float().detach(), zero)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    high = cliprange if cliprange_high is None else cliprange_high
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - cliprange, 1.0 + high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    if loss_agg == "token_mean":
        loss = rl_math.masked_mean(pg, mask)
    else:
        total, weight = rl_math.aggregate_loss(pg, mask, loss_agg, horizon)
        loss = total / weight.clamp(min=1)
    with torch.no_grad():
        stats = {"clipfrac": rl_math.masked_mean((pg_clipped > pg_unclipped).float(), mask),
                 "approx_kl": rl_math.masked_mean(0.5 * log_ratio ** 2, mask),
                 "ratio_mean": rl_math.masked_mean(ratio, mask)}
    return loss, stats


def value_and_grad(fn, logp, *args, **kwargs):
    logp = logp.clone().requires_grad_(True)
    loss, stats = fn(logp, *args, **kwargs)
    loss.backward()
    return loss.detach(), logp.grad, stats


def random_batch(seed, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T  # at least one full row
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    logp_old = -torch.rand(B, T, generator=g) * 3
    logp = logp_old + torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, T, generator=g)
    return logp, logp_old, adv, mask


# ----------------------------------------------------------------------------- the registry

def test_registry_names_options_and_unknown_name():
    assert list(POLICY_LOSSES)[:3] == ["clip", "gspo", "cispo"]
    assert policy_loss_fn("clip").fn is clip_policy_loss and not policy_loss_fn("clip").per_sequence
    assert policy_loss_fn("gspo").per_sequence and "loss_agg" not in policy_loss_fn("gspo").options
    with pytest.raises(ConfigError, match=r"ppo\.policy_loss must be one of \('clip', 'gspo', 'cispo'"):
        policy_loss_fn("ppo2")
    with pytest.raises(ValueError, match="already registered"):
        rl_math.register_policy_loss("clip")(clip_policy_loss)
    with pytest.raises(ValueError, match="unknown options"):
        rl_math.register_policy_loss("x", options=("temperature",))


@pytest.mark.parametrize("name", ["clip", "gspo", "cispo"])
def test_every_loss_stats_are_detached_scalars_and_empty_rows_are_harmless(name):
    logp, logp_old, adv, mask = random_batch(0)
    fn = policy_loss_fn(name).fn
    loss, grad, stats = value_and_grad(fn, logp, logp_old, adv, mask)
    assert loss.dim() == 0 and torch.isfinite(loss) and torch.isfinite(grad).all()
    assert {"approx_kl", "ratio_mean", "clipfrac"} <= set(stats)
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())
    # an all-masked row holding garbage (NaN, inf) changes neither the loss nor the other rows' gradients
    bad = torch.tensor([[float("nan"), float("inf"), -float("inf"), 1e30, 0, 0, 0]])
    loss2, grad2, stats2 = value_and_grad(fn, torch.cat([logp, bad]), torch.cat([logp_old, -bad]),
                                          torch.cat([adv, bad]), torch.cat([mask, torch.zeros(1, 7)]))
    close(loss2, loss)
    close(grad2[:-1], grad)
    assert (grad2[-1] == 0).all()
    for k in stats:
        close(stats2[k], stats[k])
    # a batch with nothing masked in: loss 0, gradient 0, no NaN
    loss3, grad3, stats3 = value_and_grad(fn, logp, logp_old, adv, torch.zeros_like(mask))
    assert loss3 == 0 and (grad3 == 0).all() and all(torch.isfinite(v) for v in stats3.values())


# ----------------------------------------------------------------------------- clip

@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("agg,high", [("token_mean", None), ("token_mean", 0.28), ("seq_mean_token_mean", None),
                                      ("seq_mean_token_sum", 0.3)])
def test_clip_equals_the_previous_policy_loss(seed, agg, high):
    logp, logp_old, adv, mask = random_batch(seed)
    kw = {"cliprange_high": high, "loss_agg": agg, "horizon": 7.0}
    want, want_grad, want_stats = value_and_grad(old_policy_loss, logp, logp_old, adv, mask, 0.1, **kw)
    for fn, args in ((policy_loss, (0.1,)), (clip_policy_loss, ())):
        extra = {} if args else {"cliprange_low": 0.1}
        got, got_grad, got_stats = value_and_grad(fn, logp, logp_old, adv, mask, *args, **kw, **extra)
        assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
        assert all(torch.equal(got_stats[k], want_stats[k]) for k in want_stats)


def test_clip_hand_values_gradients_and_the_clip_boundary():
    # one row, four tokens, c_low = 0.2, c_high = 0.3: ratios 1.1 (inside), 1.5 (A > 0: clipped at 1.3),
    # 0.5 (A < 0: clipped at 0.8), 1.5 (A < 0: the unclipped branch is larger, so it keeps its gradient)
    r = torch.tensor([[1.1, 1.5, 0.5, 1.5]])
    A = torch.tensor([[1.0, 2.0, -1.0, -1.0]])
    loss, grad, stats = value_and_grad(clip_policy_loss, r.log(), torch.zeros(1, 4), A, torch.ones(1, 4),
                                       cliprange_low=0.2, cliprange_high=0.3)
    close(loss, (-1.1 - 2 * 1.3 + 0.8 + 1.5) / 4)
    close(grad, [[-1.1 / 4, 0.0, 0.0, 1.5 / 4]])  # d(-A r)/dlogp = -A r where unclipped
    close(stats["clipfrac"], 0.5)
    close(stats["ratio_mean"], r.mean())
    close(stats["approx_kl"], (0.5 * r.log() ** 2).mean())
    # a ratio exactly at the boundary 1 + c_high: both branches equal, not counted as clipped
    ratio = torch.exp(torch.tensor([[math.log(2.0)]]))
    loss, grad, stats = value_and_grad(clip_policy_loss, torch.tensor([[math.log(2.0)]]), torch.zeros(1, 1),
                                       torch.ones(1, 1), torch.ones(1, 1), cliprange_low=0.2,
                                       cliprange_high=float(ratio) - 1.0)
    close(loss, -ratio[0, 0])
    assert stats["clipfrac"] == 0 and torch.isfinite(grad).all()


# ----------------------------------------------------------------------------- gspo

def gspo_reference(logp, logp_old, adv, mask, lo, hi):
    """GSPO's objective row by row (Zheng et al. 2025, eq. 5-7), written the plain way."""
    terms = []
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        if n == 0:
            continue
        s = torch.exp((logp[i, :n] - logp_old[i, :n]).sum() / n)
        a = adv[i, :n].mean()
        terms.append(-torch.minimum(s * a, torch.clamp(s, 1 - lo, 1 + hi) * a))
    return torch.stack(terms).mean()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("lo,hi", [(3e-4, 4e-4), (0.2, 0.2), (0.05, 0.5)])
def test_gspo_equals_the_plain_formula_values_and_gradients(seed, lo, hi):
    logp, logp_old, adv, mask = random_batch(seed)
    adv = adv[:, :1].expand_as(adv) * mask  # an outcome advantage: one value per row
    got, got_grad, stats = value_and_grad(gspo_policy_loss, logp, logp_old, adv, mask,
                                          cliprange_low=lo, cliprange_high=hi)
    want, want_grad, _ = value_and_grad(lambda lp, *a: (gspo_reference(lp, *a, lo, hi), {}), logp, logp_old, adv, mask)
    close(got, want)
    close(got_grad, want_grad)
    valid = mask.bool().any(1)
    s = torch.exp(rl_math.masked_mean(logp - logp_old, mask, dim=1))[valid]
    close(stats["ratio_mean"], s.mean())


def test_gspo_hand_gradient_sequence_advantage_and_clip():
    # row 0: 2 tokens, log-ratios 0.05 and 0.15 -> s = exp(0.1) (inside); A = 1 (token advantages 0.5, 1.5: their mean)
    # row 1: 1 token, log-ratio 0.5 -> s = exp(0.5) > 1 + 0.2 with A = 2 > 0: clipped, no gradient
    # row 2: 3 tokens, log-ratio -0.1 each -> s = exp(-0.1); A = -1 (inside the range)
    lr = torch.tensor([[0.05, 0.15, 0.0], [0.5, 0.0, 0.0], [-0.1, -0.1, -0.1]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]]).float()
    adv = torch.tensor([[0.5, 1.5, 0.0], [2.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    loss, grad, stats = value_and_grad(gspo_policy_loss, lr, torch.zeros(3, 3), adv, mask,
                                       cliprange_low=0.2, cliprange_high=0.2)
    s0, s2 = math.exp(0.1), math.exp(-0.1)
    close(loss, (-s0 - 2 * 1.2 + s2) / 3)
    # d/dlogp_t of -A s / N = -A s / (|y| N) on each of the row's tokens
    close(grad, [[-s0 / 2 / 3, -s0 / 2 / 3, 0], [0, 0, 0], [s2 / 3 / 3] * 3])
    close(stats["clipfrac"], 1 / 3)
    close(stats["ratio_mean"], (s0 + math.exp(0.5) + s2) / 3)


def test_gspo_on_single_token_responses_is_the_clipped_surrogate_per_token():
    logp, logp_old, adv, _ = random_batch(3, B=8, T=1)
    mask = torch.ones(8, 1)
    a = value_and_grad(gspo_policy_loss, logp, logp_old, adv, mask, cliprange_low=0.1, cliprange_high=0.2)
    b = value_and_grad(clip_policy_loss, logp, logp_old, adv, mask, cliprange_low=0.1, cliprange_high=0.2)
    close(a[0], b[0])
    close(a[1], b[1])
    close(a[2]["clipfrac"], b[2]["clipfrac"])


def test_gspo_ratio_at_the_clip_boundary_is_not_clipped():
    lr = torch.tensor([[math.log(1.5), math.log(1.5)]])
    s = torch.exp(rl_math.masked_mean(lr, torch.ones(1, 2), dim=1))[0]
    loss, grad, stats = value_and_grad(gspo_policy_loss, lr, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2),
                                       cliprange_low=0.2, cliprange_high=float(s) - 1.0)
    close(loss, -s)
    assert stats["clipfrac"] == 0 and torch.isfinite(grad).all()


# ----------------------------------------------------------------------------- cispo

def test_cispo_hand_values_and_gradients():
    # ratios 1.1 (inside), 1.5 (weight clipped to 1.3), 0.5 (weight clipped to 0.8); every token keeps
    # its gradient -w A (/ N), whatever the clip
    r = torch.tensor([[1.1, 1.5, 0.5]])
    logp_old = torch.tensor([[-1.0, -2.0, -0.5]])
    logp = logp_old + r.log()
    A = torch.tensor([[1.0, 2.0, -1.0]])
    loss, grad, stats = value_and_grad(cispo_policy_loss, logp, logp_old, A, torch.ones(1, 3),
                                       cliprange_low=0.2, cliprange_high=0.3)
    w = torch.tensor([[1.1, 1.3, 0.8]])
    close(loss, (-(w * A * logp)).mean())
    close(grad, -w * A / 3)
    close(stats["clipfrac"], 2 / 3)
    close(stats["ratio_mean"], r.mean())
    # the weight exactly at the boundary is the ratio itself (not counted as clipped)
    ratio = float(torch.exp(torch.tensor(math.log(1.25))))
    _, grad, stats = value_and_grad(cispo_policy_loss, torch.tensor([[math.log(1.25)]]), torch.zeros(1, 1),
                                    torch.ones(1, 1), torch.ones(1, 1), cliprange_low=0.2, cliprange_high=ratio - 1.0)
    close(grad, [[-ratio]])
    assert stats["clipfrac"] == 0


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_cispo_equals_the_plain_formula_under_each_aggregation(agg):
    logp, logp_old, adv, mask = random_batch(5)
    got, got_grad, _ = value_and_grad(cispo_policy_loss, logp, logp_old, adv, mask, cliprange_low=0.1,
                                      cliprange_high=0.2, loss_agg=agg, horizon=7.0)

    def plain(lp, lp_old, a, m):
        w = torch.clamp(torch.exp(lp - lp_old), 0.9, 1.2).detach()
        x = -w * a * lp * m
        rows = m.bool().any(1)
        if agg == "token_mean":
            return x.sum() / m.sum(), {}
        per_row = x.sum(1) / (m.sum(1).clamp(min=1) if agg == "seq_mean_token_mean" else 7.0)
        return per_row[rows].mean(), {}

    want, want_grad, _ = value_and_grad(plain, logp, logp_old, adv, mask)
    close(got, want)
    close(got_grad, want_grad)


# ----------------------------------------------------------------------------- the actor loss, by name

@pytest.mark.parametrize("name", ["clip", "gspo", "cispo"])
def test_make_actor_loss_uses_the_named_loss(name, monkeypatch):
    from rlhf.rl import update

    logp, logp_old, adv, mask = random_batch(1, B=4, T=5)

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.logp = torch.nn.Parameter(logp.clone())

    monkeypatch.setattr(update, "token_logprobs", lambda model, mb, t, with_entropy, truncate=None: (model.logp, torch.zeros(4, 5)))
    model = Toy()
    mb = {"response_mask": mask, "logp_old": logp_old, "advantages": adv, "sequences": torch.zeros(4, 8)}
    total, n, stats = update.make_actor_loss(0.2, 1.0, 0.0, cliprange_high=0.28, policy_loss=name)(model, mb)
    total.backward()
    loss, _ = policy_loss_fn(name).fn(logp, logp_old, adv, mask, cliprange_low=0.2, cliprange_high=0.28)
    n_want = mask.bool().any(1).sum() if name == "gspo" else mask.sum()  # gspo: a mean over rows
    close(n.float(), float(n_want))
    close(total.detach(), loss * n_want)
    assert torch.isfinite(model.logp.grad).all() and model.logp.grad.abs().sum() > 0
    assert "approx_kl" in stats and "entropy" in stats


# ----------------------------------------------------------------------------- reward shaping

def test_overlong_penalty_hand_values():
    # L_max = 16, L_cache = 4: no penalty up to 12 tokens, then -1/4 per token down to -factor at 16
    lengths = torch.tensor([0, 5, 12, 13, 14, 15, 16, 17])
    close(overlong_penalty(lengths, 16, 4), [0, 0, 0, -0.25, -0.5, -0.75, -1, -1])
    close(overlong_penalty(lengths, 16, 4, 2.0), [0, 0, 0, -0.5, -1, -1.5, -2, -2])
    close(overlong_penalty(lengths, 16, 0), [0.0] * 8)  # off
    close(overlong_penalty(torch.tensor([15, 16]), 16, 1, 0.5), [0, -0.5])


def experience(score, group, mask, logp_old, logp_ref, **kw):
    B, T = mask.shape
    P = 2
    seqs = torch.arange(B * (P + T)).reshape(B, P + T)
    scored = {"logp_old": logp_old, "logp_ref": logp_ref, "score": score, "position_ids": seqs}
    args = {"kl_estimator": "k1", "clip_reward_value": 5.0, "gamma": 1.0, "lam": 0.95, "group": group}
    return build_experience(seqs, torch.ones_like(seqs), mask, P, scored, **(args | kw))


def test_rloo_with_the_kl_in_the_reward_by_hand():
    # one group of three: scores 1, 2, 4; k1 KL per token = logp_old - logp_ref, summed over each response
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]]).float()
    logp_ref = torch.zeros(3, 3)
    logp_old = torch.tensor([[0.5, 1.0, 9.0], [0.2, 0.2, 0.2], [-1.0, 9.0, 9.0]])  # padding never counts
    score = torch.tensor([1.0, 2.0, 4.0])
    group = torch.tensor([0, 0, 0])
    exp = experience(score, group, mask, logp_old, logp_ref, kl_coef=0.1, estimator="rloo")
    R = [1 - 0.1 * 1.5, 2 - 0.1 * 0.6, 4 - 0.1 * -1.0]  # 0.85, 1.94, 4.1
    A = [R[0] - (R[1] + R[2]) / 2, R[1] - (R[0] + R[2]) / 2, R[2] - (R[0] + R[1]) / 2]
    close(exp.advantages, torch.tensor(A)[:, None] * mask, atol=1e-5)
    close(exp.score, score)  # the experience keeps the reward source's score
    # kl_coef = 0: exactly today's numbers (the score untouched)
    exp0 = experience(score, group, mask, logp_old, logp_ref, kl_coef=0.0, estimator="rloo")
    assert torch.equal(exp0.advantages, rloo_advantages(score, group, mask))
    # grpo reads the same shaped score: (R - mean) / std
    g = experience(score, group, mask, logp_old, logp_ref, kl_coef=0.1, estimator="grpo")
    Rt = torch.tensor(R, dtype=torch.float64)
    close(g.advantages, ((Rt - Rt.mean()) / (Rt.std() + 1e-6)).float()[:, None] * mask, atol=1e-5)


def test_overlong_shaping_reaches_the_advantages():
    # max_new_tokens 4, buffer 2: lengths 2, 3, 4 get 0, -0.5, -1 (factor 1)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]).float()
    zeros = torch.zeros(3, 4)
    score = torch.tensor([1.0, 1.0, 1.0])
    exp = experience(score, torch.tensor([0, 0, 0]), mask, zeros, zeros, kl_coef=0.0, estimator="rloo",
                     max_len=4, overlong_buffer=2)
    close(exp.advantages, rloo_advantages(torch.tensor([1.0, 0.5, 0.0]), torch.tensor([0, 0, 0]), mask))
    # token rewards (gae / reinforce_pp) get it in the score on the last token
    ppo = experience(score, None, mask, zeros, zeros, kl_coef=0.0, estimator="reinforce_pp", max_len=4,
                     overlong_buffer=2, overlong_penalty=2.0)
    close(ppo.rewards.sum(1), [1.0, 0.0, -1.0])
    with pytest.raises(ValueError, match="max_len"):
        experience(score, None, mask, zeros, zeros, kl_coef=0.0, estimator="rloo", overlong_buffer=2)


def test_outcome_estimators_accept_the_kl_in_the_reward_in_the_config():
    from types import SimpleNamespace

    from rlhf import config as C
    from rlhf.config.validate import validate_ppo

    info = SimpleNamespace(world_size=1, device=torch.device("cpu"))
    for over in (["algorithm=rloo", "ppo.kl_coef=0.05", "ppo.kl_loss_coef=0"],
                 ["algorithm=grpo", "ppo.kl_coef=0.05", "ppo.adaptive_kl=true"],
                 ["algorithm=gspo", "ppo.overlong_buffer=4", "ppo.overlong_penalty=0.5"],
                 ["algorithm=reinforce_pp", "ppo.policy_loss=cispo"]):
        validate_ppo(C.to_config(C.compose("ppo", over), C.PPOConfig), info)
    for algo in ("grpo", "rloo"):
        assert C.to_config(C.compose("ppo", [f"algorithm={algo}"]), C.PPOConfig).ppo.kl_coef == 0
