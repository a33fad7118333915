"""Critic-free RL (GRPO / Dr. GRPO, RLOO, REINFORCE++) and its pieces: the estimators against hand
values, KL as a loss term, the loss aggregations, asymmetric clipping, dynamic sampling, the
algorithm config group, and the RL stage end to end without a critic (CLI, resume, 2 ranks)."""
from __future__ import annotations

import math
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, SMALL_MODEL, cli_env, metrics, run_stage, summary
from rlhf.algos import rl as ppo_math
from rlhf.algos.rl import (
    advantage_estimator,
    aggregate_loss,
    grpo_advantages,
    kl_estimate,
    kl_loss_tokens,
    policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    uniform_groups,
)
from rlhf.config.validate import rollout_rows, validate_ppo


def close(actual, expected, atol=1e-5):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, f"shape {list(actual.shape)} != {list(expected.shape)}"
    assert torch.allclose(actual, expected, rtol=1e-5, atol=atol), f"\n{actual}\n!=\n{expected}"


# Six rows, T = 3: group 7 = rows 0, 1, 2, 5 (row 5 said nothing: it neither gets an advantage nor
# moves the baseline); group 8 = rows 3, 4 (equal scores); group 9 = row 6 alone.
SCORE = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 100.0, 4.0])
GROUP = torch.tensor([7, 7, 7, 8, 8, 7, 9])
LENGTHS = torch.tensor([3, 1, 2, 3, 2, 0, 3])
MASK = (torch.arange(3)[None] < LENGTHS[:, None]).float()


def per_token(row_values):
    return torch.tensor(row_values, dtype=torch.float32)[:, None] * MASK


# ----------------------------------------------------------------------------- the estimators

def test_grpo_hand_values_groups_of_one_equal_scores_ragged_masks():
    # group 7's valid scores 1, 2, 3: mean 2, unbiased std 1; group 8 all equal -> 0; group 9 alone -> 0
    close(grpo_advantages(SCORE, GROUP, MASK), per_token([-1, 0, 1, 0, 0, 0, 0]))
    # Dr. GRPO: no std division (here the same, std 1): scale the group to see it
    close(grpo_advantages(SCORE * 3, GROUP, MASK, norm_by_std=False), per_token([-3, 0, 3, 0, 0, 0, 0]))
    close(grpo_advantages(SCORE * 3, GROUP, MASK), per_token([-1, 0, 1, 0, 0, 0, 0]))
    # a two-row group: std = |a - b| / sqrt(2)
    got = grpo_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), torch.ones(2, 2))
    close(got, [[-1 / math.sqrt(2)] * 2, [1 / math.sqrt(2)] * 2])


def test_rloo_hand_values():
    # row 0: 1 - mean(2, 3) = -1.5; row 1: 2 - mean(1, 3) = 0; row 2: 3 - mean(1, 2) = 1.5
    close(rloo_advantages(SCORE, GROUP, MASK), per_token([-1.5, 0, 1.5, 0, 0, 0, 0]))
    # = n / (n - 1) x (score - group mean), the known identity, on random groups
    g = torch.Generator().manual_seed(0)
    s, grp = torch.randn(12, generator=g), torch.arange(4).repeat_interleave(3)
    want = torch.stack([(s[i] - s[grp == grp[i]].mean()) * 1.5 for i in range(12)])
    close(rloo_advantages(s, grp, torch.ones(12, 2))[:, 0], want)


def test_reinforce_pp_hand_values():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, -1.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # gamma 0.5: returns row 0 = [0.25, 0.5, 1]; row 1 = [0.5 - 0.5, -1] = [0, -1] (the 9 is padding)
    g = torch.tensor([0.25, 0.5, 1.0, 0.0, -1.0])
    want = (g - g.mean()) / g.std()  # whitened over the batch's response tokens (unbiased std)
    got = reinforce_pp_advantages(rewards, mask, 0.5)
    close(got[mask.bool()], want)
    assert got[1, 2] == 0


def test_several_ranks_equal_one_batch():
    """Groups stay on one rank, so GRPO/RLOO on each rank's rows = on all rows; REINFORCE++
    whitens over every rank through `all_reduce_sum` (here: the other rank's sums added)."""
    g = torch.Generator().manual_seed(1)
    score, group = torch.randint(0, 3, (8,), generator=g).float(), torch.arange(4).repeat_interleave(2)
    mask = (torch.arange(5)[None] < torch.randint(0, 6, (8, 1), generator=g)).float()
    rewards = torch.randn(8, 5, generator=g)
    halves = (slice(0, 4), slice(4, 8))
    for fn in (grpo_advantages, rloo_advantages):
        close(torch.cat([fn(score[h], group[h], mask[h]) for h in halves]), fn(score, group, mask))
    stats = []
    for h in halves:  # what each rank contributes to the all-reduce
        reinforce_pp_advantages(rewards[h], mask[h], 0.9, all_reduce_sum=lambda t: stats.append(t) or t)
    total = stats[0] + stats[1]
    got = torch.cat([reinforce_pp_advantages(rewards[h], mask[h], 0.9, all_reduce_sum=lambda t: total)
                     for h in halves])
    close(got, reinforce_pp_advantages(rewards, mask, 0.9), atol=1e-5)


def test_registered_without_a_critic():
    for name in ("grpo", "rloo", "reinforce_pp"):
        assert not advantage_estimator(name).needs_critic
    assert advantage_estimator("gae").needs_critic
    assert not advantage_estimator("grpo").token_rewards and advantage_estimator("reinforce_pp").token_rewards
    # relative to the prompt's group: declared, so the config refuses groups of one (#29)
    assert [n for n in ("gae", "grpo", "rloo", "reinforce_pp") if advantage_estimator(n).needs_group] == \
        ["grpo", "rloo"]
    x = ppo_math.AdvantageInputs(rewards=torch.zeros(7, 3), score=SCORE, values=None, mask=MASK, group=GROUP)
    adv, ret = advantage_estimator("grpo").fn(x, gamma=1.0, lam=1.0, norm_by_std=False)
    assert ret is None and torch.equal(adv, grpo_advantages(SCORE, GROUP, MASK, norm_by_std=False))


# ----------------------------------------------------------------------------- losses

def test_loss_aggregations_hand_values():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    s, w = aggregate_loss(x, mask, "token_mean")
    assert (s.item(), w.item()) == (10.0, 4.0)  # 10 / 4 tokens
    s, w = aggregate_loss(x, mask, "seq_mean_token_mean")
    assert (s.item(), w.item()) == (6.0, 2.0)  # (2 + 4) / 2 rows; the empty row weighs nothing
    s, w = aggregate_loss(x, mask, "seq_mean_token_sum", horizon=4)
    assert (s.item(), w.item()) == (2.5, 2.0)  # (6/4 + 4/4) / 2 rows
    with pytest.raises(ValueError, match="horizon"):
        aggregate_loss(x, mask, "seq_mean_token_sum")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate_loss(x, mask, "nope")


def test_asymmetric_clip_and_aggregated_policy_loss():
    # ratios 1.25 (A > 0: clipped at 1.2 symmetric, not with high 0.3), 0.85 (A < 0: clipped at 0.9 with low 0.1)
    logp = torch.log(torch.tensor([[1.25, 0.85]]))
    old, adv, mask = torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    sym, st = policy_loss(logp, old, adv, mask, 0.2)
    close(sym, (-1.2 + 0.85) / 2)
    assert st["clipfrac"].item() == 0.5
    asym, st = policy_loss(logp, old, adv, mask, 0.1, cliprange_high=0.3)
    close(asym, (-1.25 + 0.9) / 2)
    assert st["clipfrac"].item() == 0.5
    # seq_mean_token_mean: row means then their mean
    logp2, old2 = torch.zeros(2, 2), torch.zeros(2, 2)
    adv2, mask2 = torch.tensor([[1.0, 3.0], [2.0, 0.0]]), torch.tensor([[1, 1], [1, 0]])
    close(policy_loss(logp2, old2, adv2, mask2, loss_agg="seq_mean_token_mean")[0], -(2 + 2) / 2)
    close(policy_loss(logp2, old2, adv2, mask2)[0], -6 / 3)


def test_kl_loss_tokens_is_k3_with_finite_grads_through_padding():
    logp = torch.tensor([[-1.0, -2.0, 80.0]], requires_grad=True)  # the padding would overflow exp
    ref = torch.tensor([[-1.5, -1.0, -90.0]])
    mask = torch.tensor([[1, 1, 0]])
    kl = kl_loss_tokens(logp, ref, mask)
    close(kl[:, :2], kl_estimate(logp.detach()[:, :2], ref[:, :2], "k3"))
    assert kl[0, 2] == 0
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 2] == 0
    # d k3 / d logp = 1 - exp(ref - logp)
    close(logp.grad[0, :2], 1 - torch.exp(ref[0, :2] - logp.detach()[0, :2]))


class StubPolicy(torch.nn.Module):
    """A policy whose log-probs of the response are a parameter (so the loss's gradient is readable)."""

    def __init__(self, logp):
        super().__init__()
        self.logp = torch.nn.Parameter(logp.clone())

    def forward(self, input_ids, attention_mask, position_ids=None, *, targets, start, temperature, with_entropy,
                reduction="none"):
        return self.logp * 1, torch.zeros_like(self.logp)


def test_actor_loss_with_kl_loss_term_and_aggregation():
    from rlhf.rl.update import make_actor_loss

    g = torch.Generator().manual_seed(0)
    B, P, T = 3, 2, 4
    logp = torch.randn(B, T, generator=g) - 2
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]).float()
    mb = {"sequences": torch.ones(B, P + T, dtype=torch.long), "attention_mask": torch.ones(B, P + T),
          "position_ids": None, "prompt_len": P, "response_mask": mask, "logp_old": logp + 0.05,
          "logp_ref": logp - 0.3, "advantages": torch.randn(B, T, generator=g)}
    for agg, weight in (("token_mean", 6.0), ("seq_mean_token_mean", 2.0), ("seq_mean_token_sum", 2.0)):
        loss_fn = make_actor_loss(0.2, 1.0, 0.0, loss_agg=agg, horizon=T, kl_loss_coef=0.25)
        total, n, stats = loss_fn(StubPolicy(logp), mb)
        pg, _ = policy_loss(logp, mb["logp_old"], mb["advantages"], mask, 0.2, loss_agg=agg, horizon=T)
        k3 = kl_estimate(logp, mb["logp_ref"], "k3")
        kl_sum, kl_n = aggregate_loss(k3, mask, agg, T)
        assert float(n) == weight, agg
        close(total / n, pg + 0.25 * kl_sum / kl_n)
        close(stats["kl_loss"], kl_sum / kl_n)
    # a callable coefficient (ppo.adaptive_kl with the KL in the loss) is read at each call
    coef = [0.25]
    loss_fn = make_actor_loss(0.2, 1.0, 0.0, kl_loss_coef=lambda: coef[0])
    for value in (0.25, 1.5):
        coef[0] = value
        total, n, stats = loss_fn(StubPolicy(logp), mb)
        close(total, make_actor_loss(0.2, 1.0, 0.0, kl_loss_coef=value)(StubPolicy(logp), mb)[0])
    # without the KL term the loss is the plain surrogate, and no kl_loss stat is reported
    total, n, stats = make_actor_loss(0.2, 1.0, 0.0)(StubPolicy(logp), mb)
    close(total / n, policy_loss(logp, mb["logp_old"], mb["advantages"], mask, 0.2)[0])
    assert "kl_loss" not in stats


# ----------------------------------------------------------------------------- dynamic sampling

def test_uniform_groups_are_dropped_and_counted():
    from rlhf.rl.rollout import Rollout, drop_uniform_groups

    valid = MASK.bool().any(1)
    # group 7 differs (1, 2, 3; the empty row's 100 does not count), 8 is all 5, 9 has one row
    assert uniform_groups(SCORE, GROUP, valid).tolist() == [False, False, False, True, True, False, True]
    B = len(SCORE)
    rollout = Rollout(sequences=torch.zeros(B, 5, dtype=torch.long), attention_mask=torch.ones(B, 5),
                      response_mask=MASK.clone(), responses=torch.zeros(B, 3, dtype=torch.long), prompt_len=2,
                      group=GROUP, empty=~valid, truncated=torch.zeros(B, dtype=torch.bool))
    assert drop_uniform_groups(rollout, SCORE) == 2
    assert rollout.dropped.tolist() == [False, False, False, True, True, False, True]
    assert rollout.response_mask.sum(1).tolist() == [3, 1, 2, 0, 0, 0, 0]


# ----------------------------------------------------------------------------- config

@pytest.mark.parametrize("overrides,key", [
    # an outcome estimator with ppo.kl_coef > 0 is allowed (the KL in the reward, #33); grpo needs groups
    (["ppo.advantage_estimator=grpo"], "ppo.advantage_estimator=grpo scores each response"),
    (["ppo.policy_loss=ppo2"], "ppo.policy_loss must be one of ('clip', 'gspo', 'cispo')"),
    (["ppo.overlong_buffer=16"], "ppo.overlong_buffer must be in [0, rollout.max_new_tokens=16)"),
    (["ppo.overlong_buffer=-1"], "ppo.overlong_buffer"),
    (["ppo.overlong_buffer=4", "ppo.overlong_penalty=-1"], "ppo.overlong_penalty"),
    (["algorithm=grpo", "rollout.n_samples_per_prompt=3"], "rollout.n_samples_per_prompt (8 x 3 = 24)"),
    (["algorithm=grpo", "rollout.n_samples_per_prompt=0"], "rollout.n_samples_per_prompt must be >= 1"),
    (["ppo.dynamic_sampling=true"], "rollout.n_samples_per_prompt >= 2"),
    # a group of one is its own baseline: every advantage 0, actor_loss 0 every step (#29)
    (["algorithm=grpo", "rollout.n_samples_per_prompt=1", "rollout.prompts_per_step=64"],
     "ppo.advantage_estimator=grpo scores each response against the others of its prompt"),
    (["algorithm=rloo", "rollout.n_samples_per_prompt=1", "rollout.prompts_per_step=64"],
     "needs rollout.n_samples_per_prompt >= 2, got 1"),
    (["algorithm=grpo", "ppo.loss_agg=sum"], "ppo.loss_agg"),
    (["ppo.cliprange_high=0"], "ppo.cliprange_high"),
    (["ppo.kl_loss_coef=-1"], "ppo.kl_loss_coef"),
    (["ppo.kl_loss_estimator=k7"], "ppo.kl_loss_estimator"),
])
def test_bad_algorithm_settings_name_the_key(overrides, key):
    from rlhf import config as C

    cfg = C.to_config(C.compose("ppo", overrides), C.PPOConfig)
    with pytest.raises(C.ConfigError, match=None) as e:
        validate_ppo(cfg, SimpleNamespace(world_size=1, device=torch.device("cpu")))
    assert key in str(e.value)


def test_prompts_are_whole_on_each_rank():
    from rlhf import config as C

    cfg = C.to_config(C.compose("ppo", ["algorithm=grpo", "rollout.prompts_per_step=3",
                                        "rollout.n_samples_per_prompt=8", "rollout.mini_batch_size=24",
                                        "rollout.micro_batch_size=4"]), C.PPOConfig)
    validate_ppo(cfg, SimpleNamespace(world_size=1, device=torch.device("cpu")))  # 24 rows, fine on one rank
    with pytest.raises(C.ConfigError, match=r"rollout.prompts_per_step \(3\) must be a multiple of the world size \(2\)"):
        validate_ppo(cfg, SimpleNamespace(world_size=2, device=torch.device("cpu")))


def test_algorithm_group_sets_the_estimator_and_ppo_is_the_default():
    from rlhf import config as C

    default = C.as_yaml(C.to_config(C.compose("ppo"), C.PPOConfig))
    assert C.as_yaml(C.to_config(C.compose("ppo", ["algorithm=ppo"]), C.PPOConfig)) == default
    assert C.PPOConfig().ppo.advantage_estimator == "gae" and C.PPOConfig().rollout.n_samples_per_prompt == 1
    for algo in ("grpo", "rloo", "reinforce_pp", "gspo"):
        cfg = C.to_config(C.compose("ppo", [f"algorithm={algo}"]), C.PPOConfig)
        assert cfg.ppo.advantage_estimator == ("grpo" if algo == "gspo" else algo)
        assert cfg.ppo.policy_loss == ("gspo" if algo == "gspo" else "clip")
        assert cfg.ppo.overlong_buffer == 0
        if algo in ("grpo", "rloo", "gspo"):  # outcome estimators: no KL in the reward by default (#33)
            assert cfg.ppo.kl_coef == 0 and not cfg.ppo.adaptive_kl
        assert rollout_rows(cfg.rollout) == 64  # the same number of sampled responses as PPO's default
        # GSPO clips whole responses at a tiny range: 0.2-0.4 per step on healthy runs, over PPO's 0.2
        assert cfg.alarms.clipfrac == (0.6 if algo == "gspo" else C.AlarmsConfig().clipfrac)
        validate_ppo(cfg, SimpleNamespace(world_size=1, device=torch.device("cpu")))


# ----------------------------------------------------------------------------- the stage, end to end

@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    run_stage("sft", f"output_dir={root / 'sft'}", *SMALL_MODEL, "train.max_steps=5", "train.lr=1e-2",
              "train.eval_every=0", "train.save_every=0", "data.num_eval_prompts=4")
    run_stage("reward", f"output_dir={root / 'reward'}", f"model.name_or_path={root / 'sft'}",
              "model.fallback_to_config=false", "train.max_steps=2", "train.eval_every=0")
    return root


RL_ARGS = ["train.save_every=1", "train.eval_every=0", "data.num_eval_prompts=4", "rollout.mini_batch_size=8",
           "rollout.micro_batch_size=8", "rollout.max_new_tokens=8", "eval.max_new_tokens=8", "actor.lr=1e-3"]
ALGOS = {"grpo": ["rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "ppo.dynamic_sampling=true",
                  "train.max_steps=2"],
         "rloo": ["rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "ppo.cliprange_high=0.28",
                  "train.max_steps=1"],
         "reinforce_pp": ["rollout.prompts_per_step=16", "train.max_steps=1"]}


def rl(root, out, algo, *extra):
    return run_stage("ppo", f"output_dir={out}", f"algorithm={algo}", f"actor.model={root / 'sft'}",
                     f"critic.model={root / 'reward'}", *RL_ARGS, *ALGOS[algo], *extra)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "rloo", "reinforce_pp"])
def test_cli_run_without_a_critic(stages, tmp_path, algo):
    """Critic-free through the command line: no critic built (the memory plan lists actor, reference
    and reward model), none trained (critic_loss nan), none saved (no critic/ in the checkpoint or
    the outputs). GRPO (with dynamic sampling) then resumes exactly from its step-1 checkpoint."""
    out = tmp_path / algo
    rl(stages, out, algo)
    train = metrics(out, "train")
    steps = len(train)
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert all(r["critic_loss"] == "nan" and math.isfinite(r["actor_loss"]) for r in train)
    assert all(r["response_len"] > 0 for r in train)
    if algo != "reinforce_pp":
        assert all(r["kl_coef"] == 0 and r["kl_loss"] >= 0 for r in train)  # the KL is in the loss
    if algo == "grpo":  # counted; a group of 4 equal scores can occur, so only the bounds are known
        assert all(0 <= r["dropped_groups"] <= 4 and r["dropped_rows"] == 4 * r["dropped_groups"] for r in train)
    assert not (out / "critic").exists() and (out / "model" / "config.json").is_file()
    ckpt = out / "checkpoints" / f"step_{steps:07d}"
    assert (ckpt / "actor").is_dir() and not (ckpt / "critic").exists()
    log = (out / "ppo.log").read_text()
    plan = log.split("models on this rank:")[1].split("\n")[0]
    assert "3 models on this rank: actor" in log and "reference" in plan and "critic" not in plan
    s = summary(out)
    assert s["steps"] == steps and s["advantage_estimator"] == algo and math.isfinite(s["kl"])
    if algo == "grpo":
        shutil.rmtree(ckpt)
        shutil.rmtree(out / "model")
        rl(stages, out, algo, "train.resume=true")
        keys = ("reward", "kl", "actor_loss", "kl_loss", "entropy", "response_len", "dropped_groups")
        assert [[r[k] for k in keys] for r in metrics(out, "train")] == [[r[k] for k in keys] for r in train]


@pytest.mark.slow
def test_two_ranks_equal_one_process_per_estimator(tmp_path):
    """Per estimator, per policy loss (clip, gspo, cispo), with the sampler/trainer corrections (tis,
    sequence-level mis), for distillation's reverse-KL reward and for online DPO's pair loss: every row's
    advantages (online DPO: its pair role) and one ZeRO-3 actor update's loss, metrics and gradients on 2
    gloo ranks = in 1 process (tests/engine_scripts/rl_estimators.py); and ppo.old_logprobs' choice per
    step the same on both ranks and in 1 process."""
    import socket

    script = str(ROOT / "tests" / "engine_scripts" / "rl_estimators.py")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmds = [[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
             "--master_port", str(port), script, str(tmp_path)], [sys.executable, script, str(tmp_path)]]
    for cmd in cmds:  # one after the other: 2 CPU cores
        proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    two, one = torch.load(tmp_path / "rl_w2.pt"), torch.load(tmp_path / "rl_w1.pt")
    assert sorted(two) == sorted(one) == ["cispo", "distill", "grpo", "grpo_tis", "gspo", "online_dpo", "reinforce_pp",
                                          "rloo", "rloo_mis_seq"]
    for name in one:
        a, b = two[name], one[name]
        assert a["advantages"].abs().sum() > 0, name
        assert torch.allclose(a["advantages"], b["advantages"], atol=1e-6), name
        assert sorted(a["stats"]) == sorted(b["stats"])
        for k, v in b["stats"].items():
            assert a["stats"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), (name, k, a["stats"][k], v)
        assert sorted(a["grads"]) == sorted(b["grads"]) and len(b["grads"]) > 0
        for pname, g in b["grads"].items():
            scale = g.abs().max().item()
            assert (a["grads"][pname] - g).abs().max().item() <= 1e-5 * max(scale, 1e-8), (name, pname)
    # distillation: score 0 and gamma 0, so each token's advantage is its own reward -k1 = logp_ref - logp_old
    assert torch.allclose(one["distill"]["advantages"], -one["distill"]["k1"], atol=1e-6)
    # online DPO: one pair per prompt group that is not tied (the first group's scores all 1: no pair)
    roles = one["online_dpo"]["advantages"].reshape(4, 3)
    assert roles[0].abs().sum() == 0 and one["online_dpo"]["stats"]["weight"] == (roles == 1).sum().item() >= 1
    assert torch.equal((roles == 1).sum(1), (roles == -1).sum(1))
    # ppo.old_logprobs (#31): the sampler's log-probs forced 0.01 off on rank 1's rows only at step 2
    # (checks every 2 steps, max gap 1e-3). The gap is all-reduced, so both ranks choose alike, as 1 process
    # does, although rank 0's own rows are exactly on: sampler falls back to recompute at step 2 on both;
    # auto stops reusing after step 2 (recomputes step 3, back to reuse after its gap of 0; step 4 checks)
    old_two, old_one = torch.load(tmp_path / "old_logprobs_w2.pt"), torch.load(tmp_path / "old_logprobs_w1.pt")
    want = {"sampler": [True, False, True, True, True, True], "auto": [True, True, True, True, True, False]}
    for mode, choices in want.items():
        r0, r1 = old_two[mode]
        assert r0["choices"] == r1["choices"] == old_one[mode][0]["choices"] == choices, (mode, r0, r1, old_one[mode])
        assert r0["gaps"].keys() == old_one[mode][0]["gaps"].keys()
        for step, gap in old_one[mode][0]["gaps"].items():
            assert r0["gaps"][step] == r1["gaps"][step] == pytest.approx(gap, rel=1e-6, abs=1e-12), (mode, step)
        assert r0["own_gap"] == 0.0 and r1["own_gap"] == pytest.approx(0.01, rel=1e-4), (r0["own_gap"], r1["own_gap"])
        assert r0["gaps"][2] > 1e-3 and all(g == 0.0 for s, g in r0["gaps"].items() if s != 2), r0["gaps"]

