"""Own data, own evaluation (issue #29): with `data.path` of your own, every stage evaluates on your
held-out rows (data.eval_path, or data.eval_size of data.path, seeded by data.split_seed), never on the
shipped toy task; the gold score runs only where a judge applies; every stage names what it evaluated
on (log line, summary.json, output_dir/eval_rows.jsonl), and `rlhf.evaluate` on those rows reproduces
the stage's figures. An exported reward model scores the same under plain transformers whatever the
tokenizer's pad convention (pad == eos: Qwen's).

The user here brings a Qwen2-shaped model with its own byte-pair tokenizer whose pad token is its eos
token, and preference pairs in the HH-RLHF transcript shape, both written by the test.
"""
from __future__ import annotations

import json
import random
import string

import pytest
import torch

from conftest import ROOT, SMALL_MODEL, metrics, run_stage, summary

SHIPPED = ROOT / "data/default"
EOT = "<|endoftext|>"


# ----------------------------------------------------------------------------- the user's model and data


def make_qwen_style_tokenizer():
    """A byte-pair tokenizer with Qwen's special-token conventions: no bos, eos = pad = <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = list(string.printable[:95]) + ["\n"]
    merged = ["Hu", "Hum", "an", "As", "ss", "nt"]
    vocab = {t: i for i, t in enumerate(chars + merged + [EOT, "<|im_start|>", "<|im_end|>"])}
    merges = [("H", "u"), ("Hu", "m"), ("a", "n"), ("A", "s"), ("s", "s"), ("n", "t")]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=EOT, pad_token=EOT,
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])


def qwen_style_model_dir(root):
    """<root>/qwen-user: a local Qwen2-shaped directory (random weights) with that tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    tok = make_qwen_style_tokenizer()
    assert tok.pad_token_id == tok.eos_token_id and tok.bos_token_id is None
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    path = root / "qwen-user"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def hh_pairs(path, n: int, seed: int = 0) -> list[dict]:
    """n HH-RLHF-shaped pairs (whole transcripts): chosen spells the word backwards, rejected repeats it."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
        if w == w[::-1]:
            continue  # chosen == rejected: a pair the stages drop
        head = f"\n\nHuman: Spell {w} backwards.\n\nAssistant:"  # no judge knows this task
        rows.append({"chosen": f"{head} {w[::-1]}", "rejected": f"{head} {w}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


N_PAIRS, HELD_OUT = 120, 24
RM = ["train.max_steps=6", "train.micro_batch_size=8", "train.global_batch_size=8", "train.lr=1e-2",
      "train.eval_every=0", "train.save_every=0", "model.fallback_to_config=false", "engine.precision=fp32"]


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """The user's model, their pairs, and a reward run on them holding out HELD_OUT pairs."""
    root = tmp_path_factory.mktemp("own")
    model = qwen_style_model_dir(root)
    pairs = root / "pairs.jsonl"
    rows = hh_pairs(pairs, N_PAIRS)
    rm = root / "rm"
    proc = run_stage("reward", f"output_dir={rm}", f"model.name_or_path={model}", f"data.path={pairs}",
                     f"data.eval_size={HELD_OUT}", *RM)
    return model, pairs, rows, rm, proc


# ----------------------------------------------------------------------------- item 4: plain transformers = the run


def test_exported_reward_model_scores_under_plain_transformers_as_the_run_with_pad_equal_eos(own):
    """docs/own-model.md's snippet (AutoModelForSequenceClassification + tokenizer(prompt + response),
    padded) against the run's rule (the value at the last real token, by the attention mask), on a
    model whose tokenizer pads with eos: transformers pools at the last token that is not pad."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf.config import ModelConfig
    from rlhf.modeling.forward import batch_scores
    from rlhf.modeling.load import load_value_model
    from rlhf.modeling.roles import ValueModel

    model_dir, _, rows, rm, _ = own
    texts = [rows[0]["chosen"], rows[1]["rejected"], rows[2]["chosen"] + " and more"]  # three lengths
    # the snippet, as written in the docs
    rtok = AutoTokenizer.from_pretrained(rm / "model")
    hf = AutoModelForSequenceClassification.from_pretrained(rm / "model").eval()
    with torch.no_grad():
        snippet = hf(**rtok(texts, return_tensors="pt", padding=True)).logits[:, 0]
    # the run's rule, on the ids the stage trains on (no bos in this tokenizer; eos appended), padded
    # with the run's own pad (= eos), through the project's loader and scoring
    trained = AutoTokenizer.from_pretrained(model_dir)
    ids = [trained(t, add_special_tokens=False)["input_ids"] + [trained.eos_token_id] for t in texts]
    width = max(map(len, ids))
    batch = {"input_ids": torch.tensor([x + [trained.pad_token_id] * (width - len(x)) for x in ids]),
             "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])}
    ours = ValueModel(load_value_model(ModelConfig(name_or_path=str(rm)), trained, seed=0)).eval()
    with torch.no_grad():
        run_scores = batch_scores(ours, batch)
    assert run_scores.abs().max() > 1e-3  # a trained head: the comparison is not 0 == 0
    torch.testing.assert_close(snippet, run_scores, rtol=0, atol=1e-5)
    # what the export changed: a pad token the vocabulary has, not eos; ids and vocabulary as trained
    assert hf.config.pad_token_id == rtok.pad_token_id != rtok.eos_token_id == trained.eos_token_id
    assert rtok.get_vocab() == trained.get_vocab()
    assert rtok(texts[0])["input_ids"] == ids[0]
    # with the pad == eos convention kept, the same model scores another token (the one before eos)
    hf.config.pad_token_id = trained.eos_token_id
    with torch.no_grad():
        stale = hf(**trained([t + EOT for t in texts], return_tensors="pt", padding=True)).logits[:, 0]
    assert (stale - run_scores).abs().max() > 1e-3


# ----------------------------------------------------------------------------- items 1, 3, 5: held-out from data.path


def test_reward_stage_holds_out_the_user_s_pairs_and_names_them(own):
    _, pairs, rows, rm, proc = own
    s = summary(rm)
    source = f"data.path={pairs} (eval_size={HELD_OUT}, split_seed=1234)"
    assert s["eval_source"] == source and s["eval_rows"] == s["eval_pairs"] == HELD_OUT  # not the toy task's 400
    assert s["train_pairs"] == N_PAIRS - HELD_OUT
    assert f"held-out: {HELD_OUT} pairs from {source}" in proc.stdout + proc.stderr
    # the rows written are the user's, those the seeded split takes (the same on every rank and resume)
    held = sorted(torch.randperm(N_PAIRS, generator=torch.Generator().manual_seed(1234))[:HELD_OUT].tolist())
    assert s["eval_rows_file"] == str(rm / "eval_rows.jsonl")
    assert [json.loads(line) for line in open(rm / "eval_rows.jsonl")] == [rows[i] for i in held]
    assert [r["step"] for r in metrics(rm, "eval")] == [0, 6]


def test_evaluate_on_the_written_rows_reproduces_the_stage_s_held_out_figures(own, tmp_path):
    _, _, _, rm, _ = own
    out = tmp_path / "ev"
    proc = run_stage("evaluate", f"output_dir={out}", f"model.name_or_path={rm}",
                     f"data.eval_path={rm / 'eval_rows.jsonl'}", "batch_size=8", "engine.precision=fp32")
    want, got = summary(rm), summary(out)
    assert got["mode"] == "reward" and got["eval_rows"] == want["eval_rows"] == HELD_OUT
    assert got["eval_source"] == f"data.eval_path={rm / 'eval_rows.jsonl'}"
    assert f"held-out: {HELD_OUT} pairs from data.eval_path=" in proc.stdout + proc.stderr
    assert got["eval_accuracy"] == want["eval_accuracy"]
    for k in ("eval_chosen_score", "eval_rejected_score"):  # the stage scored packed rows, evaluate padded ones
        assert got[k] == pytest.approx(want[k], abs=1e-5), k


def test_ppo_holds_out_the_user_s_prompts_and_skips_the_gold_score(own, tmp_path):
    """Own prompts (the prompt part of the pairs), no judge: KL and reward on a held-out split, no toy
    prompts, no gold score (said once, with how to get one)."""
    model, pairs, rows, rm, _ = own
    out = tmp_path / "ppo"
    proc = run_stage("ppo", f"output_dir={out}", f"actor.model={model}", f"critic.model={rm}", f"data.path={pairs}",
                     "data.eval_size=8", "train.max_steps=1", "train.eval_every=0", "train.save_every=0",
                     "rollout.prompts_per_step=8", "rollout.mini_batch_size=8", "rollout.micro_batch_size=8",
                     "rollout.max_new_tokens=4", "eval.max_new_tokens=4")
    s = summary(out)
    assert s["eval_source"] == f"data.path={pairs} (eval_size=8, split_seed=1234)" and s["eval_rows"] == 8
    assert s["eval_prompts_source"] is None and s["gold_score_after"] is None and s["gold_score_before"] is None
    assert s["kl"] is not None and s["reward_after"] is not None
    log = proc.stdout + proc.stderr
    assert log.count("no gold score") == 1 and "set data.eval_prompts_path" in log
    held = [json.loads(line) for line in open(out / "eval_rows.jsonl")]
    assert len(held) == 8 and all(r in rows for r in held)


# ----------------------------------------------------------------------------- item 2: the gold score where a judge applies


def _own_sft(tmp_path, n: int = 64) -> str:
    rows = [json.loads(line) for line in open(SHIPPED / "sft_train.jsonl")][:n]
    path = tmp_path / "my_sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "response": r["response"]}) + "\n" for r in rows))
    return str(path)


SFT = [*SMALL_MODEL, "train.max_steps=2", "train.eval_every=0", "train.save_every=0", "train.micro_batch_size=8",
       "train.global_batch_size=8", "eval.max_new_tokens=4"]


def test_sft_on_own_data_has_no_toy_gold_score_and_names_its_held_out_rows(tmp_path):
    data = _own_sft(tmp_path)
    out = tmp_path / "sft"
    proc = run_stage("sft", f"output_dir={out}", f"data.path={data}", "data.eval_size=0.125", *SFT)
    s = summary(out)
    assert s["eval_source"] == f"data.path={data} (eval_size=0.125, split_seed=1234)" and s["eval_rows"] == 8
    assert s["eval_prompts_source"] is None and s["eval_prompts"] == 0
    assert s["gold_score_before"] is None and s["gold_score_after"] is None
    assert s["eval_loss_after"] is not None  # the held-out perplexity still runs, on the user's rows
    log = proc.stdout + proc.stderr
    assert log.count("no gold score") == 1 and "`answer` field" in log and "] - gold score:" not in log
    assert len(open(out / "eval_rows.jsonl").readlines()) == 8


def test_sft_gold_score_on_the_user_s_prompts_with_answers(tmp_path):
    data = _own_sft(tmp_path)
    prompts = tmp_path / "qa.jsonl"  # prompts no judge knows, each with an `answer`: exact match
    prompts.write_text("".join(json.dumps({"prompt": f"Human: Say {w}.\n\nAssistant:", "answer": w}) + "\n"
                               for w in ("hi", "yes", "no", "ok")))
    out = tmp_path / "sft"
    proc = run_stage("sft", f"output_dir={out}", f"data.path={data}", f"data.eval_prompts_path={prompts}", *SFT)
    s = summary(out)
    assert s["eval_prompts_source"] == f"data.eval_prompts_path={prompts}" and s["eval_prompts"] == 4
    assert s["gold_score_after"] is not None
    assert f"gold score: 4 prompts from data.eval_prompts_path={prompts}" in proc.stdout + proc.stderr


def test_a_judge_of_your_own_scores_prompts_without_answers(tmp_path):
    """eval.judge=module:fn: every held-out prompt scored by the user's function (here 0.25 each, and an
    error on the prompts that say "fail", which are left unscored and counted); not importable: exit 2."""
    data = _own_sft(tmp_path)
    prompts = tmp_path / "open.jsonl"  # no `answer`, not the shipped task: no built-in judge applies
    prompts.write_text("".join(json.dumps({"prompt": f"Human: {q}\n\nAssistant:"}) + "\n"
                               for q in ("Say hi.", "Please fail.", "Say yes.", "Fail again.")))
    (tmp_path / "my_judge.py").write_text(
        "def score(prompt, response, row):\n"
        "    assert row['prompt'] == prompt and 'answer' not in row\n"
        "    if 'ail' in prompt:\n        raise RuntimeError('no verdict')\n"
        "    return 0.25\n")
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}"}
    out = tmp_path / "sft"
    proc = run_stage("sft", f"output_dir={out}", f"data.path={data}", f"data.eval_prompts_path={prompts}",
                     "eval.judge=my_judge:score", *SFT, env=env)
    s = summary(out)
    assert s["eval_prompts_source"] == f"data.eval_prompts_path={prompts}" and s["eval_prompts"] == 4
    assert s["gold_score_before"] == s["gold_score_after"] == 25.0  # over the 2 prompts it scored
    log = proc.stdout + proc.stderr
    assert "judged by eval.judge=my_judge:score" in log
    assert "eval.judge=my_judge:score failed on 2 of this rank's 4 prompts" in log and "no verdict" in log
    bad = run_stage("sft", f"output_dir={tmp_path / 'bad'}", f"data.path={data}", "eval.judge=my_judge:nothing",
                    *SFT, env=env, check=False)
    assert bad.returncode == 2 and "eval.judge='my_judge:nothing'" in bad.stderr
    assert bad.stderr.strip().count("\n") == 0


def test_dpo_on_own_pairs_holds_them_out_and_skips_the_gold_score(tmp_path):
    rows = [json.loads(line) for line in open(SHIPPED / "pairs_train.jsonl")][:40]
    pairs = tmp_path / "my_pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "dpo"
    proc = run_stage("dpo", f"output_dir={out}", "model.name_or_path=null", *SFT, f"data.path={pairs}",
                     "data.eval_fraction=0.2")  # the former name of eval_size still works
    s = summary(out)
    assert s["eval_source"] == f"data.path={pairs} (eval_fraction=0.2, split_seed=1234)"
    assert s["eval_rows"] == s["eval_pairs"] == 8 and s["train_pairs"] == 32
    assert s["eval_prompts_source"] is None and s["gold_score_after"] is None
    assert (proc.stdout + proc.stderr).count("no gold score") == 1


# ----------------------------------------------------------------------------- the configuration


@pytest.mark.parametrize("stage", ["sft", "reward", "dpo", "ppo", "evaluate"])
def test_shipped_evaluation_files_follow_data_path(stage):
    """The shipped defaults keep their evaluation files (the embedded pipeline is unchanged); your own
    data.path turns them to null; an explicit value wins either way."""
    from rlhf.config import SCHEMAS, compose, to_config

    def data(*overrides):
        c = to_config(compose(stage, list(overrides)), SCHEMAS[stage])
        return c.data, getattr(c, "default_pairs_path", None)

    shipped, pairs = data()
    pairs_eval, prompts = str(SHIPPED / "pairs_eval.jsonl"), str(SHIPPED / "eval_prompts.jsonl")
    assert shipped.eval_path == (pairs_eval if stage in ("reward", "dpo") else None)
    assert shipped.eval_prompts_path == (None if stage == "reward" else prompts)
    assert pairs == (pairs_eval if stage == "evaluate" else None)
    assert shipped.eval_size == 0.02 and shipped.eval_fraction is None
    same, _ = data(f"data.path={shipped.path}")  # the shipped file named on the command line is still it
    assert (same.eval_path, same.eval_prompts_path) == (shipped.eval_path, shipped.eval_prompts_path)
    own, pairs = data("data.path=/data/mine.jsonl")
    assert own.eval_path is None and own.eval_prompts_path is None and pairs is None
    given, _ = data("data.path=/data/mine.jsonl", "data.eval_path=/data/held.jsonl", "data.eval_prompts_path=/data/qa.jsonl")
    assert given.eval_path == "/data/held.jsonl" and given.eval_prompts_path == "/data/qa.jsonl"


def test_held_out_split_by_fraction_count_and_former_name(tmp_path):
    from rlhf.config import ConfigError, DataConfig
    from rlhf.data.stage import held_out_source, stage_rows

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "response": "r"}) + "\n" for i in range(50)))

    def split(**kw):
        train, held = stage_rows(DataConfig(path=str(path), **kw), stage=0)
        return [r.data["prompt"] for r in train], [r.data["prompt"] for r in held]

    train, held = split(eval_size=0.1)
    assert len(held) == 5 and len(train) == 45 and not set(train) & set(held)
    assert split(eval_size=5.0) == (train, held) == split(eval_size=0.5, eval_fraction=0.1)  # a count; the former name wins
    assert split(eval_size=5.0, split_seed=7) != (train, held)  # seeded by data.split_seed
    assert split(eval_size=0) == ([f"p{i}" for i in range(50)], [])
    assert split(eval_size=0.1, eval_path=str(path))[1] == [f"p{i}" for i in range(50)]  # an explicit file wins
    assert held_out_source(DataConfig(path=str(path), eval_size=12.0)) == f"data.path={path} (eval_size=12, split_seed=1234)"
    assert held_out_source(DataConfig(path=str(path), eval_path=str(path))) == f"data.eval_path={path}"
    assert held_out_source(DataConfig(path=str(path), eval_size=0)) is None
    with pytest.raises(ConfigError, match="data.eval_size=50 holds out 50 of the 50 rows"):
        split(eval_size=50.0)


@pytest.mark.parametrize("value,ok", [("0", True), ("0.5", True), ("200", True), ("1", True), ("1.5", False),
                                      ("-0.1", False)])
def test_eval_size_is_validated(value, ok):
    from rlhf.config import ConfigError, DataConfig
    from rlhf.config.validate import validate_data

    d = DataConfig(path="x.jsonl", eval_size=float(value))
    if ok:
        validate_data(d)
    else:
        with pytest.raises(ConfigError, match="data.eval_size must be a fraction in"):
            validate_data(d)
