"""A reward model's held-out figures on preference pairs, as the reward stage and `rlhf.evaluate` compute
them: pair accuracy, mean chosen/rejected scores, and where the gold judge applies, agreement with it,
its AUC and the accuracy per task of the embedded default.

    ev = evaluate_pairs(engine, feats, examples, pad_id, batch_size)   # {"accuracy": ..., "gold_auc": ...}
    summary.update(held_out_summary(ev))                               # eval_accuracy, ...
"""
from __future__ import annotations

from typing import Any

import torch

from engine import TrainEngine
from engine.distributed import all_gather_object
from rlhf.algos.reward_model import auc, pair_accuracy
from rlhf.core.task import judge, task_of
from rlhf.data.packing import pair_collate
from rlhf.modeling.forward import batch_scores


@torch.no_grad()
def score_pairs(engine: TrainEngine, feats: list[dict], pad_id: int, batch_size: int,
                pack_length: int | None = None, *, shared: bool | None = False) -> list[tuple[int, float, float]]:
    """(index, chosen score, rejected score) of every feature, computed on the gathered model with
    the rows split over the ranks, then all-gathered (in feature order); packed when `pack_length`
    is not None (rlhf/data/packing.py); each pair's prompt run once with `shared` (data.shared_prompts resolved: True, or None = where
    that computes the fewest positions)."""
    info = engine.info
    collate = pair_collate(pad_id, pack_length, shared=shared)
    mine = feats[info.rank :: info.world_size]
    out = []
    with engine.gathered_parameters():
        engine.unwrapped.eval()
        for i in range(0, len(mine), batch_size):
            chunk = mine[i : i + batch_size]
            b = collate(chunk)
            b = {k: v.to(info.device) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
            scores = batch_scores(engine.unwrapped, b)
            c, r = scores.chunk(2)
            out += [(f["index"], float(x), float(y)) for f, x, y in zip(chunk, c.tolist(), r.tolist())]
        engine.unwrapped.train()
    return sorted(x for part in all_gather_object(out) for x in part)


def evaluate_pairs(engine: TrainEngine, feats: list[dict], examples: list, pad_id: int, batch_size: int,
             pack_length: int | None = None, *, shared: bool | None = False) -> dict[str, Any]:
    """Held-out accuracy and mean scores; agreement with / AUC against the gold judge where it applies."""
    if not feats:
        return {}
    return pair_metrics(score_pairs(engine, feats, pad_id, batch_size, pack_length, shared=shared), examples)


def pair_metrics(scored: list[tuple[int, float, float]], examples: list) -> dict[str, Any]:
    """`evaluate_pairs`' figures from `score_pairs`' (index, chosen score, rejected score) of `examples`."""
    c = torch.tensor([s[1] for s in scored])
    r = torch.tensor([s[2] for s in scored])
    # ties: the fraction of pairs scored equal (a zero head ties every pair, as at step 0: accuracy 0.0 then
    # means "no preference yet", which the plots show as "ties")
    out: dict[str, Any] = {"accuracy": pair_accuracy(c, r).item(), "ties": (c == r).float().mean().item(),
                           "chosen_score": c.mean().item(), "rejected_score": r.mean().item(),
                           "score_std": torch.cat([c, r]).std().item()}
    out["samples"] = [{"task": task_or_none(examples[i].prompt), "prompt": examples[i].prompt, "chosen": examples[i].chosen,
                       "rejected": examples[i].rejected, "chosen_score": sc, "rejected_score": sr,
                       "margin": sc - sr} for i, sc, sr in scored]
    agree, scores, labels = [], [], []
    by_task: dict[str, list[float]] = {}
    for (i, sc, sr) in scored:
        ex = examples[i]
        gc, gr = judge(ex.prompt, ex.chosen), judge(ex.prompt, ex.rejected)
        if gc is None or gr is None:
            continue
        by_task.setdefault(task_of(ex.prompt), []).append(float(sc > sr))
        scores += [sc, sr]
        labels += [gc, gr]
        if gc != gr:
            agree.append(float((sc > sr) == (gc > gr)))
    for task, hits in sorted(by_task.items()):  # the default task: held-out accuracy per kind of question
        out[f"accuracy/{task}"] = sum(hits) / len(hits)
    if agree:
        out["gold_agreement"] = sum(agree) / len(agree)
    if labels:
        out["gold_auc"] = auc(scores, labels)
    return out


def task_or_none(prompt: str) -> str | None:
    """The embedded task's kind of `prompt`, None for any other prompt."""
    try:
        return task_of(prompt)
    except ValueError:
        return None


def held_out_summary(ev: dict[str, Any]) -> dict[str, Any]:
    """`evaluate_pairs`' figures under their summary.json names (the reward stage's and rlhf.evaluate's)."""
    return {
        "eval_accuracy": ev.get("accuracy"),
        "eval_chosen_score": ev.get("chosen_score"),
        "eval_rejected_score": ev.get("rejected_score"),
        **{k.replace("accuracy/", "eval_accuracy/"): v for k, v in ev.items() if k.startswith("accuracy/")},
        "gold_agreement": ev.get("gold_agreement"),
        "gold_auc": ev.get("gold_auc"),
    }
