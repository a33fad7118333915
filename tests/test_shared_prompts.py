"""rollout.shared_prompt_forward: rows that share a prompt (GRPO's n samples of one prompt) run it once
per forward, its KV cache gathered for each row (rlhf/modeling/roles.py shared_prompt_forward,
engine/generation.py shared_prompt_cache). Every test compares with the rows run whole: the same
values up to fp32 rounding, for the roles (log-probs, entropy, values, gradients) on three model
families and a LoRA-wrapped model, for transformers generate, for the scoring pass and for a run.
ZeRO-3 on 2 gloo ranks: tests/test_ppo.py::test_zero3_ppo_gradients_equal_one_process."""
from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from conftest import SMALL_MODEL, metrics, run_stage
from engine import EngineConfig, OptimConfig, TrainEngine, hf_base_model, init_distributed
from engine import generation as G
from engine.generation import SamplingParams, prompt_groups
from rlhf import config as C
from rlhf.config.validate import (
    pair_shared_prompts, shared_prompts, validate_dpo, validate_ppo, validate_reward, validate_sft,
)
from rlhf.core.errors import ConfigError
from rlhf.data import collate_pairs, collate_shared_pairs
from rlhf.data.packing import pair_layout
from rlhf.dpo import pair_batch, response_logps
from rlhf.modeling.forward import batch_scores, position_ids_from_mask
from rlhf.modeling import roles
from rlhf.modeling.roles import Policy, ValueModel, length_buckets, shared_prompt_forward
from rlhf.rl.rewards import RewardModelScore
from rlhf.rl.rollout import generate, score_rollout

VOCAB, PAD, EOS = 53, 0, 2


def family(name: str, value: bool = False, seed: int = 0):
    """A tiny seeded model of a family: llama (RoPE, GQA), opt (learned positions, its own mask
    handling), qwen2 (RoPE with biases)."""
    import transformers as T

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=1, num_labels=1)
    if name == "llama":
        cfg = T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, **common)
        cls = T.LlamaForSequenceClassification if value else T.LlamaForCausalLM
    elif name == "qwen2":
        cfg = T.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, **common)
        cls = T.Qwen2ForSequenceClassification if value else T.Qwen2ForCausalLM
    else:
        cfg = T.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                          word_embed_proj_dim=32, max_position_embeddings=64, **common)
        cls = T.OPTForSequenceClassification if value else T.OPTForCausalLM
    cfg._attn_implementation = "eager"
    return cls(cfg).eval()


def rows(U: int = 3, n: int = 4, P: int = 7, T: int = 5, seed: int = 0):
    """U distinct left-padded prompts (of several lengths) each in n rows, shuffled, with right-padded
    responses of several lengths: (sequences, attention_mask, position_ids, response_mask, P)."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.tensor([P, 2, 4, 3, 6][:U])
    cols = torch.arange(P)
    pmask = (cols[None] >= P - plen[:, None]).long()
    prompts = torch.randint(3, VOCAB, (U, P), generator=g) * pmask
    order = torch.arange(U).repeat_interleave(n)[torch.randperm(U * n, generator=g)]
    rlen = torch.randint(0, T + 1, (U * n,), generator=g)
    rmask = (torch.arange(T)[None] < rlen[:, None]).long()
    resp = torch.randint(3, VOCAB, (U * n, T), generator=g) * rmask
    seqs, mask = torch.cat([prompts[order], resp], 1), torch.cat([pmask[order], rmask], 1)
    return seqs, mask, position_ids_from_mask(mask), rmask, P


def grads(model: torch.nn.Module, out: torch.Tensor, weight: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    (out * weight).sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_grads_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Each parameter's gradient within 1e-5 of its norm (a gradient that is zero in exact arithmetic,
    e.g. a key bias before softmax, within 1e-8 of the largest)."""
    assert len(a) == len(b) > 0
    scale = max(x.norm() for x in a)
    for x, y in zip(a, b):
        assert (x - y).norm() <= 1e-5 * max(x.norm(), 1e-3 * scale), ((x - y).norm(), x.norm(), scale)


@pytest.mark.parametrize("name", ["llama", "opt", "qwen2"])
@pytest.mark.parametrize("fused", [False, True])
def test_policy_logprobs_and_gradients_equal_the_whole_rows(name, fused):
    seqs, mask, pos, rmask, P = rows()
    policy = Policy(family(name), fused=fused)
    kw = dict(targets=seqs[:, P:], start=P - 1, temperature=0.7, with_entropy=True)
    whole, ent_whole = policy(seqs, mask, pos, **kw)
    shared, ent_shared = policy(seqs, mask, pos, prompt_len=P, **kw)
    m = rmask.bool()
    assert shared.shape == whole.shape == rmask.shape
    assert (shared - whole)[m].abs().max() < 2e-6 and (ent_shared - ent_whole)[m].abs().max() < 2e-6
    weight = torch.randn(rmask.shape, generator=torch.Generator().manual_seed(1)) * rmask
    assert_grads_close(grads(policy, whole, weight), grads(policy, shared, weight))


def test_length_buckets_are_the_cheapest_partition():
    """Sub-batches by length (rlhf/modeling/roles.py length_buckets): every row once, each sub-batch at its
    longest extent, and the cost (computed positions + a forward's fixed cost each) the least of every way
    to cut the sorted rows into at most K runs (brute force)."""
    from itertools import combinations

    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        B, T = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
        ext = torch.randint(0, T + 1, (B,), generator=g)
        tail = (torch.arange(T)[None] < ext[:, None]).long()
        K, f = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(0, 6, (1,), generator=g))
        got = length_buckets(tail, K, f)
        rows = torch.cat([r for r, _ in got])
        assert sorted(rows.tolist()) == list(range(B)) and len(got) <= K
        e = ext.clamp(min=1)
        assert all(w == int(e[r].max()) for r, w in got)
        cost = sum(len(r) * w + f for r, w in got)
        s = sorted(e.tolist())
        best = min(sum((j - i) * s[j - 1] + f for i, j in zip((0, *c), (*c, B)))
                   for k in range(min(K, B)) for c in combinations(range(1, B), k))
        assert cost == best, (trial, ext.tolist(), K, f, got)


@pytest.mark.parametrize("name", ["llama", "opt", "qwen2"])
@pytest.mark.parametrize("fused", [False, True])
def test_sub_batches_by_length_equal_the_whole_rows(name, fused, monkeypatch):
    """rollout.length_buckets: the responses on their prompts' cache in sub-batches by length, each at its own
    width: log-probs, entropy, values and gradients those of the rows run whole, to fp32 rounding."""
    monkeypatch.setattr(roles, "BUCKET_FORWARD_TOKENS", 0)  # every cut that saves a position is taken
    seqs, mask, pos, rmask, P = rows(U=3, n=5, T=9, seed=11)
    policy = Policy(family(name), fused=fused)
    policy.length_buckets = 4
    calls = []
    hf_base_model(policy).get_input_embeddings().register_forward_hook(lambda m, a, out: calls.append(a[0].shape))
    kw = dict(targets=seqs[:, P:], start=P - 1, temperature=0.7, with_entropy=True)
    whole, ent_whole = policy(seqs, mask, pos, **kw)
    calls.clear()
    shared, ent_shared = policy(seqs, mask, pos, prompt_len=P, **kw)
    widths = sorted(s[1] for s in calls[1:])
    assert calls[0] == (3, P) and len(calls) == 5 and widths[0] < widths[-1] <= 9  # 3 prompts, 4 tails
    m = rmask.bool()
    assert (shared - whole)[m].abs().max() < 2e-6 and (ent_shared - ent_whole)[m].abs().max() < 2e-6
    weight = torch.randn(rmask.shape, generator=torch.Generator().manual_seed(1)) * rmask
    assert_grads_close(grads(policy, whole, weight), grads(policy, shared, weight))
    if not fused and name != "qwen2":
        critic = ValueModel(family(name, value=True))
        critic.length_buckets = 4
        whole, shared = critic(seqs, mask, pos), critic(seqs, mask, pos, prompt_len=P)
        assert (shared - whole)[mask.bool()].abs().max() < 2e-6
        weight = torch.randn(seqs.shape, generator=torch.Generator().manual_seed(2)) * mask
        assert_grads_close(grads(critic, whole, weight), grads(critic, shared, weight))


def test_length_buckets_auto_and_config(monkeypatch):
    """null = 8 on the CPU with whole parameters; the config refuses < 1 and a run without shared prompts."""
    seqs, mask, _, _, P = rows(U=2, n=8, T=9, seed=12)
    monkeypatch.setattr(roles, "BUCKET_FORWARD_TOKENS", 0)
    assert len(roles._sub_batches(family("llama"), mask[:, P:], None)) > 1
    assert len(roles._sub_batches(family("llama"), mask[:, P:], 1)) == 1
    cfg = lambda *o: C.to_config(C.compose("ppo", ["algorithm=grpo", *o]), C.PPOConfig)  # noqa: E731
    for bad, match in ((["rollout.length_buckets=0"], "rollout.length_buckets must be >= 1"),
                       (["rollout.length_buckets=4", "rollout.shared_prompt_forward=false"], "leave it null")):
        with pytest.raises(ConfigError, match=match):
            validate_ppo(cfg(*bad), init_distributed())


@pytest.mark.parametrize("name", ["llama", "opt"])
def test_values_and_gradients_equal_the_whole_rows(name):
    seqs, mask, pos, _, P = rows()
    critic = ValueModel(family(name, value=True))
    whole, shared = critic(seqs, mask, pos), critic(seqs, mask, pos, prompt_len=P)
    assert shared.shape == whole.shape == seqs.shape
    assert (shared - whole)[mask.bool()].abs().max() < 2e-6  # prompt positions too: every real position
    weight = torch.randn(seqs.shape, generator=torch.Generator().manual_seed(2)) * mask
    assert_grads_close(grads(critic, whole, weight), grads(critic, shared, weight))


def test_a_lora_policy_trains_its_adapters_alike():
    from peft import LoraConfig, get_peft_model

    seqs, mask, pos, rmask, P = rows(seed=3)
    lm = get_peft_model(family("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
    policy = Policy(lm)
    kw = dict(targets=seqs[:, P:], start=P - 1)
    whole, _ = policy(seqs, mask, pos, **kw)
    shared, _ = policy(seqs, mask, pos, prompt_len=P, **kw)
    assert (shared - whole)[rmask.bool()].abs().max() < 2e-6
    a, b = grads(policy, whole, rmask), grads(policy, shared, rmask)
    assert len(a) == 8  # the adapters' A and B of q_proj and v_proj in 2 layers, and nothing else
    assert_grads_close(a, b)


def test_distinct_prompts_run_whole_and_groups_are_found():
    seqs, mask, pos, _, P = rows(U=3, n=1)
    assert prompt_groups(seqs, mask, P) is None
    assert shared_prompt_forward(family("llama"), "logits", seqs, mask, pos, P) is None
    seqs, mask, pos, _, P = rows(U=3, n=4)
    first, inverse = prompt_groups(seqs, mask, P)
    assert len(first) == 3 and torch.equal(seqs[first[inverse], :P], seqs[:, :P])
    # the same ids under another mask are another prompt (a pad id that is also a real token)
    mask2 = mask.clone()
    mask2[0, :P] = 1
    assert len(prompt_groups(seqs, mask2, P)[0]) == 4
    with pytest.raises(ValueError, match="attention mask"):
        Policy(family("llama"))(seqs, None, pos, targets=seqs[:, P:], start=P - 1, prompt_len=P)


def test_generate_prefills_each_prompt_once_with_the_same_tokens():
    seqs, mask, _, _, P = rows(U=3, n=4, seed=5)
    ids, pmask = seqs[:, :P], mask[:, :P]
    lm = family("llama")
    seen = []
    lm.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape), with_kwargs=True)
    for params, seeds in ((SamplingParams(max_new_tokens=6, greedy=True), None),
                          (SamplingParams(max_new_tokens=6, temperature=1.0), torch.arange(12) * 7 + 1)):
        seen.clear()
        a = G.hf_generate(lm, ids, pmask, params, eos_token_id=EOS, pad_token_id=PAD, return_logprobs=True,
                          row_seeds=seeds)
        assert seen[0] == (3, P - 1) and seen[1] == (12, 1)  # 3 prompts' prefill, then every row's last prompt token
        with mock.patch.object(G, "shared_prompt_cache", lambda *a: None):
            b = G.hf_generate(lm, ids, pmask, params, eos_token_id=EOS, pad_token_id=PAD, return_logprobs=True,
                              row_seeds=seeds)
        assert torch.equal(a.sequences, b.sequences) and torch.equal(a.response_mask, b.response_mask)
        assert (a.logprobs - b.logprobs).abs().max() < 2e-6


def test_scoring_and_reward_scores_equal_the_whole_rows():
    engine = TrainEngine(family("llama"), EngineConfig(stage=0, generation="hf"), OptimConfig(lr=1e-3),
                         total_steps=1, info=init_distributed())
    seqs, mask, _, _, P = rows(U=3, n=4, seed=7)
    torch.manual_seed(3)
    r = generate(engine, {"input_ids": seqs[:, :P], "attention_mask": mask[:, :P]}, torch.arange(12) // 4,
                 SamplingParams(max_new_tokens=8, temperature=0.8), EOS, PAD)
    models = {"actor": Policy(engine.unwrapped), "reference": Policy(family("qwen2", seed=1)),
              "critic": ValueModel(family("llama", value=True, seed=2))}
    kw = dict(**models, micro_batch_size=6, temperature=0.8)
    whole = score_rollout(r.sequences, r.attention_mask, r.prompt_len, **kw)
    shared = score_rollout(r.sequences, r.attention_mask, r.prompt_len, **kw, shared_prompts=True)
    m = r.response_mask.bool()
    for key in ("logp_old", "logp_ref", "values"):
        assert (shared[key] - whole[key])[m].abs().max() < 2e-6, key
    rm = SimpleNamespace(model=ValueModel(family("opt", value=True, seed=4)))
    a, b = RewardModelScore(rm, 12).score(r), RewardModelScore(rm, 12, shared_prompts=True).score(r)
    assert a.shape == (12,) and (a - b).abs().max() < 2e-6 and a.std() > 0


def test_config_resolves_and_refuses_packing():
    cfg = lambda *o: C.to_config(C.compose("ppo", ["algorithm=grpo", *o]), C.PPOConfig)  # noqa: E731
    assert shared_prompts(cfg()) is True
    assert shared_prompts(cfg("data.packing=true")) is False
    assert shared_prompts(cfg("rollout.shared_prompt_forward=false")) is False
    bad = cfg("data.packing=true", "rollout.shared_prompt_forward=true")
    with pytest.raises(ConfigError, match="rollout.shared_prompt_forward=true .* data.packing=true"):
        validate_ppo(bad, init_distributed())


RUN = [*SMALL_MODEL, "algorithm=grpo", "reward.sources=[judge]", "rollout.prompts_per_step=4",
       "rollout.n_samples_per_prompt=4", "rollout.mini_batch_size=8", "rollout.micro_batch_size=4",
       "train.eval_every=0", "train.save_every=0", "data.num_eval_prompts=4", "engine.precision=fp32",
       "ppo.kl_loss_coef=0.05", "train.max_steps=3"]


@pytest.mark.slow
def test_a_grpo_run_is_the_whole_rows_run_to_rounding(tmp_path):
    """The stage wires the option through generation, scoring and the update: the same samples and
    the same losses (to rounding) with it on and off, and on with activation checkpointing."""
    sft = tmp_path / "sft"
    run_stage("sft", f"output_dir={sft}", *SMALL_MODEL, "train.max_steps=2", "train.eval_every=0",
              "train.save_every=0", "data.num_eval_prompts=4")
    runs = {}
    for name, over in (("true", []), ("false", []), ("ckpt", ["engine.activation_checkpointing=true"])):
        out = tmp_path / name
        run_stage("ppo", f"output_dir={out}", f"actor.model={sft / 'model'}", *RUN,
                  f"rollout.shared_prompt_forward={'false' if name == 'false' else 'true'}", *over)
        runs[name] = metrics(out, "train")
    # activation checkpointing: the scoring shares prompts, the update runs whole rows (a checkpointed
    # block has no KV cache), and the run is the same again
    assert "the update's run whole rows" in (tmp_path / "ckpt" / "ppo.log").read_text()
    on, off = runs["true"], runs["false"]
    assert len(on) == len(off) == len(runs["ckpt"]) == 3
    for a, b in [*zip(on, off), *zip(runs["ckpt"], off)]:
        assert a["response_len"] == b["response_len"] and a["reward"] == b["reward"], (a, b)
        for key in ("actor_loss", "kl_loss", "entropy", "approx_kl"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (key, a[key], b[key])


# ----------------------------------------------------------------------------- pair stages (data.shared_prompts)


def pair_feats(n: int = 5, seed: int = 0) -> list[dict]:
    """Pair features as tokenize_pairs writes them: a prompt part (bos + prompt) of several lengths and two
    responses (+ eos) of several lengths each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, c, r = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((2, 9), (1, 6), (1, 6)))
        prompt = [1] + torch.randint(3, VOCAB, (p - 1,), generator=g).tolist()
        out.append({"chosen_ids": prompt + torch.randint(3, VOCAB, (c,), generator=g).tolist() + [EOS],
                    "rejected_ids": prompt + torch.randint(3, VOCAB, (r,), generator=g).tolist() + [EOS],
                    "prompt_len": p, "index": i})
    return out


def test_a_shared_pair_batch_is_laid_out_as_a_rollout():
    feats = [{"chosen_ids": [1, 5, 6, 7, 2], "rejected_ids": [1, 5, 6, 8, 9, 2], "prompt_len": 3},
             {"chosen_ids": [1, 4, 3, 2], "rejected_ids": [1, 4, 2], "prompt_len": 2}]
    b = collate_shared_pairs(feats, PAD, labels=True)
    X = -100
    assert b["prompt_len"] == 3 and b["shared_prompts"] is True
    assert b["input_ids"].tolist() == [[1, 5, 6, 7, 2, 0], [0, 1, 4, 3, 2, 0], [1, 5, 6, 8, 9, 2], [0, 1, 4, 2, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0], [1] * 6, [0, 1, 1, 1, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 1, 2, 3, 3], [0, 1, 2, 3, 4, 5], [0, 0, 1, 2, 2, 2]]
    assert b["labels"].tolist() == [[X, X, X, 7, 2, X], [X, X, X, 3, 2, X], [X, X, X, 8, 9, 2], [X, X, X, 2, X, X]]
    # the same rows as collate_pairs' right-padded whole rows, token for token
    whole = collate_pairs(feats, PAD)
    for i in range(4):
        assert b["input_ids"][i][b["attention_mask"][i].bool()].tolist() == \
            whole["input_ids"][i][whole["attention_mask"][i].bool()].tolist()


@pytest.mark.parametrize("name", ["llama", "opt", "qwen2"])
def test_reward_scores_and_gradients_of_shared_pairs_equal_the_whole_rows(name):
    feats = pair_feats(seed=1)
    model = ValueModel(family(name, value=True))
    seen = []
    model.inner.base_model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape),
                                                     with_kwargs=True)
    whole = batch_scores(model, collate_pairs(feats, PAD))
    b = collate_shared_pairs(feats, PAD)
    seen.clear()
    shared = batch_scores(model, b)
    # 5 prompts, then 10 responses
    assert seen == [(5, b["prompt_len"]), (10, b["input_ids"].shape[1] - b["prompt_len"])]
    assert shared.shape == (10,) and (shared - whole).abs().max() < 2e-6 and whole.std() > 0
    weight = torch.randn(10, generator=torch.Generator().manual_seed(2))
    assert_grads_close(grads(model, whole, weight), grads(model, shared, weight))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", ["llama", "opt"])
def test_dpo_logps_and_gradients_of_shared_pairs_equal_the_whole_rows(name, fused):
    feats = pair_feats(seed=3)
    policy = Policy(family(name), fused=fused)
    idx = list(range(len(feats)))
    (whole, n_whole), (shared, n_shared) = (response_logps(policy, pair_batch(feats, idx, PAD, shared=s))
                                            for s in (False, True))
    assert torch.equal(n_whole, n_shared)
    assert n_whole.tolist() == [len(f[k]) - f["prompt_len"] for k in ("chosen_ids", "rejected_ids") for f in feats]
    assert (shared - whole).abs().max() < 1e-5 * whole.abs().max()
    weight = torch.randn(10, generator=torch.Generator().manual_seed(4))
    a = grads(policy, response_logps(policy, pair_batch(feats, idx, PAD))[0], weight)
    b = grads(policy, response_logps(policy, pair_batch(feats, idx, PAD, shared=True))[0], weight)
    assert_grads_close(a, b)


def test_pair_config_resolves_and_refuses():
    cfg = lambda app, kind, *o: C.to_config(C.compose(app, list(o)), kind)  # noqa: E731
    rw = lambda *o: cfg("reward", C.RewardConfig, *o)  # noqa: E731
    assert pair_shared_prompts(rw().data, rw().engine) is None  # auto: pair_layout per micro-batch
    for over in (["data.packing=true"], ["engine.activation_checkpointing=true"], ["data.shared_prompts=false"]):
        c = rw(*over)
        assert pair_shared_prompts(c.data, c.engine) is False, over
    c = rw("data.packing=false", "data.shared_prompts=true")
    assert pair_shared_prompts(c.data, c.engine) is True
    info = init_distributed()
    with pytest.raises(ConfigError, match="data.shared_prompts=true .* data.packing=true"):
        validate_reward(rw("data.packing=true", "data.shared_prompts=true"), info)
    with pytest.raises(ConfigError, match="data.shared_prompts=true .* engine.activation_checkpointing"):
        validate_dpo(cfg("dpo", C.DPOConfig, "engine.activation_checkpointing=true", "data.shared_prompts=true"), info)
    with pytest.raises(ConfigError, match="data.shared_prompts=true .* an SFT row has no partner"):
        validate_sft(cfg("sft", C.SFTConfig, "data.shared_prompts=true"), info)
    with pytest.raises(ConfigError, match="data.shared_prompts is the pair stages'.*rollout.shared_prompt_forward"):
        validate_ppo(cfg("ppo", C.PPOConfig, "data.shared_prompts=false"), info)


def test_auto_takes_the_layout_that_computes_the_fewest_positions():
    """data.shared_prompts=null with data.packing=auto: the shipped pairs' shape (long prompts, short responses of
    close lengths) runs shared, a long-tailed mix packs, and pairs whose long prompt meets another's long
    response stay padded (shared would compute more); true and data.packing=true force their layout."""
    def pair(p, c, r):
        return {"chosen_ids": [5] * (p + c), "rejected_ids": [6] * p + [7] * r, "prompt_len": p}

    shipped = [pair(p, 7, 6) for p in (35, 31, 38, 40)]  # padded 8 x 47 = 376 slots, shared 4 x 40 + 8 x 7 = 216
    tail = [pair(4, c, r) for c, r in ((60, 4), (5, 6), (4, 8), (7, 5))]  # padded 8 x 64, shared 4 x 4 + 8 x 60,
    crossed = [pair(10, 1, 1), pair(1, 10, 10)]  # packed 3 x 64: padded 4 x 11 = 44, shared 2 x 10 + 4 x 10 = 60
    assert pair_layout(shipped, 64, True, None) == "shared" and pair_layout(shipped, None, False, None) == "shared"
    assert pair_layout(tail, 64, True, None) == "packed" and pair_layout(tail, None, False, None) == "shared"
    assert pair_layout(crossed, 11, True, None) == "padded" and pair_layout(crossed, None, False, None) == "padded"
    assert pair_layout(shipped, 64, True, False) == "padded" and pair_layout(crossed, 11, True, True) == "shared"
    assert pair_layout(shipped, 64, False, None) == "packed"  # data.packing=true packs every batch


PAIR_RUN = [*SMALL_MODEL, "model.name_or_path=null", "train.max_steps=4", "train.micro_batch_size=4",
            "train.global_batch_size=8", "train.log_every=1", "train.lr=3e-3", "train.warmup_steps=0",
            "train.eval_every=2", "train.save_every=0", "data.eval_size=16", "data.num_eval_prompts=4",
            "engine.precision=fp32"]


@pytest.mark.slow
@pytest.mark.parametrize("stage,over", [("reward", []), ("dpo", []), ("dpo", ["dpo.loss_type=kto"])])
def test_a_pair_stage_run_is_the_whole_rows_run_to_rounding(tmp_path, stage, over):
    """The reward and DPO (and KTO) stages with data.shared_prompts on and off: the same losses and held-out
    figures to fp32 rounding, step by step (accumulated micro-batches, the head-only phase included)."""
    runs = {}
    for flag in ("true", "false"):
        out = tmp_path / flag
        run_stage(stage, f"output_dir={out}", *PAIR_RUN, *over, f"data.shared_prompts={flag}", "data.packing=false",
                  "reward.head_only_fraction=0.5" if stage == "reward" else "dpo.beta=0.5")
        runs[flag] = metrics(out)
    assert "each pair's prompt runs once" in (tmp_path / "true" / f"{stage}.log").read_text()
    assert "each pair's prompt runs once" not in (tmp_path / "false" / f"{stage}.log").read_text()
    on, off = runs["true"], runs["false"]
    assert [r["kind"] for r in on] == [r["kind"] for r in off] and len([r for r in on if r["kind"] == "train"]) == 4
    compared = 0
    for a, b in zip(on, off):
        for key, x in b.items():
            if key in ("loss", "accuracy", "margin", "kl", "chosen_score", "rejected_score", "reward_chosen",
                       "grad_norm") and isinstance(x, float):
                assert abs(a[key] - x) <= 1e-5 * max(1.0, abs(x)), (a["kind"], key, a[key], x)
                compared += 1
    assert compared >= 12
