"""Packed (padding-free) batches equal padded ones: SFT loss and gradients, reward scores, loss and
gradients, DPO log-probs; Llama and OPT built from tiny configs, fp32; one process and 2 gloo ranks
under ZeRO-3 (tests/engine_scripts/packing.py)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from rlhf.config import ConfigError, DataConfig
from rlhf.config.validate import validate_data
from rlhf.data import collate_pairs, collate_sft
from rlhf.data.packing import batch_tokens, pack_bins, pack_pairs, pack_sft
from rlhf.data.tokenize import IGNORE_INDEX
from rlhf.modeling.forward import batch_scores, sft_loss
from rlhf.modeling.load import use_packing
from rlhf.modeling.roles import Policy, ValueModel
from rlhf.reward import make_loss

VOCAB, PAD = 61, 0
LENGTHS = [7, 23, 1, 16, 3, 30, 12, 9]  # ragged, one single-token row


def tiny(family: str, head: str, seed: int = 0) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       pad_token_id=PAD)
    else:  # OPT: learned positions (position_ids + 2), post-ln off, no dropout
        cfg = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
                                     pad_token_id=PAD)
    if head == "value":
        cfg.num_labels = 1
    cls = getattr(transformers, f"{'Llama' if family == 'llama' else 'OPT'}For"
                                f"{'CausalLM' if head == 'lm' else 'SequenceClassification'}")
    return cls(cfg)


def sft_rows(seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in LENGTHS:
        ids = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        p = min(n - 1, max(1, n // 3))  # prompt part: -100
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * p + ids[p:]})
    return rows


def pair_rows(seed: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(LENGTHS[:6]):
        c = torch.randint(1, VOCAB, (n + 1,), generator=g).tolist()
        r = c[: max(1, n // 2)] + torch.randint(1, VOCAB, (n % 5 + 1,), generator=g).tolist()
        rows.append({"chosen_ids": c, "rejected_ids": r, "prompt_len": 1, "index": i})
    return rows


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def loss_and_grads(loss_fn, model: torch.nn.Module, batch: dict) -> tuple:
    """`loss_fn(model, batch)` = (loss, weight, metrics), its backward, and the gradients it left."""
    loss, n, metrics = loss_fn(model, batch)
    loss.backward()
    return loss, n, metrics, grads(model)


def assert_grads_close(a: dict, b: dict, dtype: torch.dtype) -> None:
    """fp32: the whole gradient within 1e-5 (relative norm), each parameter's within 1e-4 (summation
    order differs between the [B, L] and [P, T] shapes: measured up to 2e-5 on one OPT layer norm's bias);
    fp64: each parameter's within 1e-10, so the packed computation is the padded one, not an approximation.
    A gradient that is analytically 0 (the key bias: softmax ignores a constant added to every key's
    score) is rounding noise, held to 1e-4 of the total norm."""
    assert a.keys() == b.keys() and len(a) > 5
    flat_a, flat_b = torch.cat([a[n].flatten() for n in a]), torch.cat([b[n].flatten() for n in a])
    total = flat_b.norm()
    per_param = 1e-4 if dtype == torch.float32 else 1e-10
    if dtype == torch.float32:
        assert (flat_a - flat_b).norm() / total <= 1e-5
    for n in a:
        err = (a[n] - b[n]).norm() / torch.maximum(b[n].norm(), 1e-4 * total)
        assert err <= per_param, f"{n}: relative gradient error {err:.2e}"


# ---------------------------------------------------------------- layout


def test_pack_bins_first_fit_decreasing_then_evened():
    # first-fit decreasing needs 3 packs (8+2, 6+3, 5: the fullest 10); longest first into the least
    # filled of 3 packs gives 8, 6+2, 5+3: the fullest 8, so packs of 8 tokens
    assert pack_bins([5, 3, 8, 2, 6], 10) == [[2], [4, 3], [0, 1]]
    assert pack_bins([6, 5, 4, 3], 9) == [[0, 3], [1, 2]]  # 6+3, 5+4 either way
    assert pack_bins([5, 3, 8], 0) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="does not fit"):
        pack_bins([11], 10)


def test_pack_sft_layout():
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    b = pack_sft(rows, PAD, 0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert b["labels"].tolist() == [[-100, 6, 7, -100, 9]]  # a row's first token is never a target
    assert b["attention_mask"] is None and batch_tokens(b) == 5
    b = pack_sft(rows, PAD, 4)  # packs of at most 4 tokens, as long as the fullest: a pad tail with its own positions
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 9, PAD]]
    assert b["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    assert b["row_pack"].tolist() == [0, 1] and b["row_end"].tolist() == [2, 1]
    assert b["row_id"].tolist() == [[0, 0, 0], [1, 1, -1]]
    rows.append({"input_ids": [4], "labels": [4]})  # joins the 2-token row (evened packs): no padding
    b = pack_sft(rows, PAD, 4)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 9, 4]]
    assert b["labels"].tolist() == [[-100, 6, 7], [-100, 9, -100]]
    assert b["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]] and b["row_end"].tolist() == [2, 1, 2]


# ---------------------------------------------------------------- equality with the padded batch


@pytest.mark.parametrize("family", ["llama", "opt"])
@pytest.mark.parametrize("pack_length", [0, 32])
@pytest.mark.parametrize("fused,dtype", [(False, torch.float32), (True, torch.float32), (False, torch.float64)])
def test_sft_loss_and_grads_equal_padded(family, pack_length, fused, dtype):
    policy = Policy(tiny(family, "lm"), fused=fused).to(dtype)
    rows = sft_rows()
    padded = collate_sft(rows, PAD)
    packed = pack_sft(rows, PAD, pack_length)
    assert packed["input_ids"].numel() < padded["input_ids"].numel()
    loss_a, n_a, _, g_a = loss_and_grads(sft_loss, policy, padded)
    loss_b, n_b, _, g_b = loss_and_grads(sft_loss, policy, packed)
    assert int(n_a) == int(n_b) == sum(sum(t != IGNORE_INDEX for t in r["labels"][1:]) for r in rows)
    assert loss_b.item() == pytest.approx(loss_a.item(), rel=1e-5)
    assert_grads_close(g_b, g_a, dtype)


@pytest.mark.parametrize("family", ["llama", "opt"])
@pytest.mark.parametrize("pack_length", [0, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reward_scores_loss_and_grads_equal_padded(family, pack_length, dtype):
    model = ValueModel(tiny(family, "value")).to(dtype)
    rows = pair_rows()
    padded, packed = collate_pairs(rows, PAD), pack_pairs(rows, PAD, pack_length)
    loss_fn = make_loss(margin=0.1, score_reg=0.01)
    with torch.no_grad():
        s_a, s_b = batch_scores(model, padded), batch_scores(model, packed)
    assert s_a.shape == (2 * len(rows),) and s_a.abs().min() > 0
    torch.testing.assert_close(s_b, s_a, rtol=1e-5, atol=1e-6)
    loss_a, n_a, m_a, g_a = loss_and_grads(loss_fn, model, padded)
    loss_b, n_b, m_b, g_b = loss_and_grads(loss_fn, model, packed)
    assert n_a == n_b == len(rows)
    assert loss_b.item() == pytest.approx(loss_a.item(), rel=1e-5)
    assert m_b["accuracy"].item() == m_a["accuracy"].item()
    assert_grads_close(g_b, g_a, dtype)


# ---------------------------------------------------------------- config


def test_use_packing_auto_true_false():
    llama = tiny("llama", "lm")
    assert use_packing("auto", llama) and use_packing(True, llama) and not use_packing(False, llama)
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2))
    assert use_packing("auto", gpt2) is False  # falls back to padded batches
    with pytest.raises(ConfigError, match=r"data.packing=true: model_type 'gpt2'"):
        use_packing(True, gpt2)


def test_stage_pack_length_is_the_stages_rule():
    """The pack width SFT / reward / DPO (and the planner) batch with: data.pack_length resolved where the model
    packs, None (padded) at data.packing=false, on a model that does not pack at auto, and under
    data.shared_prompts=true; true on a model that does not pack is the ConfigError naming the key."""
    from types import SimpleNamespace

    from rlhf.modeling.load import stage_pack_length

    packable, why = None, "model_type 'gpt2' is not one of ..."
    d = lambda packing, pack_length=None: SimpleNamespace(packing=packing, pack_length=pack_length, max_len=64)  # noqa: E731
    assert stage_pack_length(d("auto"), packable) == 64 and stage_pack_length(d(True, 0), packable) == 0
    assert stage_pack_length(d("auto", 256), packable, shared=None) == 256  # auto shared: per micro-batch
    assert stage_pack_length(d(False), packable) is None and stage_pack_length(d("auto"), why) is None
    assert stage_pack_length(d("auto"), packable, shared=True) is None
    with pytest.raises(ConfigError, match="data.packing=true: model_type 'gpt2'"):
        stage_pack_length(d(True), why)


def test_validate_data_packing_keys():
    with pytest.raises(ConfigError, match="data.packing must be auto, true or false"):
        validate_data(DataConfig(path="x", packing="yes"))
    with pytest.raises(ConfigError, match=r"data.pack_length must be .* >= data.max_len \(64"):
        validate_data(DataConfig(path="x", pack_length=32))
    validate_data(DataConfig(path="x", pack_length=0))
    validate_data(DataConfig(path="x", pack_length=256))


# ---------------------------------------------------------------- 2 ranks, ZeRO-3


def _launch(out: str, nproc: int) -> subprocess.Popen:
    script = os.path.join(os.path.dirname(__file__), "engine_scripts", "packing.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, script, out]
    if nproc > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
               "127.0.0.1", "--master_port", str(port), *cmd[1:]]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_packed_equals_padded_two_ranks_zero3(tmp_path):
    """2 gloo ranks under ZeRO-3, 2 micro-batches each: packed steps give the padded steps' losses and
    parameters, and both equal one process (the normalisation is exact across packs, accumulation, ranks)."""
    procs = {n: _launch(str(tmp_path), n) for n in (2, 1)}
    for n, proc in procs.items():
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output[-4000:]
    res = {n: json.load(open(tmp_path / f"{n}.json")) for n in (1, 2)}
    for kind in ("sft", "reward"):
        ref = res[1][f"{kind}_padded"]
        for n, mode in ((2, "padded"), (2, "packed"), (1, "packed")):
            got = res[n][f"{kind}_{mode}"]
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), (kind, n, mode)
            for name, norm in ref["param_norms"].items():
                assert got["param_norms"][name] == pytest.approx(norm, rel=1e-5), (kind, n, mode, name)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_dpo_response_logps_equal_padded(family):
    from rlhf.dpo import pair_batch, response_logps

    policy = Policy(tiny(family, "lm"))
    feats = [{**f, "prompt_len": 1 + i % 2} for i, f in enumerate(pair_rows())]
    table = torch.randn(len(feats), 2)
    idx = [4, 0, 2, 5]
    padded, packed = pair_batch(feats, idx, PAD, table), pair_batch(feats, idx, PAD, table, pack_length=0)
    assert torch.equal(packed["ref"], padded["ref"])
    with torch.no_grad():
        (lp_a, n_a), (lp_b, n_b) = response_logps(policy, padded), response_logps(policy, packed)
    assert lp_a.shape == (8,) and torch.equal(n_a, n_b) and n_a.sum() > 8
    torch.testing.assert_close(lp_b, lp_a, rtol=1e-5, atol=1e-5)


def test_packing_saves_only_when_rows_share_packs():
    from rlhf.data.packing import packing_saves

    assert not packing_saves([43, 40, 45], 64)  # no two fit in 64: three packs of the longest -> padded
    assert packing_saves([43, 20, 45], 64)  # 43 + 20 share a pack: 2 x 45 < 3 x 45
    assert packing_saves([43, 40, 45], 0) and not packing_saves([5, 5], 0)  # one row of 128 < 3 x 45; 10 = 2 x 5


# ---------------------------------------------------------------- the RL stage's scoring / training passes


@pytest.mark.parametrize("family", ["llama", "opt"])
@pytest.mark.parametrize("pack_length", [0, 40])
def test_rollout_logprobs_values_scores_equal_padded(family, pack_length):
    """A rollout batch (prompts left-padded, responses right-padded): log-probs (and entropy, and their
    gradients), critic values and reward scores on the repacked real tokens equal the padded ones."""
    from rlhf.algos.reward_model import sequence_scores
    from rlhf.rl.rewards import RewardModelScore
    from rlhf.modeling.forward import Repacked, position_ids_from_mask, row_values, token_logprobs, token_values

    g = torch.Generator().manual_seed(4)
    B, P, T = 5, 7, 9
    seqs = torch.randint(1, VOCAB, (B, P + T), generator=g)
    prompt = torch.tensor([7, 3, 5, 1, 6])
    resp = torch.tensor([9, 2, 0, 5, 9])  # a row with an empty response
    col = torch.arange(P + T)
    mask = ((col[None] >= P - prompt[:, None]) & (col[None] < P + resp[:, None])).long()
    seqs = seqs * mask
    base = {"sequences": seqs, "attention_mask": mask, "position_ids": position_ids_from_mask(mask), "prompt_len": P}
    packed = {**base, "pack_length": pack_length}
    assert Repacked(seqs, mask, pack_length).input_ids.numel() < seqs.numel()
    rmask = (col[None, P:] < P + resp[:, None]).float()  # response tokens [B, T]
    policy = Policy(tiny(family, "lm"))
    (la, ea), (lb, eb) = (token_logprobs(policy, b, 0.7, with_entropy=True) for b in (base, packed))
    torch.testing.assert_close(lb * rmask, la * rmask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eb * rmask, ea * rmask, rtol=1e-5, atol=1e-5)
    (la * rmask).sum().backward()
    g_a = grads(policy)
    (lb * rmask).sum().backward()
    assert_grads_close(grads(policy), g_a, torch.float32)
    critic = ValueModel(tiny(family, "value"))
    with torch.no_grad():
        va, vb = token_values(critic, base), token_values(critic, packed)
        vmask = rmask.bool()
        torch.testing.assert_close(vb[vmask], va[vmask], rtol=1e-5, atol=1e-6)
        sa = sequence_scores(row_values(critic, base), mask)
        sb = sequence_scores(row_values(critic, packed), mask)
        torch.testing.assert_close(sb, sa, rtol=1e-5, atol=1e-6)
    # the PPO reward source (the frozen reward model) packs its forwards too, with the same scores
    rollout, engine, packed_calls = SimpleNamespace(sequences=seqs, attention_mask=mask), SimpleNamespace(model=critic), []
    hook = critic.register_forward_pre_hook(lambda m, args: packed_calls.append(args[1] is None))
    padded_scores = RewardModelScore(engine, 2).score(rollout)
    packed_scores = RewardModelScore(engine, 2, pack_length).score(rollout)
    hook.remove()
    assert packed_calls == [False] * 3 + [True] * 3  # 5 rows in micro-batches of 2: padded, then packed
    torch.testing.assert_close(packed_scores, padded_scores, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(padded_scores, sa, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_ppo_with_packing_true_matches_padded(tiny_stages, tmp_path):
    """The RL stage with data.packing=true (scoring and both losses on packed rows) trains as the padded
    run: the same first-step KL, reward and losses (to rounding; the rollout is sampled from the same
    seed before any packed forward, so step 1's inputs are identical)."""
    from conftest import metrics, run_stage

    common = [f"actor.model={tiny_stages / 'sft'}", f"critic.model={tiny_stages / 'reward'}", "train.max_steps=2",
              "train.eval_every=0", "train.save_every=0", "rollout.prompts_per_step=8", "rollout.mini_batch_size=8",
              "rollout.micro_batch_size=4", "rollout.max_new_tokens=6", "eval.max_new_tokens=6",
              "data.num_eval_prompts=4"]
    for packing in ("false", "true"):
        run_stage("ppo", f"output_dir={tmp_path / packing}", *common, f"data.packing={packing}", timeout=400)
    a, b = metrics(tmp_path / "false", "train")[0], metrics(tmp_path / "true", "train")[0]
    keys = [k for k in ("kl", "reward", "actor_loss", "critic_loss", "score") if k in a]
    assert len(keys) >= 3, sorted(a)
    for k in keys:
        assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), k
