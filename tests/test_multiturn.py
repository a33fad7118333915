"""Multi-turn rollouts (rlhf/rl/multiturn.py): token-in token-out transcripts, masks, the chat template's
tool glue and its check, faults, the calculator tool, the masks through rewards/GAE, and the config keys."""
from __future__ import annotations

import contextlib
import logging
import os
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, comparable, metrics, run_stage, summary
from test_chat_data import make_chatml

from engine.generation import Generated, HFGenerator, InjectedGenerator, SamplingParams
from rlhf.algos import rl as rl_math
from rlhf.config import PPOConfig
from rlhf.config.validate import validate_env
from rlhf.core.errors import ConfigError, TrainingError
from rlhf.data import collate_prompts
from rlhf.rl import multiturn
from rlhf.rl.environments import Environment, Step
from rlhf.rl.environments.base import ERROR_GARBAGE, ERROR_RAISED, InlineRunner
from rlhf.rl.environments.calculator import CalcError, Calculator, evaluate
from rlhf.rl.experience import build_experience
from rlhf.rl.rollout import generate

# ----------------------------------------------------------------------------- helpers


class Actor:
    """The actor engine's generation interface over a generator (a model's HFGenerator or a script)."""

    def __init__(self, generator):
        self.generator = generator
        self.info = SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1)
        self.calls: list[tuple[torch.Tensor, torch.Tensor, Generated]] = []

    @contextlib.contextmanager
    def generation(self):
        actor = self

        class Recording:
            resumes = getattr(actor.generator, "resumes", False)  # (the scripted generator: no cache)

            def reserve(self, rows, tokens):
                actor.generator.reserve(rows, tokens)

            def generate(self, ids, mask, params, **kw):
                out = actor.generator.generate(ids, mask, params, **kw)
                actor.calls.append((ids.clone(), mask.clone(), out))
                return out

        yield Recording()


class Script:
    """A generator that writes scripted turns: call k gives row b the ids script[k][b] (as sampled)."""

    def __init__(self, script: list[list[list[int]]], pad: int):
        self.script, self.pad, self.k = script, pad, 0

    def generate(self, ids, mask, params, *, eos_token_id, pad_token_id, return_logprobs=False, row_seeds=None):
        turns = self.script[self.k]
        self.k += 1
        T = max(len(t) for t in turns)
        resp = torch.full((len(turns), T), self.pad, dtype=torch.long)
        rmask = torch.zeros((len(turns), T), dtype=torch.long)
        for b, t in enumerate(turns):
            resp[b, : len(t)] = torch.tensor(t)
            rmask[b, : len(t)] = 1
        return Generated(sequences=torch.cat([ids, resp], 1), attention_mask=torch.cat([mask, rmask], 1),
                         response_mask=rmask, prompt_len=ids.shape[1], logprobs=-0.5 * rmask.float())


class Tool(Environment):
    """Answers `n` turns with "12" (then ends the episode)."""

    n = 2

    def reset(self, row):
        self.turn = 0

    def step(self, text):
        self.turn += 1
        return Step("12" if self.turn <= self.n else None, {"env": 0.25})


class OneTurn(Environment):
    def step(self, text):
        return Step(None)


class Faulty(Environment):
    """Row `prompt` decides: 'raise' raises, 'garbage' returns a string, else a one-turn episode."""

    def reset(self, row):
        self.mode = row["mode"]

    def step(self, text):
        if self.mode == "raise":
            raise RuntimeError("boom")
        if self.mode == "garbage":
            return "not a Step"
        return Step(None)


@pytest.fixture(scope="module")
def embedded():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ROOT / "data/tokenizer")


@pytest.fixture(scope="module")
def tiny_lm(embedded):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(embedded), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=embedded.bos_token_id, eos_token_id=embedded.eos_token_id,
                      pad_token_id=embedded.pad_token_id)
    return LlamaForCausalLM(cfg).eval()


def prompts_of(tok, texts):
    feats = [{"input_ids": tok(t, add_special_tokens=False)["input_ids"]} for t in texts]
    return collate_prompts(feats, tok.pad_token_id)


PROMPTS = ["Human: What is 4821+3907?\n\nAssistant:", "Human: Reverse abc.\n\nAssistant:",
           "Human: What is 12+30?\n\nAssistant:"]
SAMPLE = SamplingParams(max_new_tokens=6, temperature=1.0)


def rows_of(texts, **extra):
    return [{"prompt": t, **extra} for t in texts]


# ----------------------------------------------------------------------------- token-in, token-out


def test_embedded_trained_ids_are_the_generated_and_inserted_ids(embedded, tiny_lm):
    """Every row's response region = its turns' sampled ids + the glue and observation ids, position by
    position; each later turn is generated from exactly those ids; the mask is 1 on sampled ids only."""
    tok = embedded
    glue = multiturn.template_glue(tok)
    # the embedded template writes a tool message after an assistant turn as "</s>\n\nTool: " + obs + "\n\nAssistant:"
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert glue.source == "chat template"
    assert glue.before_obs(tok.eos_token) == tuple(enc("\n\nTool: "))
    assert glue.before_obs("") == tuple(enc("</s>\n\nTool: "))
    assert glue.after_obs == tuple(enc("\n\nAssistant:"))
    torch.manual_seed(3)
    actor = Actor(HFGenerator(tiny_lm))
    batch = prompts_of(tok, PROMPTS)
    settings = multiturn.Settings(max_turns=3, max_new_tokens=6, max_episode_tokens=80)
    rollout, stats = multiturn.generate_episodes(actor, batch, torch.arange(3), rows_of(PROMPTS), SAMPLE, tok,
                                                 InlineRunner(Tool), settings, glue)
    P = rollout.prompt_len
    expected = {b: [] for b in range(3)}
    policy = {b: [] for b in range(3)}
    open_rows = list(range(3))
    for k, (ids, mask, out) in enumerate(actor.calls):
        assert len(open_rows) == ids.shape[0]
        for i, b in enumerate(open_rows):
            # the turn's input is the prompt + everything inserted so far, nothing re-encoded
            row_in = ids[i][mask[i].bool()].tolist()
            assert row_in == batch["input_ids"][b][batch["attention_mask"][b].bool()].tolist() + expected[b]
            n = int(out.response_mask[i].sum())
            toks = out.responses[i, :n].tolist()
            toks = toks[: settings.budget - len(expected[b])]
            expected[b] += toks
            policy[b] += [1] * len(toks)
            empty = k == 0 and (not toks or toks[0] == tok.eos_token_id)
            if k < Tool.n and k < settings.max_turns - 1 and not empty:
                ending = tok.eos_token if toks[-1] == tok.eos_token_id else ""
                obs = list(glue.before_obs(ending)) + enc("12") + list(glue.after_obs)
                if len(expected[b]) + len(obs) < settings.budget:
                    expected[b] += obs
                    policy[b] += [0] * len(obs)
        open_rows = [b for b in open_rows if len(expected[b]) > 0 and policy[b][-1] == 0]
    assert len(actor.calls) >= 2, "the scripted tool keeps episodes going for 2 more turns"
    for b in range(3):
        n = len(expected[b])
        assert rollout.sequences[b, P : P + n].tolist() == expected[b], f"row {b}"
        assert rollout.attention_mask[b, P:].tolist() == [1] * n + [0] * (rollout.sequences.shape[1] - P - n)
        want_mask = [0] * n if rollout.empty[b] else policy[b]
        assert rollout.response_mask[b, :n].tolist() == want_mask, f"row {b}: a glue/observation token in the mask"
        assert rollout.response_mask[b, n:].sum() == 0
        assert (rollout.logp_gen[b][rollout.response_mask[b] == 0] == 0).all()
    assert stats.tool_calls.tolist() == [float(sum(1 for k in range(len(policy[b]) - 1)
                                                   if policy[b][k] == 1 and policy[b][k + 1] == 0)) for b in range(3)]
    assert stats.env_reward.tolist() == [0.25 * t for t in stats.turns.tolist()]


def test_chatml_tool_glue_and_the_template_check(caplog):
    """A ChatML tokenizer (Qwen2.5's tool layout, eos != <|im_end|>): turns end at the turn_stop <|im_end|>;
    the ids equal apply_chat_template of the conversation; a wrong glue is counted and named once."""
    tok = make_chatml()
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    glue = multiturn.template_glue(tok, ("<|im_end|>",))
    assert tok.decode(glue.before_obs("<|im_end|>")) == "\n<|im_start|>user\n<tool_response>\n"
    assert tok.decode(glue.after_obs) == "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    end = enc("<|im_end|>")
    call, answer = enc("get_weather city Paris") + end, enc("It is sunny and 21 degrees in Paris.") + end
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the weather in Paris today?"}],
                                     tokenize=False, add_generation_prompt=True)
    rows = [{"prompt": "What is the weather in Paris today?",
             "messages": [{"role": "user", "content": "What is the weather in Paris today?"}]}]

    class Weather(Environment):
        def step(self, text):
            return Step("sunny, 21" if "get_weather" in text else None)

    def run(g):
        actor = Actor(Script([[call], [answer]], tok.pad_token_id))
        settings = multiturn.Settings(max_turns=3, max_new_tokens=20, max_episode_tokens=200, turn_stop=("<|im_end|>",))
        return multiturn.generate_episodes(actor, prompts_of(tok, [prompt]), torch.arange(1), rows, SAMPLE, tok,
                                           InlineRunner(Weather), settings, g)

    rollout, stats = run(glue)
    whole = tok.apply_chat_template(
        rows[0]["messages"] + [{"role": "assistant", "content": "get_weather city Paris"},
                               {"role": "tool", "content": "sunny, 21"},
                               {"role": "assistant", "content": "It is sunny and 21 degrees in Paris."}], tokenize=False)
    ids = rollout.sequences[0][rollout.attention_mask[0].bool()].tolist()
    assert ids == enc(whole)[: len(ids)] and tok.decode(ids) + "\n" == whole
    inserted = enc("\n<|im_start|>user\n<tool_response>\nsunny, 21\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert rollout.response_mask[0].tolist() == [1] * len(call) + [0] * len(inserted) + [1] * len(answer)
    assert (stats.template_checked, stats.template_mismatch) == (1, 0)
    assert rollout.answer_mask[0].tolist() == [0] * (len(call) + len(inserted)) + [1] * len(answer)
    # a glue that drops the tool header: the check counts the row and names the first differing position
    bad = multiturn.Glue(before={k: v[:1] for k, v in glue.before.items()}, after_obs=glue.after_obs,
                         source="chat template")
    multiturn._warned["template"] = False
    with caplog.at_level(logging.WARNING, logger="rlhf.ppo"):
        _, stats = run(bad)
    assert (stats.template_checked, stats.template_mismatch) == (1, 1)
    assert f"response position {len(call) + 1}" in caplog.text


# ----------------------------------------------------------------------------- one turn = today's rollout


def test_a_one_turn_environment_gives_todays_rollout_and_experience(embedded, tiny_lm):
    tok = embedded
    batch = prompts_of(tok, PROMPTS)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    torch.manual_seed(11)
    ref = generate(Actor(HFGenerator(tiny_lm)), batch, torch.arange(3), params, tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(11)
    got, stats = multiturn.generate_episodes(Actor(HFGenerator(tiny_lm)), batch, torch.arange(3), rows_of(PROMPTS),
                                             params, tok, InlineRunner(OneTurn),
                                             multiturn.Settings(max_turns=4, max_new_tokens=8),
                                             multiturn.template_glue(tok))
    for name in ("sequences", "attention_mask", "response_mask", "responses", "empty", "truncated", "logp_gen"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert got.prompt_len == ref.prompt_len and stats.turns.tolist() == [1.0, 1.0, 1.0]
    # the same rewards and advantages, every estimator (the same masks in, the same numbers out)
    g = torch.Generator().manual_seed(0)
    B, T = got.response_mask.shape
    scored = {"logp_old": torch.randn(B, T, generator=g), "logp_ref": torch.randn(B, T, generator=g),
              "values": torch.randn(B, T, generator=g), "score": torch.randn(B, generator=g),
              "position_ids": torch.zeros(B, T + got.prompt_len, dtype=torch.long)}
    for est in ("gae", "grpo", "rloo", "reinforce_pp"):
        exps = [build_experience(r.sequences, r.attention_mask, r.response_mask, r.prompt_len, dict(scored),
                                 kl_coef=0.1, kl_estimator="k1", clip_reward_value=5.0, gamma=1.0, lam=0.95,
                                 estimator=est, group=torch.tensor([0, 0, 1])) for r in (got, ref)]
        for name in ("rewards", "kl", "advantages", "returns"):
            a, b = getattr(exps[0], name), getattr(exps[1], name)
            assert (a is None and b is None) or torch.equal(a, b), (est, name)


# ----------------------------------------------------------------------------- masks through the RL math


def test_observation_holes_are_skipped_by_rewards_gae_and_returns():
    """A row with an observation hole gives the numbers of the same row with the hole cut out."""
    g = torch.Generator().manual_seed(1)
    r, v = torch.randn(1, 7, generator=g), torch.randn(1, 7, generator=g)
    holey = torch.tensor([[1, 1, 0, 0, 1, 1, 0]], dtype=torch.float32)  # turn, observation, turn, pad
    keep = holey[0].bool()
    dense = torch.ones(1, 4)
    a_h, ret_h = rl_math.gae_advantages(r, v, holey, gamma=0.9, lam=0.8)
    a_d, ret_d = rl_math.gae_advantages(r[:, keep], v[:, keep], dense, gamma=0.9, lam=0.8)
    assert torch.allclose(a_h[:, keep], a_d) and (a_h[:, ~keep] == 0).all()
    assert torch.allclose(ret_h[:, keep], ret_d)
    assert torch.allclose(rl_math.discounted_returns(r, holey, 0.9)[:, keep], rl_math.discounted_returns(r[:, keep], dense, 0.9))
    rewards, _ = rl_math.compute_rewards(torch.zeros(1, 7), torch.zeros(1, 7), torch.tensor([2.0]), holey, 0.1, 5.0)
    assert rewards[0].tolist() == [0, 0, 0, 0, 0, 2.0, 0]  # the score on the last policy token, not column 3


# ----------------------------------------------------------------------------- faults


def test_faults_end_their_episode_masked_and_counted_and_the_step_goes_on(embedded, tiny_lm):
    tok = embedded
    modes = ["raise", "ok", "garbage"]
    torch.manual_seed(5)
    rollout, stats = multiturn.generate_episodes(
        Actor(HFGenerator(tiny_lm)), prompts_of(tok, PROMPTS), torch.arange(3),
        [{"prompt": p, "mode": m} for p, m in zip(PROMPTS, modes)], SamplingParams(max_new_tokens=4, greedy=True),
        tok, InlineRunner(Faulty), multiturn.Settings(max_turns=2, max_new_tokens=4), multiturn.template_glue(tok))
    assert rollout.env_failed.tolist() == [True, False, True]
    assert [e.error for e in stats.episodes] == [ERROR_RAISED, None, ERROR_GARBAGE]
    assert rollout.response_mask[0].sum() == 0 and rollout.response_mask[2].sum() == 0
    assert rollout.response_mask[1].sum() > 0 or bool(rollout.empty[1])
    assert (stats.errors, stats.timeouts) == (2, 0) and "boom" in stats.first_error
    rec = multiturn.step_env_metrics(stats, torch.device("cpu"))
    assert (rec["env_errors"], rec["env_timeouts"], rec["episodes"]) == (2, 0, 3)
    settings = multiturn.Settings(max_turns=2, max_new_tokens=4, max_failure_fraction=0.5, env_name="tests:Faulty")
    with pytest.raises(TrainingError, match=r"rollout.env=tests:Faulty: 2 of 3 episodes .* boom"):
        multiturn.check_failures(rec, stats, settings)
    multiturn.check_failures(rec, stats, multiturn.Settings(max_turns=2, max_new_tokens=4, max_failure_fraction=0.7))
    # every episode faulted: the step teaches nothing, so even a fraction of 1 stops (as a step without rewards)
    every = {**rec, "env_errors": 3}
    with pytest.raises(TrainingError, match=r"rollout.env=tests:Faulty: 3 of 3 episodes of the step faulted"):
        multiturn.check_failures(every, stats, multiturn.Settings(max_turns=2, max_new_tokens=4, max_failure_fraction=1.0,
                                                                  env_name="tests:Faulty"))


class Slow(Tool):
    """Tool, each step taking 30 ms."""

    def step(self, text):
        time.sleep(0.03)
        return super().step(text)


def test_the_episodes_overhead_is_everything_outside_the_model():
    """env_overhead_s = the episodes' time outside the generator's calls: the environment's (env_s) and more;
    a generator that takes 50 ms a call is not in it."""
    tok_ids = [[[5, 6, 2]] * 2] * 3  # every turn of both rows: two tokens and EOS (id 2)

    class Timed(Script):
        def generate(self, *a, **kw):
            time.sleep(0.05)
            return super().generate(*a, **kw)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ROOT / "data/tokenizer")
    texts = PROMPTS[:2]
    _, stats = multiturn.generate_episodes(
        Actor(Timed(tok_ids, tok.pad_token_id)), prompts_of(tok, texts), torch.arange(2), rows_of(texts), SAMPLE, tok,
        InlineRunner(Slow), multiturn.Settings(max_turns=3, max_new_tokens=4, max_episode_tokens=200),
        multiturn.template_glue(tok))
    assert stats.tool_calls.tolist() == [2.0, 2.0] and stats.turns.tolist() == [3.0, 3.0]
    # 6 environment calls of 30 ms; the generator's 3 calls of 50 ms would add 150 ms
    assert 6 * 0.03 <= stats.env_s <= stats.overhead_s < stats.env_s + 0.1, (stats.env_s, stats.overhead_s)
    rec = multiturn.step_env_metrics(stats, torch.device("cpu"))
    assert rec["env_overhead_s"] == pytest.approx(stats.overhead_s) and rec["env_s"] == pytest.approx(stats.env_s)


def test_the_env_bench_runs_the_pipelines_tool_rl_stage():
    """scripts/bench_env.py --step times the RL stage that run_all.sh's TASK=tools runs."""
    from scripts.bench_env import TOOLS_RL

    text = (ROOT / "scripts" / "run_all.sh").read_text()
    tools = text.split("  tools)", 1)[1].split("\n    ;;", 1)[0].split("\n      off)", 1)[0]  # the tool arm's lines
    for arg in TOOLS_RL:
        assert (arg in tools) if arg != "algorithm=grpo" else ('ALGO="${ALGO:-grpo}"' in text.split("  tools)")[1]), arg


# ----------------------------------------------------------------------------- the calculator


@pytest.mark.parametrize("expr,value", [("4821+3907", "8728"), ("12 - 30", "-18"), ("1.5*4", "6"), ("7/2", "3.5"),
                                        ("1/3", "0.3333333333"), ("-2+-3", "-5"), ("(2+3)*4", "20"), ("0.1+0.2", "0.3"),
                                        ("10.", "10")])
def test_calculator_evaluates_arithmetic(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr,why", [("__import__('os')", "only digits"), ("2**100", "not arithmetic: BinOp"),
                                      ("abc", "only digits"), ("1/0", "division by zero"), ("", "empty"),
                                      ("1+", "not a well-formed"), ("9" * 50, "too large"), ("3%2", "only digits"),
                                      ("1" + "+1" * 150, "longer than")])
def test_calculator_refuses_anything_else(expr, why):
    with pytest.raises(CalcError, match=why.replace("*", r"\*")):
        evaluate(expr)


def test_calculator_environment_steps():
    env = Calculator()
    assert env.reset({"prompt": "x"}) is None
    assert env.step(" calc: 4821+3907").observation == "8728"
    assert env.step(" calc: 1+1 then calc: 2+5").observation == "7"  # the last call of the turn
    assert env.step(" calc: os.system").observation.startswith("error: only digits")
    assert env.step(" 8728").observation is None  # no call: the answer, the episode ends


# ----------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("key,value,msg", [
    ("max_turns", 0, "rollout.max_turns must be >= 1"),
    ("max_episode_tokens", 0, "rollout.max_episode_tokens must be >= 1"),
    ("turn_stop", [""], "rollout.turn_stop must be a list of non-empty strings"),
    ("env_workers", -1, "rollout.env_workers must be >= 0"),
    ("env_timeout_s", 0.0, "rollout.env_timeout_s must be a finite number > 0"),
    ("env_timeout_s", float("inf"), "rollout.env_timeout_s must be a finite number > 0"),
    ("max_env_failure_fraction", 1.5, r"rollout.max_env_failure_fraction must be in \[0, 1\]"),
    ("env", "nocolon", "rollout.env must be 'module:function'"),
    ("env", "no_such_module_xyz:Env", "rollout.env='no_such_module_xyz:Env': cannot import"),
])
def test_bad_env_settings_name_the_key(key, value, msg):
    r = PPOConfig().rollout
    setattr(r, key, value)
    with pytest.raises(ConfigError, match=msg):
        validate_env(r)


def test_good_env_settings_pass_and_settings_budget():
    r = PPOConfig().rollout
    r.env, r.max_turns, r.max_new_tokens, r.turn_stop = "rlhf.rl.environments.calculator:Calculator", 3, 8, ["!"]
    validate_env(r)
    assert multiturn.Settings.of(r).budget == 24
    r.max_episode_tokens = 10
    assert multiturn.Settings.of(r).budget == 10


# ----------------------------------------------------------------------------- the tool task's data, the alarm


def test_shipped_tool_data_is_what_the_generator_makes_and_held_out_sums_are_unseen():
    import json
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    from make_tool_data import build

    files = build()
    for name, rows in files.items():
        with open(ROOT / "data" / "tools" / f"{name}.jsonl") as f:
            assert [json.loads(line) for line in f] == rows, name
    held = {r["prompt"] for r in files["eval_tools"]}
    seen = {r["prompt"] for r in files["prompts_tools"]} | {
        "Human: " + r["messages"][0]["content"] + "\n\nAssistant:" for r in files["sft_tools"]}
    assert len(held) == 200 and not held & seen
    # the control arm's rows: the same sums, the answer as one response
    assert [(r["prompt"], r["response"]) for r in files["sft_direct"]] == [
        ("Human: " + r["messages"][0]["content"] + "\n\nAssistant:", " " + r["messages"][3]["content"])
        for r in files["sft_tools"]]
    demo = files["sft_tools"][0]["messages"]
    a, b = (int(x) for x in demo[1]["content"].removeprefix("calc: ").split("+"))
    assert demo[2]["content"] == demo[3]["content"] == str(a + b) == Calculator().step(" " + demo[1]["content"]).observation


def test_tool_collapse_alarm():
    from rlhf.rl.alarms import tool_collapse

    a = tool_collapse([1.0, 1.0, 0.9, 0.3, 0.2, 0.1], [2.0] * 6, 3, 0.5)
    assert a.fired and a.figures["tool_calls_ratio"] == pytest.approx(0.2 / 0.9667, abs=1e-3)
    assert a.figures["turns_ratio"] == 1.0
    assert not tool_collapse([1.0] * 6, [2.0, 2.0, 2.0, 1.5, 1.5, 1.5], 3, 0.5).fired  # turns at 0.75x: quiet
    assert tool_collapse([1.0] * 6, [2.0, 2.0, 2.0, 1.0, 1.0, 0.5], 3, 0.5).fired      # turns at 0.42x
    nan = float("nan")
    assert tool_collapse([nan] * 6, [nan] * 6, 3, 0.5) is None  # a single-turn run: not computed
    assert tool_collapse([1.0] * 5, [1.0] * 5, 3, 0.5) is None  # fewer than 2 windows


# ----------------------------------------------------------------------------- the RL stage with an environment

ONE_TURN_ENV = """
from rlhf.rl.environments import Environment, Step


class OneTurn(Environment):
    def step(self, text):
        return Step(None)


class Broken(Environment):
    def step(self, text):
        raise RuntimeError("the tool is down")
"""


def test_ppo_with_a_one_turn_environment_logs_the_single_turn_numbers(tiny_stages, tmp_path):
    """The RL stage through its command line: a one-turn environment (inline) gives the same metrics as no
    environment, step by step (the wall-clock fields aside), plus its own figures; an environment that
    always faults stops the run naming rollout.env."""
    (tmp_path / "mt_envs.py").write_text(ONE_TURN_ENV)
    common = [f"actor.model={tiny_stages / 'sft'}", f"critic.model={tiny_stages / 'reward'}", "algorithm=grpo",
              "reward.sources=[judge]", "train.max_steps=2", "train.eval_every=0", "train.save_every=0",
              "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=4", "rollout.mini_batch_size=8",
              "rollout.micro_batch_size=8", "rollout.max_new_tokens=6", "data.num_eval_prompts=4",
              "eval.max_new_tokens=6"]
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}"}
    run_stage("ppo", f"output_dir={tmp_path / 'plain'}", *common, env=env)
    run_stage("ppo", f"output_dir={tmp_path / 'env'}", *common, "rollout.env=mt_envs:OneTurn", "rollout.env_workers=0",
              env=env)
    plain, multi = metrics(tmp_path / "plain", "train"), metrics(tmp_path / "env", "train")
    extra = {"turns", "tool_calls", "obs_tokens", "env_errors", "env_timeouts", "template_checked",
             "template_mismatch", "episodes"}
    assert [{k: v for k, v in r.items() if k not in extra} for r in comparable(multi)] == comparable(plain)
    assert [(r["turns"], r["tool_calls"], r["obs_tokens"], r["env_errors"], r["episodes"]) for r in multi] == \
        [(1.0, 0.0, 0.0, 0, 8)] * 2
    s = summary(tmp_path / "env")
    assert s["gold_score_tool_after"] == s["gold_score_after"]  # one turn: the same greedy answer, judged alike
    assert (s["env_errors"], s["env_timeouts"]) == (0, 0)
    proc = run_stage("ppo", f"output_dir={tmp_path / 'broken'}", *common, "rollout.env=mt_envs:Broken",
                     "rollout.env_workers=0", env=env, check=False)
    assert proc.returncode == 2
    assert "rollout.env=mt_envs:Broken: 8 of 8 episodes of the step faulted" in proc.stderr + proc.stdout
    assert "the tool is down" in proc.stderr + proc.stdout
    # stopped before the step trained, as a step without rewards: the state before it kept, nothing exported
    broken = tmp_path / "broken"
    assert os.listdir(broken / "checkpoints") == ["step_0000000"] and metrics(broken, "train") == []
    assert not (broken / "summary.json").exists() and not (broken / "model").exists()


def test_alarm_key_is_validated():
    from rlhf.config.validate import validate_alarms

    a = PPOConfig().alarms
    a.tool_collapse = 1.5
    with pytest.raises(ConfigError, match=r"alarms.tool_collapse must be in \[0, 1\], got 1.5"):
        validate_alarms(a)


def test_the_documented_environment_runs_as_written(embedded):
    """docs/environments.md's example class, executed as the page shows it, in an episode of scripted turns."""
    text = (ROOT / "docs" / "environments.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "docs/environments.md", "exec"), namespace)
    tok = embedded
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = [tok.eos_token_id]
    script = Script([[enc(" lookup: Paris") + eos], [enc(" lookup: Rome") + eos], [enc(" france") + eos]], tok.pad_token_id)
    settings = multiturn.Settings(max_turns=4, max_new_tokens=20, max_episode_tokens=200)
    rollout, stats = multiturn.generate_episodes(Actor(script), prompts_of(tok, ["Human: Where is Paris?\n\nAssistant:"]),
                                                 torch.arange(1), rows_of(["x"]), SAMPLE, tok,
                                                 InlineRunner(namespace["Lookup"]), settings, multiturn.template_glue(tok))
    e = stats.episodes[0]
    assert e.observations == ["france", "italy"] and e.texts[-1] == " france"
    assert stats.env_reward.tolist() == [pytest.approx(-0.1)]  # two calls: one over the free one
    assert tok.decode(rollout.responses[0][rollout.answer_mask[0].bool()], skip_special_tokens=True) == " france"
    assert "\n\nTool: italy\n\nAssistant:" in tok.decode(rollout.responses[0])


def test_injected_generation_gives_the_transformers_episodes(embedded, tiny_lm):
    """engine.generation=injected (each later turn resumed from its KV cache) and transformers generate
    (re-prefilled each turn) run the same greedy episodes: the same ids, masks and observations."""
    import copy

    from engine import EngineConfig, OptimConfig, TrainEngine, init_distributed

    tok = embedded
    engine = TrainEngine(copy.deepcopy(tiny_lm), EngineConfig(stage=0, generation="injected"),
                         OptimConfig(lr=1e-2, scheduler="constant"), total_steps=1, info=init_distributed())
    greedy = SamplingParams(max_new_tokens=6, greedy=True)
    settings = multiturn.Settings(max_turns=3, max_new_tokens=6, max_episode_tokens=80)
    args = (prompts_of(tok, PROMPTS), torch.arange(3), rows_of(PROMPTS), greedy, tok, InlineRunner(Tool), settings,
            multiturn.template_glue(tok))
    with engine.generation() as gen:
        assert gen.name == "injected"
    got, stats = multiturn.generate_episodes(engine, *args)
    ref, ref_stats = multiturn.generate_episodes(Actor(HFGenerator(tiny_lm)), *args)
    assert stats.tool_calls.sum() > 0, "the episodes went over several turns"
    for name in ("sequences", "attention_mask", "response_mask", "answer_mask"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert [e.observations for e in stats.episodes] == [e.observations for e in ref_stats.episodes]
    torch.testing.assert_close(got.logp_gen, ref.logp_gen, rtol=1e-4, atol=1e-5)


class Prefilled(InjectedGenerator):
    """The injected decoder with each turn prefilled whole (as a generator that cannot resume)."""

    resumes = False


def tiny_opt(tok):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(vocab_size=len(tok), hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=32,
                                    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                    pad_token_id=tok.pad_token_id)).eval()


@pytest.mark.parametrize("arch,sampled", [("llama", False), ("llama", True), ("opt", True)])
def test_resumed_turns_equal_re_prefilled_ones(embedded, tiny_lm, arch, sampled):
    """The injected decoder continuing each episode from its KV cache (only the new tokens fed: the last
    sampled token, the glue and the observation; finished episodes dropped from the cache's rows, tokens cut
    after a turn's limit never attended) gives the episodes of prefilling the whole transcript each turn:
    the same ids and masks, log-probs to float rounding; greedy and sampled with per-row streams. The cache
    is allocated once."""
    from engine.inference import InferenceModel

    tok = embedded
    texts = [*PROMPTS, "Human: Sort cab.\n\nAssistant:", "Human: Count the a in banana.\n\nAssistant:"]

    class Mixed(Tool):  # episodes of 1, 2 and 3 turns in one batch: rows leave the cache's batch
        def reset(self, row):
            super().reset(row)
            self.n = row["n"]

    rows = [{"prompt": t, "n": k % 3} for k, t in enumerate(texts)]
    params = SamplingParams(max_new_tokens=5, greedy=not sampled, temperature=1.0)
    settings = multiturn.Settings(max_turns=3, max_new_tokens=5, max_episode_tokens=60)
    seeds = torch.arange(100, 100 + len(texts)) if sampled else None
    runs = {}
    lm = tiny_lm if arch == "llama" else tiny_opt(tok)  # OPT: learned positions, continued past the cache
    for name, cls in (("resumed", InjectedGenerator), ("prefilled", Prefilled)):
        model = InferenceModel(lm.config, lm.state_dict().items(), dtype=torch.float32, device="cpu")
        actor = Actor(cls(model))
        runs[name] = (*multiturn.generate_episodes(
            actor, prompts_of(tok, texts), torch.arange(len(texts)), rows, params, tok, InlineRunner(Mixed), settings,
            multiturn.template_glue(tok), row_seeds=seeds), actor, model)
    (got, stats, actor, model), (ref, ref_stats, ref_actor, _) = runs["resumed"], runs["prefilled"]
    assert [len(e.turns) for e in stats.episodes] == [len(e.turns) for e in ref_stats.episodes] == [1, 2, 3, 1, 2]
    for name in ("sequences", "attention_mask", "response_mask", "answer_mask"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    torch.testing.assert_close(got.logp_gen, ref.logp_gen, rtol=1e-5, atol=1e-5)
    # later turns fed only what was not in the cache: far fewer columns than the whole transcripts
    fed, whole = [c[0].shape for c in actor.calls[1:]], [c[0].shape for c in ref_actor.calls[1:]]
    assert [r for r, _ in fed] == [r for r, _ in whole] == [3, 1]  # rows: the episodes still open
    assert all(f < w / 2 for (_, f), (_, w) in zip(fed, whole)), (fed, whole)
    assert model.allocations == 2  # the fused weights, then the KV cache once for every turn
