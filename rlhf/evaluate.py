"""Held-out evaluation shared by the stages: generations scored by the gold judge, and perplexity.

Both run on the gathered (unsharded) model and split their rows over the ranks, so ranks may take
different numbers of decode steps without any collective in between; results are all-gathered.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.distributed import all_reduce_sum
from engine.generation import SamplingParams
from rlhf.config import DataConfig, GenerationConfig
from rlhf.data import collate_prompts, collate_sft, load_rows, parse_prompts, tokenize_prompts
from rlhf.data.tokenize import IGNORE_INDEX
from rlhf.task import judge


@dataclass(slots=True)
class EvalPrompt:
    text: str
    ids: list[int]
    answer: str | None
    task: str | None


def load_eval_prompts(d: DataConfig, tokenizer: Any) -> list[EvalPrompt]:
    """The first `d.num_eval_prompts` of `d.eval_prompts_path` (none when it is null)."""
    if not d.eval_prompts_path:
        return []
    examples = parse_prompts(load_rows(d.eval_prompts_path, d.eval_split, d.cache_dir), tokenizer)
    if d.num_eval_prompts:
        examples = examples[: d.num_eval_prompts]
    feats, _ = tokenize_prompts(examples, tokenizer, d.max_prompt_len, d.overlong, d.add_bos)
    return [EvalPrompt(f["prompt"], f["input_ids"], f["answer"], f["meta"].get("task")) for f in feats]


def sampling_params(g: GenerationConfig) -> SamplingParams:
    return SamplingParams(max_new_tokens=g.max_new_tokens, greedy=g.greedy, temperature=g.temperature,
                          top_k=g.top_k, top_p=g.top_p)


def all_gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def generate_texts(
    generate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    prompts: Sequence[EvalPrompt],
    tokenizer: Any,
    batch_size: int,
    device: torch.device,
) -> list[str]:
    """Decoded responses of this rank's prompts. `generate(ids, mask) -> response ids [B, T]`."""
    texts: list[str] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        batch = collate_prompts([{"input_ids": p.ids} for p in chunk], tokenizer.pad_token_id)
        responses = generate(batch["input_ids"].to(device), batch["attention_mask"].to(device))
        texts += tokenizer.batch_decode(responses, skip_special_tokens=True)
    return texts


def gold_eval(
    generator: Any,
    prompts: Sequence[EvalPrompt],
    tokenizer: Any,
    g: GenerationConfig,
    *,
    rank: int,
    world: int,
    device: torch.device,
    n_samples: int = 3,
) -> dict[str, Any]:
    """Generate for every prompt (rank r takes prompts[r::world]) and score with the gold judge.

    `generator`: what `engine.generation()` yields (`.generate(ids, mask, params, ...)`). Returns
    gold_score (100 x mean, or None without a judge), gold_score/<task>, response_len (mean
    characters) and `samples` (the first few prompt/response/score triples). Torch's RNG is left
    as it was (sampled evaluation must not shift the training run's random stream).
    """
    params = sampling_params(g)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    def gen(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = generator.generate(ids, mask, params, eos_token_id=eos, pad_token_id=pad)
        return out.responses.masked_fill(out.response_mask == 0, pad)

    idx = list(range(rank, len(prompts), world))
    mine = [prompts[i] for i in idx]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        texts = generate_texts(gen, mine, tokenizer, g.batch_size, device)
    scored = [(i, p.text, t, judge(p.text, t, p.answer), p.task) for i, p, t in zip(idx, mine, texts)]
    merged = sorted(x for part in all_gather(scored) for x in part)
    result: dict[str, Any] = {"response_len": sum(len(x[2]) for x in merged) / max(1, len(merged))}
    judged = [(s, task) for _, _, _, s, task in merged if s is not None]
    result["gold_score"] = 100.0 * sum(s for s, _ in judged) / len(judged) if judged else None
    for task in sorted({t for _, t in judged if t}):
        vals = [s for s, t in judged if t == task]
        result[f"gold_score/{task}"] = 100.0 * sum(vals) / len(vals)
    result["samples"] = [{"prompt": p, "response": t, "score": s} for _, p, t, s, _ in merged[:n_samples]]
    return result


@torch.no_grad()
def perplexity(
    model: torch.nn.Module,
    features: Sequence[dict[str, list[int]]],
    pad_id: int,
    batch_size: int,
    *,
    rank: int,
    world: int,
    device: torch.device,
) -> dict[str, float]:
    """Token-weighted loss and perplexity on SFT features (labels -100 outside responses)."""
    mine = list(features[rank::world])
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    for i in range(0, len(mine), batch_size):
        b = collate_sft(mine[i : i + batch_size], pad_id)
        logits = model(input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device)).logits
        labels = b["labels"][:, 1:].to(device)
        acc[0] += F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                  reduction="sum").double()
        acc[1] += (labels != IGNORE_INDEX).sum()
    model.train(was_training)
    all_reduce_sum(acc)
    loss = (acc[0] / acc[1]).item() if acc[1] > 0 else float("nan")
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 50 else float("inf")}
