"""Generate the embedded tool task's data into data/tools/ (deterministic): sums with the calculator tool.

    python scripts/make_tool_data.py            # rewrites data/tools/*.jsonl

The judge's `add` kind (rlhf/core/task.py) with two 4-digit operands: sums the ~1M-parameter default model
does not learn to do in its head in minutes. Files (sft_tools, prompts_tools and eval_tools hold distinct sums):

    sft_tools.jsonl    tool-use demonstrations as chat messages (the embedded tokenizer's template has a
                       tool role): user "What is A+B?", assistant "calc: A+B", tool "S", assistant "S";
                       mixed with the shipped demonstrations (data/default/sft_train.jsonl) by the SFT
                       stage of `TASK=tools bash scripts/run_all.sh`, so these are part of its SFT rows
    sft_direct.jsonl   the same 2,000 sums answered directly, no tool ({prompt, response: " S"}): the control
                       arm's SFT rows (`TASK=tools TOOL=off`: SFT -> RL on the same prompts without the tool),
                       the gold score a model of this size reaches on these sums in its head
    prompts_tools.jsonl    RL prompts ("Human: What is A+B?\\n\\nAssistant:")
    eval_tools.jsonl       held-out prompts with their answers (the gold score with and without the tool)

The RL stage runs them with `rollout.env=rlhf.rl.environments.calculator:Calculator`: a turn `calc: A+B`
gets the sum back as a tool message, the next turn answers (docs/environments.md).
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rlhf.core.task import gold_answer, make_prompt

SEED = 4321
SIZES = {"sft_tools": 2000, "prompts_tools": 2000, "eval_tools": 200}  # distinct sums each
LOW, HIGH = 1000, 9999  # 4-digit operands


def build() -> dict[str, list[dict]]:
    """{file name: rows} of data/tools/ (the same every call)."""
    rng = random.Random(SEED)
    pairs: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    while len(pairs) < sum(SIZES.values()):
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        if (a, b) not in seen:
            seen.add((a, b))
            pairs.append((a, b))
    files, start = {}, 0
    for name, n in SIZES.items():
        rows = []
        for a, b in pairs[start : start + n]:
            question, prompt = f"What is {a}+{b}?", make_prompt(f"What is {a}+{b}?")
            answer = gold_answer(prompt)
            if name == "sft_tools":
                rows.append({"messages": [{"role": "user", "content": question},
                                          {"role": "assistant", "content": f"calc: {a}+{b}"},
                                          {"role": "tool", "content": answer},
                                          {"role": "assistant", "content": answer}]})
            elif name == "prompts_tools":
                rows.append({"prompt": prompt})
            else:
                rows.append({"prompt": prompt, "answer": answer, "task": "add"})
        files[name] = rows
        start += n
    # the control arm: sft_tools' sums, each answered in one response
    files["sft_direct"] = [{"prompt": make_prompt(r["messages"][0]["content"]), "response": " " + r["messages"][3]["content"]}
                           for r in files["sft_tools"]]
    return files


def main() -> None:
    out = ROOT / "data" / "tools"
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in build().items():
        with open(out / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"{out / name}.jsonl: {len(rows)} rows")


if __name__ == "__main__":
    main()
