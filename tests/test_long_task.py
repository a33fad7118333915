"""The long-answer task (TASK=long): the judge's countby kind, its shipped data (scripts/make_long_data.py), and
scripts/run_all.sh TASK=long at smoke size (docs/tasks.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

import forkserver
from conftest import ROOT, SMALL_MODEL, cli_env, metrics, summary
from rlhf.core.task import gold_answer, gold_score, judge, make_prompt, task_of

sys.path.insert(0, str(ROOT / "scripts"))
from make_long_data import DEMO_HABIT_RATE, DEMO_SLIP_RATE, MAX_TOKENS, MIN_TOKENS, build, length_summary  # noqa: E402


def test_countby_judge_hand_cases():
    p = make_prompt("Count from 093 to 117 by 8.")
    assert task_of(p) == "countby" and gold_answer(p) == "093 101 109 117"  # as wide as the end is written
    assert gold_score(p, " 093 101 109 117") == 1.0 and gold_score(p, "093 101 109 117\n") == 1.0
    assert gold_score(p, " 093 101 109") == 0.0  # one term short (the demonstrator's habit)
    assert gold_score(p, " 093 101 109 117 125") == 0.0  # one past the end
    assert gold_score(p, " 093 101 099 117") == 0.0  # a dropped carry
    assert gold_score(p, " 93 101 109 117") == 0.0  # not zero-padded
    assert gold_answer(make_prompt("Count from 1 to 10 by 4.")) == "01 05 09"  # an end between terms: the last <= B
    assert gold_answer(make_prompt("Count from 7 to 7 by 3.")) == "7"
    for bad in ("Count from 5 to 1 by 2.", "Count from 1 to 5 by 0."):  # no answer: no judge, not a wrong one
        with pytest.raises(ValueError, match="a count needs a step >= 1 and an end >= its start"):
            gold_answer(make_prompt(bad))
        assert judge(make_prompt(bad), " 1") is None


def test_shipped_long_data_is_what_the_generator_makes():
    files = build()
    for name, rows in files.items():
        with open(ROOT / "data" / "long" / f"{name}.jsonl") as f:
            assert [json.loads(line) for line in f] == rows, name
    prompts = {name: [r["prompt"] for r in rows] for name, rows in files.items()}
    every = [p for ps in prompts.values() for p in ps]
    assert len(every) == len(set(every)) == 7000  # distinct within and across files: held-out prompts unseen
    # every count ends on a round hundred, the first of its terms to end in 00: the end is a local decision
    for p in every:
        terms = gold_answer(p).split()
        assert len(terms) >= 10 and [t for t in terms if t.endswith("00")] == [terms[-1]] and len(terms[0]) == 4
    # the gold answers' lengths under the shipped tokenizer span the task's range (measured: min 51, median 226, max 401)
    lengths = length_summary(files)
    assert MIN_TOKENS <= lengths["min"] <= 60 and 390 <= lengths["max"] <= MAX_TOKENS and 180 <= lengths["median"] <= 260
    for r in files["eval_prompts"]:
        assert r["answer"] == gold_answer(r["prompt"]) and r["task"] == "countby"
    # pairs: chosen right, rejected wrong by the judge
    for r in files["pairs_train"] + files["pairs_eval"]:
        assert gold_score(r["prompt"], r["chosen"]) == 1.0 and gold_score(r["prompt"], r["rejected"]) == 0.0
    # demonstrations: the habit (one term short) at its rate, a dropped carry at its rate, the rest right
    demos = files["sft_train"]
    habit = sum(r["response"].split() == gold_answer(r["prompt"]).split()[:-1] for r in demos) / len(demos)
    right = sum(gold_score(r["prompt"], r["response"]) for r in demos) / len(demos)
    assert abs(habit - DEMO_HABIT_RATE) < 0.03 and abs(1 - habit - right - DEMO_SLIP_RATE) < 0.02


@pytest.mark.slow
def test_run_all_long_task_smoke(tmp_path):
    """`TASK=long PRESET=smoke bash scripts/run_all.sh` (CI's size, a smaller model): SFT -> reward -> PPO on the
    long task's data, every generation up to 64 new tokens at this size; the held-out gold figures, the responses'
    lengths and the truncation counts reach the summaries, consistent with each other."""
    root = tmp_path / "long"
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "run_all.sh"), *(f"sft:{o}" for o in SMALL_MODEL)], cwd=ROOT,
                          env=forkserver.shim_env({**cli_env(), "PATH": path, "OUTPUT_DIR": str(root), "PRESET": "smoke",
                                                   "TASK": "long"}), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    sft, rm, ppo = (summary(root / stage) for stage in ("sft", "reward", "ppo"))
    for s in (sft, ppo):
        for when in ("before", "after"):
            assert 0.0 <= s[f"gold_score_{when}"] <= 100.0 and 0.0 <= s[f"truncated_rate_{when}"] <= 1.0
            assert 1 <= s[f"response_tokens_{when}"] <= 64  # eval.max_new_tokens=64 at smoke size
            # a response of fewer tokens than the budget ended on eos: a truncated one has all 64
            assert s[f"response_tokens_{when}"] >= 64 * s[f"truncated_rate_{when}"]
        assert s["gold_score/countby_after"] == s["gold_score_after"]  # every held-out prompt is of the long task
    assert ppo["gold_score_before"] == pytest.approx(sft["gold_score_after"])  # the same model, greedy
    assert ppo["truncated_rate_before"] == pytest.approx(sft["truncated_rate_after"])
    assert 0.0 <= rm["eval_accuracy"] <= 1.0
    # the rollouts' truncation: counted per step in metrics.jsonl, summed in summary.json
    steps = metrics(root / "ppo", "train")
    assert len(steps) == 2 and ppo["truncated_responses"] == sum(r["truncated_responses"] for r in steps)
    assert ppo["truncated_rate"] == pytest.approx(ppo["truncated_responses"] / (2 * 8))
    assert all(0 < r["response_len"] <= 64 for r in steps)
    # the task's settings reached the stages: positions for long answers, the rollout budget and the overlong shaping
    cfg = yaml.safe_load((root / "ppo" / "config.yaml").read_text())
    assert (cfg["rollout"]["max_new_tokens"], cfg["ppo"]["overlong_buffer"]) == (64, 16)
    assert cfg["data"]["path"] == "data/long/prompts_train.jsonl"
    for stage in ("sft", "reward", "ppo"):
        assert json.loads((root / stage / "model" / "config.json").read_text())["max_position_embeddings"] == 512


def test_run_all_long_task_refuses_another_pipeline_and_names_it_among_the_tasks(tmp_path):
    env = {**cli_env(), "OUTPUT_DIR": str(tmp_path)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "run_all.sh")], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "TASK": "long", "PIPELINE": "dpo"}, timeout=60)
    assert proc.returncode == 2 and "TASK=long runs SFT -> reward -> RL" in proc.stderr
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "run_all.sh")], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "TASK": "longer"}, timeout=60)
    assert proc.returncode == 2 and "long = long answers" in proc.stderr
    assert os.listdir(tmp_path) == []  # nothing ran
