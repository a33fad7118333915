"""PPO math against hand-computed tensors, and vectorised GAE against a per-token loop."""
from __future__ import annotations

import math

import pytest
import torch

from rlhf.algos.rl import (
    AdaptiveKLController,
    FixedKLController,
    compute_rewards,
    entropy_from_logits,
    gae_advantages,
    kl_estimate,
    make_kl_controller,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    value_loss,
)

NAN = float("nan")


def close(actual, expected, rtol=1.3e-6, atol=1e-5):
    """assert_close's float32 tolerances; torch.allclose because assert_close's first call
    costs ~1 s of lazy imports."""
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, f"shape {list(actual.shape)} != {list(expected.shape)}"
    assert torch.allclose(actual, expected, rtol=rtol, atol=atol), f"\n{actual}\n!=\n{expected}"


# ----------------------------------------------------------------------------- masked reductions

def test_masked_mean_and_sum_with_empty_row_and_nan_padding():
    x = torch.tensor([[1.0, 2.0, NAN], [NAN, NAN, NAN]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    close(masked_mean(x, mask, dim=1), [1.5, 0.0])
    close(masked_sum(x, mask, dim=1), [3.0, 0.0])
    close(masked_mean(x, mask), 1.5)
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)
    close(masked_var(x, torch.zeros_like(mask)), 0.0)
    close(masked_var(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.ones(1, 4)), 5.0 / 3.0)


def test_masked_whiten_has_mean_0_std_1_over_masked_entries():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g) * 3.0 + 2.0
    lengths = torch.tensor([6, 3, 1, 0])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    x[~mask] = 1e6  # padding must not leak in
    w = masked_whiten(x, mask)
    assert torch.all(w[~mask] == 0)
    close(w[mask].mean(), 0.0, atol=1e-6, rtol=0)
    close(w[mask].std(), 1.0, atol=1e-6, rtol=0)
    unshifted = masked_whiten(x, mask, shift_mean=False)
    close(unshifted[mask].mean(), x[mask].mean(), atol=1e-5, rtol=0)
    close(unshifted[mask].std(), 1.0, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- rewards

def test_kl_estimators_hand_values():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.3]]))
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.3]]))
    log2 = math.log(2.0)
    close(kl_estimate(logp, ref, "k1"), [[log2, -log2, 0.0]])
    close(kl_estimate(logp, ref, "k2"), [[0.5 * log2 ** 2, 0.5 * log2 ** 2, 0.0]])
    # k3 = exp(ref - logp) - (ref - logp) - 1:
    #   ref - logp = -log 2 -> 0.5 + log 2 - 1 = 0.193147;  ref - logp = +log 2 -> 2 - log 2 - 1
    close(kl_estimate(logp, ref, "k3"), [[0.19314718, 0.30685282, 0.0]])
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(logp, ref, "k4")


def test_compute_rewards_hand_batch():
    # Response lengths 3, 1, 2 (T=3); padding holds garbage that must not leak in.
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    logp_old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, 9.0, 9.0], [-1.5, -0.2, 7.0]])
    logp_ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.8, 0.0, 0.0], [-1.0, -0.7, 0.0]])
    score = torch.tensor([7.0, -2.0, -6.0])  # clipped to 5, kept at -2, clipped to -5
    rewards, kl = compute_rewards(logp_old, logp_ref, score, mask, kl_coef=0.1,
                                  clip_reward_value=5.0)
    close(kl, [[0.5, -1.0, 0.0], [0.5, 0.0, 0.0], [-0.5, 0.5, 0.0]])
    # rewards = -0.1 * kl, plus the clipped score at index length - 1
    close(rewards, [[-0.05, 0.1, 5.0],
                    [-2.05, 0.0, 0.0],
                    [0.05, -5.05, 0.0]])
    # clipping disabled with inf: row 0 gets the full 7
    rewards_inf, _ = compute_rewards(logp_old, logp_ref, score, mask, 0.1, float("inf"))
    close(rewards_inf[0], [-0.05, 0.1, 7.0])
    close(rewards_inf[2], [0.05, -6.05, 0.0])


def test_compute_rewards_k3_and_empty_row():
    mask = torch.tensor([[1, 1], [0, 0]])
    logp_old = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.5]]))
    logp_ref = torch.log(torch.tensor([[0.25, 0.5], [0.1, 0.1]]))
    rewards, kl = compute_rewards(logp_old, logp_ref, torch.tensor([1.0, 3.0]), mask,
                                  kl_coef=0.5, clip_reward_value=2.0, kl_estimator="k3")
    close(kl, [[0.19314718, 0.30685282], [0.0, 0.0]])
    close(rewards, [[-0.09657359, 1.0 - 0.15342641], [0.0, 0.0]])  # empty row: no score


def test_compute_rewards_validation():
    m = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"\[2, 3\].*\[2, 4\]"):
        compute_rewards(m, torch.ones(2, 4), torch.zeros(2), m, 0.1, 5.0)
    with pytest.raises(ValueError, match="score"):
        compute_rewards(m, m, torch.zeros(3), m, 0.1, 5.0)
    for bad in (0.0, -1.0, None):
        with pytest.raises(ValueError, match="clip_reward_value"):
            compute_rewards(m, m, torch.zeros(2), m, 0.1, bad)


def test_compute_rewards_casts_bf16_up():
    mask = torch.ones(1, 2)
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16)
    rewards, kl = compute_rewards(lp, lp, torch.tensor([1.0], dtype=torch.bfloat16), mask, 0.1, 5.0)
    assert rewards.dtype == torch.float32 and kl.dtype == torch.float32
    close(rewards, [[0.0, 1.0]])


# ----------------------------------------------------------------------------- GAE

def test_gae_hand_gamma_1():
    # r = [0.1, -0.2, 1.0], V = [0.5, 0.4, 0.6], gamma = 1, lam = 0.95; the 4th column is padding.
    #   t=2: delta = 1.0 + 0   - 0.6 = 0.4   A2 = 0.4
    #   t=1: delta = -0.2 + 0.6 - 0.4 = 0.0  A1 = 0.0 + 0.95 * 0.4  = 0.38
    #   t=0: delta = 0.1 + 0.4 - 0.5 = 0.0   A0 = 0.0 + 0.95 * 0.38 = 0.361
    #   returns = A + V = [0.861, 0.78, 1.0]
    rewards = torch.tensor([[0.1, -0.2, 1.0, 9.0]])
    values = torch.tensor([[0.5, 0.4, 0.6, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.95)
    close(adv, [[0.361, 0.38, 0.4, 0.0]])
    close(ret, [[0.861, 0.78, 1.0, 0.0]])


def gae_advantages_loop(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                        gamma: float = 1.0, lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference GAE with plain Python loops per row and token (slow; the vectorised one is checked
    against it). Same contract as `gae_advantages`: [B, T] in, (advantages, returns) [B, T] out."""
    B, T = mask.shape
    advantages = torch.zeros(B, T, dtype=torch.float32)
    returns = torch.zeros(B, T, dtype=torch.float32)
    for b in range(B):
        n = int(mask[b].bool().sum())
        r = [float(x) for x in rewards[b, :n]]
        v = [float(x) for x in values[b, :n]]
        gae = 0.0
        for t in reversed(range(n)):
            next_v = v[t + 1] if t + 1 < n else 0.0
            gae = r[t] + gamma * next_v - v[t] + gamma * lam * gae
            advantages[b, t] = gae
            returns[b, t] = gae + v[t]
    return advantages.to(mask.device), returns.to(mask.device)


def test_gae_hand_gamma_09():
    # gamma = 0.9, lam = 0.95 (gamma * lam = 0.855), same r and V:
    #   t=2: delta = 1.0 - 0.6 = 0.4                      A2 = 0.4
    #   t=1: delta = -0.2 + 0.9*0.6 - 0.4 = -0.06         A1 = -0.06 + 0.855*0.4   = 0.282
    #   t=0: delta = 0.1 + 0.9*0.4 - 0.5 = -0.04          A0 = -0.04 + 0.855*0.282 = 0.20111
    #   returns = [0.70111, 0.682, 1.0]
    rewards = torch.tensor([[0.1, -0.2, 1.0]])
    values = torch.tensor([[0.5, 0.4, 0.6]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.95)
    close(adv, [[0.20111, 0.282, 0.4]])
    close(ret, [[0.70111, 0.682, 1.0]])
    adv_loop, ret_loop = gae_advantages_loop(rewards, values, mask, gamma=0.9, lam=0.95)
    close(adv_loop, [[0.20111, 0.282, 0.4]])
    close(ret_loop, [[0.70111, 0.682, 1.0]])


@pytest.mark.parametrize("seed", range(5))
def test_gae_vectorised_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 7, 11
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = 0, T  # always an empty row and a full row
    mask = torch.arange(T)[None, :] < lengths[:, None]
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    gamma = [1.0, 0.99, 0.9, 0.5, 1.0][seed]
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=0.95)
    adv_ref, ret_ref = gae_advantages_loop(rewards, values, mask, gamma=gamma, lam=0.95)
    assert torch.allclose(adv, adv_ref, atol=1e-6)
    assert torch.allclose(ret, ret_ref, atol=1e-6)
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)
    assert torch.allclose(ret[mask], (adv + values)[mask], atol=1e-6)


def test_gae_has_no_grad():
    values = torch.randn(2, 3, requires_grad=True)
    adv, ret = gae_advantages(torch.randn(2, 3), values, torch.ones(2, 3))
    assert not adv.requires_grad and not ret.requires_grad


# ----------------------------------------------------------------------------- losses

def test_policy_loss_clipping_inactive():
    # ratios 1.1 and 0.9 lie inside [0.8, 1.2]; the 3rd column is padding (ratio would be inf).
    logp_old = torch.tensor([[-1.0, -2.0, 0.0]])
    logp = (logp_old + torch.log(torch.tensor([[1.1, 0.9, 1.0]])))
    logp[0, 2] = 100.0
    logp.requires_grad_(True)
    adv = torch.tensor([[2.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = policy_loss(logp, logp_old, adv, mask, cliprange=0.2)
    # -A * ratio = [-2.2, 0.9] -> mean -0.65
    close(loss.detach(), -0.65)
    close(stats["clipfrac"], 0.0)
    close(stats["ratio_mean"], 1.0)
    close(stats["approx_kl"], 0.5 * (math.log(1.1) ** 2 + math.log(0.9) ** 2) / 2)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    close(logp.grad, [[-2.2 / 2, 0.9 / 2, 0.0]])  # d/dlogp of -A*ratio/n = -A*ratio/n


def test_policy_loss_clipping_active_positive_and_negative_advantages():
    #  ratio  A   -A*r   -A*clip(r)  max    clipped branch taken?
    #  1.5   +1   -1.5   -1.2        -1.2   yes
    #  0.5   +1   -0.5   -0.8        -0.5   no
    #  1.5   -1   +1.5   +1.2        +1.5   no
    #  0.5   -1   +0.5   +0.8        +0.8   yes
    # loss = (-1.2 - 0.5 + 1.5 + 0.8) / 4 = 0.15, clipfrac = 2/4
    logp_old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]])).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, stats = policy_loss(logp, logp_old, adv, torch.ones(1, 4), cliprange=0.2)
    close(loss.detach(), 0.15)
    close(stats["clipfrac"], 0.5)
    close(stats["ratio_mean"], 1.0)
    assert not stats["clipfrac"].requires_grad and stats["clipfrac"].dim() == 0
    loss.backward()
    # clipped tokens get no gradient; the others -A * ratio / 4
    close(logp.grad, [[0.0, -0.125, 0.375, 0.0]])


def test_value_loss_clipping_inactive():
    # |v - v_old| = 0.1 < 0.2: v_clipped = v. (v-R)^2 = [0.16, 0.81] -> loss 0.5 * 0.485
    values = torch.tensor([[1.1, 1.9, 7.0]])
    values_old = torch.tensor([[1.0, 2.0, 0.0]])
    returns = torch.tensor([[1.5, 1.0, -7.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = value_loss(values, values_old, returns, mask, cliprange_value=0.2)
    close(loss, 0.2425)
    close(stats["vf_clipfrac"], 0.0)
    close(stats["value_error"], 0.485)


def test_value_loss_clipping_active():
    #  v     v_old  R    v_clip  (v-R)^2  (v_clip-R)^2  max
    #  1.0   0.0    2.0   0.2    1.0      3.24          3.24  (clipped)
    # -1.0   0.0    0.0  -0.2    1.0      0.04          1.0
    #  0.5   0.0    0.0   0.2    0.25     0.04          0.25
    # loss = 0.5 * 4.49 / 3, vf_clipfrac = 1/3, value_error = 2.25 / 3
    values = torch.tensor([[1.0, -1.0, 0.5]], requires_grad=True)
    loss, stats = value_loss(values, torch.zeros(1, 3), torch.tensor([[2.0, 0.0, 0.0]]),
                             torch.ones(1, 3), cliprange_value=0.2)
    close(loss.detach(), 0.5 * 4.49 / 3)
    close(stats["vf_clipfrac"], 1.0 / 3.0)
    close(stats["value_error"], 0.75)
    loss.backward()
    # clipped token: no gradient; others (v - R) / 3
    close(values.grad, [[0.0, -1.0 / 3.0, 0.5 / 3.0]])


def test_loss_shape_mismatch_names_shapes():
    with pytest.raises(ValueError, match=r"advantages \[1, 3\]"):
        policy_loss(torch.zeros(1, 4), torch.zeros(1, 4), torch.zeros(1, 3), torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"returns \[2, 4\]"):
        value_loss(torch.zeros(1, 4), torch.zeros(1, 4), torch.zeros(2, 4), torch.ones(1, 4))


def test_entropy_from_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0],
                           [1000.0, 1000.0, -1000.0, -1000.0],
                           [3.0, 3.0, float("-inf"), float("-inf")]], requires_grad=True)
    h = entropy_from_logits(logits)
    close(h.detach(), [math.log(4.0), math.log(2.0), math.log(2.0)])
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()
    p = torch.tensor([0.7, 0.2, 0.1])
    close(entropy_from_logits(p.log().to(torch.bfloat16)), -(p * p.log()).sum(), atol=1e-2, rtol=0)
    assert entropy_from_logits(torch.zeros(2, 3, 5, dtype=torch.bfloat16)).dtype == torch.float32


# ----------------------------------------------------------------------------- KL controllers

def test_adaptive_kl_controller_two_updates_and_round_trip():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    # kl 9 -> error clip(9/6 - 1 = 0.5) = 0.2 -> mult 1 + 0.2 * 256 / 10000 = 1.00512
    ctl.update(torch.tensor(9.0), n_steps=256)
    assert ctl.value == pytest.approx(0.100512, rel=1e-12)
    # kl 5.4 -> error 5.4/6 - 1 = -0.1 -> mult 1 - 0.1 * 512 / 10000 = 0.99488
    ctl.update(5.4, n_steps=512)
    assert ctl.value == pytest.approx(0.100512 * 0.99488, rel=1e-12)

    other = AdaptiveKLController(init_kl_coef=1.0, target=1.0, horizon=1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.state_dict() == ctl.state_dict()
    ctl.update(7.0, 100)
    other.update(7.0, 100)
    assert other.value == ctl.value
    for bad in (float("nan"), float("inf"), torch.tensor(float("nan"))):  # never a crash, never a NaN coef
        ctl.update(bad, 100)
        assert ctl.value == other.value


def test_adaptive_kl_floor_holds_the_coefficient_while_the_kl_is_under_the_target():
    """ppo.kl_coef_min: with the floor at the start value, a KL under the target leaves the coefficient
    where it is (Ziegler's rule alone would lower it), and a KL over it raises it by the same rule."""
    plain = AdaptiveKLController(init_kl_coef=0.8, target=0.4, horizon=100)
    floor = AdaptiveKLController(init_kl_coef=0.8, target=0.4, horizon=100, min_value=0.8)
    for kl in (0.0, 0.1, 0.3):  # under the target: plain x (1 - 0.2 x 64 / 100) = 0.872, then ...
        plain.update(kl, 64)
        floor.update(kl, 64)
    # errors clip(-1) = -0.2, clip(-0.75) = -0.2, -0.25 -> -0.2: three x 0.872
    assert plain.value == pytest.approx(0.8 * 0.872**3, rel=1e-12)
    assert floor.value == 0.8
    floor.update(0.5, 64)  # over: error 0.25 -> 0.2, x 1.128
    assert floor.value == pytest.approx(0.8 * 1.128, rel=1e-12)
    floor.update(0.44, 32)  # error 0.1 -> x 1.032
    assert floor.value == pytest.approx(0.8 * 1.128 * 1.032, rel=1e-12)
    for _ in range(10):  # back under: down by the rule, never under the floor
        floor.update(0.2, 64)
        assert floor.value >= 0.8
    assert floor.value == 0.8
    part = AdaptiveKLController(init_kl_coef=0.8, target=0.4, horizon=100, min_value=0.5)
    for _ in range(5):
        part.update(0.0, 64)
    assert part.value == 0.5  # 0.8 x 0.872^4 = 0.46 < 0.5
    assert "min_value=0.5" in repr(part)
    for bad in (-0.1, 0.9):
        with pytest.raises(ValueError, match="min_value"):
            AdaptiveKLController(init_kl_coef=0.8, target=0.4, horizon=100, min_value=bad)
    with pytest.raises(ValueError, match="adaptive"):
        make_kl_controller(0.8, False, min_value=0.8)
    assert make_kl_controller(0.8, True, 0.4, 100, 0.8).min_value == 0.8


@pytest.mark.parametrize("overrides, message", [
    ({"kl_coef_min": 0.5}, "needs ppo.adaptive_kl=true"),
    ({"adaptive_kl": True, "kl_target": 0.4, "kl_coef_min": 0.9}, "between 0 and ppo.kl_coef=0.8"),
    ({"adaptive_kl": True, "kl_target": 0.4, "kl_coef_min": -0.1}, "ppo.kl_coef_min"),
])
def test_kl_coef_min_is_checked_against_the_config(overrides, message):
    import dataclasses
    from types import SimpleNamespace

    from rlhf.config import ConfigError, PPOConfig
    from rlhf.config.validate import validate_ppo

    cfg = PPOConfig(data=dataclasses.replace(PPOConfig().data, path="prompts.jsonl"))
    for key in ("actor", "critic"):  # ${model.lora} is resolved by to_config; built in Python, set it
        setattr(cfg, key, dataclasses.replace(getattr(cfg, key), lora=cfg.model.lora))
    cfg.ppo = dataclasses.replace(cfg.ppo, kl_coef=0.8, **overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        validate_ppo(cfg, SimpleNamespace(world_size=1, device=torch.device("cpu")))
    for ok in (dict(adaptive_kl=True, kl_target=0.4, kl_coef_min=0.8), dict(adaptive_kl=True, kl_target=0.4,
               kl_coef_min=None), dict(adaptive_kl=False, kl_coef_min=None)):  # null = kl_coef, with either
        cfg.ppo = dataclasses.replace(cfg.ppo, **ok)
        validate_ppo(cfg, SimpleNamespace(world_size=1, device=torch.device("cpu")))


def test_fixed_kl_controller_and_factory():
    ctl = make_kl_controller(0.1, adaptive=False)
    assert isinstance(ctl, FixedKLController)
    ctl.update(100.0, 1000)
    assert ctl.value == 0.1
    fresh = FixedKLController(0.5)
    fresh.load_state_dict(ctl.state_dict())
    assert fresh.value == 0.1
    adaptive = make_kl_controller(0.1, True, target=6.0, horizon=10000)
    assert isinstance(adaptive, AdaptiveKLController)
    with pytest.raises(ValueError, match="target"):
        make_kl_controller(0.1, True)


# ----------------------------------------------------------------------------- the estimator registry


def test_gae_is_registered_and_is_gae_advantages():
    from rlhf.algos.rl import AdvantageInputs, advantage_estimator

    g = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    mask = (torch.arange(7)[None] < torch.tensor([[7], [3], [0], [5]])).float()
    est = advantage_estimator("gae")
    assert est.needs_critic
    got = est.fn(AdvantageInputs(rewards=rewards, score=torch.zeros(4), values=values, mask=mask,
                                 group=torch.arange(4)), gamma=0.9, lam=0.8)
    want = gae_advantages(rewards, values, mask, 0.9, 0.8)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_registry_rejects_unknown_and_duplicate_names(monkeypatch):
    from rlhf.algos import rl as ppo_math

    monkeypatch.setattr(ppo_math, "ADVANTAGE_ESTIMATORS", dict(ppo_math.ADVANTAGE_ESTIMATORS))
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'; registered: gae"):
        ppo_math.advantage_estimator("nope")
    with pytest.raises(ValueError, match="already registered"):
        ppo_math.register_advantage("gae", needs_critic=True)(lambda x, **_: None)


def test_a_critic_free_estimator_sees_scores_and_groups_and_returns_no_targets(monkeypatch):
    """The experience hands every estimator the same inputs; one without a critic gets values=None,
    and the experience then carries no values/returns (the micro-batches leave them out)."""
    from rlhf.algos import rl as ppo_math
    from rlhf.rl.experience import build_experience

    monkeypatch.setattr(ppo_math, "ADVANTAGE_ESTIMATORS", dict(ppo_math.ADVANTAGE_ESTIMATORS))
    seen = {}

    @ppo_math.register_advantage("group_mean_baseline", needs_critic=False)
    def group_mean_baseline(x, *, gamma, lam):  # score minus its prompt group's mean, on every token
        seen.update(values=x.values, group=x.group.tolist())
        means = torch.stack([x.score[x.group == gid].mean() for gid in x.group])
        return (x.score - means)[:, None] * x.mask, None

    B, P, T = 4, 2, 3
    seqs = torch.arange(B * (P + T)).reshape(B, P + T)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    scored = {"logp_old": torch.zeros(B, T), "logp_ref": torch.zeros(B, T), "score": torch.tensor([1., 3., 2., 6.]),
              "position_ids": seqs}
    exp = build_experience(seqs, torch.ones_like(seqs), mask, P, scored, kl_coef=0.1, kl_estimator="k1",
                           clip_reward_value=5.0, gamma=1.0, lam=0.95, estimator="group_mean_baseline",
                           group=torch.tensor([7, 7, 9, 9]))
    assert seen == {"values": None, "group": [7, 7, 9, 9]}
    assert exp.advantages[:, 0].tolist() == [-1.0, 1.0, -2.0, 2.0]
    assert exp.values is None and exp.returns is None
    mb = exp.rows([1, 3])
    assert "values" not in mb and "returns" not in mb and mb["group"].tolist() == [7, 9]
