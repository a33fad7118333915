"""The gold score: generations on held-out prompts, scored by the gold judge (exact match with a
prompt's `answer` field, else the embedded task's judge: rlhf/core/task.py).

    prompts, fields = gold_set(cfg.data, tok)             # data.eval_prompts_path, first num_eval_prompts
    ev = gold_of(engine, prompts, tok, cfg.eval)          # in the engine's generation mode
    ev["gold_score"], ev["gold_score/reverse"], ev["samples"]

The gold score runs only where a judge applies: prompts with an `answer` field, or the shipped task's
prompts. The conf/data defaults name the shipped task's prompts only while data.path is the shipped file,
so with data of your own a stage has no gold score (logged once, with how to get one) unless
data.eval_prompts_path names prompts with answers.

`gold_eval` runs on the gathered (unsharded) model and splits its prompts over the ranks, so ranks may
take different numbers of decode steps without any collective in between; results are all-gathered.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.distributed import all_gather_object
from engine.generation import SamplingParams
from rlhf.config import DataConfig, GenerationConfig
from rlhf.core.plugins import as_score, load_function
from rlhf.core.task import judge
from rlhf.data import Row, collate_prompts, load_rows, parse_prompts, tokenize_prompts

logger = logging.getLogger("rlhf.evaluate")


@dataclass(slots=True)
class EvalPrompt:
    text: str
    ids: list[int]
    answer: str | None
    task: str | None


def eval_prompts_of(rows: Sequence[Row], d: DataConfig, tokenizer: Any) -> list[EvalPrompt]:
    """The prompts of the first `d.num_eval_prompts` of `rows` (0: all), tokenized under the over-long rule."""
    examples = parse_prompts(rows, tokenizer)
    if d.num_eval_prompts:
        examples = examples[: d.num_eval_prompts]
    feats, _ = tokenize_prompts(examples, tokenizer, d.max_prompt_len, d.overlong, d.add_bos)
    return [EvalPrompt(f["prompt"], f["input_ids"], f["answer"], f["meta"].get("task")) for f in feats]


def load_eval_prompts(d: DataConfig, tokenizer: Any) -> list[EvalPrompt]:
    """The first `d.num_eval_prompts` of `d.eval_prompts_path` (none when it is null)."""
    if not d.eval_prompts_path:
        return []
    return eval_prompts_of(load_rows(d.eval_prompts_path, d.eval_split, d.cache_dir, key="data.eval_prompts_path"),
                           d, tokenizer)


def judged(prompts: Sequence[EvalPrompt], g: GenerationConfig | None = None) -> list[EvalPrompt]:
    """The prompts a gold judge can score: every one with `eval.judge`, else those with an `answer` and
    the shipped task's."""
    if g is not None and g.judge:
        return list(prompts)
    return [p for p in prompts if judge(p.text, "", p.answer) is not None]


class Judge:
    """The gold judge of `g`: `eval.judge`'s function when set, called as fn(prompt, response, row) with
    row = {prompt, answer (when the prompt has one), task (the shipped task's)}; else the built-in
    (rlhf/core/task.py `judge`). A call of the user's that raises or returns no finite number leaves that
    prompt unscored (None), counted in `failures` with the first error kept."""

    def __init__(self, g: GenerationConfig):
        self.fn = load_function(g.judge, "eval.judge") if g.judge else None
        self.failures, self.first_error = 0, None

    def __call__(self, p: EvalPrompt, response: str) -> float | None:
        if self.fn is None:
            return judge(p.text, response, p.answer)
        row = {"prompt": p.text, **({"answer": p.answer} if p.answer is not None else {}),
               **({"task": p.task} if p.task else {})}
        try:
            return as_score(self.fn(p.text, response, row))
        except Exception as e:  # the user's code: counted, never the end of a run
            self.failures += 1
            self.first_error = self.first_error or " ".join(f"{type(e).__name__}: {e}".split())
            return None


NO_GOLD_HINT = ("for one, set data.eval_prompts_path to held-out prompts with an `answer` field (a response "
                "scores 100 when it equals the answer, stripped)")


def gold_applies(prompts: Sequence[EvalPrompt], source: str | None, g: GenerationConfig | None = None
                 ) -> dict[str, Any]:
    """Whether the gold score runs on `prompts` (from `source`, e.g. "data.eval_prompts_path=..."): only
    where a judge applies to at least one of them. Logs which (once: call it at a stage's start) and
    returns the summary.json fields: eval_prompts_source (None: no gold score) and eval_prompts."""
    if source is None:
        logger.info("no gold score: data.eval_prompts_path is null (the shipped task's prompts are its default "
                    "only while data.path is the shipped data); %s", NO_GOLD_HINT)
        return {"eval_prompts_source": None, "eval_prompts": 0}
    n_judged = len(judged(prompts, g))
    if not n_judged:
        logger.info("no gold score: none of the %d prompts from %s has an `answer` field or is a prompt of the "
                    "shipped task (rlhf/core/task.py), so no judge can score them; %s", len(prompts), source,
                    NO_GOLD_HINT)
        return {"eval_prompts_source": None, "eval_prompts": 0}
    logger.info("gold score: %d prompts from %s%s%s", len(prompts), source,
                f", judged by eval.judge={g.judge}" if g is not None and g.judge else "",
                "" if n_judged == len(prompts) else f" ({n_judged} of them judged: the others have no judge)")
    return {"eval_prompts_source": source, "eval_prompts": len(prompts)}


def gold_set(d: DataConfig, tokenizer: Any, g: GenerationConfig | None = None
             ) -> tuple[list[EvalPrompt], dict[str, Any]]:
    """A stage's gold-score prompts (SFT, DPO): the first `d.num_eval_prompts` of `d.eval_prompts_path`
    where a judge (`g.judge`, or the built-in) applies to them, else none; and `gold_applies`' fields."""
    prompts = load_eval_prompts(d, tokenizer)
    fields = gold_applies(prompts, f"data.eval_prompts_path={d.eval_prompts_path}" if d.eval_prompts_path else None,
                          g)
    return (prompts if fields["eval_prompts_source"] else []), fields


def sampling_params(g: GenerationConfig) -> SamplingParams:
    return SamplingParams(max_new_tokens=g.max_new_tokens, greedy=g.greedy, temperature=g.temperature,
                          top_k=g.top_k, top_p=g.top_p)


def generate_texts(
    generate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    prompts: Sequence[EvalPrompt],
    tokenizer: Any,
    batch_size: int,
    device: torch.device,
    width: int | None = None,
) -> list[str]:
    """Decoded responses of this rank's prompts. `generate(ids, mask) -> response ids [B, T]`; `width`: every
    batch left-padded to it (else to its longest prompt)."""
    texts: list[str] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        batch = collate_prompts([{"input_ids": p.ids} for p in chunk], tokenizer.pad_token_id, width)
        responses = generate(batch["input_ids"].to(device), batch["attention_mask"].to(device))
        texts += tokenizer.batch_decode(responses, skip_special_tokens=True)
    return texts


def gold_eval(
    generator: Any,
    prompts: Sequence[EvalPrompt],
    tokenizer: Any,
    g: GenerationConfig,
    info: Any,
    *,
    n_samples: int | None = None,
) -> dict[str, Any]:
    """Generate for every prompt (rank r takes prompts[r::world]; `info`: the engine's DistInfo) and
    score with the gold judge (`Judge`: eval.judge's function, else the built-in).

    `generator`: what `engine.generation()` yields (`.generate(ids, mask, params, ...)`). Returns
    gold_score (100 x mean, or None without a judge), gold_score/<task>, response_len (mean
    characters) and `samples`: per prompt (the first `n_samples`; None: every one) its task, prompt, response,
gold (the judge's score, None where none applies) and length (characters); response_tokens (mean response
    tokens, eos counted) and truncated_rate (the share of responses that hit eval.max_new_tokens without an
    eos). Torch's RNG is left
    as it was (sampled evaluation must not shift the training run's random stream).
    """
    params = sampling_params(g)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    tokens: list[int] = []  # per prompt, in generation order: response tokens (eos counted)
    cut: list[bool] = []  # per prompt: the response hit eval.max_new_tokens without an eos (truncated)

    def gen(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = generator.generate(ids, mask, params, eos_token_id=eos, pad_token_id=pad)
        n = out.response_mask.sum(1)  # [B]
        last = out.responses.gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]  # [B] each row's last token
        tokens.extend(n.tolist())
        cut.extend(((n == params.max_new_tokens) & (last != eos)).tolist())
        return out.responses.masked_fill(out.response_mask == 0, pad)

    idx, device = list(range(info.rank, len(prompts), info.world_size)), info.device
    mine = [prompts[i] for i in idx]
    # NOTE: one prompt width for every batch and rank (the longest of all the prompts): a row's logits then
    # do not depend on eval.batch_size or the world size through its padding (engine.deterministic).
    width = max((len(p.ids) for p in prompts), default=None)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        texts = generate_texts(gen, mine, tokenizer, g.batch_size, device, width)
    gold = Judge(g)
    scored = [(i, p.text, t, gold(p, t), p.task, n, c) for i, p, t, n, c in zip(idx, mine, texts, tokens, cut)]
    if gold.failures:
        logger.warning("eval.judge=%s failed on %d of this rank's %d prompts, left unscored (first: %s)", g.judge,
                       gold.failures, len(mine), gold.first_error)
    merged = sorted(x for part in all_gather_object(scored) for x in part)
    result: dict[str, Any] = {"response_len": sum(len(x[2]) for x in merged) / max(1, len(merged)),
                              "response_tokens": sum(x[5] for x in merged) / max(1, len(merged)),
                              "truncated_rate": sum(x[6] for x in merged) / max(1, len(merged))}
    judged = [(s, task) for _, _, _, s, task, _, _ in merged if s is not None]
    result["gold_score"] = 100.0 * sum(s for s, _ in judged) / len(judged) if judged else None
    for task in sorted({t for _, t in judged if t}):
        vals = [s for s, t in judged if t == task]
        result[f"gold_score/{task}"] = 100.0 * sum(vals) / len(vals)
    result["samples"] = [{"task": task, "prompt": p, "response": t, "gold": s, "length": len(t)}
                         for _, p, t, s, task, _, _ in merged[:n_samples]]
    return result


def gold_of(engine: Any, prompts: Sequence[EvalPrompt], tokenizer: Any, g: GenerationConfig) -> dict[str, Any]:
    """`gold_eval` in `engine`'s generation mode ({} without prompts): a stage's gold figures."""
    if not prompts:
        return {}
    with engine.generation() as generator:
        return gold_eval(generator, prompts, tokenizer, g, engine.info)


def gold_summary(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The gold figures of two evaluations under their summary.json names: gold_score_before/after,
    gold_score/<task>_before/after, and the held-out responses' mean tokens and truncated share
    (response_tokens_before/after, truncated_rate_before/after; None without an evaluation)."""
    return {"gold_score_before": before.get("gold_score"), "gold_score_after": after.get("gold_score"),
            **{f"{k}_{when}": ev.get(k) for k in ("response_tokens", "truncated_rate")
               for when, ev in (("before", before), ("after", after))},
            **{f"{k}_{when}": v for when, ev in (("before", before), ("after", after))
               for k, v in ev.items() if k.startswith("gold_score/")}}


def gold_line(ev: dict[str, Any]) -> str | None:
    """"gold score 66.0 (add=90 reverse=40 ...)" for a progress line, None without a gold score."""
    if ev.get("gold_score") is None:
        return None
    tasks = " ".join(f"{k.split('/')[1]}={v:.0f}" for k, v in ev.items() if k.startswith("gold_score/"))
    return f"gold score {ev['gold_score']:.1f} ({tasks})"


def eval_line(own: str | None, ev: dict[str, Any], empty: str) -> str:
    """A stage's progress line for an evaluation: its own figures (`own`, None: none), then the gold
    score's; `empty` when there is neither."""
    return ", ".join(part for part in (own, gold_line(ev)) if part) or empty
