"""The DPO stage: `dpo_loss` against hand-computed values for every loss type, the batch layout, the
LoRA reference, and `python -m rlhf.dpo` through its command line (small model, a few steps)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

import pytest
import torch

from conftest import ROOT, SMALL_MODEL, metrics, run_stage, summary
from rlhf.algos.preference import LOSS_TYPES, dpo_loss, pair_stats, sequence_logps


def softplus(x: float) -> float:  # -log sigmoid(-x)
    return math.log1p(math.exp(x))


# Two pairs. h = (pc - pr) - (rc - rr) = [2, -2]; with beta = 0.5, beta * h = [1, -1].
PC, PR = torch.tensor([-2.0, -5.0]), torch.tensor([-4.0, -3.0])
RC, RR = torch.tensor([-3.0, -4.0]), torch.tensor([-3.0, -4.0])
NC, NR = torch.tensor([2.0, 4.0]), torch.tensor([4.0, 2.0])


def loss_of(loss_type: str, **kw) -> tuple[list[float], list[float], list[float]]:
    kw = {"beta": 0.5, **kw}
    losses, c, r = dpo_loss(PC, PR, RC, RR, NC, NR, loss_type=loss_type, **kw)
    return losses.tolist(), c.tolist(), r.tolist()


# ----------------------------------------------------------------------------- dpo_loss by hand


def test_sigmoid_is_dpo_and_its_implicit_rewards():
    losses, c, r = loss_of("sigmoid")
    assert losses == pytest.approx([softplus(-1), softplus(1)], rel=1e-6)  # -log s(1), -log s(-1)
    assert c == pytest.approx([0.5 * (-2 + 3), 0.5 * (-5 + 4)])  # beta (logp - ref)
    assert r == pytest.approx([0.5 * (-4 + 3), 0.5 * (-3 + 4)])


def test_label_smoothing_gives_conservative_dpo_and_robust_dpo():
    e = 0.1
    cdpo, _, _ = loss_of("sigmoid", label_smoothing=e)
    assert cdpo == pytest.approx([(1 - e) * softplus(-1) + e * softplus(1), (1 - e) * softplus(1) + e * softplus(-1)],
                                 rel=1e-6)
    robust, _, _ = loss_of("robust", label_smoothing=e)
    assert robust == pytest.approx([((1 - e) * softplus(-1) - e * softplus(1)) / (1 - 2 * e),
                                    ((1 - e) * softplus(1) - e * softplus(-1)) / (1 - 2 * e)], rel=1e-6)
    # without smoothing both are DPO
    assert loss_of("robust")[0] == pytest.approx(loss_of("sigmoid")[0], rel=1e-7)


def test_ipo_hinge_and_simpo():
    assert loss_of("ipo")[0] == pytest.approx([(2 - 1) ** 2, (-2 - 1) ** 2])  # (h - 1/(2 beta))^2
    assert loss_of("hinge")[0] == pytest.approx([0.0, 2.0])  # max(0, 1 - beta h)
    losses, c, r = loss_of("simpo", gamma=0.2)
    # chosen = beta logp / n = [-0.5, -0.625], rejected = [-0.5, -0.75]; loss = -log s(c - r - gamma)
    assert c == pytest.approx([-0.5, -0.625]) and r == pytest.approx([-0.5, -0.75])
    assert losses == pytest.approx([softplus(0.2), softplus(0.2 - 0.125)], rel=1e-6)
    # reference-free: the reference is not needed and not read
    free, _, _ = dpo_loss(PC, PR, None, None, NC, NR, loss_type="simpo", beta=0.5, gamma=0.2)
    assert free.tolist() == pytest.approx(losses)


def test_sft_coef_adds_the_chosen_nll_per_token():
    base, _, _ = loss_of("sigmoid")
    rpo, _, _ = loss_of("sigmoid", sft_coef=0.5)
    assert [a - b for a, b in zip(rpo, base)] == pytest.approx([0.5 * 2 / 2, 0.5 * 5 / 4])


@pytest.mark.parametrize("beta", [1e-3, 1e-5])
def test_beta_to_zero_limits(beta):
    kw = {"beta": beta}
    # sigmoid/robust: log 2 - beta h / 2 + O(beta^2); the implicit rewards vanish
    for lt in ("sigmoid", "robust"):
        losses, c, r = loss_of(lt, **kw)
        assert losses == pytest.approx([math.log(2) - beta * 2 / 2, math.log(2) + beta * 2 / 2],
                                     abs=beta ** 2 + 1e-7)  # + float32 rounding
        assert max(map(abs, c + r)) <= 2 * beta
    assert loss_of("hinge", **kw)[0] == pytest.approx([1 - beta * 2, 1 + beta * 2])
    # ipo: the target margin 1/(2 beta) dominates: beta^2 loss -> 1/4
    assert [beta ** 2 * v for v in loss_of("ipo", **kw)[0]] == pytest.approx([0.25, 0.25], rel=10 * beta)
    assert loss_of("simpo", gamma=0.3, **kw)[0] == pytest.approx([softplus(0.3)] * 2, rel=10 * beta)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_sign_conventions(loss_type):
    """A policy that raised chosen over its reference has positive chosen rewards, a positive margin,
    accuracy 1, and a lower loss than with the roles swapped."""
    kw = {"beta": 0.5, "label_smoothing": 0.1 if loss_type in ("sigmoid", "robust") else 0.0}
    pc, pr, rc, rr, n = torch.tensor([-1.0]), torch.tensor([-4.0]), torch.tensor([-3.0]), torch.tensor([-3.0]), torch.ones(1)
    good, c, r = dpo_loss(pc, pr, rc, rr, n, n, loss_type=loss_type, **kw)
    bad, _, _ = dpo_loss(pr, pc, rr, rc, n, n, loss_type=loss_type, **kw)
    stats = pair_stats(c, r)
    assert stats["margin"].item() > 0 and stats["accuracy"].item() == 1.0
    assert (c > 0).all() if loss_type != "simpo" else (c > r).all()
    assert good.item() < bad.item()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gradients_raise_chosen_and_lower_rejected(loss_type):
    """At h = 0 (policy = reference), exact gradients of the loss w.r.t. the policy's log-probs."""
    beta, e, gamma = 0.5, 0.1, 0.2
    kw = {"beta": beta, "label_smoothing": e if loss_type == "robust" else 0.0, "gamma": gamma if loss_type == "simpo" else 0.0}
    pc = torch.tensor([-3.0], requires_grad=True)
    pr = torch.tensor([-3.0], requires_grad=True)
    nc, nr = torch.tensor([2.0]), torch.tensor([3.0])
    dpo_loss(pc, pr, torch.tensor([-3.0]), torch.tensor([-3.0]), nc, nr, loss_type=loss_type, **kw)[0].sum().backward()
    sig = 1 / (1 + math.exp(-(gamma + beta * (3 / 2 - 3 / 3))))  # simpo: s(-(beta (pc/nc - pr/nr) - gamma))
    want = {"sigmoid": beta / 2, "robust": beta / (2 * (1 - 2 * e)), "ipo": 1 / beta, "hinge": beta, "simpo": sig * beta / 2}
    assert pc.grad.item() < 0 < pr.grad.item()
    assert -pc.grad.item() == pytest.approx(want[loss_type], rel=1e-6)
    r_want = want[loss_type] * (2 / 3 if loss_type == "simpo" else 1)  # simpo: beta / n_r instead of beta / n_c
    assert pr.grad.item() == pytest.approx(r_want, rel=1e-6)


def test_bad_arguments_are_errors():
    with pytest.raises(ValueError, match="loss_type"):
        loss_of("kto")
    with pytest.raises(ValueError, match="beta"):
        loss_of("sigmoid", beta=0.0)
    with pytest.raises(ValueError, match="reference"):
        dpo_loss(PC, PR, None, None, NC, NR, loss_type="sigmoid")


# ----------------------------------------------------------------------------- batches and log-probs


def test_pair_batch_labels_cover_exactly_the_responses():
    from rlhf.dpo import pair_batch

    feats = [{"chosen_ids": [1, 5, 6, 7, 2], "rejected_ids": [1, 5, 6, 8, 9, 2], "prompt_len": 3},
             {"chosen_ids": [1, 4, 3, 2], "rejected_ids": [1, 4, 9, 2], "prompt_len": 2}]
    table = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    b = pair_batch(feats, [1, 0], pad_id=0, table=table)
    I = -100
    assert b["input_ids"].shape == (4, 6)  # chosen rows (pairs 1, 0), then rejected rows
    assert b["labels"].tolist() == [[I, I, 3, 2, I, I], [I, I, I, 7, 2, I], [I, I, 9, 2, I, I], [I, I, I, 8, 9, 2]]
    assert b["ref"].tolist() == [-3.0, -1.0, -4.0, -2.0]
    logp = torch.arange(20, dtype=torch.float32).reshape(4, 5)  # as if predicted: targets = labels[:, 1:]
    sums, lens = sequence_logps(logp, b["labels"][:, 1:] != I)
    assert lens.tolist() == [2, 2, 2, 3] and sums.tolist() == [1 + 2, 7 + 8, 11 + 12, 17 + 18 + 19]


def _tiny(tmp_path):
    """A small llama saved as a HF directory, and its tokenizer."""
    from rlhf.config import ModelConfig
    from rlhf.modeling.load import load_causal_lm, load_tokenizer

    cfg = ModelConfig(tokenizer=str(ROOT / "data/tokenizer"), config={
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64})
    tok = load_tokenizer(cfg)
    model = load_causal_lm(cfg, tok, seed=3)
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    return str(tmp_path / "base"), tok


def _feats(tok, n: int = 6):
    from rlhf.data import parse_pairs, tokenize_pairs
    from rlhf.data.sources import load_rows

    rows = load_rows(str(ROOT / "data/default/pairs_eval.jsonl"))[:n]
    return tokenize_pairs(parse_pairs(rows, tok), tok, 64, 48, "truncate", True)[0]


def _hf_table(model_dir: str, feats) -> torch.Tensor:
    """Summed response log-probs of each pair by plain transformers, one sequence at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    with torch.no_grad():
        for f in feats:
            row = []
            for ids in (f["chosen_ids"], f["rejected_ids"]):
                logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
                tok_logp = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
                row.append(tok_logp[f["prompt_len"] - 1 :].sum().item())
            out.append(row)
    return torch.tensor(out)


def test_lora_reference_is_the_base_model_and_the_table_matches_transformers(tmp_path):
    from engine import TrainEngine, init_distributed
    from rlhf.config import LoraConfig, ModelConfig, TrainConfig, stage_engine
    from rlhf.config.validate import engine_config, optim_config
    from rlhf.dpo import table_of
    from rlhf.modeling.load import load_causal_lm
    from rlhf.modeling.roles import Policy

    base_dir, tok = _tiny(tmp_path)
    feats = _feats(tok)
    info = init_distributed()
    cfg = ModelConfig(name_or_path=base_dir, lora=LoraConfig(r=4, alpha=8))
    policy = Policy(load_causal_lm(cfg, tok, seed=0))
    with torch.no_grad():  # trained adapters: B != 0, so the policy is no longer its base
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    # fp32: the table is compared with plain transformers in fp32 (the default, auto, is bf16 on a bf16 CPU)
    ecfg = dataclasses.replace(stage_engine(), precision="fp32")
    engine = TrainEngine(policy, engine_config(ecfg, info), optim_config(TrainConfig()), total_steps=1, info=info)
    want = _hf_table(base_dir, feats)
    base = table_of(engine, feats, tok.pad_token_id, batch_size=4, base=True)  # padded batches of 4
    torch.testing.assert_close(base, want, rtol=1e-5, atol=1e-4)
    adapted = table_of(engine, feats, tok.pad_token_id, batch_size=4)
    assert (adapted - want).abs().max() > 0.1  # the adapters are on outside the context


# ----------------------------------------------------------------------------- the command line

STEPS = 6
SMALL = [*SMALL_MODEL, "model.name_or_path=null", "train.log_every=1", "train.lr=3e-3", "train.warmup_steps=0",
         "train.micro_batch_size=8", "train.global_batch_size=8", "data.num_eval_prompts=8", "dpo.beta=0.5",
         "dpo.sft_coef=0",  # plain DPO (the default adds RPO's NLL): the loss starts at log 2
         "engine.precision=fp32"]  # compared across ZeRO stages and ranks: bf16 rounds differently in each


def _pairs(tmp_path, n: int = 48) -> str:
    rows = [json.loads(line) for line in open(ROOT / "data/default/pairs_train.jsonl")][:n]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo")
    path = _pairs(tmp)
    # own pairs (the shipped task's, in a file of our own): the gold score's prompts are named explicitly
    base = [*SMALL, f"data.path={path}", f"data.eval_path={path}", f"train.max_steps={STEPS}", "train.save_every=3",
            "train.eval_every=3", f"data.eval_prompts_path={ROOT / 'data/default/eval_prompts.jsonl'}"]
    run_stage("dpo", f"output_dir={tmp / 'a'}", *base)
    return tmp / "a", base


def test_default_outputs_and_summary(run_a):
    out, _ = run_a
    for name in ("config.yaml", "metrics.jsonl", "dpo.png", "summary.json", "model/config.json", "model/model.safetensors",
                 "checkpoints/step_0000006/reference_logps.pt"):
        assert (out / name).is_file(), name
    s = summary(out)
    assert s["stage"] == "dpo" and s["steps"] == STEPS and s["reference"] == "precompute"
    assert s["train_pairs"] == s["eval_pairs"] == 48 and s["peak_rss_mb"] > 0
    # before training the policy is its reference: every implicit reward is 0, the loss log 2
    assert s["eval_loss_before"] == pytest.approx(math.log(2), abs=1e-6) and s["eval_margin_before"] == 0
    assert s["eval_margin_after"] > 0 and s["eval_accuracy_after"] > 0.5
    assert s["gold_score_before"] is not None and s["gold_score_after"] is not None
    train = metrics(out, "train")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the first step starts at the reference
    assert [r["step"] for r in metrics(out, "eval")] == [0, 3, 6]
    tables = torch.load(out / "checkpoints/step_0000006/reference_logps.pt")
    assert tables["train"].shape == (48, 2) and torch.equal(tables["train"], tables["eval"])  # same file twice


def test_online_reference_gives_the_precomputed_values(run_a, tmp_path):
    out_a, base = run_a
    run_stage("dpo", f"output_dir={tmp_path / 'o'}", *base, "dpo.reference=online", "train.save_every=0")
    assert summary(tmp_path / "o")["reference"] == "online"
    for kind, keys in (("train", ("loss", "reward_chosen", "reward_rejected")), ("eval", ("loss", "margin"))):
        a, o = metrics(out_a, kind), metrics(tmp_path / "o", kind)
        assert len(a) == len(o)
        for x, y in zip(a, o):
            for k in keys:  # the same model and rows; only the batch padding differs
                assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-5), (kind, x["step"], k)


def test_resume_continues_exactly(run_a, tmp_path):
    out_a, base = run_a
    out_r = tmp_path / "r"
    shutil.copytree(out_a, out_r)
    shutil.rmtree(out_r / "checkpoints" / "step_0000006")
    shutil.rmtree(out_r / "model")
    os.remove(out_r / "summary.json")
    run_stage("dpo", f"output_dir={out_r}", *base, "train.resume=true")
    want = [(r["step"], r["loss"], r["margin"], r["lr"]) for r in metrics(out_a, "train")]
    got = [(r["step"], r["loss"], r["margin"], r["lr"]) for r in metrics(out_r, "train")]
    assert got == want  # steps 1-3 kept, 4-6 recomputed bit for bit (the reference tables came back)
    from safetensors.torch import load_file

    a, r = load_file(out_a / "model/model.safetensors"), load_file(out_r / "model/model.safetensors")
    assert all(torch.equal(a[k], r[k]) for k in a)
    assert summary(out_r)["eval_loss_before"] == summary(out_a)["eval_loss_before"]


def test_a_missing_sft_output_names_the_stage_to_run(tmp_path):
    proc = run_stage("dpo", f"output_dir={tmp_path / 'o'}", "model.name_or_path=outputs/sft_not_here", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "python -m rlhf.sft" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["prompt_chosen_rejected", "hh_transcripts", "message_lists"])
def test_every_pair_shape_trains(shape, tmp_path):
    from test_reward import _shapes  # the reward stage's pair shapes: the same files, the same reader

    path = _shapes(tmp_path, n=32)[shape]
    out = tmp_path / "out"
    run_stage("dpo", f"output_dir={out}", *SMALL, f"data.path={path}", f"data.eval_path={path}", "train.max_steps=8",
              "data.num_eval_prompts=0")
    s = summary(out)
    assert s["train_pairs"] == 32 and s["eval_pairs"] == 32
    assert s["eval_accuracy_after"] >= 0.9, s  # correct answer over a refusal: far above chance
    assert s["eval_loss_after"] < s["eval_loss_before"] == pytest.approx(math.log(2), abs=1e-6)


@pytest.mark.slow
def test_torchrun_zero3_matches_one_process(run_a, tmp_path):
    out_a, base = run_a
    out = tmp_path / "z3"
    run_stage("dpo", f"output_dir={out}", *base, "engine=zero3", "train.micro_batch_size=4", "train.save_every=0",
              torchrun=2)
    one, two = metrics(out_a, "train"), metrics(out, "train")
    assert len(two) == STEPS
    for a, b in zip(one, two):
        # (not accuracy: at step 1 the policy is its reference, and every reward is 0 up to rounding)
        for k in ("loss", "margin", "reward_chosen", "reward_rejected"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (a["step"], k)
    ea, eb = metrics(out_a, "eval")[-1], metrics(out, "eval")[-1]
    assert eb["loss"] == pytest.approx(ea["loss"], rel=1e-4) and eb["gold_score"] == ea["gold_score"]
