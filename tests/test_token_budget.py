"""Token-budget micro-batches (rollout.micro_batch_tokens) and the exact normalisation of the RL losses:
the partition (rlhf/data/microbatch.py) on hand cases and properties, trimmed forwards equal to the
full-width ones, the config key, the per-step metrics, train_step's known total weight, and (slow) one
mini-batch's loss, stats and gradients equal however it is micro-batched on 1 and 2 gloo ranks, and a GRPO
run with budgets on 1 and 2 ranks with the same metrics."""
from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, cli_env, comparable, metrics, run_stage

from engine import EngineConfig, OptimConfig, TrainEngine, init_distributed
from engine.distributed import DistInfo
from rlhf.data.microbatch import bin_cost, pad_response, row_extents, token_budget_bins, trim_columns
from rlhf.modeling.forward import position_ids_from_mask
from rlhf.modeling.roles import Policy, ValueModel
from rlhf.rl.rollout import batching_counts, budget_micro_batches, score_rollout

VOCAB = 40


# ----------------------------------------------------------------------------- the partition


def test_bins_hand_cases():
    prompt, resp = [2, 2, 6, 6], [9, 2, 5, 1]  # rows' lengths 11, 4, 11, 7
    # longest first: row 2 (11, prompt 6), row 0 (11): 2 x (6 + 9) = 30 > 20, alone; row 3: with row 2 2 x (6 + 5)
    # = 22, with row 0 30, alone; row 1: with row 3 2 x (6 + 2) = 16
    assert token_budget_bins(prompt, resp, 20) == [[2], [0], [1, 3]]
    assert token_budget_bins(prompt, resp, 60) == [[0, 1, 2, 3]]  # 4 x (6 + 9) = 60
    assert bin_cost(prompt, resp, [0, 1, 2, 3]) == 60 and bin_cost(prompt, resp, [1, 3]) == 16
    # packed: the real tokens 11, 11, 7, 4 summed
    assert token_budget_bins(prompt, resp, 20, packed=True) == [[2, 3], [0, 1]]
    assert bin_cost(prompt, resp, [0, 1], packed=True) == 15
    # more bins asked for (another rank's count): the costliest bin of several rows is split, longer half first
    assert token_budget_bins(prompt, resp, 60, min_bins=2) == [[0, 2], [1, 3]]
    assert token_budget_bins(prompt, resp, 60, min_bins=4) == [[2], [0], [3], [1]]
    assert token_budget_bins(prompt, resp, 20, min_bins=4) == [[2], [0], [3], [1]]
    # groups stay together: rows (0, 1) and (2, 3); group 1 costs 2 x 11 = 22 > 20: alone, over the budget
    assert token_budget_bins(prompt, resp, 22, groups=[0, 0, 1, 1]) == [[2, 3], [0, 1]]
    assert token_budget_bins(prompt, resp, 20, groups=[5, 5, 9, 9]) == [[2, 3], [0, 1]]
    # more micro-batches than groups (another rank's rows came from more prompts): the largest group goes apart
    assert token_budget_bins(prompt, resp, 100, groups=[0, 0, 0, 1], min_bins=3) == [[2], [0, 1], [3]]
    assert token_budget_bins(prompt, resp, 100, groups=[0, 0, 1, 1], min_bins=4) == [[2], [3], [0], [1]]
    assert token_budget_bins([], [], 10) == []


def test_bins_refuse_bad_input():
    with pytest.raises(ValueError, match="one entry per row"):
        token_budget_bins([1, 2], [3], 10)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        token_budget_bins([1], [1], 0)
    with pytest.raises(ValueError, match="cannot make 4 micro-batches of 3 rows"):
        token_budget_bins([1, 1, 1], [1, 1, 1], 10, groups=[0, 0, 1], min_bins=4)


@pytest.mark.parametrize("seed", range(30))
def test_bins_properties(seed):
    """Every row exactly once, a group's rows together, no micro-batch over the budget unless it is one unit
    that alone exceeds it, and exactly max(first-fit count, min_bins) micro-batches (so the ranks, each asked
    for the max of their counts, run as many)."""
    rng = random.Random(seed)
    B = rng.randint(1, 40)
    prompt = [rng.randint(1, 12) for _ in range(B)]
    resp = [rng.randint(0, 30) for _ in range(B)]
    groups = [i // rng.randint(1, 4) for i in range(B)] if seed % 2 else None
    packed = seed % 3 == 0
    budget = rng.randint(10, 300)
    units = {}
    for i in range(B):
        units.setdefault(i if groups is None else groups[i], []).append(i)
    first = token_budget_bins(prompt, resp, budget, groups=groups, packed=packed)
    for want in (1, rng.randint(1, len(units)), rng.randint(1, B)):
        bins = token_budget_bins(prompt, resp, budget, groups=groups, packed=packed, min_bins=want)
        assert len(bins) == max(len(first), want)
        assert sorted(i for b in bins for i in b) == list(range(B))
        for b in bins:
            assert b == sorted(b)
            whole = [u for u in units.values() if set(u) <= set(b)]
            if want <= len(units):
                assert sum(len(u) for u in whole) == len(b), "a unit split across micro-batches"
            if bin_cost(prompt, resp, b, packed) > budget:
                assert len(whole) <= 1, "over the budget with more than one unit"


def test_row_extents_and_trim_by_attention_not_response_mask():
    P, T = 4, 6
    attn = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0, 0, 0],    # prompt 2, response 2
                         [0, 0, 0, 1, 1, 1, 1, 1, 0, 0],    # prompt 1, multi-turn: 4 attended response columns
                         [0, 1, 1, 1, 1, 0, 0, 0, 0, 0]])   # prompt 3, response 1
    rmask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 0, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0]]).float()  # row 1: observation
    assert row_extents(attn, P) == ([2, 1, 3], [2, 4, 1])
    seqs = torch.arange(30).reshape(3, 10) * attn
    batch = {"sequences": seqs, "attention_mask": attn, "position_ids": position_ids_from_mask(attn),
             "response_mask": rmask, "advantages": torch.ones(3, T), "score": torch.arange(3.0), "prompt_len": P,
             "pack_length": None}
    out = trim_columns(batch, P)
    assert out["prompt_len"] == 3 and out["sequences"].shape == (3, 7) and out["response_mask"].shape == (3, 4)
    assert torch.equal(out["sequences"], seqs[:, 1:8]) and torch.equal(out["response_mask"], rmask[:, :4])
    assert torch.equal(out["position_ids"], batch["position_ids"][:, 1:8]) and torch.equal(out["score"], batch["score"])
    assert out["pack_length"] is None
    # rows 0 and 2: left columns 0 (both padding) go, and responses end at column 2
    sub = trim_columns(batch, P, [2, 0])
    assert sub["prompt_len"] == 3 and torch.equal(sub["sequences"], seqs[[2, 0], 1:6])
    assert torch.equal(sub["advantages"], torch.ones(2, 2)) and torch.equal(sub["score"], torch.tensor([2.0, 0.0]))
    assert torch.equal(pad_response(torch.ones(2, 2), T), torch.cat([torch.ones(2, 2), torch.zeros(2, 4)], 1))
    # the forward's computed tokens: 3 rows x (3 + 4), rows 0 and 2: 2 x (3 + 2); padded: the full width
    assert batching_counts(attn, P, [[0, 1, 2]]) == {"micro_batches": 1, "computed_tokens": 21, "real_tokens": 13}
    assert batching_counts(attn, P, [[0, 2], [1]], trimmed=False)["computed_tokens"] == 30
    assert batching_counts(attn, P, [[0, 2], [1]], packed=True)["computed_tokens"] == 13


# ----------------------------------------------------------------------------- trimmed forwards


def tiny(seed: int, value: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    return (LlamaForSequenceClassification if value else LlamaForCausalLM)(cfg).eval()


def ragged(B: int = 12, P: int = 7, T: int = 10, seed: int = 0):
    """B rows, each prompt (left-padded, lengths 1..P) shared by 2 rows, responses right-padded with
    lengths 0..T, row 1 a multi-turn episode (an observation inside: attended, out of the response mask)."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(1, P + 1, (B // 2,), generator=g).repeat_interleave(2)
    rlen = torch.randint(0, T + 1, (B,), generator=g)
    rlen[0], rlen[1] = T // 3, T  # one short, one full
    cols = torch.arange(P + T)
    attn = ((cols >= P - plen[:, None]) & (cols < P + rlen[:, None])).long()
    seqs = torch.randint(1, VOCAB, (B, P + T), generator=g)
    seqs[:, :P] = seqs[::2, :P].repeat_interleave(2, 0)
    seqs = seqs * attn
    rmask = attn[:, P:].clone()
    rmask[1, 3:6] = 0
    return seqs, attn, rmask, torch.arange(B) // 2, P


@pytest.mark.parametrize("shared,pack_length", [(False, None), (True, None), (False, 24)])
def test_trimmed_scoring_equals_the_full_width_forward(shared, pack_length):
    """Old and reference log-probs and values through token budgets (several micro-batches of their own widths,
    padded back to [B, T]) equal one full-width forward of every row to 1e-6 (fp32), with shared prompts
    and with packing too; and the budgets computed fewer tokens."""
    seqs, attn, rmask, group, P = ragged()
    roles = {"actor": Policy(tiny(0)), "reference": Policy(tiny(1)), "critic": ValueModel(tiny(2, True))}
    kw = dict(**roles, temperature=0.8, pack_length=pack_length, shared_prompts=shared)
    full_counts = {}
    whole = score_rollout(seqs, attn, P, micro_batch_size=len(seqs), batching=full_counts,
                          **{**kw, "pack_length": None, "shared_prompts": False})
    assert full_counts["micro_batches"] == 1 and full_counts["computed_tokens"] == seqs.numel()
    m = attn[:, P:].bool()  # every attended response position (the observation's too)
    for budget in (17, 40, 90):
        counts = {}
        got = score_rollout(seqs, attn, P, micro_batch_size=1, micro_batch_tokens=budget, group=group,
                            batching=counts, **kw)
        assert counts["micro_batches"] > 1 and counts["computed_tokens"] < seqs.numel()
        assert counts["real_tokens"] == int(attn.sum())
        for key in ("logp_old", "logp_ref", "values"):
            assert got[key].shape == whole[key].shape == rmask.shape, key
            err = (got[key] - whole[key])[m].abs().max().item()
            assert err < 1e-6, f"budget {budget} {key}: {err:.2e}"
            assert torch.isfinite(got[key]).all(), key  # columns past a micro-batch's width: padded back with 0
        assert torch.equal(got["position_ids"], whole["position_ids"])


def test_budget_micro_batches_keep_groups_and_log_over_budget_rows(caplog):
    seqs, attn, rmask, group, P = ragged()
    prompt, extent = row_extents(attn, P)
    bins = budget_micro_batches(attn, P, 40, groups=group)
    assert bins == token_budget_bins(prompt, extent, 40, groups=group.tolist())  # one rank: no equalising
    assert all(len({int(group[i]) for i in b}) * 2 == len(b) for b in bins)
    with caplog.at_level("WARNING", logger="rlhf.ppo"):
        bins = budget_micro_batches(attn, P, 10)
    longest = max(p + e for p, e in zip(prompt, extent))
    assert longest > 10 and "over the budget run alone" in caplog.text
    assert all(len(b) == 1 for b in bins if bin_cost(prompt, extent, b) > 10)


# ----------------------------------------------------------------------------- config, engine, metrics


def test_config_key_is_validated():
    from rlhf.check import check_stage
    from rlhf.config import PPOConfig
    from rlhf.core.errors import ConfigError

    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), is_main=True)
    cfg = PPOConfig()
    assert cfg.rollout.micro_batch_tokens is None  # row counts by default
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    later = ["output_dir=/nowhere/ppo", "actor.model=/nowhere/sft", "critic.model=/nowhere/reward"]
    for bad in (0, -5, longest - 1):
        with pytest.raises(ConfigError, match=rf"^rollout.micro_batch_tokens must be null \(row counts\) or >= "
                                              rf"data.max_prompt_len \+ rollout.max_new_tokens = {longest} \(one whole "
                                              rf"row per forward\), got {bad}$"):
            check_stage("ppo", [*later, f"rollout.micro_batch_tokens={bad}"], one)
    for good in (longest, 4096, "null"):
        check_stage("ppo", [*later, f"rollout.micro_batch_tokens={good}"], one)


def test_train_step_with_the_known_total_weight():
    """A known global weight gives the estimate-and-correct path's loss and gradient norm (to rounding) and
    refuses a loss whose weights disagree with it."""
    info = init_distributed()

    def loss_fn(model, mb):
        out = model(mb["x"]).squeeze(-1)
        return ((out - mb["y"]) ** 2).sum(), float(len(mb["y"])), {"m": out.mean()}

    g = torch.Generator().manual_seed(0)
    micro = [{"x": torch.randn(n, 3, generator=g), "y": torch.randn(n, generator=g)} for n in (2, 5, 1)]
    results = []
    for total in (None, 8.0):
        torch.manual_seed(0)
        engine = TrainEngine(torch.nn.Linear(3, 1), EngineConfig(stage=0), OptimConfig(grad_clip=0.0), total_steps=1,
                             info=info)
        results.append(engine.train_step(micro, loss_fn, total))
    a, b = results
    assert a["weight"] == b["weight"] == 8.0
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
    assert b["m"] == pytest.approx(a["m"], rel=1e-6)
    with pytest.raises(ValueError, match=r"the loss's weights sum to 8.0 over the ranks, but total_weight=9.0"):
        engine.train_step(micro, loss_fn, 9.0)


def test_step_metrics_report_micro_batches_and_padding():
    """update_micro_batches: the step's micro-batches (summed over its mini-batches); *_computed_per_real: the
    forwards' computed tokens over the real ones."""
    from rlhf.config import PPOConfig
    from rlhf.rl.experience import build_experience
    from rlhf.rl.metrics import step_metrics
    from rlhf.rl.rollout import Rollout

    seqs, attn, rmask, group, P = ragged(B=4)
    rollout = Rollout(sequences=seqs, attention_mask=attn, response_mask=rmask, responses=seqs[:, P:], prompt_len=P,
                      group=group, empty=torch.zeros(4, dtype=torch.bool), truncated=torch.zeros(4, dtype=torch.bool))
    T = rmask.shape[1]
    scored = {"logp_old": torch.zeros(4, T), "logp_ref": torch.zeros(4, T), "score": torch.ones(4),
              "position_ids": position_ids_from_mask(attn)}
    exp = build_experience(seqs, attn, rmask, P, scored, kl_coef=0.0, kl_estimator="k1", clip_reward_value=5.0,
                           gamma=1.0, lam=1.0, estimator="grpo", group=group)
    a_stats = [{"loss": 0.0, "lr": 1e-3, "skipped": False, "micro_batches": 3, "computed_tokens": 90, "real_tokens": 60},
               {"loss": 0.0, "lr": 1e-3, "skipped": False, "micro_batches": 2, "computed_tokens": 70, "real_tokens": 60}]
    rec = step_metrics(rollout, exp, a_stats, [], PPOConfig(), 0.0, (0.0, 1.0, 2.0, 3.0),
                       scoring={"micro_batches": 4, "computed_tokens": 55, "real_tokens": 50})
    assert rec["update_micro_batches"] == 5 and rec["update_computed_per_real"] == pytest.approx(160 / 120)
    assert rec["scoring_micro_batches"] == 4 and rec["scoring_computed_per_real"] == pytest.approx(1.1)
    plain = step_metrics(rollout, exp, [{"loss": 0.0, "lr": 1e-3, "skipped": False}], [], PPOConfig(), 0.0,
                         (0.0, 1.0, 2.0, 3.0))
    assert "update_micro_batches" not in plain and "scoring_micro_batches" not in plain


# ----------------------------------------------------------------------------- exact normalisation, 1 and 2 ranks


def _launch(nproc: int, out) -> subprocess.Popen:
    import socket

    script = str(ROOT / "tests" / "engine_scripts" / "budget_grads.py")
    if nproc == 1:
        cmd = [sys.executable, script, str(out)]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
               "127.0.0.1", "--master_port", str(port), script, str(out)]
    return subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_minibatch_loss_and_gradients_are_the_same_however_micro_batched(tmp_path):
    """For clip with each ppo.loss_agg, gspo and cispo (each with a KL-loss term and a ptx term): the mini-batch's
    actor and critic loss, the actor's stats and every parameter's gradient through `update` equal, to 1e-6
    relative, those of one micro-batch of every row in one process, whether the rows go by row counts or
    token budgets (trimmed, shared prompts, packed) in one process or by token budgets on 2 gloo ranks under
    ZeRO-3 (where the ranks' own counts of micro-batches differ and are equalised)."""
    procs = [_launch(1, tmp_path), _launch(2, tmp_path)]
    for proc in procs:
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, out[-4000:]
    one, two = torch.load(tmp_path / "budget_w1.pt"), torch.load(tmp_path / "budget_w2.pt")
    assert one.pop("local_bins") == [{"budget 45": 3, "budget 20": 5}]
    assert two.pop("local_bins") == [{"budget 45": 2, "budget 20": 3}, {"budget 45": 2, "budget 20": 2}]
    assert len(one) == len(two) == 5
    for case in one:
        ref = one[case]["one micro-batch"]
        assert ref["micro_batches"] == 1
        runs = {**{f"1 rank {k}": v for k, v in one[case].items()}, **{f"2 ranks {k}": v for k, v in two[case].items()}}
        assert len(runs) == 9
        for name, got in runs.items():
            for key in ("loss", "critic_loss", *ref["stats"]):
                want = ref[key] if key in ref else ref["stats"][key]
                have = got[key] if key in got else got["stats"][key]
                assert have == pytest.approx(want, rel=1e-6, abs=1e-7), (case, name, key)
            for role in ("actor", "critic"):
                assert sorted(got[role]) == sorted(ref[role]) and len(ref[role]) > 10
                for p, g in ref[role].items():
                    err = ((got[role][p] - g).norm() / g.norm()).item()
                    assert err < 1e-6, f"{case} {name} {role} {p}: relative error {err:.2e}"
        assert one[case]["budget 30"]["micro_batches"] == 4 and one[case]["budget 30"]["computed"] < 120
        assert two[case]["budget 20"]["micro_batches"] == 3


@pytest.mark.slow
def test_grpo_with_token_budgets_on_two_ranks_equals_one_process(tiny_stages, tmp_path):
    """`python -m rlhf.ppo algorithm=grpo` (tiny; the reward model's scores, one mini-batch of the step's 16 rows)
    with rollout.micro_batch_tokens: 1 process and torchrun 2 ranks (ZeRO-3, fp32, per-row sampling streams) log
    the same metrics at every step as 1 process by row counts, to rounding, though each rank forms its own
    micro-batches; the budgets add their batching figures (per rank)."""
    args = ["algorithm=grpo", f"actor.model={tiny_stages / 'sft'}", f"critic.model={tiny_stages / 'reward'}",
            "engine=zero3", "engine.precision=fp32", "engine.deterministic=true", "train.max_steps=2",
            "train.save_every=0", "train.eval_every=0", "data.num_eval_prompts=4", "eval.max_new_tokens=6",
            "rollout.max_new_tokens=12", "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4",
            "rollout.mini_batch_size=16", "rollout.micro_batch_size=2", "actor.lr=1e-2"]
    rows, one, two = tmp_path / "rows", tmp_path / "one", tmp_path / "two"
    run_stage("ppo", f"output_dir={rows}", *args)
    run_stage("ppo", f"output_dir={one}", *args, "rollout.micro_batch_tokens=200")
    run_stage("ppo", f"output_dir={two}", *args, "rollout.micro_batch_tokens=200", torchrun=2)
    r, a, b = (comparable(metrics(d, "train")) for d in (rows, one, two))
    assert [x["step"] for x in r] == [x["step"] for x in a] == [x["step"] for x in b] == [1, 2]
    batching = ("update_micro_batches", "update_computed_per_real", "scoring_micro_batches", "scoring_computed_per_real")
    for w, x, y in zip(r, a, b):
        assert x.keys() == y.keys() == w.keys() | set(batching)  # row counts log no batching figures
        assert w["actor_grad_norm"] > 0.1 and w["reward"] != 0  # a step that learns something
        assert (x["update_micro_batches"], y["update_micro_batches"]) == (4, 2)  # per rank: 16 rows, 8 rows
        assert 1.0 <= x["update_computed_per_real"] < 1.5 and 1.0 <= y["scoring_computed_per_real"] < 1.5
        for k in w:
            for got in (x, y):
                if isinstance(w[k], float):
                    assert got[k] == pytest.approx(w[k], rel=1e-4, abs=1e-6), (w["step"], k, w[k], got[k])
                else:
                    assert got[k] == w[k], (w["step"], k)
