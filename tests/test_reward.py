"""The reward stage: scoring positions, the pairwise loss, save -> load, and every pair shape through
`python -m rlhf.reward` (small model, a few steps)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import ROOT, SMALL_MODEL, comparable, killed_at, leftovers, metrics, run_stage, summary
from rlhf.algos.reward_model import auc, last_token_index, pair_accuracy, pairwise_loss, sequence_scores

# ----------------------------------------------------------------------------- scoring positions


def test_last_token_index_right_left_and_no_padding():
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    none = torch.ones(2, 4, dtype=torch.long)
    assert last_token_index(right).tolist() == [2, 4, 0]
    assert last_token_index(left).tolist() == [4, 4, 4]
    assert last_token_index(none).tolist() == [3, 3]


def test_sequence_scores_pick_the_value_at_the_last_real_token():
    values = torch.arange(15, dtype=torch.float32).reshape(3, 5) / 10  # value = row*0.5 + col*0.1
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    left = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 1, 1]])
    assert sequence_scores(values, right).tolist() == pytest.approx([0.2, 0.9, 1.1])
    assert sequence_scores(values, left).tolist() == pytest.approx([0.4, 0.9, 1.4])


def test_a_real_leading_pad_or_bos_token_is_not_skipped():
    # models like OPT start every sequence with a token whose id equals the pad id; the mask, not
    # the id, says what is real, so the score stays at the last real token (no fixed offsets)
    pad = 1
    ids = torch.tensor([[pad, 5, 6, pad, pad], [pad, 7, 8, 9, 4]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    values = ids.float() * 10
    assert last_token_index(mask).tolist() == [2, 4]
    assert sequence_scores(values, mask).tolist() == [60.0, 40.0]


def test_a_row_without_real_tokens_is_an_error():
    with pytest.raises(ValueError, match="no real token"):
        last_token_index(torch.tensor([[1, 1], [0, 0]]))


# ----------------------------------------------------------------------------- the loss


def test_pairwise_loss_matches_a_hand_computation():
    c = torch.tensor([1.0, 0.0, 3.0])
    r = torch.tensor([0.0, 2.0, 3.0])
    # -log sigmoid(d) = log(1 + exp(-d)) for d = 1, -2, 0
    expect = [math.log(1 + math.exp(-1)), math.log(1 + math.exp(2)), math.log(2)]
    assert pairwise_loss(c, r).tolist() == pytest.approx(expect, rel=1e-6)
    # a margin shifts the difference: d - 0.5
    expect_m = [math.log(1 + math.exp(-0.5)), math.log(1 + math.exp(2.5)), math.log(1 + math.exp(0.5))]
    assert pairwise_loss(c, r, margin=0.5).tolist() == pytest.approx(expect_m, rel=1e-6)
    # score regularisation adds reg * (c^2 + r^2) / 2
    reg = [e + 0.1 * (a * a + b * b) / 2 for e, a, b in zip(expect, c.tolist(), r.tolist())]
    assert pairwise_loss(c, r, score_reg=0.1).tolist() == pytest.approx(reg, rel=1e-6)
    assert pair_accuracy(c, r).item() == pytest.approx(1 / 3)  # the tie counts as wrong
    with pytest.raises(ValueError, match="differ in shape"):
        pairwise_loss(c, r[:2])


def test_auc_counts_ties_half():
    assert auc([3, 2, 1, 2], [1, 1, 0, 0]) == pytest.approx((1 + 1 + 1 + 0.5) / 4)
    assert auc([1, 2], [1, 1]) is None


def test_loss_gradient_pushes_chosen_up_and_rejected_down():
    c = torch.tensor([0.3], requires_grad=True)
    r = torch.tensor([0.1], requires_grad=True)
    pairwise_loss(c, r).sum().backward()
    s = torch.sigmoid(torch.tensor(0.2)).item()
    assert c.grad.item() == pytest.approx(-(1 - s)) and r.grad.item() == pytest.approx(1 - s)


# ----------------------------------------------------------------------------- the model


def _value_model(seed: int = 0):
    from rlhf.config import ModelConfig
    from rlhf.modeling.load import load_tokenizer, load_value_model
    from rlhf.modeling.roles import ValueModel

    cfg = ModelConfig(name_or_path=None, tokenizer=str(ROOT / "data/tokenizer"),
                      config={"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64})
    tok = load_tokenizer(cfg)
    return ValueModel(load_value_model(cfg, tok, seed=seed)).eval(), tok


def test_value_head_runs_in_its_weights_dtype_under_bf16_autocast():
    """Under bf16 autocast (engine.precision=bf16 at stage 0/1) the backbone computes in bf16 but the
    head does not: values = fp32 head(hidden states as fp32), not bf16-rounded scores
    (which made close pairs ties and left the default reward model at 0.66 accuracy)."""
    import torch.nn.functional as F

    from engine import hf_base_model

    model, tok = _value_model()
    base = hf_base_model(model)
    with torch.no_grad():
        base.score.weight.normal_(0, 1.0)
    ids = torch.tensor([tok("Human: Sort 3 1 2.")["input_ids"]] * 2)
    mask = torch.ones_like(ids)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        values = model(ids, mask)
        hidden = getattr(base, base.base_model_prefix)(input_ids=ids, attention_mask=mask).last_hidden_state
    assert values.dtype == torch.float32  # (Llama's final norm already returns fp32 hidden states)
    want = F.linear(hidden.float(), base.score.weight)[..., 0]  # the head in fp32, as without autocast
    torch.testing.assert_close(values, want, rtol=1e-6, atol=1e-6)
    rounded = want.to(torch.bfloat16).float()
    assert (values - rounded).abs().max() > 1e-4  # what a bf16 head would have returned differs


def test_head_only_phase_leaves_the_backbone_unchanged():
    """backbone_grad=0 (the first reward.head_only_fraction of the steps): the head trains, every backbone weight stays
    bit for bit (its gradients are exact zeros, AdamW moves nothing), the values are the model's own;
    backbone_grad=1 then trains everything."""
    from engine import EngineConfig, OptimConfig, TrainEngine, hf_base_model
    from rlhf.reward import make_loss

    model, tok = _value_model()
    model.train()
    with torch.no_grad():
        hf_base_model(model).score.weight.normal_(0, 0.1)
    engine = TrainEngine(model, EngineConfig(stage=0), OptimConfig(lr=1e-2, weight_decay=0.0), total_steps=10)
    rows = [tok(t)["input_ids"] for t in ("Human: Sort 3 1 2. Assistant: 1 2 3", "Human: Upper ab. Assistant: AB",
                                         "Human: Sort 3 1 2. Assistant: 3 1 2", "Human: Upper ab. Assistant: ab")]
    L = max(map(len, rows))
    batch = {"input_ids": torch.tensor([r + [tok.pad_token_id] * (L - len(r)) for r in rows]),  # chosen rows first
             "attention_mask": torch.tensor([[1] * len(r) + [0] * (L - len(r)) for r in rows])}
    named = lambda: {k: v.detach().clone() for k, v in model.named_parameters()}  # noqa: E731
    start = named()
    model.backbone_grad = 0.0
    with torch.no_grad():
        plain = model(batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(model(batch["input_ids"], batch["attention_mask"]).detach(), plain, rtol=0, atol=0)
    for _ in range(3):
        out = engine.train_step([batch], make_loss(0.0, 0.0))
    after = named()
    moved = {k for k in start if not torch.equal(start[k], after[k])}
    assert moved and all("score" in k for k in moved) and out["grad_norm"] > 0
    model.backbone_grad = 1.0
    engine.train_step([batch], make_loss(0.0, 0.0))
    assert any(not torch.equal(after[k], v) for k, v in named().items() if "score" not in k)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_head_only_fast_path_equals_the_scaled_backward(precision):
    """One process, head alone: the backbone runs without a graph and its weights get zero gradients. Every
    weight, the AdamW state and each step's loss and gradient norm equal, bit for bit, those of the path that
    keeps the backbone in the graph with a zero-scaled gradient (what DDP / FSDP2 ranks run), through head-only
    steps, two micro-batches a step, weight decay, then full steps; and the fast path builds no backbone graph."""
    from engine import EngineConfig, OptimConfig, TrainEngine, hf_base_model
    from rlhf.reward import make_loss

    tok = _value_model()[1]
    rows = [tok(t)["input_ids"] for t in ("Human: Sort 3 1 2. Assistant: 1 2 3", "Human: Upper ab. Assistant: AB",
                                         "Human: Sort 3 1 2. Assistant: 3 1 2", "Human: Upper ab. Assistant: ab")]
    L = max(map(len, rows))
    batch = {"input_ids": torch.tensor([r + [tok.pad_token_id] * (L - len(r)) for r in rows]),
             "attention_mask": torch.tensor([[1] * len(r) + [0] * (L - len(r)) for r in rows])}

    def train(fast: bool):
        model = _value_model(seed=3)[0]
        model.train()
        model.head_only_without_graph = fast  # one process here: True takes the fast path
        with torch.no_grad():
            hf_base_model(model).score.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(5))
        engine = TrainEngine(model, EngineConfig(stage=0, precision=precision),
                             OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=2), total_steps=8)
        outs = []
        for step in range(6):
            model.backbone_grad = 0.0 if step < 4 else 1.0
            out = engine.train_step([batch, batch], make_loss(0.0, 0.0))
            outs.append((out["loss"], out["grad_norm"], out["accuracy"]))
        state = {k: v.detach().clone() for k, v in model.named_parameters()}
        adam = [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                for s in engine.optimizer.state.values()]
        return outs, state, adam

    slow, fast = train(False), train(True)
    assert fast[0] == slow[0]
    assert all(torch.equal(fast[1][k], slow[1][k]) for k in slow[1])
    assert len(fast[2]) == len(slow[2]) and all(
        f.keys() == s.keys() and all(torch.equal(torch.as_tensor(f[k]), torch.as_tensor(s[k])) for k in s)
        for f, s in zip(fast[2], slow[2]))
    # the fast path: no gradient reaches the backbone's output (nothing to backpropagate through)
    model = _value_model()[0]
    model.backbone_grad = 0.0
    seen = []
    backbone = hf_base_model(model).model
    backbone.register_forward_hook(lambda m, i, o: seen.append(o.last_hidden_state.requires_grad))
    model(batch["input_ids"], batch["attention_mask"]).sum().backward()
    assert seen == [False]
    assert all(p.grad is not None and torch.count_nonzero(p.grad) == 0 for p in backbone.parameters())


def test_head_init_std_sets_a_fresh_head_and_keeps_a_trained_one(tmp_path):
    """reward.head_init_std: 0 = a zero head (every score 0, so the first steps train the head alone:
    the backbone's gradient is zero), > 0 = normal(0, std) drawn from the seed; a head that a
    reward checkpoint brings is kept as saved."""
    from rlhf.config import ModelConfig
    from rlhf.modeling.load import has_trained_head, load_tokenizer, load_value_model

    cfg = ModelConfig(name_or_path=None, tokenizer=str(ROOT / "data/tokenizer"),
                      config={"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64})
    tok = load_tokenizer(cfg)
    own = load_value_model(cfg, tok, seed=0).score.weight
    assert own.std().item() == pytest.approx(0.02, rel=0.3)  # the model's own init: initializer_range
    zero = load_value_model(cfg, tok, seed=0, head_init_std=0.0)
    assert not has_trained_head(zero) and torch.count_nonzero(zero.score.weight) == 0
    small = [load_value_model(cfg, tok, seed=s, head_init_std=1e-3).score.weight for s in (0, 0, 1)]
    assert torch.equal(small[0], small[1]) and not torch.equal(small[0], small[2])
    assert small[0].std().item() == pytest.approx(1e-3, rel=0.3)
    ids = torch.tensor([tok("Human: Reverse abc.\n\nAssistant: cba")["input_ids"]])
    from rlhf.modeling.roles import ValueModel

    assert torch.count_nonzero(ValueModel(zero)(ids, torch.ones_like(ids))) == 0
    zero.score.weight.data.fill_(0.5)  # "trained"
    zero.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    kept = load_value_model(ModelConfig(name_or_path=str(tmp_path / "rm")), tok, seed=0, head_init_std=0.0)
    assert has_trained_head(kept) and torch.all(kept.score.weight == 0.5)


def test_a_sequence_scores_the_same_alone_and_in_a_right_padded_batch():
    model, tok = _value_model()
    a = tok("Human: Sort 3 1 2.\n\nAssistant: 1 2 3")["input_ids"]
    b = tok("Human: What is 2+2?\n\nAssistant: 4")["input_ids"]
    from rlhf.data import collate_pairs

    batch = collate_pairs([{"chosen_ids": a, "rejected_ids": b}], tok.pad_token_id)
    with torch.no_grad():
        together = sequence_scores(model(**batch), batch["attention_mask"])
        alone = [sequence_scores(model(input_ids=torch.tensor([s]), attention_mask=torch.ones(1, len(s), dtype=torch.long)),
                                 torch.ones(1, len(s), dtype=torch.long)).item() for s in (a, b)]
    assert batch["attention_mask"].sum(1).tolist() == [len(a), len(b)] and len(a) != len(b)
    assert together.tolist() == pytest.approx(alone, rel=1e-5, abs=1e-6)


# ----------------------------------------------------------------------------- the command line

STEPS = 30
BASE = [*SMALL_MODEL, "model.name_or_path=null", f"train.max_steps={STEPS}", "train.log_every=1", "train.lr=3e-3",
        "train.warmup_steps=3", "train.eval_every=0", "train.micro_batch_size=16", "train.global_batch_size=16",
        # compared with plain transformers (fp32) and across ZeRO stages: the default (auto) is bf16 on a
        # bf16-capable CPU, which rounds differently in each
        "engine.precision=fp32"]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("reward") / "default"
    run_stage("reward", f"output_dir={out}", *BASE)
    return out


def test_default_run_writes_its_outputs_and_summary(default_run):
    for name in ("config.yaml", "metrics.jsonl", "reward.png", "summary.json", "model/config.json", "model/model.safetensors"):
        assert (default_run / name).is_file(), name
    s = summary(default_run)
    assert s["stage"] == "reward" and s["steps"] == STEPS
    for key in ("eval_accuracy", "eval_chosen_score", "eval_rejected_score", "gold_agreement", "gold_auc"):
        assert isinstance(s[key], float), key
    assert 0.0 <= s["eval_accuracy"] <= 1.0
    train = metrics(default_run, "train")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in train)


def test_killed_inside_a_checkpoint_write_resumes_exactly(default_run, tmp_path):
    """SIGKILL inside the step-20 checkpoint write; train.resume=true goes on from step 10's and ends
    as the uninterrupted run (checkpointing does not change the run: default_run saves only at the end)."""
    out = tmp_path / "k"
    killed_at("reward", out, "checkpoint_write:2", *BASE, "train.save_every=10")
    run_stage("reward", f"output_dir={out}", *BASE, "train.save_every=10", "train.resume=true")
    assert not leftovers(out)
    assert comparable(metrics(out)) == comparable(metrics(default_run))
    assert summary(out)["eval_accuracy"] == summary(default_run)["eval_accuracy"]


def _eval_batches(tok):
    from rlhf.data import collate_pairs, parse_pairs, tokenize_pairs
    from rlhf.data.sources import load_rows

    rows = load_rows(str(ROOT / "data/default/pairs_eval.jsonl"))
    feats, _ = tokenize_pairs(parse_pairs(rows, tok), tok, 64, 48, "truncate", True)
    return [collate_pairs(feats[i : i + 64], tok.pad_token_id) for i in range(0, len(feats), 64)]


def test_saved_reward_model_reloads_with_identical_scores(default_run):
    """model/ loads as AutoModelForSequenceClassification, and the path PPO uses (load_value_model)
    gives the same scores as HF's own pooling and as the run's final held-out evaluation."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf.config import ModelConfig
    from rlhf.modeling.load import load_tokenizer, load_value_model
    from rlhf.modeling.roles import ValueModel

    model_dir = str(default_run / "model")
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    assert hf.config.num_labels == 1
    cfg = ModelConfig(name_or_path=model_dir)
    ours = ValueModel(load_value_model(cfg, load_tokenizer(cfg), seed=999)).eval()  # seed must not matter
    chosen = []
    with torch.no_grad():
        for b in _eval_batches(tok):
            mine = sequence_scores(ours(**b), b["attention_mask"])
            theirs = hf(**b).logits.squeeze(-1)
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
            chosen += mine.chunk(2)[0].tolist()
    final = metrics(default_run, "eval")[-1]
    assert final["step"] == STEPS
    assert sum(chosen) / len(chosen) == pytest.approx(final["chosen_score"], rel=1e-4, abs=1e-5)


def _shapes(tmp_path, n: int = 192) -> dict[str, str]:
    """The shipped task's prompts written as each pair shape rlhf/data/records.py accepts, with an
    easy preference (the correct answer over a refusal), so a few steps must lift accuracy well
    above chance."""
    rows = [json.loads(line) for line in open(ROOT / "data/default/pairs_train.jsonl")][:n]
    bad = " I do not know."
    shapes = {
        "prompt_chosen_rejected": [{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": bad} for r in rows],
        "hh_transcripts": [{"chosen": "\n\n" + r["prompt"] + r["chosen"], "rejected": "\n\n" + r["prompt"] + bad}
                           for r in rows],
        "message_lists": [
            {"chosen": [{"role": "user", "content": _question(r["prompt"])}, {"role": "assistant", "content": r["chosen"].strip()}],
             "rejected": [{"role": "user", "content": _question(r["prompt"])}, {"role": "assistant", "content": bad.strip()}]}
            for r in rows],
    }
    paths = {}
    for name, data in shapes.items():
        p = tmp_path / f"{name}.jsonl"
        p.write_text("".join(json.dumps(d) + "\n" for d in data))
        paths[name] = str(p)
    return paths


def _question(prompt: str) -> str:
    return prompt.removeprefix("Human: ").removesuffix("\n\nAssistant:")


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["prompt_chosen_rejected", "hh_transcripts", "message_lists"])
def test_every_pair_shape_trains_above_chance(shape, tmp_path):
    path = _shapes(tmp_path)[shape]
    out = tmp_path / "out"
    run_stage("reward", f"output_dir={out}", *BASE, f"data.path={path}", f"data.eval_path={path}", "train.max_steps=20")
    train = metrics(out, "train")
    first, last = train[:3], train[-3:]
    assert sum(r["loss"] for r in last) < sum(r["loss"] for r in first)
    s = summary(out)
    assert s["train_pairs"] == 192 and s["eval_pairs"] == 192
    assert s["eval_accuracy"] >= 0.9, s  # on the training pairs: far above chance (0.5)
    assert s["eval_chosen_score"] > s["eval_rejected_score"]


@pytest.mark.slow
def test_torchrun_zero2_matches_one_process(default_run, tmp_path):
    out = tmp_path / "z2"
    run_stage("reward", f"output_dir={out}", *BASE, "engine=zero2", "train.micro_batch_size=8", torchrun=2)
    one = [r["loss"] for r in metrics(default_run, "train")]
    two = [r["loss"] for r in metrics(out, "train")]
    assert len(two) == STEPS
    rel = [abs(a - b) / abs(a) for a, b in zip(one, two)]
    # the first step differs only in the order of the gradient reduction; later steps add fp32
    # drift through 30 Adam updates at lr 3e-3 (measured: 4e-8 at step 1, up to 1.5e-4 by step 30)
    assert rel[0] <= 1e-6 and max(rel) <= 5e-4, rel
    a, b = metrics(default_run, "eval")[-1], metrics(out, "eval")[-1]
    for key in ("chosen_score", "rejected_score"):  # (accuracy may flip on a near-tie pair)
        assert b[key] == pytest.approx(a[key], rel=1e-3, abs=2e-3), key  # the same drift; scores ~0.2
