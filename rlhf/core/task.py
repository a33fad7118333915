"""The embedded default task: small verifiable instructions in a Human/Assistant format.

Six kinds of prompt, each with exactly one correct answer that `gold_answer` derives from the
prompt text alone (so the judge scores any response, not just the shipped ones):

    Human: Reverse kqzt.\\n\\nAssistant:            -> " tzqk"
    Human: Sort 5 2 9 1.\\n\\nAssistant:            -> " 1 2 5 9"
    Human: Uppercase kqzt.\\n\\nAssistant:          -> " KQZT"
    Human: Shift kqzt by one.\\n\\nAssistant:       -> " lrau"   (each letter's successor, z -> a)
    Human: What is 23+19?\\n\\nAssistant:          -> " 42"
    Human: How many a in abacab?\\n\\nAssistant:    -> " 3"
    Human: Count from 093 to 117 by 8.\\n\\nAssistant: -> " 093 101 109 117"   (every term, as wide as the end)

The shipped data (scripts/make_default_data.py) uses the first four, DEFAULT_TASKS: their
correctness can be judged from the response by matching characters, which a ~1M-parameter reward
model learns on a CPU in minutes. Addition and counting stay judged (a user's data may use them),
but are not shipped: a model that size verifies neither a sum nor a count in that budget (measured:
held-out pair accuracy at chance for sums and ~0.74 for counts after 20 epochs on those pairs alone).

The seventh kind, `countby` (LONG_TASKS), is the long-answer task of `TASK=long bash scripts/run_all.sh`
(data/long, scripts/make_long_data.py): an arithmetic progression written out term by term (each term
zero-padded to the digits of the end as the prompt writes it, so every term of a count is as wide), so the
correct answer's length follows the prompt (50-400 tokens of the shipped character-level tokenizer in
the shipped data, which counts by one up to a round hundred) and a response that stops one term early,
runs past the end or slips one carry is wrong.

`gold_score(prompt, response)` is 1.0 when the response (surrounding whitespace stripped) is exactly
the answer, else 0.0. A run's gold score is 100 × the mean over held-out prompts.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

PROMPT_PREFIX = "Human: "
PROMPT_SUFFIX = "\n\nAssistant:"
TASKS = ("reverse", "sort", "upper", "shift", "add", "count", "countby")  # every kind the judge knows
DEFAULT_TASKS = ("reverse", "sort", "upper", "shift")  # the kinds in the shipped data
LONG_TASKS = ("countby",)  # the long-answer task's kinds (data/long)

_PATTERNS = {
    "add": re.compile(r"What is (\d+)\+(\d+)\?"),
    "reverse": re.compile(r"Reverse ([a-z]+)\."),
    "sort": re.compile(r"Sort ((?:\d )*\d)\."),
    "count": re.compile(r"How many ([a-z]) in ([a-z]+)\?"),
    "upper": re.compile(r"Uppercase ([a-z]+)\."),
    "shift": re.compile(r"Shift ([a-z]+) by one\."),
    "countby": re.compile(r"Count from (\d+) to (\d+) by (\d+)\."),
}


def make_prompt(instruction: str) -> str:
    return f"{PROMPT_PREFIX}{instruction}{PROMPT_SUFFIX}"


def parse_prompt(prompt: str) -> tuple[str, tuple[str, ...]]:
    """Return (task name, captured fields) of a default-task prompt; ValueError if it is none."""
    text = prompt.strip()
    if text.startswith(PROMPT_PREFIX) and text.endswith(PROMPT_SUFFIX.strip()):
        body = text[len(PROMPT_PREFIX) : -len(PROMPT_SUFFIX.strip())].strip()
        for task, pattern in _PATTERNS.items():
            m = pattern.fullmatch(body)
            if m:
                return task, m.groups()
    raise ValueError(f"not a prompt of the default task: {prompt!r}")


def gold_answer(prompt: str) -> str:
    """The one correct answer (without the leading space of the response)."""
    task, g = parse_prompt(prompt)
    if task == "add":
        return str(int(g[0]) + int(g[1]))
    if task == "reverse":
        return g[0][::-1]
    if task == "sort":
        return " ".join(sorted(g[0].split()))
    if task == "upper":
        return g[0].upper()
    if task == "shift":
        return "".join(chr((ord(c) - 97 + 1) % 26 + 97) for c in g[0])
    if task == "countby":  # every term from A while <= B, as many digits as B is written with (zero-padded)
        start, end, step = (int(x) for x in g)
        if step < 1 or end < start:
            raise ValueError(f"a count needs a step >= 1 and an end >= its start: {prompt!r}")
        return " ".join(f"{n:0{len(g[1])}d}" for n in range(start, end + 1, step))
    return str(g[1].count(g[0]))  # count


def gold_score(prompt: str, response: str) -> float:
    """1.0 if `response` is exactly the correct answer (whitespace around it ignored), else 0.0."""
    return 1.0 if response.strip() == gold_answer(prompt) else 0.0


def mean_gold_score(prompts: Sequence[str], responses: Sequence[str]) -> float:
    """100 × mean gold score: the headline figure of every stage (percentage points)."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if not prompts:
        raise ValueError("no prompts to score")
    return 100.0 * sum(gold_score(p, r) for p, r in zip(prompts, responses)) / len(prompts)


def task_of(prompt: str) -> str:
    return parse_prompt(prompt)[0]


def judge(prompt: str, response: str, answer: str | None = None) -> float | None:
    """The gold score of one response: exact match with `answer` when the data gives one, else the
    default task's judge when the prompt is one of its prompts, else None (no gold judge)."""
    if answer is not None:
        return 1.0 if response.strip() == answer.strip() else 0.0
    try:
        return gold_score(prompt, response)
    except ValueError:
        return None
