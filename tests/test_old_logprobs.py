"""The RL step's scoring (#31): `ppo.old_logprobs=recompute|sampler|auto` (rlhf/rl/old_logprobs.py) takes
the old log-probs from the sampler while its gap to the trainer's stays under ppo.old_logprobs_max_gap,
and falls back (logged) when a gap is forced over it; `rollout.score_batch_size` scores in fuller
batches with the same values as the training micro-batch's (to rounding)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from conftest import SMALL_MODEL, metrics, run_stage
from engine import EngineConfig, OptimConfig, TrainEngine, init_distributed
from engine.generation import SamplingParams
from rlhf import config as C
from rlhf.config.validate import score_batch_size, validate_ppo
from rlhf.core.errors import ConfigError
from rlhf.modeling.roles import Policy, ValueModel
from rlhf.rl.experience import build_experience
from rlhf.rl.old_logprobs import FIRST_CHECKS, OldLogprobs
from rlhf.rl.rewards import RewardModelScore
from rlhf.rl.rollout import generate, score_rollout
from rlhf.rl.update import make_actor_loss

EOS, PAD = 2, 0


def ppo_cfg(*over: str) -> C.PPOConfig:
    return C.to_config(C.compose("ppo", list(over)), C.PPOConfig)


# ----------------------------------------------------------------------------- the schedule, by hand


def schedule(src: OldLogprobs, gaps: dict[int, float], steps: int, start: int = 0) -> list[bool]:
    """recompute(step) for each step, feeding `gaps[step]` (the measured gap) after each recomputed one."""
    out = []
    for step in range(start, steps):
        recompute = src.recompute(step)
        out.append(recompute)
        src.after_step(step, {"gen_logprob_gap": gaps.get(step, 1e-7)} if recompute else {})
    return out


def test_auto_reuses_under_the_threshold_and_recomputes_over_it(caplog):
    src = OldLogprobs(ppo_cfg("ppo.old_logprobs=auto", "ppo.old_logprobs_check_every=4").ppo, C.RolloutConfig())
    assert FIRST_CHECKS == 2
    with caplog.at_level(logging.INFO, logger="rlhf.ppo"):
        # steps 0, 1: the first checks; 4: a check over 1e-3 -> 5, 6, 7 recompute until the check at 7 passes
        got = schedule(src, {4: 0.5, 5: 0.2, 6: 0.01}, 12)
    R, S = True, False
    assert got == [R, R, S, S, R, R, R, R, R, S, S, S], got  # 8 (a check, 1e-7) brings the reuse back
    lines = [r.getMessage() for r in caplog.records if "ppo.old_logprobs=auto" in r.getMessage()]
    assert lines == [
        "step 2: ppo.old_logprobs=auto reuses the sampler's log-probs (gen_logprob_gap 1e-07 <= ppo.old_logprobs_max_gap=0.001)",
        "step 5: ppo.old_logprobs=auto recomputes the old log-probs (gen_logprob_gap 0.5 > ppo.old_logprobs_max_gap=0.001)",
        "step 8: ppo.old_logprobs=auto reuses the sampler's log-probs (gen_logprob_gap 1e-07 <= ppo.old_logprobs_max_gap=0.001)",
    ], lines


def test_sampler_falls_back_for_good_and_recompute_never_reuses(caplog):
    src = OldLogprobs(ppo_cfg("ppo.old_logprobs=sampler", "ppo.old_logprobs_check_every=3").ppo, C.RolloutConfig())
    with caplog.at_level(logging.WARNING, logger="rlhf.ppo"):
        got = schedule(src, {3: 2e-3}, 8)  # the check at step 3 goes over: recompute from there on
    assert got == [True, False, False, True, True, True, True, True], got
    assert src.fell_back and src.state_dict() == {"reusing": False, "fell_back": True, "last_gap": 2e-3}
    assert "step 4: ppo.old_logprobs=sampler falls back to recompute" in caplog.text
    assert schedule(OldLogprobs(ppo_cfg("ppo.old_logprobs=recompute").ppo, C.RolloutConfig()), {}, 5) == [True] * 5
    # a NaN gap is not "under"; auto with an importance correction recomputes every step
    nan = OldLogprobs(ppo_cfg("ppo.old_logprobs=sampler").ppo, C.RolloutConfig())
    assert schedule(nan, {0: float("nan")}, 3) == [True, True, True]
    tis = OldLogprobs(ppo_cfg("ppo.old_logprobs=auto", "ppo.is_correction=tis").ppo, C.RolloutConfig())
    assert schedule(tis, {}, 4) == [True] * 4
    # resumed from its state, the schedule goes on as the uninterrupted one
    a = OldLogprobs(ppo_cfg("ppo.old_logprobs_check_every=5").ppo, C.RolloutConfig())
    whole = schedule(a, {}, 9)
    b = OldLogprobs(ppo_cfg("ppo.old_logprobs_check_every=5").ppo, C.RolloutConfig())
    first = schedule(b, {}, 4)
    c = OldLogprobs(ppo_cfg("ppo.old_logprobs_check_every=5").ppo, C.RolloutConfig())
    c.load_state_dict(b.state_dict())
    assert first + schedule(c, {}, 9, start=4) == whole and whole.count(False) == 6, whole  # checks at 0, 1, 5


def test_config_is_validated_naming_the_key():
    info = SimpleNamespace(world_size=1, device=torch.device("cpu"))
    p, r = ppo_cfg().ppo, ppo_cfg().rollout
    assert (p.old_logprobs, p.old_logprobs_max_gap, p.old_logprobs_check_every, r.score_batch_size) == \
        ("auto", 1e-3, 10, None)
    assert score_batch_size(r, 1) == 64 and score_batch_size(r, 2) == 32  # 2 x 32, at most the rows per rank
    assert score_batch_size(ppo_cfg("rollout.score_batch_size=8").rollout, 1) == 8
    for over, match in ((["ppo.old_logprobs=cached"], r"ppo\.old_logprobs must be one of \('recompute', 'sampler', 'auto'\)"),
                        (["ppo.old_logprobs_max_gap=-1"], r"ppo\.old_logprobs_max_gap must be a finite number >= 0"),
                        (["ppo.old_logprobs_check_every=0"], r"ppo\.old_logprobs_check_every must be >= 1"),
                        (["ppo.old_logprobs=sampler", "ppo.is_correction=mis"],
                         r"ppo\.old_logprobs=sampler .* ppo\.is_correction=mis"),
                        (["rollout.score_batch_size=0"], r"rollout\.score_batch_size must be >= 1")):
        with pytest.raises(ConfigError, match=match):
            validate_ppo(ppo_cfg(*over), info)


# ----------------------------------------------------------------------------- the values


def tiny(seed: int, value: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD, num_labels=1)
    model = (LlamaForSequenceClassification if value else LlamaForCausalLM)(cfg).eval()
    if not value:
        with torch.no_grad():  # peaked next-token distributions, as a trained model has
            model.lm_head.weight.mul_(10.0)
    return model


@pytest.fixture(scope="module")
def step():
    """One rollout of 6 rows (ragged prompts, responses of several lengths) on a tiny actor, with a
    reference, a critic and a reward model."""
    engine = TrainEngine(tiny(0), EngineConfig(stage=0, generation="hf"), OptimConfig(lr=1e-3), total_steps=1,
                         info=init_distributed())
    ids = torch.tensor([[0, 0, 1, 5, 9], [1, 7, 3, 4, 8], [0, 1, 6, 6, 6], [0, 0, 0, 1, 3], [1, 3, 3, 9, 4],
                        [0, 0, 1, 2, 7]])
    torch.manual_seed(3)
    r = generate(engine, {"input_ids": ids, "attention_mask": (ids != 0).long()}, torch.arange(6),
                 SamplingParams(max_new_tokens=8, temperature=0.8), EOS, PAD)
    assert len(set(r.response_mask.sum(1).tolist())) > 1, "responses of one length: the batches are not ragged"
    models = {"actor": Policy(engine.unwrapped), "reference": Policy(tiny(1)), "critic": ValueModel(tiny(2, True))}
    return r, models, ValueModel(tiny(4, True))


@pytest.mark.parametrize("pack_length", [None, 13])
def test_score_batch_size_gives_the_training_micro_batch_values(step, pack_length):
    r, models, rm = step
    score = lambda n: score_rollout(r.sequences, r.attention_mask, r.prompt_len, **models, micro_batch_size=n,  # noqa: E731
                                    temperature=0.8, pack_length=pack_length)
    small, full = score(2), score(6)
    m = r.response_mask.bool()
    for key in ("logp_old", "logp_ref", "values"):
        assert full[key].shape == small[key].shape == r.response_mask.shape, key
        torch.testing.assert_close(full[key][m], small[key][m], rtol=0, atol=2e-6, msg=key)
    frozen = SimpleNamespace(model=rm)
    torch.testing.assert_close(RewardModelScore(frozen, 6, pack_length).score(r),
                               RewardModelScore(frozen, 2, pack_length).score(r), rtol=0, atol=2e-6)


def test_sampler_old_logprobs_skip_the_actor_and_give_the_recomputed_update(step):
    """Without the actor the scoring pass returns no logp_old and the same reference/critic values; the
    sampler's log-probs (temperature 0.8, no truncation) are the trainer's to rounding, so the update's
    experience and actor loss are too."""
    r, models, _ = step
    kw = dict(micro_batch_size=6, temperature=0.8)
    full = score_rollout(r.sequences, r.attention_mask, r.prompt_len, **models, **kw)
    skip = score_rollout(r.sequences, r.attention_mask, r.prompt_len, **{**models, "actor": None}, **kw)
    assert "logp_old" not in skip
    assert torch.equal(skip["logp_ref"], full["logp_ref"]) and torch.equal(skip["values"], full["values"])
    m = r.response_mask.bool()
    assert (full["logp_old"][m] - r.logp_gen[m]).abs().max() < 1e-5
    exps = {}
    for name, logp_old in (("recompute", full["logp_old"]), ("sampler", r.logp_gen)):
        scored = {**full, "logp_old": logp_old, "score": torch.tensor([1.0, 0.0, 2.0, 0.5, -1.0, 0.0])}
        exps[name] = build_experience(r.sequences, r.attention_mask, r.response_mask, r.prompt_len, scored,
                                      kl_coef=0.1, kl_estimator="k1", clip_reward_value=5.0, gamma=1.0, lam=0.95)
    for key in ("rewards", "advantages", "returns"):
        torch.testing.assert_close(getattr(exps["sampler"], key), getattr(exps["recompute"], key), rtol=0, atol=1e-5)
    loss = make_actor_loss(0.2, 0.8, 0.0)
    losses = {k: loss(models["actor"], {**e.rows(list(range(6))), "pack_length": None})[0].item()
              for k, e in exps.items()}
    assert abs(losses["sampler"] - losses["recompute"]) < 1e-5 * max(1.0, abs(losses["recompute"])), losses


# ----------------------------------------------------------------------------- a run


RUN = [*SMALL_MODEL, "algorithm=grpo", "reward.sources=[judge]", "rollout.prompts_per_step=4",
       "rollout.n_samples_per_prompt=4", "rollout.mini_batch_size=8", "rollout.micro_batch_size=4",
       "train.eval_every=0", "train.save_every=0", "data.num_eval_prompts=4"]


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    out = tmp_path_factory.mktemp("old_logprobs") / "sft"
    run_stage("sft", f"output_dir={out}", *SMALL_MODEL, "train.max_steps=2", "train.eval_every=0",
              "train.save_every=0", "data.num_eval_prompts=4")
    return out


def test_run_reuses_the_sampler_and_falls_back_when_the_gap_is_forced(sft, tmp_path):
    # auto, healthy (fp32 on CPU, no truncation): steps 1-2 measured, 3 reused, 4 a check (check_every=3)
    auto = tmp_path / "auto"
    run_stage("ppo", f"output_dir={auto}", f"actor.model={sft / 'model'}", *RUN, "train.max_steps=4",
              "engine.precision=fp32", "ppo.old_logprobs_check_every=3")
    rows = metrics(auto, "train")
    assert [x["old_logprobs_sampler"] for x in rows] == [0, 0, 1, 0], rows
    assert all(x["gen_logprob_gap"] < 1e-5 for x in rows if not x["old_logprobs_sampler"])
    assert "gen_logprob_gap" not in rows[2]  # nothing to measure on a reused step
    assert "step 2: ppo.old_logprobs=auto reuses the sampler's log-probs" in (auto / "ppo.log").read_text()
    # sampler, the gap forced: top-k truncates the sampler's distribution, -log(kept mass) per token
    forced = tmp_path / "forced"
    run_stage("ppo", f"output_dir={forced}", f"actor.model={sft / 'model'}", *RUN, "train.max_steps=2",
              "engine.precision=fp32", "ppo.old_logprobs=sampler", "rollout.top_k=2")
    rows = metrics(forced, "train")
    assert [x["old_logprobs_sampler"] for x in rows] == [0, 0], rows
    assert rows[0]["gen_logprob_gap"] > 1e-3 and rows[1]["gen_logprob_gap"] > 1e-3, rows
    log = (forced / "ppo.log").read_text()
    assert "step 1: ppo.old_logprobs=sampler falls back to recompute for the rest of the run" in log, log[-3000:]
