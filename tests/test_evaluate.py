"""`python -m rlhf.evaluate` reproduces each stage's own held-out figures from the model it exported.

One module-scoped pipeline (SFT -> reward -> PPO, small model, few steps) is evaluated once per stage;
the figures must be *equal* to the stage's summary (same data, same batch shapes, same engine path).
"""
from __future__ import annotations

import json
import os

import pytest

from conftest import ROOT, run_stage, summary

N_PROMPTS = 12  # the first 12 shipped eval prompts, in the stages and here
MODEL = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
         "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2"]
# SFT memorises the correct answers of the first 6 eval prompts (a few steps from a random init score 0
# on the shipped task, which would make "equal gold scores" an empty check): its gold score is ~50.
EVAL_PROMPTS = f"data.eval_prompts_path={ROOT / 'data/default/eval_prompts.jsonl'}"  # with data of our own: named
SFT = [*MODEL, "train.max_steps=45", "train.lr=1e-2", "train.scheduler=constant", "train.warmup_steps=0",
       "train.eval_every=0", "train.save_every=0", "train.micro_batch_size=16", "train.global_batch_size=16",
       "data.eval_fraction=0.1", f"data.num_eval_prompts={N_PROMPTS}", EVAL_PROMPTS]
REWARD = ["model.fallback_to_config=false", "train.max_steps=8", "train.eval_every=0", "train.micro_batch_size=16",
          "train.global_batch_size=16"]
PPO = ["train.max_steps=2", "train.eval_every=0", "rollout.prompts_per_step=8", "rollout.mini_batch_size=8",
       "rollout.micro_batch_size=4", f"data.num_eval_prompts={N_PROMPTS}", "actor.lr=1e-3"]


def evaluate(out, *overrides: str, check: bool = True):
    return run_stage("evaluate", f"output_dir={out}", *overrides, check=check)


def samples(out) -> list[dict]:
    with open(os.path.join(out, "samples.jsonl")) as f:
        return [json.loads(line) for line in f]


def printed_samples(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("  sample: ")]


def as_printed(rows: list[dict]) -> list[str]:
    return [f"  sample: {r['prompt']!r} -> {r['response']!r} (gold {r['score']})" for r in rows]


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    with open(ROOT / "data/default/eval_prompts.jsonl") as f:
        rows = [json.loads(line) for line in f][:6]
    memo = root / "memo.jsonl"
    memo.write_text("".join(json.dumps({"prompt": r["prompt"], "response": " " + r["answer"]}) + "\n"
                            for r in rows * 8))
    procs = {"sft": run_stage("sft", f"output_dir={root / 'sft'}", *SFT, f"data.path={memo}")}
    run_stage("reward", f"output_dir={root / 'reward'}", f"model.name_or_path={root / 'sft'}", *REWARD)
    procs["ppo"] = run_stage("ppo", f"output_dir={root / 'ppo'}", f"actor.model={root / 'sft'}",
                             f"critic.model={root / 'reward'}", *PPO)
    return root, memo, procs


@pytest.fixture(scope="module")
def sft_eval(stages):
    root, memo, _ = stages
    out = root / "eval_sft"
    # the SFT stage's held-out rows: the same data.path and data.eval_fraction (carved the same way)
    proc = evaluate(out, f"model.name_or_path={root / 'sft'}", f"data.path={memo}", "data.eval_fraction=0.1",
                    f"data.num_eval_prompts={N_PROMPTS}", "batch_size=16", EVAL_PROMPTS)
    return out, proc


def test_sft_output_reproduces_its_gold_score_and_held_out_loss(stages, sft_eval):
    root, _, procs = stages
    out, proc = sft_eval
    want, got = summary(root / "sft"), summary(out)
    assert got["stage"] == "evaluate" and got["mode"] == "policy"  # mode auto: a causal LM
    assert 0 < want["gold_score_after"] < 100
    assert got["gold_score"] == want["gold_score_after"]
    tasks = {k[: -len("_after")] for k in want if k.startswith("gold_score/") and k.endswith("_after")}
    assert tasks and {k for k in got if k.startswith("gold_score/")} == tasks
    for k in tasks:
        assert got[k] == want[f"{k}_after"], k
    # perplexity on the SFT stage's held-out share of data.path (same rows, same batch size)
    assert got["eval_rows"] > 0
    assert got["eval_loss"] == want["eval_loss_after"]
    assert got["perplexity"] == want["perplexity_after"]
    # every prompt's generation is in samples.jsonl, scored; summary printed last
    rows = samples(out)
    assert len(rows) == got["eval_prompts"] == N_PROMPTS
    assert as_printed(rows[:3]) == printed_samples(procs["sft"].stdout)  # the same generations
    assert 100 * sum(r["score"] for r in rows) / len(rows) == pytest.approx(got["gold_score"])
    assert proc.stdout.rstrip().splitlines()[-1].split()[0] in got
    assert "evaluation done" in proc.stdout and "gold_score" in proc.stdout
    assert [r["kind"] for r in map(json.loads, open(out / "metrics.jsonl"))] == ["eval"]


def test_reward_output_reproduces_its_held_out_pair_figures(stages, tmp_path):
    root, _, _ = stages
    out = tmp_path / "eval_reward"
    # mode auto (LlamaForSequenceClassification -> reward); the stage's micro batch for bit-equal scores
    evaluate(out, f"model.name_or_path={root / 'reward'}", "batch_size=16")
    want, got = summary(root / "reward"), summary(out)
    assert got["mode"] == "reward" and got["eval_pairs"] == want["eval_pairs"]
    keys = [k for k in want if k.startswith(("eval_accuracy", "eval_chosen", "eval_rejected", "gold_"))]
    assert {"eval_accuracy", "eval_chosen_score", "gold_agreement", "gold_auc", "eval_accuracy/reverse"} <= set(keys)
    for k in keys:
        assert got[k] == want[k], (k, got[k], want[k])
    rows = samples(out)
    assert len(rows) == want["eval_pairs"]
    hits = sum(r["chosen_score"] > r["rejected_score"] for r in rows) / len(rows)
    assert hits == pytest.approx(got["eval_accuracy"], abs=1e-7)  # (the figure is a float32 mean)


def test_ppo_output_reproduces_its_greedy_gold_score(stages, tmp_path):
    root, _, procs = stages
    out = tmp_path / "eval_ppo"
    # PPO's final greedy eval: its eval.* keys (the SFT defaults) on data.eval_prompts_path
    evaluate(out, f"model.name_or_path={root / 'ppo'}", f"data.num_eval_prompts={N_PROMPTS}", "data.path=")
    want, got = summary(root / "ppo"), summary(out)
    assert got["mode"] == "policy" and got["eval_loss"] is None  # data.path= : no perplexity rows
    assert 0 < want["gold_score_after"] < 100
    assert got["gold_score"] == want["gold_score_after"]
    assert as_printed(samples(out)[:3]) == printed_samples(procs["ppo"].stdout)
    for k in (k for k in want if k.startswith("gold_score/") and k.endswith("_after")):
        assert got[k[: -len("_after")]] == want[k], k


def test_answer_field_is_scored_by_exact_match(stages, sft_eval, tmp_path):
    # Prompts the gold judge does not know; the answers are the model's own greedy responses for the
    # first half and something else for the second, so the score is exactly 50.
    prompts = [f"Human: Say {w}.\n\nAssistant:" for w in ("hi", "yes", "abc", "no", "zz", "ok")]
    first = tmp_path / "p1.jsonl"
    first.write_text("".join(json.dumps({"prompt": p, "answer": "?"}) + "\n" for p in prompts))
    common = [f"model.name_or_path={stages[0] / 'sft'}", "data.path=", "data.num_eval_prompts=0"]
    evaluate(tmp_path / "e1", *common, f"data.eval_prompts_path={first}")
    assert summary(tmp_path / "e1")["gold_score"] == 0.0  # no response is "?"
    responses = [r["response"] for r in samples(tmp_path / "e1")]
    second = tmp_path / "p2.jsonl"
    answers = [r.strip() if i < 3 else r.strip() + "x" for i, r in enumerate(responses)]
    second.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in zip(prompts, answers)))
    evaluate(tmp_path / "e2", *common, f"data.eval_prompts_path={second}")
    got = summary(tmp_path / "e2")
    assert got["gold_score"] == 50.0
    assert [r["score"] for r in samples(tmp_path / "e2")] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert not any(k.startswith("gold_score/") for k in got)  # no `task` field


def test_missing_model_is_a_clear_error(tmp_path):
    proc = evaluate(tmp_path / "o", f"model.name_or_path={tmp_path / 'nope'}", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "model.name_or_path" in proc.stderr and "no such file or directory" in proc.stderr
    proc = evaluate(tmp_path / "o", "model.name_or_path=outputs/no_such_stage", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "no such file" in proc.stderr


def test_prompts_without_answer_or_judge_are_an_error(stages, tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "Human: Say hi.\\n\\nAssistant:"}\n{"prompt": "Tell me a joke"}\n')
    proc = evaluate(tmp_path / "o", f"model.name_or_path={stages[0] / 'sft'}", f"data.eval_prompts_path={bad}",
                    check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "data.eval_prompts_path" in proc.stderr and "answer" in proc.stderr
    assert not os.path.exists(tmp_path / "o" / "summary.json")


def test_config_schema_has_a_comment_on_every_field():
    import dataclasses
    import inspect

    from rlhf.config import EvaluateConfig

    src = inspect.getsource(EvaluateConfig).splitlines()
    for f in dataclasses.fields(EvaluateConfig):
        (line,) = [x for x in src if x.startswith(f"    {f.name}: ")]
        assert "  # " in line, line
    assert (ROOT / "conf" / "evaluate.yaml").is_file()


@pytest.mark.slow
def test_torchrun_two_ranks_match_one_process(stages, sft_eval, tmp_path):
    out_one, _ = sft_eval
    out = tmp_path / "two"
    root, memo, _ = stages
    run_stage("evaluate", f"output_dir={out}", f"model.name_or_path={root / 'sft'}", f"data.path={memo}",
              "data.eval_fraction=0.1", f"data.num_eval_prompts={N_PROMPTS}", "batch_size=16", EVAL_PROMPTS, torchrun=2)
    one, two = summary(out_one), summary(out)
    assert two["gold_score"] == one["gold_score"]
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-6)
    assert [r["response"] for r in samples(out)] == [r["response"] for r in samples(out_one)]
