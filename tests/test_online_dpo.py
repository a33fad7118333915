"""Online DPO (algorithm=online_dpo): the best-vs-worst pairs of each prompt group, the pair loss against
rlhf/algos/preference.py's DPO loss, the config's refusals, and one tiny run through the command line."""
from __future__ import annotations

import math
import shutil
from types import SimpleNamespace

import pytest
import torch

from rlhf.algos.online_dpo import PAIR_LOSSES, best_worst_pairs, pair_loss
from rlhf.algos.preference import dpo_loss
from rlhf.config.validate import validate_ppo
from tests.conftest import metrics, run_stage, summary

ONE = SimpleNamespace(world_size=1, device=torch.device("cpu"))


def test_best_vs_worst_ties_and_rows_without_a_response():
    # group 7: rows 0-3, best row 2 (0.9), worst row 1 (-0.5); group 3: rows 4-6, all 0.2 -> tied;
    # group 5: rows 7-9, row 8 the best score but masked out (empty / non-finite) -> best row 9, worst 7;
    # group 1: rows 10-11, one valid row -> unpaired; group 2: rows 12-13, 0.7 vs -0.7
    score = torch.tensor([0.1, -0.5, 0.9, 0.3, 0.2, 0.2, 0.2, -1.0, 5.0, 0.0, 1.0, 2.0, 0.7, -0.7])
    group = torch.tensor([7, 7, 7, 7, 3, 3, 3, 5, 5, 5, 1, 1, 2, 2])
    valid = torch.ones(14, dtype=torch.bool)
    valid[8] = valid[11] = False
    p = best_worst_pairs(score, group, valid)
    assert p.chosen.tolist()[0] == 2 and p.rejected.tolist()[0] == 1
    assert p.valid.tolist() == [True, False, True, False, True]
    assert (p.chosen[2].item(), p.rejected[2].item()) == (9, 7)  # the masked row 8 (score 5) does not compete
    assert (p.chosen[4].item(), p.rejected[4].item()) == (12, 13)
    assert (p.tied, p.unpaired, p.n) == (1, 1, 3)
    # a slot that is no pair still names two rows of its own group (weighted 0 by the loss)
    for slot in (1, 3):
        assert group[p.chosen[slot]] == group[p.rejected[slot]] == [3, 1][slot // 2]
    # equal best scores: the first row is the chosen one
    tie_best = best_worst_pairs(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0, 0, 0]), torch.ones(3, dtype=torch.bool))
    assert (tie_best.chosen.item(), tie_best.rejected.item(), tie_best.n) == (0, 2, 1)
    with pytest.raises(ValueError, match="needs >= 2 responses per prompt"):
        best_worst_pairs(torch.tensor([1.0, 2.0]), torch.tensor([0, 1]), torch.ones(2, dtype=torch.bool))


@pytest.mark.parametrize("loss_type", PAIR_LOSSES)
def test_pair_loss_is_preference_dpo_loss_on_the_same_numbers(loss_type):
    torch.manual_seed(0)
    k, T = 3, 5
    logp = (-torch.rand(2 * k, T) * 3).requires_grad_(True)
    mask = torch.ones(2 * k, T)
    mask[1, 3:] = 0  # chosen 1: 3 tokens
    mask[4, 1:] = 0  # rejected 1: 1 token
    ref = -torch.rand(2 * k) * 10
    weight = torch.tensor([1.0, 1.0, 0.0])  # the third slot is no pair
    total, n, stats = pair_loss(logp, mask, ref, weight, loss_type=loss_type, beta=0.3, sft_coef=0.5)
    sums = (logp * mask).sum(1)
    lens = mask.sum(1)
    want, rc, rr = dpo_loss(sums[:k], sums[k:], ref[:k], ref[k:], lens[:k], lens[k:], loss_type=loss_type, beta=0.3,
                            sft_coef=0.5)
    assert n.item() == 2
    assert total.item() == pytest.approx(want[:2].sum().item(), rel=1e-6)
    assert stats["dpo_accuracy"].item() == pytest.approx((rc[:2] > rr[:2]).float().mean().item())
    assert stats["dpo_margin"].item() == pytest.approx((rc[:2] - rr[:2]).mean().item(), rel=1e-6)
    total.backward()
    g = logp.grad
    assert torch.all(g[[2, 5]] == 0)  # the slot of weight 0 sends no gradient
    assert torch.all(g[mask == 0] == 0)  # nor do padding tokens
    if loss_type != "ipo":  # (ipo's square pulls a margin past 1 / (2 beta) back down)
        # the loss pushes the chosen response's tokens up and the rejected's down (where it is active)
        assert torch.all(g[0][mask[0] > 0] <= 0) and torch.all(g[3][mask[3] > 0] >= 0)


def test_pair_loss_with_no_pair_is_zero_and_finite():
    logp = torch.zeros(2, 3, requires_grad=True)
    total, n, stats = pair_loss(logp, torch.zeros(2, 3), torch.zeros(2), torch.zeros(1), loss_type="simpo")
    assert total.item() == 0 and n.item() == 0 and all(v.item() == 0 for v in stats.values())
    total.backward()
    assert torch.isfinite(logp.grad).all()


def _cfg(*overrides):
    from rlhf import config as C

    return C.to_config(C.compose("ppo", list(overrides)), C.PPOConfig)


def test_algorithm_online_dpo_sets_its_keys():
    cfg = _cfg("algorithm=online_dpo")
    assert (cfg.ppo.objective, cfg.ppo.advantage_estimator, cfg.ppo.kl_coef) == ("online_dpo", "grpo", 0.0)
    assert (cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt) == (16, 8)
    assert (cfg.actor.lr, cfg.train.max_steps, cfg.critic.lr) == (1e-4, 20, 5e-4)  # only the actor's changes
    assert (cfg.online_dpo.loss_type, cfg.online_dpo.beta, cfg.online_dpo.sft_coef) == ("sigmoid", 0.1, 0.0)
    validate_ppo(cfg, ONE)
    assert _cfg().ppo.objective == "rl"


@pytest.mark.parametrize("overrides,key", [
    (["rollout.n_samples_per_prompt=1", "rollout.prompts_per_step=64"], "rollout.n_samples_per_prompt >= 2"),
    (["online_dpo.loss_type=kto"], "online_dpo.loss_type"),
    (["online_dpo.beta=0"], "online_dpo.beta"),
    (["online_dpo.sft_coef=-1"], "online_dpo.sft_coef"),
    (["ppo.kl_coef=0.1"], "ppo.kl_coef must be 0"),
    (["ppo.kl_loss_coef=0.1"], "ppo.kl_loss_coef must be 0"),
    (["ppo.ptx_coef=0.1"], "ppo.ptx_coef must be 0"),
    (["ppo.is_correction=tis"], "set ppo.is_correction=none"),
    (["ppo.advantage_estimator=gae"], "would load one"),
    (["ppo.objective=sft"], "ppo.objective must be one of"),
])
def test_bad_online_dpo_settings_name_the_key(overrides, key):
    from rlhf.config import ConfigError

    with pytest.raises(ConfigError) as e:
        validate_ppo(_cfg("algorithm=online_dpo", *overrides), ONE)
    assert key in str(e.value)


@pytest.mark.slow
def test_cli_online_dpo_run(tiny_stages, tmp_path):
    """Two steps of 4 prompts x 3 samples: every prompt group is a pair, a tie or unpaired; no critic is
    built or saved; the actor moved and is exported; the summary adds the pairs up; resumed from its
    step-1 checkpoint, step 2 repeats exactly."""
    out = tmp_path / "odpo"

    def odpo(*extra):
        run_stage("ppo", f"output_dir={out}", "algorithm=online_dpo", f"actor.model={tiny_stages / 'sft'}",
                  f"critic.model={tiny_stages / 'reward'}", "rollout.prompts_per_step=4",
                  "rollout.n_samples_per_prompt=3", "rollout.mini_batch_size=12", "rollout.micro_batch_size=4",
                  "rollout.max_new_tokens=8", "eval.max_new_tokens=8", "data.num_eval_prompts=4", "train.max_steps=2",
                  "train.eval_every=0", "train.save_every=1", "actor.lr=1e-3", *extra)

    odpo()
    train = metrics(out, "train")
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["pairs"] + r["tied_groups"] + r["unpaired_groups"] == 4, r
        assert r["critic_loss"] == "nan" and math.isfinite(r["actor_loss"])
        if r["pairs"]:
            assert r["pair_score_margin"] > 0 and 0 <= r["dpo_accuracy"] <= 1
            # before the step's update the policy is the reference's copy at step 1: implicit rewards 0,
            # the sigmoid loss log 2 on every pair
            if r["step"] == 1:
                assert r["dpo_margin"] == pytest.approx(0, abs=1e-5)
                assert r["actor_loss"] == pytest.approx(math.log(2), rel=1e-4)
    s = summary(out)
    assert s["objective"] == "online_dpo" and s["pairs"] == sum(r["pairs"] for r in train) > 0
    assert s["tied_groups"] == sum(r["tied_groups"] for r in train)
    assert not (out / "critic").exists() and (out / "model" / "config.json").is_file()
    log = (out / "ppo.log").read_text()
    assert "online_dpo: " in log and "2 steps of 4 prompts x 3 samples, 2 actor (no critic) updates" in log
    plan = log.split("models on this rank:")[1].split("\n")[0]
    assert "critic" not in plan and "reference" in plan and "reward_model" in plan
    # exact resume: drop the last checkpoint and the export, continue from step 1
    shutil.rmtree(out / "checkpoints" / "step_0000002")
    shutil.rmtree(out / "model")
    odpo("train.resume=true")
    keys = ("pairs", "tied_groups", "unpaired_groups", "actor_loss", "dpo_margin", "dpo_accuracy", "reward", "kl")
    assert [[r[k] for k in keys] for r in metrics(out, "train")] == [[r[k] for k in keys] for r in train]
