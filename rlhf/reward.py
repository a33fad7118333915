"""Stage 2: a pairwise reward model.

    python -m rlhf.reward                                    # from outputs/sft, shipped pairs, CPU
    python -m rlhf.reward model.name_or_path=/models/opt-350m data.path=Anthropic/hh-rlhf
    torchrun --nproc_per_node 2 -m rlhf.reward engine=zero3 train.micro_batch_size=16

Choices: the model is the backbone of a causal LM with a fresh scalar head
(`AutoModelForSequenceClassification`, num_labels=1), zero-initialised by default
(`reward.head_init_std=0`: less seed variance, see RewardLossConfig); an existing reward checkpoint
keeps its head. The first `reward.head_only_fraction` of the steps (0.2) trains the head alone, the
backbone's gradient zero (LP-FT: a run no longer stalls on what the head cannot yet read).
A sequence's score is the head's value at its last real token, found from the attention mask
(rlhf/reward_math.py). Loss: -log sigmoid(r_chosen - r_rejected - margin) (+ optional score
regularisation), mean over pairs; chosen and rejected are scored in one concatenated forward pass,
packed end to end without padding where the model supports it (`data.packing`, rlhf/data/packing.py;
a row's score is then the value at its own last token).
Held-out evaluation: pair accuracy, mean chosen/rejected scores, and where a gold judge exists,
agreement with it (pairs) and the AUC of scores separating correct from incorrect responses.
Writes to `output_dir`: config.yaml, metrics.jsonl, reward.png, checkpoints/, model/ (HF), summary.json.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from engine import TrainEngine
from rlhf.app import stage_main
from rlhf.config import RewardConfig, engine_config, optim_config, validate_reward
from rlhf.data import collate_pairs
from rlhf.data.packing import is_packed, pack_length_of, pack_pairs, packed_scores, packs
from rlhf.data.stage import stage_data
from rlhf.evaluate import all_gather
from rlhf.models import check_context, export_model, load_tokenizer, load_value_model, use_packing
from rlhf.roles import ValueModel
from rlhf.reward_math import auc, pair_accuracy, pairwise_loss, sequence_scores
from rlhf.stage import Run
from rlhf.task import judge, task_of

logger = logging.getLogger("rlhf.reward")


def batch_scores(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """[rows] scores of a `ValueModel` on a padded batch (value at the last real token) or a packed one
    (rlhf/data/packing.py: value at each row's last token, in row order)."""
    if is_packed(batch):
        return packed_scores(model(batch["input_ids"], None, batch["position_ids"]), batch)
    return sequence_scores(model(batch["input_ids"], batch["attention_mask"]), batch["attention_mask"])


def pair_collate(pad_id: int, pack_length: int | None, only_if_saves: bool = False):
    """rows -> collate_pairs' padded batch, or with `pack_length` (not None) the packed one (with
    `only_if_saves`, data.packing=auto: only where packing computes fewer slots)."""
    def collate(rows: list[dict]) -> dict:
        lengths = [len(r["chosen_ids"]) for r in rows] + [len(r["rejected_ids"]) for r in rows]
        if packs(lengths, pack_length, only_if_saves):
            return pack_pairs(rows, pad_id, pack_length)
        return collate_pairs(rows, pad_id)

    return collate


def make_loss(margin: float, score_reg: float):
    def reward_loss(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, int, dict]:
        """Summed pairwise loss over the B pairs of a [2B, L] batch (chosen rows first), padded or packed."""
        scores = batch_scores(model, batch)
        chosen, rejected = scores.chunk(2)
        loss = pairwise_loss(chosen, rejected, margin, score_reg)
        metrics = {"accuracy": pair_accuracy(chosen, rejected), "chosen_score": chosen.mean(),
                   "rejected_score": rejected.mean()}
        return loss.sum(), chosen.shape[0], {k: v.detach() for k, v in metrics.items()}

    return reward_loss


@torch.no_grad()
def score_pairs(engine: TrainEngine, feats: list[dict], pad_id: int, batch_size: int,
                pack_length: int | None = None) -> list[tuple[int, float, float]]:
    """(index, chosen score, rejected score) of every feature, computed on the gathered model with
    the rows split over the ranks, then all-gathered (in feature order); packed when `pack_length`
    is not None (rlhf/data/packing.py)."""
    info = engine.info
    collate = pair_collate(pad_id, pack_length)
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
    return sorted(x for part in all_gather(out) for x in part)


def evaluate(engine: TrainEngine, feats: list[dict], examples: list, pad_id: int, batch_size: int,
             pack_length: int | None = None) -> dict[str, Any]:
    """Held-out accuracy and mean scores; agreement with / AUC against the gold judge where it applies."""
    if not feats:
        return {}
    return pair_metrics(score_pairs(engine, feats, pad_id, batch_size, pack_length), examples)


def pair_metrics(scored: list[tuple[int, float, float]], examples: list) -> dict[str, Any]:
    """`evaluate`'s figures from `score_pairs`' (index, chosen score, rejected score) of `examples`."""
    c = torch.tensor([s[1] for s in scored])
    r = torch.tensor([s[2] for s in scored])
    out: dict[str, Any] = {"accuracy": pair_accuracy(c, r).item(), "chosen_score": c.mean().item(),
                           "rejected_score": r.mean().item(), "score_std": torch.cat([c, r]).std().item()}
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


def run(cfg: RewardConfig) -> dict[str, Any]:
    run, accum = Run.open("reward", "Reward model", cfg, cfg.train, validate_reward)
    tok, d, r = load_tokenizer(cfg.model), cfg.data, cfg.reward
    data = stage_data(d, cfg.train, cfg.seed, tok, 1, "reward")

    model = ValueModel(load_value_model(cfg.model, tok, seed=cfg.seed, head_init_std=r.head_init_std))
    check_context(model, d.max_len, "data.max_len")
    pack_len = pack_length_of(d) if use_packing(d.packing, model) else None
    collate = pair_collate(tok.pad_token_id, pack_len, only_if_saves=d.packing == "auto")
    engine = TrainEngine(model, engine_config(cfg.engine, run.info), optim_config(cfg.train), total_steps=data.total,
                         info=run.info)
    run.begin(engine, data.total, lambda: evaluate(engine, data.eval, data.eval_examples, tok.pad_token_id,
                                                   cfg.train.micro_batch_size, pack_len), _eval_line, memory=engine)

    head_only = round(r.head_only_fraction * data.total)
    if head_only:
        logger.info("steps 1-%d train the score head alone (reward.head_only_fraction=%s), then the whole model",
                    head_only, r.head_only_fraction)

    def head_phase(step: int) -> None:
        engine.unwrapped.backbone_grad = 0.0 if step < head_only else 1.0

    keys = ("loss", "accuracy", "chosen_score", "rejected_score", "lr", "grad_norm")
    last = run.loop(engine, data.order, accum, lambda idx: collate([data.train[i] for i in idx]),
                    make_loss(r.margin, r.score_reg), keys,
                    {"loss": ("loss", ".3f"), "acc": ("accuracy", ".2f"), "lr": ("lr", ".2e")}, before_step=head_phase)

    after = run.evaluate_after()
    return run.finish({
        "train_pairs": len(data.train),
        "eval_pairs": len(data.eval),
        "final_train_loss": last.get("loss"),
        "final_train_accuracy": last.get("accuracy"),
        **held_out_summary(after),
        "skipped_steps": engine.skipped_steps,
    }, export_model(engine, tok, cfg.output_dir, cfg.model, add_bos=d.add_bos), PLOT)


PLOT = [
    ("loss", [("train", "train", "loss")]),
    ("pair accuracy", [("train", "train", "accuracy"), ("held-out", "eval", "accuracy")]),
    ("score", [("chosen (held-out)", "eval", "chosen_score"), ("rejected (held-out)", "eval", "rejected_score")]),
]


def held_out_summary(ev: dict[str, Any]) -> dict[str, Any]:
    """`evaluate`'s figures under their summary.json names (the reward stage's and rlhf.evaluate's)."""
    return {
        "eval_accuracy": ev.get("accuracy"),
        "eval_chosen_score": ev.get("chosen_score"),
        "eval_rejected_score": ev.get("rejected_score"),
        **{k.replace("accuracy/", "eval_accuracy/"): v for k, v in ev.items() if k.startswith("accuracy/")},
        "gold_agreement": ev.get("gold_agreement"),
        "gold_auc": ev.get("gold_auc"),
    }


def _eval_line(ev: dict) -> str:
    if not ev:
        return "no held-out pairs"
    line = (f"held-out accuracy {ev['accuracy']:.3f}, chosen {ev['chosen_score']:.3f}, "
            f"rejected {ev['rejected_score']:.3f}")
    if ev.get("gold_auc") is not None:
        line += f", gold AUC {ev['gold_auc']:.3f}"
    return line


def main() -> None:
    stage_main("reward", RewardConfig, run)


if __name__ == "__main__":
    main()
