"""On-policy distillation (algorithm=distill): the per-token reverse KL as the reward of the `reinforce`
estimator against hand values, its policy gradient against autograd's reverse-KL gradient, the
refusals (no teacher, a teacher with another tokenizer, reward sources), and a tiny run through the
command line where the student's KL to a different teacher checkpoint falls."""
from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch

from rlhf.algos import rl as rl_math
from rlhf.config.validate import validate_ppo
from tests.conftest import SMALL_MODEL, metrics, run_stage, summary

ONE = SimpleNamespace(world_size=1, device=torch.device("cpu"))


def test_per_token_reverse_kl_reward_and_reinforce_advantages_by_hand():
    # student and teacher log-probs of the sampled tokens; row 1 has 2 tokens, row 2 none (empty)
    logp_s = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -3.0, 9.0], [7.0, 7.0, 7.0]])
    logp_t = torch.tensor([[-1.5, -1.0, -0.5], [-0.4, -1.0, 9.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.float)
    rewards, kl = rl_math.compute_rewards(logp_s, logp_t, torch.zeros(3), mask, 2.0, 5.0, "k1")
    # k1 = log p_s - log p_t on each response token, the reward -kl_coef x k1 (score 0)
    assert torch.allclose(kl, torch.tensor([[1.0, 0.0, -1.5], [0.3, -2.0, 0.0], [0.0, 0.0, 0.0]]))
    assert torch.allclose(rewards, torch.tensor([[-2.0, 0.0, 3.0], [-0.6, 4.0, 0.0], [0.0, 0.0, 0.0]]))
    est = rl_math.advantage_estimator("reinforce")
    assert not est.needs_critic and est.token_rewards
    x = rl_math.AdvantageInputs(rewards=rewards, score=torch.zeros(3), values=None, mask=mask, group=torch.arange(3))
    adv, ret = est.fn(x, gamma=0.0, lam=1.0)
    assert ret is None and torch.equal(adv, rewards)  # gamma 0: each token its own
    adv1, _ = est.fn(x, gamma=1.0, lam=1.0)  # gamma 1: the reverse KL of the rest of the response
    assert torch.allclose(adv1, torch.tensor([[1.0, 3.0, 3.0], [3.4, 4.0, 0.0], [0.0, 0.0, 0.0]]))


def test_the_policy_gradient_is_the_reverse_kl_gradient():
    """Over every token y of a 5-way categorical, weighted by the student's p(y): the clipped surrogate
    with advantage -k1(y), at ratio 1, has the gradient of KL(p_student || p_teacher) (autograd's) --
    the student moves towards the teacher: tokens it over-weights go down."""
    torch.manual_seed(0)
    theta = torch.randn(5, requires_grad=True)
    logq = torch.log_softmax(torch.randn(5), 0)
    logp = torch.log_softmax(theta, 0)
    kl = (logp.exp() * (logp - logq)).sum()
    (want,) = torch.autograd.grad(kl, theta, retain_graph=True)
    surrogate = 0
    for y in range(5):
        lp = logp[y].reshape(1, 1)
        reward, _ = rl_math.compute_rewards(lp.detach(), logq[y].reshape(1, 1), torch.zeros(1), torch.ones(1, 1),
                                            1.0, 5.0, "k1")
        loss, _ = rl_math.clip_policy_loss(lp, lp.detach(), reward, torch.ones(1, 1), cliprange_low=0.2,
                                           cliprange_high=0.2, loss_agg="token_mean", horizon=None)
        surrogate = surrogate + logp[y].exp().detach() * loss
    (got,) = torch.autograd.grad(surrogate, theta)
    assert torch.allclose(got, want, atol=1e-6), (got, want)
    # one small step along it lowers the reverse KL
    with torch.no_grad():
        after = torch.log_softmax(theta - 0.1 * got, 0)
        assert (after.exp() * (after - logq)).sum() < kl


def _cfg(*overrides):
    from rlhf import config as C

    return C.to_config(C.compose("ppo", list(overrides)), C.PPOConfig)


def test_algorithm_distill_sets_its_keys():
    cfg = _cfg("algorithm=distill", "teacher.model=/runs/teacher")
    p = cfg.ppo
    assert (p.objective, p.advantage_estimator, p.gamma, p.kl_coef, p.kl_estimator) == (
        "distill", "reinforce", 0.0, 1.0, "k1")
    assert cfg.rollout.n_samples_per_prompt == 1 and p.kl_loss_coef == 0
    # the measured settings (docs/results-log.md, "Distillation, measured"); the critic's lr untouched
    assert (cfg.actor.lr, cfg.train.max_steps, cfg.critic.lr, cfg.actor.scheduler) == (2e-4, 24, 5e-4, "constant")
    validate_ppo(cfg, ONE)


@pytest.mark.parametrize("overrides,key", [
    ([], "needs teacher.model"),
    (["teacher.model=/t", "ppo.kl_coef=0"], "ppo.kl_coef is the weight of the per-token reverse KL"),
    (["teacher.model=/t", "ppo.adaptive_kl=true"], "ppo.adaptive_kl"),
    (["teacher.model=/t", "reward.sources=[judge]"], "reward.sources/weights/function are not read"),
    (["teacher.model=/t", "reference.model=/r"], "reference.model is not read by ppo.objective=distill"),
])
def test_bad_distill_settings_name_the_key(overrides, key):
    from rlhf.config import ConfigError

    with pytest.raises(ConfigError) as e:
        validate_ppo(_cfg("algorithm=distill", *overrides), ONE)
    assert key in str(e.value)


def test_a_teacher_outside_distillation_is_refused():
    from rlhf.config import ConfigError

    with pytest.raises(ConfigError, match="teacher.model is read only by algorithm=distill"):
        validate_ppo(_cfg("algorithm=grpo", "teacher.model=/t"), ONE)


def test_a_teacher_with_another_tokenizer_is_refused(tiny_stages, tmp_path):
    from rlhf.config import ConfigError
    from rlhf.modeling.load import load_tokenizer
    from rlhf.rl.distill import check_teacher
    from rlhf.rl.models import model_cfg

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_stages / "sft", teacher)
    cfg = _cfg("algorithm=distill", f"teacher.model={teacher}", f"actor.model={tiny_stages / 'sft'}")
    tok = load_tokenizer(model_cfg(cfg, cfg.actor.model), key="actor")
    check_teacher(cfg, tok, model_cfg)  # the same tokenizer: accepted
    conf = teacher / "model" / "tokenizer_config.json"
    c = json.loads(conf.read_text())
    c["eos_token"] = "<unk>"  # another end-of-sequence id
    conf.write_text(json.dumps(c))
    with pytest.raises(ConfigError, match=r"teacher.model=.* another tokenizer than the student .* eos token ids differ"):
        check_teacher(cfg, tok, model_cfg)
    with pytest.raises(ConfigError, match="teacher.model"):  # a reward model is no teacher
        check_teacher(_cfg("algorithm=distill", f"teacher.model={tiny_stages / 'reward'}"), tok, model_cfg)
    # through the command line: exit 2, the message naming teacher.model, before any weights load
    proc = run_stage("ppo", f"output_dir={tmp_path / 'out'}", "algorithm=distill", f"teacher.model={teacher}",
                     f"actor.model={tiny_stages / 'sft'}", check=False)
    assert proc.returncode == 2 and "teacher.model=" in proc.stderr and "eos token ids differ" in proc.stderr


@pytest.mark.slow
def test_cli_distill_run_brings_the_student_towards_a_larger_teacher(tiny_stages, tmp_path):
    """The student (tiny_stages' 2-step SFT, hidden 32) distils from a larger, longer-trained SFT
    checkpoint (hidden 48): no reward model or critic is built, the teacher takes the reference's place,
    the reverse KL to it (k1, summed over the response) falls over the steps and on the held-out prompts;
    resumed from its step-5 checkpoint, step 6 and the final evaluation repeat exactly."""
    teacher = tmp_path / "teacher"
    big = [o.replace("hidden_size=32", "hidden_size=48") for o in SMALL_MODEL]
    run_stage("sft", f"output_dir={teacher}", *big, "train.max_steps=30", "train.lr=1e-2", "train.eval_every=0",
              "train.save_every=0", "data.num_eval_prompts=4")
    out = tmp_path / "distill"

    def distill(*extra):
        run_stage("ppo", f"output_dir={out}", "algorithm=distill", f"teacher.model={teacher}",
                  f"actor.model={tiny_stages / 'sft'}", "rollout.prompts_per_step=32", "rollout.mini_batch_size=32",
                  "rollout.micro_batch_size=32", "rollout.max_new_tokens=8", "eval.max_new_tokens=8",
                  "data.num_eval_prompts=16", "train.max_steps=6", "train.eval_every=0", "train.save_every=5",
                  "actor.lr=1e-2", *extra)

    distill()
    train = metrics(out, "train")
    kls = [r["kl"] for r in train]
    assert len(kls) == 6 and all(math.isfinite(k) for k in kls)
    # the student's KL to the teacher falls (measured: 2.21 2.75 2.07 1.69 1.22 1.85 per step; on the
    # held-out prompts, sampled with one seed, 2.38 before -> 1.35 after)
    assert sum(kls[-3:]) < 0.85 * sum(kls[:3]), kls
    assert all(r["reward"] == 0 for r in train)  # no reward source: the KL is the only signal
    ev = metrics(out, "eval")
    assert ev[0]["step"] == 0 and ev[0]["kl"] > 1 and ev[-1]["step"] == 6 and ev[-1]["kl"] < 0.75 * ev[0]["kl"], ev
    s = summary(out)
    assert s["objective"] == "distill" and s["teacher"] == str(teacher) and s["advantage_estimator"] == "reinforce"
    plan = (out / "ppo.log").read_text().split("models on this rank:")[1].split("\n")[0]
    assert "teacher" in plan and "reward_model" not in plan and "critic" not in plan and "reference" not in plan
    assert (out / "model" / "config.json").is_file() and not (out / "critic").exists()
    # exact resume: drop the last checkpoint and the export, continue from step 5
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")) == [
        "step_0000005", "step_0000006"]
    shutil.rmtree(out / "checkpoints" / "step_0000006")
    shutil.rmtree(out / "model")
    distill("train.resume=true")
    keys = ("kl", "reward", "actor_loss", "entropy", "response_len", "clipfrac")
    assert [[r[k] for k in keys] for r in metrics(out, "train")] == [[r[k] for k in keys] for r in train]
    assert [(r["step"], r["kl"], r["gold_score"]) for r in metrics(out, "eval")] == [
        (r["step"], r["kl"], r["gold_score"]) for r in ev]
    assert (out / "model" / "config.json").is_file()
