"""Generate the long-answer task's data into data/long/ (deterministic): counts written out term by term.

    python scripts/make_long_data.py            # rewrites data/long/*.jsonl
    python scripts/make_long_data.py --lengths  # and prints the gold answers' token lengths (shipped tokenizer)

The judge's `countby` kind (rlhf/core/task.py): "Count from 8437 to 8500 by 1." is answered " 8437 8438 ... 8499
8500", every term written out in four digits (as the prompt writes A and B). Every prompt counts up to a round
hundred B from A = B - 9 ... B - 79, so the correct answer's length follows the prompt: 10 to 80 terms of five
tokens each (four digits and a space), 51 to 401 tokens of the shipped character-level tokenizer (answer + eos;
MIN_TOKENS, MAX_TOKENS). Every term is its predecessor plus one (a carry into the tens every ten terms, into the
hundreds at B), and the answer must end exactly on B: a response that stops one term early, runs one past B, or
drops a carry is wrong, and one that never stops is truncated at the RL stage's rollout.max_new_tokens.

Why this shape (docs/stages.md, the long-answer task): the ~1M-parameter default model learns a count by one in a
few hundred steps, but not a count by 2-9 (the digits a step adds, a carry in one term of three) nor an end it must
compare digit by digit with the prompt's B: 400 steps of those data left every greedy answer running to the
token budget (gold 0.0). With B a round hundred, the first term ending in 00 is B, so the end is a local decision
the model and the reward model can learn; the prompt still sets where the count starts and so its length.

Files (every prompt distinct across all of them; held-out prompts in no training file; 99 ends x 71 lengths =
7,029 possible prompts, 7,000 used):

    sft_train.jsonl      {prompt, response}: demonstrations, imperfect on purpose: the demonstrator has a habit,
                         stopping one term before B, on its x99 (DEMO_HABIT_RATE of them), and drops a carry in
                         DEMO_SLIP_RATE more. Greedy decoding copies the habit (it is the most frequent ending), as
                         on the embedded default's sorts, and RL must remove it: the reward model sees that a
                         response's last term is not the round hundred
    pairs_train.jsonl    {prompt, chosen, rejected}: chosen the correct answer; rejected a plausible wrong one (PAIR_KINDS:
    pairs_eval.jsonl     the habit, one term past B, a dropped carry, or the answer cut off part way)
    prompts_train.jsonl  {prompt}: the RL stage's prompts
    eval_prompts.jsonl   {prompt, answer, task}: held-out prompts, scored by the gold judge (exact match)
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rlhf.core.task import gold_answer, make_prompt

SEED = 5757
SIZES = {"sft_train": 3000, "pairs_train": 2700, "pairs_eval": 200, "prompts_train": 1000, "eval_prompts": 100}
MIN_TOKENS, MAX_TOKENS = 50, 402  # a gold answer's tokens: " " + answer + eos (one token per character)
WIDTH = 4  # digits of every term (and of A and B in the prompt)
DEMO_HABIT_RATE = 0.6  # demonstrations that stop one term before B (the habit)
DEMO_SLIP_RATE = 0.1  # demonstrations with one carry dropped (the rest right)
PAIR_KINDS = (("habit", 0.4), ("past", 0.15), ("carry", 0.25), ("cut", 0.2))  # rejected answers' kinds, shares


def answer_tokens(answer: str) -> int:
    """Tokens of a response " answer" + eos under the shipped character-level tokenizer."""
    return len(answer) + 2


def random_instruction(rng: random.Random) -> str:
    """A count up to a round hundred B (100-9900) of 10-80 terms: MIN_TOKENS..MAX_TOKENS tokens written out."""
    end, terms = 100 * rng.randint(1, 99), rng.randint(10, 80)
    return f"Count from {end - terms + 1:0{WIDTH}d} to {end:0{WIDTH}d} by 1."


def terms_of(prompt: str) -> list[int]:
    return [int(t) for t in gold_answer(prompt).split()]


def written(terms: list[int]) -> str:
    return " ".join(f"{n:0{WIDTH}d}" for n in terms)


def drop_carry(rng: random.Random, terms: list[int]) -> list[int]:
    """One term whose tens (or hundreds) carry is lost, e.g. 8440 -> 8430 after 8439; the terms after it right."""
    carried = [i for i in range(1, len(terms)) if terms[i] // 10 != terms[i - 1] // 10]
    i = rng.choice(carried)  # the last term, B, always carries
    return terms[:i] + [terms[i] - 10] + terms[i + 1 :]


def wrong_answer(rng: random.Random, prompt: str, kind: str) -> str:
    terms = terms_of(prompt)
    step = terms[1] - terms[0]
    if kind == "habit":  # one term short of B
        bad = terms[:-1]
    elif kind == "past":  # one term past B
        bad = terms + [terms[-1] + step]
    elif kind == "carry":
        bad = drop_carry(rng, terms)
    else:  # "cut": the answer stops somewhere in its second or third quarter
        bad = terms[: rng.randint(len(terms) // 4, 3 * len(terms) // 4)]
    return written(bad)


def unique_prompts(rng: random.Random, n: int) -> list[str]:
    seen: set[str] = set()
    out = []
    while len(out) < n:
        p = make_prompt(random_instruction(rng))
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def build(seed: int = SEED) -> dict[str, list[dict]]:
    """{file name: rows} of data/long/ (the same every call)."""
    rng = random.Random(seed)
    pool = unique_prompts(rng, sum(SIZES.values()))
    kinds, shares = zip(*PAIR_KINDS)
    files, start = {}, 0
    for name, size in SIZES.items():
        part, start = pool[start : start + size], start + size
        rows = []
        for prompt in part:
            right = gold_answer(prompt)
            if name == "sft_train":
                u = rng.random()
                ans = right
                if u < DEMO_HABIT_RATE:
                    ans = wrong_answer(rng, prompt, "habit")
                elif u < DEMO_HABIT_RATE + DEMO_SLIP_RATE:
                    ans = wrong_answer(rng, prompt, "carry")
                rows.append({"prompt": prompt, "response": " " + ans})
            elif name.startswith("pairs"):
                kind = rng.choices(kinds, weights=shares)[0]
                rows.append({"prompt": prompt, "chosen": " " + right, "rejected": " " + wrong_answer(rng, prompt, kind)})
            elif name == "prompts_train":
                rows.append({"prompt": prompt})
            else:
                rows.append({"prompt": prompt, "answer": right, "task": "countby"})
        files[name] = rows
    return files


def length_summary(files: dict[str, list[dict]]) -> dict[str, float]:
    """Tokens of the gold answers (" answer" + eos) over every prompt of every file, by the shipped tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ROOT / "data" / "tokenizer"))
    prompts = [r["prompt"] for rows in files.values() for r in rows]
    lengths = sorted(len(tok(" " + gold_answer(p), add_special_tokens=False)["input_ids"]) + 1 for p in prompts)
    return {"prompts": len(lengths), "min": lengths[0], "median": statistics.median(lengths), "max": lengths[-1],
            "mean": round(statistics.fmean(lengths), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "data" / "long")
    ap.add_argument("--lengths", action="store_true", help="print the gold answers' token lengths")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    files = build()
    for name, rows in files.items():
        with open(args.out / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"{args.out / name}.jsonl: {len(rows)} rows")
    if args.lengths:
        print("gold answer tokens:", json.dumps(length_summary(files)))


if __name__ == "__main__":
    main()
