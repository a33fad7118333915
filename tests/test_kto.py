"""KTO (dpo.loss_type=kto): `kto_loss` against the paper's formula on hand-made cases (values, gradients,
the reference point's clamp and detach), the unpaired rows and the split pairs of the data layer, the
mismatched KL rows, and `python -m rlhf.dpo dpo.loss_type=kto` through its command line."""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from conftest import ROOT, metrics, run_stage, summary
from rlhf.algos.preference import kto_loss, kto_means, kto_stats, kto_weight_advice, sequence_logps
from rlhf.core.errors import DataFormatError
from rlhf.data import mismatched_rows, parse_unpaired, tokenize_unpaired


def s(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# Three rows (desirable, undesirable, desirable) and their three mismatched rows.
POL, REF = torch.tensor([-2.0, -5.0, -3.0]), torch.tensor([-3.0, -4.0, -3.0])
DES = torch.tensor([True, False, True])
POL_KL, REF_KL = torch.tensor([-6.0, -7.0, -5.0]), torch.tensor([-7.0, -7.0, -6.0])  # log-ratios 1, 0, 1
BETA = 0.5
Z0 = BETA * 2 / 3  # beta x mean(1, 0, 1)
R = [BETA * 1, BETA * -1, 0.0]  # beta (logp - ref)


# ----------------------------------------------------------------------------- kto_loss by hand


def test_values_follow_the_paper():
    losses, rewards, kl = kto_loss(POL, REF, DES, POL_KL, REF_KL, beta=BETA)
    assert kl.item() == pytest.approx(2 / 3)
    assert rewards.tolist() == pytest.approx(R)
    want = [1 - s(R[0] - Z0), 1 - s(Z0 - R[1]), 1 - s(R[2] - Z0)]
    assert losses.tolist() == pytest.approx(want, rel=1e-6)
    # the weights scale each kind's losses only
    weighted, _, _ = kto_loss(POL, REF, DES, POL_KL, REF_KL, beta=BETA, desirable_weight=2.0, undesirable_weight=0.5)
    assert weighted.tolist() == pytest.approx([2 * want[0], 0.5 * want[1], 2 * want[2]], rel=1e-6)


def test_gradients_by_hand_and_the_reference_point_is_detached():
    pol, pol_kl = POL.clone().requires_grad_(), POL_KL.clone().requires_grad_()
    lam_d, lam_u = 2.0, 0.5
    losses, _, _ = kto_loss(pol, REF, DES, pol_kl, REF_KL, beta=BETA, desirable_weight=lam_d, undesirable_weight=lam_u)
    losses.sum().backward()
    ds = lambda x: s(x) * (1 - s(x))  # noqa: E731 -- sigmoid'
    # d/dlogp lam_D (1 - s(beta logp - ...)) = -lam_D beta s'; undesirable: + lam_U beta s'(z0 - r)
    want = [-lam_d * BETA * ds(R[0] - Z0), lam_u * BETA * ds(Z0 - R[1]), -lam_d * BETA * ds(R[2] - Z0)]
    assert pol.grad.tolist() == pytest.approx(want, rel=1e-6)
    assert pol_kl.grad is None  # z0 is a constant to the loss: no gradient reaches the mismatched rows


def test_the_reference_point_is_clamped_at_zero():
    # the policy gives the mismatched responses less mass than the reference: the KL estimate is < 0
    losses, _, kl = kto_loss(POL, REF, DES, REF_KL - 1.0, REF_KL, beta=BETA)
    assert kl.item() == 0.0
    assert losses.tolist() == pytest.approx([1 - s(R[0]), 1 - s(-R[1]), 1 - s(R[2])], rel=1e-6)


def test_policy_equal_to_reference_gives_one_half_everywhere():
    losses, rewards, kl = kto_loss(REF, REF, DES, REF_KL, REF_KL, beta=BETA)
    assert losses.tolist() == [0.5] * 3 and rewards.tolist() == [0.0] * 3 and kl.item() == 0.0


def test_a_batch_of_only_desirable_rows():
    des = torch.ones(3, dtype=torch.bool)
    losses, rewards, kl = kto_loss(POL, REF, des, POL_KL, REF_KL, beta=BETA)
    assert losses.tolist() == pytest.approx([1 - s(r - Z0) for r in R], rel=1e-6)
    means = kto_means({k: v.item() for k, v in kto_stats(rewards, des, kl).items()})
    assert means["reward_desirable"] == pytest.approx(sum(R) / 3)
    assert means["reward_undesirable"] is None and means["margin"] is None and means["kl"] == pytest.approx(2 / 3)


def test_a_single_token_response():
    # one response token (its eos) of log-prob -0.7 under the policy, -0.2 under the reference
    mask = torch.tensor([[False, False, True, False]])
    pol, n = sequence_logps(torch.tensor([[-9.0, -9.0, -0.7, -9.0]]), mask)
    ref, _ = sequence_logps(torch.tensor([[-1.0, -1.0, -0.2, -1.0]]), mask)
    assert n.item() == 1 and pol.item() == pytest.approx(-0.7)
    losses, rewards, _ = kto_loss(pol, ref, torch.tensor([False]), torch.tensor([-3.0]), torch.tensor([-3.0]), beta=1.0)
    assert rewards.item() == pytest.approx(-0.5)
    assert losses.item() == pytest.approx(1 - s(0.5), rel=1e-6)  # undesirable: 1 - s(z0 - r), z0 = 0


def test_kl_reduce_gives_the_estimate_of_the_whole_world():
    """Two ranks' halves with their [sum, count] summed = one process with every mismatched row."""
    whole, _, kl = kto_loss(POL, REF, DES, POL_KL, REF_KL, beta=BETA)
    other = torch.tensor([(POL_KL[2] - REF_KL[2]).item(), 1.0])  # what the "other rank" holds
    part, _, kl_part = kto_loss(POL[:2], REF[:2], DES[:2], POL_KL[:2], REF_KL[:2], beta=BETA,
                                kl_reduce=lambda t: t + other)
    assert kl_part.item() == pytest.approx(kl.item()) and part.tolist() == pytest.approx(whole[:2].tolist())


def test_sft_coef_adds_the_nll_per_token_of_desirable_rows_only():
    base, _, _ = kto_loss(POL, REF, DES, POL_KL, REF_KL, beta=BETA)
    lens = torch.tensor([2.0, 5.0, 4.0])
    rpo, _, _ = kto_loss(POL, REF, DES, POL_KL, REF_KL, beta=BETA, sft_coef=0.5, lengths=lens)
    assert (rpo - base).tolist() == pytest.approx([0.5 * 2 / 2, 0.0, 0.5 * 3 / 4])


def test_bad_arguments_are_errors():
    with pytest.raises(ValueError, match="beta"):
        kto_loss(POL, REF, DES, POL_KL, REF_KL, beta=0.0)
    with pytest.raises(ValueError, match="weights"):
        kto_loss(POL, REF, DES, POL_KL, REF_KL, undesirable_weight=0.0)
    with pytest.raises(ValueError, match="mismatched"):
        kto_loss(POL, REF, DES, POL_KL[:0], REF_KL[:0])


def test_stats_average_exactly_over_micro_batches():
    """Two micro-batches' kto_stats averaged with weights = their row counts (what the engine does) give
    the per-kind means of all the rows together."""
    rewards = torch.tensor([0.4, -0.2, 0.1, 0.3, -0.6])
    des = torch.tensor([True, False, True, True, False])
    parts = [(rewards[:2], des[:2]), (rewards[2:], des[2:])]
    kl = torch.tensor(0.25)
    avg = {k: sum(kto_stats(r, d, kl)[k].item() * len(r) for r, d in parts) / 5 for k in kto_stats(rewards, des, kl)}
    got = kto_means(avg)
    assert got["reward_desirable"] == pytest.approx((0.4 + 0.1 + 0.3) / 3)
    assert got["reward_undesirable"] == pytest.approx((-0.2 - 0.6) / 2)
    assert got["margin"] == pytest.approx(0.8 / 3 + 0.4) and got["kl"] == pytest.approx(0.25)


def test_weight_advice_follows_eq_8():
    assert kto_weight_advice(100, 100, 1.0, 1.0) is None  # ratio 1
    assert kto_weight_advice(130, 100, 1.0, 1.0) is None  # 1.3 <= 4/3
    assert kto_weight_advice(100, 0, 1.0, 1.0) is None  # one kind only
    advice = kto_weight_advice(100, 300, 1.0, 1.0)  # ratio 1/3: upweight the desirable rows to [3, 4]
    assert "dpo.desirable_weight in [3, 4]" in advice and "dpo.undesirable_weight in [0.25, 0.333]" in advice
    assert kto_weight_advice(100, 300, 3.5, 1.0) is None


# ----------------------------------------------------------------------------- rows


@pytest.fixture(scope="module")
def tok():
    from rlhf.config import ModelConfig
    from rlhf.modeling.load import load_tokenizer

    return load_tokenizer(ModelConfig(tokenizer=str(ROOT / "data/tokenizer")))


P = "Human: Reverse ab.\n\nAssistant:"


def test_unpaired_shapes_and_split_pairs():
    trl = parse_unpaired([{"prompt": P, "completion": " ba", "label": True},
                          {"prompt": P, "completion": " ab", "label": False}])
    assert [(e.prompt, e.response, e.label) for e in trl] == [(P, " ba", True), (P, " ab", False)]
    ours = parse_unpaired([{"prompt": P, "response": " ba", "label": False}])
    assert (ours[0].response, ours[0].label) == (" ba", False)
    pairs = parse_unpaired([{"prompt": P, "chosen": " ba", "rejected": " ab"}])
    assert [(e.prompt, e.response, e.label, e.origin) for e in pairs] == [
        (P, " ba", True, "row 0 (chosen)"), (P, " ab", False, "row 0 (rejected)")]
    hh = parse_unpaired([{"chosen": "Human: x\n\nAssistant: y", "rejected": "Human: x\n\nAssistant: z"}])
    assert [(e.prompt, e.response, e.label) for e in hh] == [
        ("Human: x\n\nAssistant:", " y", True), ("Human: x\n\nAssistant:", " z", False)]


def test_message_list_prompts_and_completions():
    from test_chat_data import make_chatml

    chat = make_chatml()
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}],
             "label": True}]
    (ex,) = parse_unpaired(rows, chat)
    assert ex.prompt == chat.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                 add_generation_prompt=True)
    assert ex.response == "yo" and ex.label is True


@pytest.mark.parametrize("row,says", [
    ({"prompt": P, "completion": " ab"}, "missing field 'label'"),
    ({"prompt": P, "completion": " ab", "label": None}, "missing field 'label'"),
    ({"prompt": P, "completion": " ab", "label": "yes"}, "field 'label' must be true or false, got str 'yes'"),
    ({"prompt": P, "completion": " ab", "label": 1}, "field 'label' must be true or false, got int 1"),
    ({"prompt": P, "label": True}, "fit no unpaired shape"),
])
def test_malformed_rows_are_refused_naming_the_row(row, says):
    good = {"prompt": P, "completion": " ba", "label": True}
    with pytest.raises(DataFormatError, match="row 1: ") as e:
        parse_unpaired([good, row])
    if "fit no" not in says:  # (as a later row: "missing field 'completion'", the shape being the first row's)
        assert says in str(e.value)
    with pytest.raises(DataFormatError) as first:  # as the first row, it decides (or fails) the shape
        parse_unpaired([row])
    assert says in str(first.value)


def test_mismatched_rows_pair_each_prompt_with_another_rows_response(tok):
    rows = [{"prompt": f"Human: Reverse {w}.\n\nAssistant:", "chosen": f" {w[::-1]}", "rejected": f" {w}"}
            for w in ("ab", "cde", "fg", "hij")]
    feats, stats = tokenize_unpaired(parse_unpaired(rows), tok, 64, 48)
    assert stats["kept"] == 8 and stats["desirable"] == stats["undesirable"] == 4
    mismatched_rows(feats, 64, seed=3)
    partners = [f["kl_partner"] for f in feats]
    for i, f in enumerate(feats):
        j, n = f["kl_partner"], f["prompt_len"]
        other = feats[j]
        assert j != i and other["input_ids"][: other["prompt_len"]] != f["input_ids"][:n]  # another prompt
        assert f["kl_ids"] == f["input_ids"][:n] + other["input_ids"][other["prompt_len"]:]
    again = mismatched_rows([dict(f) for f in feats], 64, seed=3)
    assert [f["kl_partner"] for f in again] == partners  # fixed by the seed
    assert [f["kl_partner"] for f in mismatched_rows([dict(f) for f in feats], 64, seed=4)] != partners
    short = mismatched_rows([dict(f) for f in feats], 12, seed=3)  # the KL rows are cut to max_len
    assert all(len(f["kl_ids"]) == min(12, len(g["kl_ids"])) for f, g in zip(short, feats))
    with pytest.raises(ValueError, match="at least 2 rows"):
        mismatched_rows(feats[:1], 64, seed=3)


# ----------------------------------------------------------------------------- the command line

STEPS = 6
SMALL = ["model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=2",
         "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "model.name_or_path=null",
         "train.log_every=1", "train.lr=3e-3", "train.warmup_steps=0", "train.micro_batch_size=8",
         "train.global_batch_size=8", "data.num_eval_prompts=8", "dpo.beta=0.5", "dpo.loss_type=kto",
         "dpo.sft_coef=0",  # plain KTO: every loss starts at 1/2
         "engine.precision=fp32"]  # compared across ZeRO stages and ranks: bf16 rounds differently in each


def _files(tmp, n: int = 24) -> tuple[str, str]:
    """The first `n` shipped pairs, and the same content as TRL's unpaired rows (chosen, then rejected)."""
    pairs = [json.loads(line) for line in open(ROOT / "data/default/pairs_train.jsonl")][:n]
    unpaired = [{"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
                for r in pairs for side in ("chosen", "rejected")]
    for name, rows in (("pairs.jsonl", pairs), ("unpaired.jsonl", unpaired)):
        (tmp / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(tmp / "pairs.jsonl"), str(tmp / "unpaired.jsonl")


@pytest.fixture(scope="module")
def run_k(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kto")
    pairs, unpaired = _files(tmp)
    base = [*SMALL, f"train.max_steps={STEPS}", "train.save_every=3", "train.eval_every=3",
            f"data.eval_prompts_path={ROOT / 'data/default/eval_prompts.jsonl'}"]
    run_stage("dpo", f"output_dir={tmp / 'p'}", *base, f"data.path={pairs}", f"data.eval_path={pairs}")
    return tmp, base, pairs, unpaired


def test_pairs_are_split_into_rows_and_trained(run_k):
    tmp, _, _, _ = run_k
    out = tmp / "p"
    for name in ("metrics.jsonl", "dpo.png", "model/model.safetensors", "checkpoints/step_0000006/reference_logps.pt"):
        assert (out / name).is_file(), name
    s_ = summary(out)
    assert s_["loss_type"] == "kto" and s_["reference"] == "precompute"
    assert s_["train_rows"] == 48 and s_["desirable"] == 24 and s_["undesirable"] == 24 and s_["eval_rows"] == 48
    # before training the policy is its reference: every reward and the KL are 0, every loss 1/2
    assert s_["eval_loss_before"] == pytest.approx(0.5, abs=1e-6) and s_["eval_margin_before"] == 0
    assert s_["eval_kl_before"] == 0 and s_["gold_score_before"] is not None
    assert s_["eval_margin_after"] > 0 and s_["eval_loss_after"] < 0.5
    assert s_["eval_reward_desirable_after"] > s_["eval_reward_undesirable_after"]
    train = metrics(out, "train")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert train[0]["loss"] == pytest.approx(0.5, abs=1e-6) and train[0]["kl"] == 0
    for r in train:  # the record's per-kind means agree with its margin; a batch of 8 rows of both kinds
        assert r["margin"] == pytest.approx(r["reward_desirable"] - r["reward_undesirable"], abs=1e-6)
        assert 0 < r["desirable_share"] < 1 and r["kl"] >= 0
    assert [r["step"] for r in metrics(out, "eval")] == [0, 3, 6]
    tables = torch.load(out / "checkpoints/step_0000006/reference_logps.pt")
    assert tables["train"].shape == (48, 2)  # (own row, mismatched row)


def test_an_unpaired_file_gives_what_its_pairs_give(run_k, tmp_path):
    """TRL's {prompt, completion, label} rows written from the pairs (chosen, then rejected) are the rows
    the split makes: the same run, figure for figure."""
    tmp, base, _, unpaired = run_k
    out = tmp_path / "u"
    run_stage("dpo", f"output_dir={out}", *base, f"data.path={unpaired}", f"data.eval_path={unpaired}",
              "train.save_every=0")
    for kind in ("train", "eval"):
        a, u = metrics(tmp / "p", kind), metrics(out, kind)
        assert len(a) == len(u)
        for x, y in zip(a, u):
            for k in ("loss", "margin", "kl"):
                assert y[k] == pytest.approx(x[k], rel=1e-6, abs=1e-7), (kind, x["step"], k)


def test_online_reference_gives_the_precomputed_values(run_k, tmp_path):
    tmp, base, pairs, _ = run_k
    out = tmp_path / "o"
    run_stage("dpo", f"output_dir={out}", *base, f"data.path={pairs}", f"data.eval_path={pairs}",
              "dpo.reference=online", "train.save_every=0")
    assert summary(out)["reference"] == "online"
    for kind in ("train", "eval"):
        a, o = metrics(tmp / "p", kind), metrics(out, kind)
        assert len(a) == len(o)
        for x, y in zip(a, o):
            for k in ("loss", "margin", "kl"):  # the same model and rows; only the batch padding differs
                assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-5), (kind, x["step"], k)


def test_resume_continues_exactly(run_k, tmp_path):
    tmp, base, pairs, _ = run_k
    out_r = tmp_path / "r"
    shutil.copytree(tmp / "p", out_r)
    shutil.rmtree(out_r / "checkpoints" / "step_0000006")
    shutil.rmtree(out_r / "model")
    os.remove(out_r / "summary.json")
    run_stage("dpo", f"output_dir={out_r}", *base, f"data.path={pairs}", f"data.eval_path={pairs}", "train.resume=true")
    want = [(r["step"], r["loss"], r["margin"], r["kl"]) for r in metrics(tmp / "p", "train")]
    assert [(r["step"], r["loss"], r["margin"], r["kl"]) for r in metrics(out_r, "train")] == want


@pytest.mark.parametrize("label,says", [(None, "missing field 'label'"), ('"yes"', "field 'label' must be true or false")])
def test_a_malformed_row_exits_2_naming_file_and_line(label, says, tmp_path):
    good = json.dumps({"prompt": P, "completion": " ba", "label": True})
    bad = '{"prompt": "%s", "completion": " ab"%s}' % (P.replace("\n", "\\n"), "" if label is None else f', "label": {label}')
    path = tmp_path / "rows.jsonl"
    path.write_text(good + "\n" + good + "\n" + bad + "\n")
    proc = run_stage("dpo", f"output_dir={tmp_path / 'o'}", *SMALL, f"data.path={path}", check=False, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert says in proc.stderr and f"{path}:3" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_torchrun_zero3_matches_one_process(run_k, tmp_path):
    """Two gloo ranks of 4 rows each under ZeRO-3 = one process with the 8 rows: the KL estimate is
    all-reduced over the ranks, so z0 is the same mean."""
    tmp, base, pairs, _ = run_k
    out = tmp_path / "z3"
    run_stage("dpo", f"output_dir={out}", *base, f"data.path={pairs}", f"data.eval_path={pairs}", "engine=zero3",
              "train.micro_batch_size=4", "train.save_every=0", torchrun=2)
    one, two = metrics(tmp / "p", "train"), metrics(out, "train")
    assert len(two) == STEPS
    for a, b in zip(one, two):
        for k in ("loss", "margin", "kl", "reward_desirable", "reward_undesirable"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (a["step"], k)
    ea, eb = metrics(tmp / "p", "eval")[-1], metrics(out, "eval")[-1]
    assert eb["loss"] == pytest.approx(ea["loss"], rel=1e-4) and eb["gold_score"] == ea["gold_score"]
