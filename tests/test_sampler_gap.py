"""Sampler vs trainer log-probs (#30): every generation path returns the log-probs of the tokens it drew,
the step reports their gap to the scoring pass's (gen_logprob_gap, gen_kl) and the gen alarm fires on a
forced gap; the scoring pass works at the sampling temperature; ppo.is_correction=tis|mis weights
against their formulas on hand-made cases, wired into every registered policy loss."""
from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from engine import EngineConfig, OptimConfig, TrainEngine, init_distributed
from engine.generation import SamplingParams, hf_generate
from rlhf import config as C
from rlhf.algos import rl as rl_math
from rlhf.config import AlarmsConfig
from rlhf.config.validate import validate_ppo
from rlhf.core.errors import ConfigError
from rlhf.modeling.forward import position_ids_from_mask, token_logprobs
from rlhf.modeling.roles import Policy
from rlhf.rl.alarms import Monitor, sampler_trainer_gap
from rlhf.rl.experience import build_experience
from rlhf.rl.metrics import sampler_gap
from rlhf.rl.rollout import generate, score_rollout

EOS, PAD = 2, 0


def close(actual, expected, atol=1e-6):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, f"shape {list(actual.shape)} != {list(expected.shape)}"
    assert torch.allclose(actual, expected, rtol=1e-5, atol=atol), f"\n{actual}\n!=\n{expected}"


def tiny_lm(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
    return LlamaForCausalLM(cfg).eval()


def prompts():
    ids = torch.tensor([[0, 0, 1, 5, 9], [1, 7, 3, 4, 8], [0, 1, 6, 6, 6], [0, 0, 0, 1, 3]])
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def full_logprobs(model, seqs, attn, P, temperature):
    """[B, T, V] log_softmax(logits / T) at the positions that predict each response token, by hand."""
    with torch.no_grad():
        logits = model(input_ids=seqs, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
    return (logits[:, P - 1 : -1].float() / temperature).log_softmax(-1)


# ----------------------------------------------------------------------------- the scoring pass at temperature T


def test_scoring_pass_uses_the_sampling_temperature():
    model = tiny_lm()
    p = prompts()
    torch.manual_seed(1)
    out = hf_generate(model, p["input_ids"], p["attention_mask"], SamplingParams(max_new_tokens=6, temperature=0.6),
                      eos_token_id=EOS, pad_token_id=PAD)
    P, T = out.prompt_len, 0.6
    scored = score_rollout(out.sequences, out.attention_mask, P, actor=Policy(model), reference=Policy(model),
                           critic=None, micro_batch_size=3, temperature=T)
    want = full_logprobs(model, out.sequences, out.attention_mask, P, T).gather(-1, out.responses[..., None])[..., 0]
    m = out.response_mask.bool()
    torch.testing.assert_close(scored["logp_old"][m], want[m], rtol=1e-5, atol=1e-6)
    # and not at temperature 1: the two differ by far more than rounding on this model
    at_one = full_logprobs(model, out.sequences, out.attention_mask, P, 1.0).gather(-1, out.responses[..., None])[..., 0]
    assert (scored["logp_old"][m] - at_one[m]).abs().max() > 1e-2
    batch = {"sequences": out.sequences, "attention_mask": out.attention_mask,
             "position_ids": position_ids_from_mask(out.attention_mask), "prompt_len": P}
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(Policy(model), batch, T)[m], want[m], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the sampler's log-probs


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.7)])
def test_hf_sampler_logprobs_are_the_filtered_renormalised_distribution(top_k, top_p):
    """With top-k/top-p the token was drawn from softmax(logits / T) over the kept set, renormalised:
    the sampler's log-prob is the trainer's minus log(kept mass), by hand from the full distribution."""
    from kernels.sampling import keep_mask_reference

    model = tiny_lm()
    p = prompts()
    torch.manual_seed(2)
    T = 0.8
    out = hf_generate(model, p["input_ids"], p["attention_mask"],
                      SamplingParams(max_new_tokens=5, temperature=T, top_k=top_k, top_p=top_p),
                      eos_token_id=EOS, pad_token_id=PAD, return_logprobs=True)
    lp = full_logprobs(model, out.sequences, out.attention_mask, out.prompt_len, T)    # [B, Tr, V]
    B, Tr, V = lp.shape
    keep = keep_mask_reference(lp.reshape(-1, V), top_k, top_p).reshape(B, Tr, V)
    kept_mass = torch.where(keep, lp.exp(), 0.0).sum(-1)                                 # [B, Tr]
    want = lp.gather(-1, out.responses[..., None])[..., 0] - kept_mass.log()
    m = out.response_mask.bool()
    assert keep.gather(-1, out.responses[..., None])[..., 0][m].all()  # every drawn token was kept
    torch.testing.assert_close(out.logprobs[m], want[m], rtol=1e-5, atol=1e-5)
    assert (kept_mass[m] < 1 - 1e-3).any()  # the filter really truncated something here
    assert (out.logprobs[~m] == 0).all()


# ----------------------------------------------------------------------------- the gap, end to end on both paths


def rollout_step(path: str, *, sample_temperature: float, score_temperature: float, top_k: int = 0,
                 row_seeds: torch.Tensor | None = None):
    """One RL step's generate -> score -> experience on a tiny engine (engine.generation=`path`); the
    sampler draws at `sample_temperature`, the scoring pass uses `score_temperature`."""
    model = tiny_lm()
    with torch.no_grad():  # peaked next-token distributions, as a trained model has (a random one is near uniform)
        model.lm_head.weight.mul_(10.0)
    engine = TrainEngine(model, EngineConfig(stage=0, generation=path), OptimConfig(lr=1e-3), total_steps=1,
                         info=init_distributed())
    torch.manual_seed(3)
    p = prompts()
    r = generate(engine, p, torch.arange(4), SamplingParams(max_new_tokens=8, temperature=sample_temperature,
                                                            top_k=top_k), EOS, PAD, row_seeds=row_seeds)
    assert engine.generation_path == path
    scored = score_rollout(r.sequences, r.attention_mask, r.prompt_len, actor=Policy(engine.unwrapped),
                           reference=Policy(engine.unwrapped), critic=None, micro_batch_size=4,
                           temperature=score_temperature)
    scored["score"] = torch.zeros(4)
    scored["logp_gen"] = r.logp_gen  # what Models.score adds
    exp = build_experience(r.sequences, r.attention_mask, r.response_mask, r.prompt_len, scored, kl_coef=0.0,
                           kl_estimator="k1", clip_reward_value=5.0, gamma=1.0, lam=0.95, estimator="grpo")
    assert r.logp_gen is not None and exp.logp_gen is not None and r.response_mask.sum() > 0
    return r, exp


def ppo_cfg(*over: str):
    return C.to_config(C.compose("ppo", list(over)), C.PPOConfig).ppo


@pytest.mark.parametrize("path", ["hf", "injected"])
def test_no_fault_gap_is_rounding_and_a_forced_temperature_gap_fires_the_alarm(path, caplog):
    _, exp = rollout_step(path, sample_temperature=0.7, score_temperature=0.7)
    ok = sampler_gap(exp, ppo_cfg())
    assert ok["gen_logprob_gap_max"] < 1e-4 and ok["gen_kl"] < 1e-8, ok  # fp32 on CPU: rounding only
    # the fault: the sampler applies temperature 1.0, the scoring pass 0.7
    _, bad_exp = rollout_step(path, sample_temperature=1.0, score_temperature=0.7)
    bad = sampler_gap(bad_exp, ppo_cfg())
    assert bad["gen_logprob_gap"] > 1e-2 and bad["gen_logprob_gap_max"] > 1000 * max(ok["gen_logprob_gap_max"], 1e-7)
    assert bad["gen_kl"] >= AlarmsConfig().gen_kl, bad
    # by hand: the per-token figures from the experience's two log-probs
    m = bad_exp.response_mask.bool()
    d = (bad_exp.logp_old - bad_exp.logp_gen)[m]
    assert math.isclose(bad["gen_logprob_gap"], d.abs().mean().item(), rel_tol=1e-5)
    assert math.isclose(bad["gen_kl"], (d.exp() - d - 1).mean().item(), rel_tol=1e-4)
    # the alarm: quiet on the healthy step, fires (one WARN line) on the faulty one
    monitor = Monitor(AlarmsConfig())
    assert monitor.after_step(1, ok)["alarm_gen"] == 0
    with caplog.at_level(logging.WARNING, logger="rlhf.alarms"):
        rec = monitor.after_step(2, bad)
    assert rec["alarm_gen"] == 1 and monitor.fired == ["gen"] and monitor.first_fired == {"gen": 2}
    assert math.isclose(rec["alarm_gen_kl"], bad["gen_kl"]) and "ALARM gen at step 2" in caplog.text


@pytest.mark.parametrize("path", ["hf", "injected"])
def test_per_row_streams_return_the_sampler_logprobs(path):
    """With per-row sampling streams (engine.deterministic's row seeds) transformers' processed scores
    hold only the drawn token: the sampler's own log-probs are returned instead, at rounding from the
    scoring pass's; the other path agrees on the tokens and the log-probs."""
    seeds = torch.tensor([11, 12, 13, 14])
    r, exp = rollout_step(path, sample_temperature=0.7, score_temperature=0.7, row_seeds=seeds)
    gap = sampler_gap(exp, ppo_cfg())
    assert gap["gen_logprob_gap_max"] < 1e-4 and gap["gen_kl"] < 1e-8, gap
    other, _ = rollout_step("injected" if path == "hf" else "hf", sample_temperature=0.7, score_temperature=0.7,
                            row_seeds=seeds)
    assert torch.equal(r.sequences, other.sequences)
    torch.testing.assert_close(r.logp_gen, other.logp_gen, atol=1e-5, rtol=0)


def test_top_k_gap_is_the_truncation():
    """With top-k on, the sampler's distribution is not the trainer's: the gap is -log(kept mass), >= 0."""
    _, exp = rollout_step("hf", sample_temperature=1.0, score_temperature=1.0, top_k=3)
    m = exp.response_mask.bool()
    d = (exp.logp_old - exp.logp_gen)[m]
    assert (d <= 1e-5).all() and d.min() < -1e-2  # the trainer's log-prob is never above the sampler's


@pytest.mark.parametrize("path", ["hf", "injected"])
@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.8), (5, 0.9)])
def test_trainer_logprobs_under_the_sampler_truncation_close_the_gap(path, top_k, top_p):
    """ppo.trainer_logprobs=sampler: the scoring pass takes its log-probs under the sampler's top-k / top-p
    truncation, renormalised, so its ratio compares the distribution the tokens were drawn from: the gap that
    truncation made (`test_top_k_gap_is_the_truncation`) falls to fp32 rounding; the update's loss uses the same."""
    from rlhf.config.validate import trainer_truncation
    from rlhf.rl.update import make_actor_loss

    model = tiny_lm()
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    engine = TrainEngine(model, EngineConfig(stage=0, generation=path), OptimConfig(lr=1e-3), total_steps=1,
                         info=init_distributed())
    torch.manual_seed(5)
    r = generate(engine, prompts(), torch.arange(4), SamplingParams(max_new_tokens=8, temperature=0.9, top_k=top_k,
                                                                    top_p=top_p), EOS, PAD)
    kw = dict(actor=Policy(engine.unwrapped), reference=Policy(engine.unwrapped), critic=None, micro_batch_size=4,
              temperature=0.9)
    full = score_rollout(r.sequences, r.attention_mask, r.prompt_len, **kw)
    trunc = score_rollout(r.sequences, r.attention_mask, r.prompt_len, **kw, truncate=(top_k, top_p))
    m = r.response_mask.bool()
    assert (full["logp_old"] - r.logp_gen)[m].min() < -1e-3  # truncation made a gap
    assert (trunc["logp_old"] - r.logp_gen)[m].abs().max() < 1e-4  # taken under it, none is left
    # the loss's new log-probs are the same function: at the old policy the ratio is 1 on every token
    mb = {"sequences": r.sequences, "attention_mask": r.attention_mask, "position_ids": trunc["position_ids"],
          "prompt_len": r.prompt_len, "response_mask": r.response_mask, "advantages": torch.ones_like(r.logp_gen),
          "logp_old": trunc["logp_old"], "logp_ref": trunc["logp_ref"]}
    loss = make_actor_loss(0.2, 0.9, 0.0, truncate=(top_k, top_p))
    _, _, stats = loss(Policy(engine.unwrapped), mb)
    assert stats["approx_kl"] < 1e-9 and abs(stats["ratio_mean"] - 1) < 1e-5 and stats["clipfrac"] == 0
    full_loss = make_actor_loss(0.2, 0.9, 0.0)  # the untruncated new log-probs against the truncated old: ratio < 1
    assert full_loss(Policy(engine.unwrapped), mb)[2]["ratio_mean"] < 1 - 1e-4
    # the key: off by default, on only for a truncating sampler
    assert trainer_truncation(C.to_config(C.compose("ppo", []), C.PPOConfig)) is None
    cfg = C.to_config(C.compose("ppo", ["ppo.trainer_logprobs=sampler", "rollout.top_k=4"]), C.PPOConfig)
    assert trainer_truncation(cfg) == (4, 1.0)


def test_gen_alarm_hand_values_and_missing_figures():
    a = sampler_trainer_gap([0.001, 0.02], [0.01, 0.1], [0.05, 0.9], threshold=0.01)
    assert a.fired and a.figures == {"kl": 0.02, "gap": 0.1, "gap_max": 0.9}
    assert not sampler_trainer_gap([0.5, 0.009], [0.1, 0.01], [0.1, 0.01], threshold=0.01).fired  # last step only
    assert sampler_trainer_gap([None], [None], [None], 0.01) is None  # no sampler log-probs: not computed


def test_monitor_resumes_from_a_checkpoint_written_before_the_gen_alarm():
    m = Monitor(AlarmsConfig())
    state = m.state_dict()
    state["quiet"].pop("gen")
    m.load_state_dict(state)
    assert m.after_step(1, {"gen_kl": 1.0, "gen_logprob_gap": 1.0, "gen_logprob_gap_max": 2.0})["alarm_gen"] == 1


# ----------------------------------------------------------------------------- tis / mis: the formulas


def hand_case():
    # 2 rows x 3 tokens; row 1 has 2 real tokens. log rho = logp_old - logp_gen
    logp_gen = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -9.0]])
    log_rho = torch.tensor([[math.log(3.0), math.log(0.25), 0.0], [math.log(1.5), math.log(0.8), 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logp_gen + log_rho, logp_gen, mask


def test_tis_token_and_sequence_by_hand():
    old, gen, mask = hand_case()
    close(rl_math.tis_weights(old, gen, mask, cap=2.0), [[2.0, 0.25, 1.0], [1.5, 0.8, 0.0]])
    # sequence: the geometric mean of each row's ratios, capped, on every token of the row
    g0, g1 = (3.0 * 0.25 * 1.0) ** (1 / 3), (1.5 * 0.8) ** 0.5
    close(rl_math.tis_weights(old, gen, mask, cap=2.0, level="sequence"), [[g0, g0, g0], [g1, g1, 0.0]])
    close(rl_math.tis_weights(old, gen, mask, cap=1.0, level="sequence"), [[g0, g0, g0], [1.0, 1.0, 0.0]])


def test_mis_token_and_sequence_by_hand():
    old, gen, mask = hand_case()
    # token: rho kept inside [0.5, 2], 0 outside (3.0 and 0.25 rejected)
    close(rl_math.mis_weights(old, gen, mask, low=0.5, high=2.0), [[0.0, 0.0, 1.0], [1.5, 0.8, 0.0]])
    g0, g1 = (3.0 * 0.25) ** (1 / 3), (1.5 * 0.8) ** 0.5  # 0.909, 1.095
    close(rl_math.mis_weights(old, gen, mask, low=0.5, high=2.0, level="sequence"), [[g0, g0, g0], [g1, g1, 0.0]])
    # bounds that reject row 1's geometric mean (1.095 > 1.05) and keep row 0's
    close(rl_math.mis_weights(old, gen, mask, low=0.9, high=1.05, level="sequence"), [[g0, g0, g0], [0.0, 0.0, 0.0]])
    close(rl_math.is_weights("none", old, gen, mask), mask.float())


def test_weights_are_detached_and_bad_options_are_refused():
    old, gen, mask = hand_case()
    old, gen = old.clone().requires_grad_(), gen.clone().requires_grad_()
    for name in ("tis", "mis"):
        for level in rl_math.IS_LEVELS:
            w = rl_math.is_weights(name, old, gen, mask, level=level)
            assert not w.requires_grad and w.dtype == torch.float32
    with pytest.raises(ValueError, match="cap must be > 0"):
        rl_math.tis_weights(old, gen, mask, cap=0.0)
    for lo, hi in ((1.0, 2.0), (0.5, 1.0), (-0.1, 2.0)):
        with pytest.raises(ValueError, match="0 <= low < 1 < high"):
            rl_math.mis_weights(old, gen, mask, low=lo, high=hi)
    with pytest.raises(ValueError, match="unknown importance-sampling correction 'is'"):
        rl_math.is_weights("is", old, gen, mask)
    with pytest.raises(ValueError, match="unknown importance-sampling level"):
        rl_math.tis_weights(old, gen, mask, level="row")


def test_huge_ratios_and_padding_garbage_stay_finite():
    old = torch.tensor([[0.0, 0.0, float("nan")]])
    gen = torch.tensor([[-200.0, 0.0, float("-inf")]])  # rho = e^200 on token 0; padding garbage on token 2
    mask = torch.tensor([[1, 1, 0]])
    close(rl_math.tis_weights(old, gen, mask, cap=2.0), [[2.0, 1.0, 0.0]])
    close(rl_math.mis_weights(old, gen, mask), [[0.0, 1.0, 0.0]])


# ----------------------------------------------------------------------------- tis / mis in the policy losses


def random_batch(seed, B=3, T=5):
    g = torch.Generator().manual_seed(seed)
    logp_old = -torch.rand(B, T, generator=g) * 3
    logp = (logp_old + 0.3 * torch.randn(B, T, generator=g)).requires_grad_()
    logp_gen = logp_old + 0.25 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    return logp, logp_old, logp_gen, adv, mask


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_clip_and_cispo_losses_are_the_per_token_terms_times_the_weight(correction):
    """The correction enters as w * (the per-token policy loss), w detached: value and gradient by hand."""
    logp, logp_old, logp_gen, adv, mask = random_batch(0)
    w = rl_math.is_weights(correction, logp_old, logp_gen, mask, cap=1.5, low=0.7, high=1.4)
    kept = w[mask.bool()]
    assert (kept != 1).all() and (kept > 0).sum() >= 5 and (correction == "tis" or (kept == 0).any()), w
    aw = rl_math.is_weighted_advantages(adv, w)
    m = mask.bool()
    ratio = torch.exp(logp - logp_old)
    per_token = {
        "clip": torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)),
        "cispo": -ratio.detach().clamp(0.8, 1.2) * adv * logp,
    }
    for name, term in per_token.items():
        loss, _ = rl_math.policy_loss_fn(name).fn(logp, logp_old, aw, mask, cliprange_low=0.2, cliprange_high=0.2)
        want = (w * term)[m].sum() / m.sum()
        close(loss.detach(), want.detach())
        (g,) = torch.autograd.grad(loss, logp)
        (g_want,) = torch.autograd.grad(want, logp)
        close(g, g_want)


def test_gspo_sequence_level_weight_scales_each_response():
    logp, logp_old, logp_gen, _, mask = random_batch(1)
    adv = torch.tensor([1.0, -0.5, 2.0])[:, None].expand(3, 5) * mask  # an outcome advantage per row
    w = rl_math.is_weights("tis", logp_old, logp_gen, mask, cap=1.2, level="sequence")
    loss, _ = rl_math.gspo_policy_loss(logp, logp_old, rl_math.is_weighted_advantages(adv, w), mask,
                                       cliprange_low=0.2, cliprange_high=0.2)
    m = mask.bool()
    s = torch.exp(rl_math.masked_mean(torch.where(m, logp - logp_old, 0.0), m, dim=1))
    a = adv[:, 0]
    per_row = torch.maximum(-a * s, -a * s.clamp(0.8, 1.2))
    close(loss.detach(), (w[:, 0] * per_row).mean().detach())


@pytest.mark.parametrize("name", ["clip", "gspo", "cispo"])
def test_make_actor_loss_applies_the_correction_for_every_policy_loss(name, monkeypatch):
    from rlhf.rl import update

    logp, logp_old, logp_gen, adv, mask = random_batch(2, B=4)

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.logp = torch.nn.Parameter(logp.detach().clone())

    monkeypatch.setattr(update, "token_logprobs", lambda model, mb, t, with_entropy: (model.logp, torch.zeros(4, 5)))
    mb = {"response_mask": mask, "logp_old": logp_old, "advantages": adv, "sequences": torch.zeros(4, 8),
          "logp_gen": logp_gen}
    total, n, _ = update.make_actor_loss(0.2, 1.0, 0.0, policy_loss=name, is_correction="mis", is_low=0.8,
                                         is_high=1.25)(Toy(), mb)
    w = rl_math.mis_weights(logp_old, logp_gen, mask, low=0.8, high=1.25)
    assert (w[mask.bool()] == 0).any()  # some tokens rejected
    loss, _ = rl_math.policy_loss_fn(name).fn(logp.detach(), logp_old, adv * w, mask, cliprange_low=0.2,
                                              cliprange_high=None)
    close(total.detach(), loss * n)
    plain, _, _ = update.make_actor_loss(0.2, 1.0, 0.0, policy_loss=name)(Toy(), mb)
    assert not torch.allclose(plain.detach(), total.detach())  # the correction changed the loss
    del mb["logp_gen"]
    with pytest.raises(ValueError, match="needs the sampler's log-probs"):
        update.make_actor_loss(0.2, 1.0, 0.0, policy_loss=name, is_correction="tis")(Toy(), mb)


def test_is_metrics_count_the_rejected_and_capped_tokens():
    old, gen, mask = hand_case()
    exp = SimpleNamespace(logp_old=old, logp_gen=gen, response_mask=mask.float())
    mis = sampler_gap(exp, ppo_cfg("ppo.is_correction=mis", "ppo.is_low=0.5", "ppo.is_high=2.0"))
    # tokens: rho 3, 0.25, 1 | 1.5, 0.8 -> weights 0, 0, 1 | 1.5, 0.8
    assert mis["is_masked_tokens"] == 2 and mis["is_masked_seqs"] == 0
    assert math.isclose(mis["is_weight_mean"], (1 + 1.5 + 0.8) / 5, rel_tol=1e-6)
    assert math.isclose(mis["is_weight_max"], 1.5, rel_tol=1e-6)
    seq = sampler_gap(exp, ppo_cfg("ppo.is_correction=mis", "ppo.is_level=sequence", "ppo.is_low=0.95",
                                   "ppo.is_high=1.05"))
    assert seq["is_masked_seqs"] == 2 and seq["is_masked_tokens"] == 5 and seq["is_weight_max"] == 0
    tis = sampler_gap(exp, ppo_cfg("ppo.is_correction=tis", "ppo.is_cap=1.2"))
    assert tis["is_capped_tokens"] == 2  # rho 3 and 1.5
    assert math.isclose(tis["is_weight_mean"], (1.2 + 0.25 + 1 + 1.2 + 0.8) / 5, rel_tol=1e-6)
    d = torch.tensor([math.log(3), math.log(0.25), 0.0, math.log(1.5), math.log(0.8)])
    assert math.isclose(tis["gen_logprob_gap"], d.abs().mean().item(), rel_tol=1e-6)
    assert math.isclose(tis["gen_logprob_gap_max"], math.log(4), rel_tol=1e-6)
    assert math.isclose(tis["gen_kl"], (d.exp() - d - 1).mean().item(), rel_tol=1e-5)
    assert "is_weight_mean" not in sampler_gap(exp, ppo_cfg())


# ----------------------------------------------------------------------------- the config


def test_config_options_are_validated_naming_the_key():
    info = SimpleNamespace(world_size=1, device=torch.device("cpu"))
    p = ppo_cfg()
    assert (p.is_correction, p.is_cap, p.is_low, p.is_high, p.is_level) == ("none", 2.0, 0.5, 2.0, "token")
    assert AlarmsConfig().gen_kl == 0.01
    validate_ppo(C.to_config(C.compose("ppo", ["ppo.is_correction=mis", "ppo.is_level=sequence"]), C.PPOConfig), info)
    for over, match in ((["ppo.is_correction=is"], r"ppo\.is_correction must be one of \('none', 'tis', 'mis'\)"),
                        (["ppo.is_level=row"], r"ppo\.is_level must be one of"),
                        (["ppo.is_cap=0"], r"ppo\.is_cap must be a finite number > 0"),
                        (["ppo.is_low=1.0"], r"ppo\.is_low and ppo\.is_high must satisfy"),
                        (["ppo.is_high=0.9"], r"ppo\.is_low and ppo\.is_high must satisfy"),
                        (["alarms.gen_kl=0"], r"alarms\.gen_kl must be a finite number > 0")):
        with pytest.raises(ConfigError, match=match):
            validate_ppo(C.to_config(C.compose("ppo", over), C.PPOConfig), info)
