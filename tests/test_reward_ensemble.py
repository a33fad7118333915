"""Reward-model ensembles (rlhf/rl/rewards.py), their disagreement alarm (rlhf/rl/alarms.py), and
train.export_best / train.early_stop_patience (rlhf/ppo.py BestEval): the formulas on hand-made scores,
the config checks, and one PPO run with a two-model ensemble that exports its best evaluation's actor
and resumes to the same choice."""
from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from conftest import comparable, killed_at, metrics, run_stage, summary
from rlhf.config import AlarmsConfig, ConfigError, PPOTrainConfig, RewardSourcesConfig
from rlhf.config.validate import validate_alarms, validate_best, validate_reward_sources
from rlhf.ppo import BestEval
from rlhf.rl.alarms import Monitor, disagreement_growth, train_alarms
from rlhf.rl.rewards import RewardEnsemble, WeightedSum, disagreement, ensemble_reward

# 3 members x 4 rows
SCORES = torch.tensor([[1.0, 0.0, 2.0, -1.0],
                       [3.0, 0.0, 2.0, 1.0],
                       [2.0, 3.0, 2.0, 0.0]])


def test_ensemble_reward_is_the_formula_on_hand_made_scores():
    # by hand: row 0 scores 1, 3, 2 -> mean 2, population std sqrt(2/3); row 1: 0, 0, 3 -> mean 1, std sqrt(2)
    std = torch.tensor([math.sqrt(2 / 3), math.sqrt(2.0), 0.0, math.sqrt(2 / 3)])
    mean, got_std = ensemble_reward(SCORES, "mean")
    torch.testing.assert_close(mean, torch.tensor([2.0, 1.0, 2.0, 0.0]))
    torch.testing.assert_close(got_std, std)
    low, _ = ensemble_reward(SCORES, "min")
    assert low.tolist() == [1.0, 0.0, 2.0, -1.0]
    for lam in (0.0, 0.5, 2.0):
        r, _ = ensemble_reward(SCORES, "mean_minus_std", lam)
        torch.testing.assert_close(r, torch.tensor([2.0, 1.0, 2.0, 0.0]) - lam * std)
    # one member: its scores, no disagreement
    one, s1 = ensemble_reward(SCORES[:1], "mean_minus_std", 3.0)
    assert one.tolist() == SCORES[0].tolist() and s1.tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="unknown ensemble aggregate 'median'"):
        ensemble_reward(SCORES, "median")


class Fixed:
    def __init__(self, row):
        self.row = row

    def score(self, rollout):
        return self.row.clone()


def test_the_ensemble_source_and_its_disagreement_alone_or_in_a_weighted_sum():
    ens = RewardEnsemble([Fixed(r) for r in SCORES], "min")
    rollout = SimpleNamespace()
    assert ens.score(rollout).tolist() == [1.0, 0.0, 2.0, -1.0]
    torch.testing.assert_close(disagreement(ens), SCORES.std(0, unbiased=False))
    total = WeightedSum([(1.0, ens), (0.5, Fixed(torch.ones(4)))], ["model", "judge"])
    assert total.score(rollout).tolist() == [1.5, 0.5, 2.5, -0.5]
    torch.testing.assert_close(disagreement(total), SCORES.std(0, unbiased=False))
    assert disagreement(Fixed(torch.ones(4))) is None  # one reward model: no disagreement figure


def test_the_disagreement_alarm():
    # baseline window mean 0.1; the last window's mean 0.25: 2.5x
    stds = [0.1, 0.1, 0.1, 0.2, 0.3, 0.25]
    a = disagreement_growth(stds, 3, 2.0)
    assert a.fired and a.figures["ratio"] == pytest.approx(2.5) and "2.50x" in a.text, a
    assert not disagreement_growth(stds, 3, 3.0).fired
    assert disagreement_growth(stds[:5], 3, 2.0) is None  # two windows needed
    assert disagreement_growth([math.nan] * 6, 3, 2.0) is None  # no ensemble: no figure, no alarm
    # through the monitor: a run's records with the figure
    hist = [{"reward_disagreement": x, "kl": 0.0, "entropy": 1.0, "response_len": 5.0, "clipfrac": 0.0}
            for x in stds]
    names = [a.name for a in train_alarms(hist, AlarmsConfig(window=3))]
    assert "disagreement" in names
    mon = Monitor(AlarmsConfig(window=3, disagreement_ratio=2.0))
    out = [mon.after_step(i, h) for i, h in enumerate(hist, 1)]
    assert out[-1]["alarm_disagreement"] == 1 and mon.first_fired == {"disagreement": 6}


def test_best_eval_picks_the_earliest_best_and_counts_patience():
    b = BestEval(PPOTrainConfig(export_best=True, early_stop_patience=2), "gold_score")
    seq = [(0, 50.0), (10, 70.0), (20, 70.0), (30, 65.0), (31, 60.0)]
    new = [b.after_eval(s, {"gold_score": g, "kl": s / 100, "samples": [1]}) for s, g in seq]
    assert new == [True, True, False, False, False]
    assert (b.step, b.score, b.since) == (10, 70.0, 3) and b.exhausted()
    assert b.eval == {"gold_score": 70.0, "kl": 0.1}  # kept without its samples
    assert b.exported(31, {"gold_score": 60.0}) == {"step": 10, "eval": {"gold_score": 70.0, "kl": 0.1}}
    again = BestEval(PPOTrainConfig(export_best=True, early_stop_patience=2), "gold_score")
    again.load_state_dict(json.loads(json.dumps(b.state_dict())))  # as a checkpoint keeps it
    assert again.state_dict() == b.state_dict()
    # without export_best the last step's actor is exported; without patience the run never stops early
    last = BestEval(PPOTrainConfig(), "reward")
    for s, g in seq:
        last.after_eval(s, {"reward": g})
    assert last.exported(31, {"reward": 60.0})["step"] == 31 and not last.exhausted()
    assert not b.after_eval(40, {"gold_score": math.nan})  # a NaN evaluation is never the best


def test_a_kl_budget_keeps_the_last_evaluation_within_it_and_marks_the_first_over():
    seq = [(0, 50.0, 0.0), (10, 80.0, 0.2), (20, 75.0, 0.45), (30, 90.0, 0.6), (31, 95.0, 0.4)]
    b = BestEval(PPOTrainConfig(kl_budget=0.5), "gold_score")
    new = [b.after_eval(s, {"gold_score": g, "kl": k, "samples": [1]}) for s, g, k in seq]
    # the latest within the budget is kept whatever its gold; once over, a later evaluation back under it
    # does not count (the run stops at the first one over)
    assert new == [True, True, True, False, False] and b.keeps_actor
    assert b.over == {"step": 30, "kl": 0.6} and b.step == 20
    assert b.exported(31, {"gold_score": 95.0, "kl": 0.4}) == {"step": 20, "eval": {"gold_score": 75.0, "kl": 0.45}}
    assert b.exported_by() == "the last evaluation within train.kl_budget=0.5 (held-out KL to the reference)"
    again = BestEval(PPOTrainConfig(kl_budget=0.5), "gold_score")
    again.load_state_dict(json.loads(json.dumps(b.state_dict())))  # as a checkpoint keeps it
    assert again.state_dict() == b.state_dict() and again.over == {"step": 30, "kl": 0.6}
    # with export_best: the best gold among the evaluations within the budget (step 10's 80 beats step 20's 75)
    best = BestEval(PPOTrainConfig(kl_budget=0.5, export_best=True), "gold_score")
    for s, g, k in seq:
        best.after_eval(s, {"gold_score": g, "kl": k})
    assert best.exported(31, {})["step"] == 10 and best.exported_by().startswith("best held-out gold_score within")
    # a budget never reached: the last step's actor, nothing over
    wide = BestEval(PPOTrainConfig(kl_budget=5.0), "gold_score")
    for s, g, k in seq:
        wide.after_eval(s, {"gold_score": g, "kl": k})
    assert wide.over is None and wide.exported(31, {"kl": 0.4})["step"] == 31
    nan = BestEval(PPOTrainConfig(kl_budget=0.5), "gold_score")
    assert nan.after_eval(0, {"gold_score": 1.0, "kl": 0.0}) and not nan.after_eval(10, {"gold_score": 2.0, "kl": math.nan})
    assert nan.over["step"] == 10  # a NaN KL is over the budget
    with pytest.raises(ConfigError, match="train.kl_budget is checked on the held-out KL"):
        BestEval(PPOTrainConfig(kl_budget=0.5), "reward").after_eval(0, {"reward": 1.0})


@pytest.mark.parametrize("kwargs,objective,match", [
    ({"kl_budget": 0.0}, "rl", "train.kl_budget is the held-out KL"),
    ({"kl_budget": -1.0}, "rl", "train.kl_budget is the held-out KL"),
    ({"kl_budget": math.inf}, "rl", "train.kl_budget is the held-out KL"),
    ({"kl_budget": "half"}, "rl", "train.kl_budget is the held-out KL"),
    ({"kl_budget": 0.5, "eval_every": 0}, "rl", "set train.eval_every > 0, got 0"),
    ({"kl_budget": 0.5}, "distill", "algorithm=distill has none"),
])
def test_bad_kl_budgets_are_config_errors(kwargs, objective, match):
    with pytest.raises(ConfigError, match=match):
        validate_best(PPOTrainConfig(**kwargs), objective)
    validate_best(PPOTrainConfig(kl_budget=0.5, eval_every=10), "online_dpo")  # fine


def test_a_run_over_its_kl_budget_stops_and_exports_the_last_actor_within_it(tiny_stages, tmp_path):
    from safetensors.torch import load_file

    args = [f"actor.model={tiny_stages / 'sft'}", f"critic.model={tiny_stages / 'reward'}", "train.max_steps=4",
            "train.eval_every=1", "train.save_every=1", "rollout.prompts_per_step=8", "rollout.mini_batch_size=8",
            "rollout.micro_batch_size=8", "rollout.max_new_tokens=6", "eval.max_new_tokens=6", "data.num_eval_prompts=8",
            "actor.lr=3e-2", "ppo.kl_coef=0"]
    run_stage("ppo", f"output_dir={tmp_path / 'free'}", *args, timeout=600)
    kls = [r["kl"] for r in metrics(tmp_path / "free", "eval")]
    # the steps whose held-out KL is above every earlier one: a budget between the two is first exceeded
    # there; the first such step and the last (when another) are run, so a stop before the last step and an
    # evaluation over the budget at the last step are both seen whatever this machine's rounding gives
    rises = [i for i in range(1, len(kls)) if kls[i] > max(kls[:i])]
    assert rises, kls  # a step at lr 3e-2 with no KL penalty moves the actor off the reference
    for s in sorted({rises[0], rises[-1]}):
        budget = (max(kls[:s]) + kls[s]) / 2
        out = tmp_path / f"budget_{s}"
        run_stage("ppo", f"output_dir={out}", *args, f"train.kl_budget={budget}", timeout=600)
        got, ev = summary(out), metrics(out, "eval")
        assert [r["step"] for r in ev] == list(range(s + 1)) and got["steps"] == s, (kls, s)
        assert comparable(ev) == comparable(metrics(tmp_path / "free", "eval")[: s + 1])  # the same run up to there
        if s < 4:  # an evaluation before the last step: the run stops there
            assert got["stopped_early"].startswith(f"train.kl_budget: held-out KL {kls[s]:.4g} at step {s} is over")
        else:  # the last one: nothing left to stop, the export all the same
            assert got["stopped_early"] is None
        assert got["kl_budget_exceeded"] == {"step": s, "kl": kls[s]} and got["kl_budget"] == budget
        assert got["exported_step"] == s - 1 and got["kl"] == kls[s - 1] and got["last_step_eval"]["kl"] == kls[s]
        assert got["exported_by"].startswith("the last evaluation within train.kl_budget=")
        model = load_file(out / "model" / "model.safetensors")
        want = (load_file(tiny_stages / "sft" / "model" / "model.safetensors") if s == 1 else  # step 0: the SFT model
                torch.load(out / "checkpoints" / f"step_{s:07d}" / "best_actor.pt", weights_only=True))
        assert all(torch.equal(model[k], want[k].to(model[k].dtype)) for k in model)


@pytest.mark.parametrize("field,value,match", [
    ("ensemble_agg", "median", "reward.ensemble_agg must be one of"),
    ("ensemble_lambda", -1.0, "reward.ensemble_lambda must be a finite number >= 0"),
    ("ensemble_lambda", math.inf, "reward.ensemble_lambda must be a finite number >= 0"),
])
def test_bad_ensemble_settings_are_config_errors(field, value, match):
    with pytest.raises(ConfigError, match=match):
        validate_reward_sources(RewardSourcesConfig(**{field: value}))


def test_ensemble_models_need_the_model_source_and_the_best_keys_are_checked():
    with pytest.raises(ConfigError, match=r"reward.ensemble_models=\['rm2'\] .* 'model' is not in reward.sources"):
        validate_reward_sources(RewardSourcesConfig(sources=["judge"], ensemble_models=["rm2"]))
    validate_reward_sources(RewardSourcesConfig(ensemble_models=["rm2"], ensemble_agg="min"))  # fine
    with pytest.raises(ConfigError, match="train.early_stop_patience must be an integer >= 0"):
        validate_best(PPOTrainConfig(early_stop_patience=-1))
    with pytest.raises(ConfigError, match="set train.eval_every > 0, got 0"):
        validate_best(PPOTrainConfig(export_best=True, eval_every=0))
    with pytest.raises(ConfigError, match="alarms.disagreement_ratio must be a finite number > 1"):
        validate_alarms(AlarmsConfig(disagreement_ratio=1.0))


@pytest.fixture(scope="module")
def ensemble(tiny_stages, tmp_path_factory):
    """A second reward model (another seed and a random head init) and held-out prompts no judge scores,
    so the best evaluation is chosen on the sampled held-out reward (a continuous figure)."""
    root = tmp_path_factory.mktemp("ensemble")
    run_stage("reward", f"output_dir={root / 'rm2'}", f"model.name_or_path={tiny_stages / 'sft'}",
              "model.fallback_to_config=false", "train.max_steps=1", "train.eval_every=0", "train.save_every=0",
              "data.num_eval_prompts=4", "seed=7", "reward.head_init_std=0.5")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Human: Tell me about {w}.\n\nAssistant:"}) + "\n"
                               for w in ("cats", "rivers", "clocks", "bread")))
    return root


def ens_args(tiny_stages, ensemble):
    return [f"actor.model={tiny_stages / 'sft'}", f"critic.model={tiny_stages / 'reward'}",
            f"reward.ensemble_models=[{ensemble / 'rm2'}]", "reward.ensemble_agg=mean_minus_std",
            "reward.ensemble_lambda=0.5", "train.max_steps=3", "train.eval_every=1", "train.save_every=1",
            "train.export_best=true", "train.early_stop_patience=2", "rollout.prompts_per_step=8", "rollout.mini_batch_size=8",
            "rollout.micro_batch_size=8", "rollout.max_new_tokens=6", "eval.max_new_tokens=6",
            f"data.eval_prompts_path={ensemble / 'prompts.jsonl'}", "data.num_eval_prompts=4", "actor.lr=1e-2"]


def test_an_ensemble_run_exports_its_best_evaluation_and_resumes_to_the_same_choice(tiny_stages, ensemble,
                                                                                     tmp_path):
    from safetensors.torch import load_file

    a = tmp_path / "a"
    run_stage("ppo", f"output_dir={a}", *ens_args(tiny_stages, ensemble), timeout=600)
    s, train, ev = summary(a), metrics(a, "train"), metrics(a, "eval")
    # patience 2: the run stops after the first evaluation (before the last step) that is the second in a row
    # not beating the best; the steps it ran follow from its own evaluations
    best_so_far, since, stop = -math.inf, 0, 3
    for r in ev:
        since = 0 if r["reward"] > best_so_far else since + 1
        best_so_far = max(best_so_far, r["reward"])
        if since >= 2 and r["step"] < 3:
            stop = r["step"]
            break
    assert [r["step"] for r in train] == list(range(1, stop + 1)) and [r["step"] for r in ev] == list(range(stop + 1))
    assert s["steps"] == stop
    assert s["stopped_early"] is None if stop == 3 else s["stopped_early"].startswith("train.early_stop_patience: 2 ")
    # two reward models that differ: their std per response, every step and on the held-out prompts
    assert all(r["reward_disagreement"] > 0 and math.isfinite(r["reward_disagreement"]) for r in train), train
    assert all(r["reward_disagreement"] > 0 for r in ev)
    # no judge: the best is the highest held-out reward, the earliest of equals; the summary is its evaluation
    rewards = [r["reward"] for r in ev]
    best = rewards.index(max(rewards))
    assert s["exported_step"] == best and s["exported_by"] == "best held-out reward", (s, rewards)
    assert s["reward_after"] == rewards[best] and s["last_step_eval"]["reward"] == rewards[-1]
    model = load_file(a / "model" / "model.safetensors")
    if best == 0:  # the SFT model itself was the best
        want = load_file(tiny_stages / "sft" / "model" / "model.safetensors")
    elif best < stop:  # the snapshot the last checkpoint kept
        want = torch.load(a / "checkpoints" / f"step_{stop:07d}" / "best_actor.pt", weights_only=True)
    else:
        want = None
    if want is not None:
        assert all(torch.equal(model[k], want[k].to(model[k].dtype)) for k in model)

    # killed while writing step 2's checkpoint, resumed from step 1's: the same steps, evaluations and choice
    b = tmp_path / "b"
    killed_at("ppo", b, "between_models:2", *ens_args(tiny_stages, ensemble))
    run_stage("ppo", f"output_dir={b}", *ens_args(tiny_stages, ensemble), "train.resume=true", timeout=600)
    assert comparable(metrics(b, "train")) == comparable(train)
    assert comparable(metrics(b, "eval")) == comparable(ev)
    assert summary(b)["exported_step"] == s["exported_step"]
    got = load_file(b / "model" / "model.safetensors")
    assert all(torch.equal(got[k], model[k]) for k in model)
    assert os.path.isfile(b / "checkpoints" / f"step_{stop:07d}" / "best_actor.pt")
    assert summary(b)["steps"] == stop
