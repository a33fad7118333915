"""Generate the embedded default task's data and tokenizer into data/ (deterministic).

    python scripts/make_default_data.py            # rewrites data/default/*.jsonl and data/tokenizer/

Prompts are drawn without repetition from one pool and partitioned, so held-out evaluation prompts
never appear in any training file. SFT demonstrations are imperfect on purpose, with a stated error
rate per task (DEMO_ERROR_RATE; 35% of all demonstrations are wrong). On two tasks the demonstrator
has a habit, and is wrong more often than right: it leaves the last letter of an upper-cased word in
lower case, and it leaves the last two distinct digits of a sorted list swapped. Supervised learning
copies the habits (greedy decoding picks the demonstrator's most frequent answer), while preference
data (correct answer chosen; a plausible wrong one rejected: the habit, another slip, or an off-task
answer) teaches a reward model to catch them: a lower-case letter or an out-of-order pair is visible
in the response itself, so judging is easier than doing, which is the situation in which RLHF beats
imitation. PPO must remove the habits. A sort's other slips are mostly the mistakes of a policy that has
learnt to sort but miscopies (SORT_DIGIT_SLIP: one digit changed, dropped or doubled, still in order), so
the reward model does not pay for a sorted list whatever its digits. All four kinds
(rlhf.core.task.DEFAULT_TASKS) are judged by matching characters of the response against the prompt;
addition and counting are not shipped, because a reward model of this size does not learn to verify them
on a CPU in minutes (rlhf/core/task.py).

pairs_train_2.jsonl and pairs_train_3.jsonl (MORE_PAIRS) are two more samples of the preference pairs, drawn
as pairs_train.jsonl is but by generators seeded --seed + 1 and + 2 (their prompts may meet the training
files', never a held-out one): the data of a reward-model ensemble's other members (scripts/run_all.sh
RM_ENSEMBLE=2 or 3). Members trained on the same pairs share their blind spots, and a policy optimised
against them finds those first (docs/results-log.md, "The over-optimisation case").
"""
from __future__ import annotations

import argparse
import json
import random
import string
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rlhf.core.task import DEFAULT_TASKS, gold_answer, make_prompt, parse_prompt

SEED = 1234
SIZES = {  # rows per file; every prompt is unique across all files
    "sft_train": 8000,
    "pairs_train": 8000,
    "pairs_eval": 400,
    "prompts_train": 2000,
    "eval_prompts": 200,
}
DEMO_ERROR_RATE = {"reverse": 0.10, "sort": 0.60, "upper": 0.60, "shift": 0.10}
PAIR_OFF_TASK = 0.2  # share of preference pairs whose rejected answer is off-task
SORT_DIGIT_SLIP = 0.75  # share of a sort pair's other slips that keep the order but not the digits
MORE_PAIRS = {"pairs_train_2": 1, "pairs_train_3": 2}  # independent samples of the pairs: generator seed + offset


def random_instruction(rng: random.Random, task: str) -> str:
    if task == "sort":
        return "Sort " + " ".join(rng.choices("0123456789", k=rng.randint(3, 6))) + "."
    word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 6)))
    return {"reverse": f"Reverse {word}.", "upper": f"Uppercase {word}.",
            "shift": f"Shift {word} by one."}[task]


def wrong_answer(rng: random.Random, prompt: str, task: str, systematic: bool) -> str:
    """A plausible mistake. systematic=True gives the demonstrator's habitual error."""
    right = gold_answer(prompt)
    if task == "upper":
        if systematic:  # the habit: the last letter left in lower case
            return right[:-1] + right[-1].lower()
        if rng.random() < 0.5:  # a miscopied letter (still all upper case)
            i = rng.randrange(len(right))
            return right[:i] + rng.choice(string.ascii_uppercase.replace(right[i], "")) + right[i + 1 :]
    if task == "shift" and rng.random() < 0.5:  # one letter copied instead of shifted
        word = parse_prompt(prompt)[1][0]
        i = rng.randrange(len(word))
        return right[:i] + word[i] + right[i + 1 :]
    chars = right.split() if task == "sort" else list(right)
    if task == "sort" and systematic:  # the habit: the last two distinct neighbours left swapped
        for i in range(len(chars) - 2, -1, -1):
            if chars[i] != chars[i + 1]:
                chars[i], chars[i + 1] = chars[i + 1], chars[i]
                return " ".join(chars)
    if task == "sort" and rng.random() < SORT_DIGIT_SLIP:  # in order, wrong digits: the slips of a policy
        for _ in range(20):  # that sorts but miscopies (one digit changed: half of them; dropped; doubled)
            i, how = rng.randrange(len(chars)), rng.choice(("change", "change", "drop", "double"))
            new = {"change": [rng.choice("0123456789")], "drop": [], "double": [chars[i]] * 2}[how]
            cand = sorted(chars[:i] + new + chars[i + 1 :])
            if cand != chars:
                return " ".join(cand)
    for _ in range(20):
        i = rng.randrange(len(chars) - 1)
        cand = chars[:]
        cand[i], cand[i + 1] = cand[i + 1], cand[i]
        if cand != chars:
            return " ".join(cand) if task == "sort" else "".join(cand)
    # all equal characters/digits: change one instead
    cand = chars[:]
    if task == "sort":
        cand[0] = "9" if cand[0] != "9" else "0"
        return " ".join(cand)
    first, second = ("Z", "Y") if task == "upper" else ("z", "a")
    cand[0] = first if cand[0] != first else second
    return "".join(cand)


def off_task_answer(rng: random.Random, task: str) -> str:
    """The correct answer to a random question of another task (a well-formed but off-task reply)."""
    other = rng.choice([t for t in DEFAULT_TASKS if t != task])
    return gold_answer(make_prompt(random_instruction(rng, other)))


def unique_prompts(rng: random.Random, n: int) -> list[tuple[str, str]]:
    seen: set[str] = set()
    out = []
    while len(out) < n:
        task = DEFAULT_TASKS[len(out) % len(DEFAULT_TASKS)]
        p = make_prompt(random_instruction(rng, task))
        if p not in seen:
            seen.add(p)
            out.append((p, task))
    rng.shuffle(out)
    return out


def build(seed: int = SEED) -> dict[str, list[dict]]:
    """Every shipped file's rows, by name: the task's files, then MORE_PAIRS' samples of the pairs."""
    files = build_task(seed)
    held_out = {r["prompt"] for name in ("eval_prompts", "pairs_eval") for r in files[name]}
    for name, offset in MORE_PAIRS.items():
        files[name] = [r for r in build_task(seed + offset)["pairs_train"] if r["prompt"] not in held_out]
    return files


def build_task(seed: int) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    pool = unique_prompts(rng, sum(SIZES.values()))
    files, start = {}, 0
    for name, size in SIZES.items():
        part, start = pool[start : start + size], start + size
        rows = []
        for prompt, task in part:
            right = gold_answer(prompt)
            if name == "sft_train":
                wrong = rng.random() < DEMO_ERROR_RATE[task]
                ans = wrong_answer(rng, prompt, task, systematic=True) if wrong else right
                rows.append({"prompt": prompt, "response": " " + ans})
            elif name.startswith("pairs"):
                # the rejected answer mirrors the policy's likely mistakes (40% the demonstrator's
                # habit, 40% other slips) or is off-task (20%: the answer to another kind of
                # question), so the reward model also learns what an answer to *this* question
                # looks like and PPO cannot win it over with a malformed one
                u = rng.random()
                if u < PAIR_OFF_TASK:
                    bad = off_task_answer(rng, task)
                else:
                    bad = wrong_answer(rng, prompt, task, systematic=u < PAIR_OFF_TASK + (1 - PAIR_OFF_TASK) / 2)
                rows.append({"prompt": prompt, "chosen": " " + right, "rejected": " " + bad})
            elif name == "prompts_train":
                rows.append({"prompt": prompt})
            else:
                rows.append({"prompt": prompt, "answer": right, "task": task})
        files[name] = rows
    return files


def build_tokenizer(out_dir: Path) -> None:
    """A character-level tokenizer (76 tokens) with a Human/Assistant chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = string.ascii_lowercase + string.ascii_uppercase + string.digits + " \n.,?:+-!'"
    vocab = {t: i for i, t in enumerate(specials + list(chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        padding_side="right", model_max_length=256,
    )
    # hh-rlhf's "Human: ...\n\nAssistant: ..." turns; an assistant turn ends with eos (its end-of-turn
    # token, trained with it: rlhf/data/chat.py). System and tool turns have their own prefix (issue #29:
    # they were dropped); another role is an error, not a silently missing turn.
    fast.chat_template = (
        "{% for m in messages %}"
        "{% if m['role'] in ('system', 'developer') %}{{ 'System: ' + m['content'] + '\n\n' }}"
        "{% elif m['role'] == 'user' %}{{ 'Human: ' + m['content'] + '\n\n' }}"
        "{% elif m['role'] == 'assistant' %}{{ 'Assistant: ' + m['content'] + eos_token + '\n\n' }}"
        "{% elif m['role'] == 'tool' %}{{ 'Tool: ' + m['content'] + '\n\n' }}"
        "{% else %}{{ raise_exception('unknown role ' + m['role']) }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
    )
    fast.save_pretrained(str(out_dir))
    # NOTE: transformers 5 saves tokenizer_class "TokenizersBackend", a class 4.x lacks ("does not exist");
    # PreTrainedTokenizerFast loads on both (5.x keeps it as an alias of TokenizersBackend).
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "data")
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args()
    (args.out / "default").mkdir(parents=True, exist_ok=True)
    for name, rows in build(args.seed).items():
        with open(args.out / "default" / f"{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print(f"{name}: {len(rows)} rows")
    build_tokenizer(args.out / "tokenizer")
    print(f"tokenizer -> {args.out / 'tokenizer'}")


if __name__ == "__main__":
    main()
