"""Reward sources (rlhf/rl/rewards.py): the verifiable rewards and the weighted sum against hand-computed
values, a user function's failures as counted row errors, and every source through `python -m rlhf.ppo`."""
from __future__ import annotations

import json
import logging
import math
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, metrics, run_stage, summary
from rlhf.config import ConfigError, RewardSourcesConfig
from rlhf.config.validate import validate_reward_sources
from rlhf.core.plugins import load_function
from rlhf.rl.rewards import (
    TextReward,
    WeightedSum,
    answer_reward,
    build,
    check_rows,
    judge_reward,
    normalize_answer,
    prompt_row,
    report_errors,
)
from rlhf.rl.rollout import mask_nonfinite

PAD, EOS = 0, 1


class CharTokenizer:
    """Token id = the character's code point; 0 pads, 1 is the EOS (both special)."""

    pad_token_id = PAD

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(chr(i) for i in row if not (skip_special_tokens and i in (PAD, EOS))) for row in ids]


def rollout(responses: list[str], group: list[int]):
    """Responses as char ids + EOS, right-padded; the response mask covers the text and the EOS."""
    width = max(len(r) for r in responses) + 2
    ids = torch.zeros(len(responses), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(responses):
        ids[i, : len(r) + 1] = torch.tensor([ord(c) for c in r] + [EOS])
        mask[i, : len(r) + 1] = 1
    ids[0, -1] = ord("x")  # a token after the EOS, outside the mask: never decoded
    return SimpleNamespace(responses=ids, response_mask=mask, sequences=ids, group=torch.tensor(group))


ROWS = [
    prompt_row("Human: Reverse abc.\n\nAssistant:", None, {}),
    prompt_row("Human: Uppercase ab.\n\nAssistant:", None, {"task": "upper"}),
    prompt_row("Q: capital of France?", "Paris", {"task": "geo"}),
]


def test_answer_normalisation_strips_and_collapses_whitespace_but_keeps_case():
    assert normalize_answer("  4 6\t 7\n") == "4 6 7"
    assert normalize_answer("\tKQZT \n") == "KQZT"
    assert normalize_answer("") == ""
    row = {"prompt": "p", "answer": " New  York "}
    assert answer_reward("p", "New York", row) == 1.0
    assert answer_reward("p", " new york", row) == 0.0  # case is kept: "Uppercase" tasks are about case
    assert answer_reward("p", "NewYork", row) == 0.0  # whitespace collapsed, not removed
    assert answer_reward("p", "3", {"prompt": "p", "answer": 3}) == 1.0  # a numeric answer compares as text


def test_judge_is_the_gold_judge_answer_first_then_the_embedded_task():
    assert judge_reward(ROWS[0]["prompt"], " cba", ROWS[0]) == 1.0
    assert judge_reward(ROWS[0]["prompt"], " abc", ROWS[0]) == 0.0
    assert judge_reward(ROWS[2]["prompt"], " Paris ", ROWS[2]) == 1.0  # the row's answer decides
    assert prompt_row("p", "a", {"task": "t"}) == {"prompt": "p", "task": "t", "answer": "a"}
    assert prompt_row("p", None, {}) == {"prompt": "p"}


def test_text_sources_and_weighted_sum_hand_computed():
    tok = CharTokenizer()
    ro = rollout([" cba", " AB", "Paris", " abc"], group=[0, 1, 2, 0])
    judge = TextReward("judge", judge_reward, tok, ROWS)
    assert judge.texts(ro) == [" cba", " AB", "Paris", " abc"]  # EOS, pads and the token after EOS dropped
    assert judge.score(ro).tolist() == [1.0, 1.0, 1.0, 0.0]
    length = TextReward("len", lambda p, r, row: len(r), tok, ROWS, guarded=True)
    assert length.score(ro).tolist() == [4.0, 3.0, 5.0, 4.0]
    total = WeightedSum([(1.0, judge), (0.5, length)])
    assert total.score(ro).tolist() == [3.0, 2.5, 3.5, 2.0]  # 1*judge + 0.5*len
    assert total.errors == 0 and total.first_error is None
    # through build(): weights from the config; one source of weight 1 is the source itself
    cfg = RewardSourcesConfig(sources=["judge", "model"], weights=[2.0, -1.0])
    model = SimpleNamespace(score=lambda r: torch.tensor([0.5, 1.0, 2.0, -1.0]))
    assert build(cfg, tok, ROWS, reward_model=model).score(ro).tolist() == [1.5, 1.0, 0.0, 1.0]
    assert build(RewardSourcesConfig(sources=["model"]), tok, ROWS, reward_model=model) is model


def test_a_raising_or_nonfinite_function_is_a_counted_row_error(caplog):
    def fn(prompt, response, row):
        if "Uppercase" in prompt:
            raise KeyError("boom")
        return {"cba": math.nan, "abc": "1.5"}.get(response.strip(), 2)  # NaN, a str (not a number), an int

    tok = CharTokenizer()
    src = TextReward("mymod:fn", fn, tok, ROWS, guarded=True)
    ro = rollout([" cba", " AB", "Paris", " abc"], group=[0, 1, 2, 0])
    score = src.score(ro)
    assert math.isnan(score[0]) and math.isnan(score[1]) and math.isnan(score[3]) and score[2] == 2.0
    assert src.errors == 3
    assert src.first_error.startswith("mymod:fn: ValueError: returned nan")
    with caplog.at_level(logging.WARNING, logger="rlhf.rewards"):
        assert report_errors(src, step=7) == 3
    assert "step 7" in caplog.text and "mymod:fn" in caplog.text and "3 row(s)" in caplog.text
    # the failed rows are dropped from the update like any non-finite score
    ro.response_mask = ro.response_mask.clone()
    scored = {"score": score}
    assert mask_nonfinite(ro, scored) == {"score": 3}
    assert ro.nonfinite.tolist() == [True, True, False, True] and ro.response_mask[[0, 1, 3]].sum() == 0
    assert scored["score"].tolist() == [0.0, 0.0, 2.0, 0.0]
    assert src.score(rollout(["Paris"], [2])).tolist() == [2.0] and src.errors == 0  # counted per call


def test_a_trl_style_batched_function_is_called_as_trl_calls_it():
    """TRL's reward-function convention, `fn(prompts, completions, **kwargs) -> list[float]` with the dataset's
    other columns as keyword lists, failed on every row as a per-row call (#29): told apart by its signature."""
    from rlhf.rl.rewards import BATCHED, PER_ROW, FunctionReward, calling_convention

    seen = {}

    def trl(prompts, completions, answer, **kwargs):  # TRL: the extra columns arrive as lists
        seen.update(prompts=prompts, completions=completions, answer=answer, **kwargs)
        return [float(c.strip() == (a or "").strip()) for c, a in zip(completions, answer)]

    def lengths(completions, **kwargs):
        return [len(c) for c in completions]

    def only_named(completions, task):  # no **kwargs: only the keywords it names are passed
        return [0.5 if t else 0.0 for t in task]

    assert [calling_convention(f, "m:f") for f in (trl, lengths, only_named, lambda **kw: [], answer_reward,
                                                   lambda p, r, row=None: 0.0, lambda *a: 0.0)] == \
        [BATCHED, BATCHED, BATCHED, BATCHED, PER_ROW, PER_ROW, PER_ROW]
    for bad in (lambda prompt, response: 0.0, lambda x: 0.0, lambda a, b, c, d: 0.0):
        with pytest.raises(ConfigError, match=r"reward.function=m:bad: its signature .* fits neither"):
            calling_convention(bad, "m:bad")
    tok = CharTokenizer()
    ro = rollout([" cba", " AB", "Paris", " abc"], group=[0, 1, 2, 0])
    src = FunctionReward("m:trl", trl, tok, ROWS)
    assert src.score(ro).tolist() == [0.0, 0.0, 1.0, 0.0] and src.errors == 0
    assert seen["prompts"] == [ROWS[g]["prompt"] for g in (0, 1, 2, 0)]
    assert seen["completions"] == [" cba", " AB", "Paris", " abc"]
    assert seen["completion_ids"][2] == [ord(c) for c in "Paris"] + [EOS]  # the response's tokens, EOS included
    assert seen["answer"] == [None, None, "Paris", None] and seen["task"] == [None, "upper", "geo", None]
    assert FunctionReward("m:len", lengths, tok, ROWS).score(ro).tolist() == [4.0, 3.0, 5.0, 4.0]
    assert FunctionReward("m:named", only_named, tok, ROWS).score(ro).tolist() == [0.0, 0.5, 0.5, 0.0]
    # a whole call that fails fails its rows; a bad element fails its row
    bad = FunctionReward("m:short", lambda completions, **kw: [1.0], tok, ROWS)
    assert all(math.isnan(x) for x in bad.score(ro).tolist()) and bad.errors == 4
    assert bad.first_error.startswith("m:short: ValueError: returned 1 scores for 4 completions")
    mixed = FunctionReward("m:mixed", lambda completions, **kw: [1, None, "2", math.inf], tok, ROWS)
    assert mixed.score(ro).tolist()[0] == 1.0 and mixed.errors == 3
    assert mixed.first_error.startswith("m:mixed: TypeError: returned NoneType None, not a number")
    # through build(), as the run builds it
    cfg = RewardSourcesConfig(sources=["function"], function="os.path:join")
    assert isinstance(build(cfg, tok, ROWS), FunctionReward)


def test_a_function_that_scores_nothing_is_refused_at_the_start(tmp_path, monkeypatch):
    """Called on the first prompt rows before any model loads: a function that fails on every one of them
    (raises, returns a string, NaN, a list of the wrong length) stops the run naming reward.function, where it
    used to fail on every row of every step; one that fails on some rows only runs (those rows counted)."""
    from rlhf.rl.rewards import check_function

    (tmp_path / "probe_fns.py").write_text(
        "import math\n"
        "def good(prompt, response, row):\n    return float(response == row.get('answer'))\n"
        "def trl(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
        "def strings(prompt, response, row):\n    return 'good'\n"
        "def raises(completions, solution, **kwargs):\n    return [1.0] * len(completions)\n"
        "def nan(prompt, response, row):\n    return math.nan\n"
        "def long(prompts, completions):\n    return [1.0] * (len(completions) + 1)\n"
        "def some(prompt, response, row):\n    return 1.0 if row.get('task') == 'geo' else 1 / 0\n"
        "def two(prompt, response):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    class Tok(CharTokenizer):
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    def check(name):
        check_function(RewardSourcesConfig(sources=["function"], function=f"probe_fns:{name}"), Tok(), ROWS,
                       "data.path='qa.jsonl'")

    for ok in ("good", "trl", "some"):
        check(ok)
    for name, says in (("strings", "TypeError: returned str 'good', not a number"),
                       ("raises", "TypeError: ") ,  # a required column the prompt rows lack: `solution`
                       ("nan", "ValueError: returned nan"),
                       ("long", "ValueError: returned 4 scores for 3 completions"),
                       ("two", "fits neither")):
        with pytest.raises(ConfigError) as e:
            check(name)
        msg = str(e.value)
        assert msg.startswith(f"reward.function=probe_fns:{name}: ") and says in msg and "\n" not in msg, msg
        if name != "two":
            assert "on the first 3 prompt rows of data.path='qa.jsonl'" in msg and "scored none of them" in msg
    with pytest.raises(ConfigError, match="solution"):
        check("raises")


def test_load_function_and_config_errors_name_the_key():
    assert load_function("os.path:join") is __import__("os").path.join
    for spec, says in (("os.path", "module:function"), ("no_such_module_xyz:f", "cannot import"),
                       ("os:no_such_attr", "has no attribute"), ("os:sep", "not a function"), (None, "module:function")):
        with pytest.raises(ConfigError, match="reward.function") as e:
            load_function(spec)
        assert says in str(e.value)
    for cfg, says in ((RewardSourcesConfig(sources=["modle"]), "unknown source 'modle'"),
                      (RewardSourcesConfig(sources=[]), "at least one"),
                      (RewardSourcesConfig(sources=["judge", "judge"]), "twice"),
                      (RewardSourcesConfig(sources=["judge", "model"], weights=[1.0]), "1 weights for 2"),
                      (RewardSourcesConfig(sources=["judge"], weights=[math.inf]), "finite"),
                      (RewardSourcesConfig(sources=["judge"], function="os:sep"), "'function' is not in"),
                      (RewardSourcesConfig(sources=["function"]), "reward.function must be")):
        with pytest.raises(ConfigError, match="reward") as e:
            validate_reward_sources(cfg)
        assert says in str(e.value)


def test_rows_without_answer_or_judge_are_refused():
    check_rows(["judge", "model"], ROWS, "x")  # every row judgeable (an answer, or a task prompt)
    with pytest.raises(ConfigError, match="'answer' but 2 of 3 prompt rows of data.path='x' has no `answer`"):
        check_rows(["answer"], ROWS, "data.path='x'")
    with pytest.raises(ConfigError, match="'judge' but 1 of 2 prompt rows .* no judge"):
        check_rows(["judge"], [ROWS[0], prompt_row("Write a poem.", None, {})], "f")
    check_rows(["model", "function"], [prompt_row("Write a poem.", None, {})], "f")  # needs nothing


# --------------------------------------------------------------------------- through the command line

PPO = ["train.max_steps=2", "train.eval_every=0", "train.save_every=0", "rollout.prompts_per_step=8",
       "rollout.mini_batch_size=8", "rollout.micro_batch_size=8", "rollout.max_new_tokens=6",
       "eval.max_new_tokens=6", "data.num_eval_prompts=4", "alarms.enabled=false"]

USER_MODULE = '''
import math

def score(prompt, response, row):
    # the prompt row's fields arrive: its answer and its other fields (task)
    assert row["prompt"] == prompt and row["answer"] and row["task"] in prompt.lower() and isinstance(response, str)
    if "Sort" in prompt:
        raise RuntimeError("cannot score sorting")
    if "Reverse" in prompt:
        return math.nan
    return 1.0
'''


def ppo(stages, out, *extra, check=True):
    return run_stage("ppo", f"output_dir={out}", f"actor.model={stages / 'sft'}", f"critic.model={stages / 'reward'}",
                     *PPO, *extra, check=check, timeout=300)


def test_every_source_summed_with_a_failing_user_function_through_the_cli(tiny_stages, tmp_path, monkeypatch):
    """A prompt file with `answer` and `task` fields; reward = 0 x reward model + 1 x judge + 1 x answer
    + 0.5 x score(), where score() raises on Sort prompts and returns NaN on Reverse ones: those rows
    are dropped and counted, the others score 2 x match + 0.5, and the run completes. (The judge alone,
    without a reward model loaded: tests/test_alarms.py's stop_on_alarm run.)"""
    (tmp_path / "user_rewards.py").write_text(USER_MODULE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}")
    rows = [json.loads(line) for line in open(ROOT / "data/default/eval_prompts.jsonl")][:32]
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "o"
    # held-out: the first prompts of the same file (own data.path: no shipped eval prompts by default)
    proc = ppo(tiny_stages, out, f"data.path={data}", f"data.eval_prompts_path={data}",
               "reward.sources=[model,judge,answer,function]", "reward.weights=[0,1,1,0.5]",
               "reward.function=user_rewards:score")
    log = (proc.stdout + proc.stderr).replace("\r", "")
    assert "reward: 0 x model + 1 x judge + 1 x answer + 0.5 x user_rewards:score\n" in log  # the model is loaded
    assert "reward function failed on" in log  # one WARN line per step, naming the function and the exception
    assert ("user_rewards:score: RuntimeError: cannot score sorting" in log
            or "user_rewards:score: ValueError: returned nan" in log)
    train = metrics(out, "train")
    for r in train:
        assert r["reward_errors"] == r["nonfinite_rows"] > 0, r  # every failed row dropped, and no other
        kept = 8 - r["reward_errors"]
        matches = (r["reward"] - 0.5) / 2 * kept  # judge and answer agree on these rows: a whole number
        assert abs(matches - round(matches)) < 1e-4 and 0 <= round(matches) <= kept, r
    s = summary(out)
    assert s["reward_errors"] == sum(r["reward_errors"] for r in train)
    assert s["reward_sources"] == ["model", "judge", "answer", "function"] and math.isfinite(s["reward_after"])


@pytest.mark.parametrize("source,poems", [("answer", False), ("judge", True)])
def test_a_source_the_prompts_cannot_feed_is_refused_before_models_load(tiny_stages, tmp_path, source, poems):
    """answer on the default prompts (no `answer` field); judge on prompts no judge knows."""
    data = []
    if poems:
        (tmp_path / "poems.jsonl").write_text('{"prompt": "Write a poem."}\n' * 16)
        data = [f"data.path={tmp_path / 'poems.jsonl'}"]
    proc = ppo(tiny_stages, tmp_path / "o", f"reward.sources=[{source}]", *data, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"reward.sources has {source!r} but 16 of 16 prompt rows" in proc.stderr if poems else \
        "reward.sources has 'answer' but" in proc.stderr
    assert ("no judge can score it" if poems else "no `answer` field") in proc.stderr
    assert not (tmp_path / "o" / "metrics.jsonl").exists()
