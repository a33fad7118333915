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
(rlhf/algos/reward_model.py). Loss: -log sigmoid(r_chosen - r_rejected - margin) (+ optional score
regularisation), mean over pairs; chosen and rejected are scored in one concatenated forward pass,
packed end to end without padding where the model supports it (`data.packing`, rlhf/data/packing.py;
a row's score is then the value at its own last token), or with each pair's prompt run once and both
responses on its KV cache (`data.shared_prompts`; by default wherever that computes the fewest positions,
which on the shipped pairs is every micro-batch).
Held-out evaluation (data.eval_path, else data.eval_size of data.path): pair accuracy, mean
chosen/rejected scores, and where a gold judge exists, agreement with it (pairs) and the AUC of scores
separating correct from incorrect responses.
Writes to `output_dir`: config.yaml, metrics.jsonl, reward.png, checkpoints/, model/ (HF), eval_rows.jsonl
(the held-out pairs: `rlhf.evaluate data.eval_path=` it gives the same figures), summary.json.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from engine import TrainEngine
from rlhf.algos.reward_model import pair_accuracy, pairwise_loss
from rlhf.config import RewardConfig
from rlhf.config.validate import SHARED_LINE, engine_config, optim_config, pair_shared_prompts, validate_reward
from rlhf.data.packing import pair_collate, widest_row
from rlhf.data.stage import stage_data
from rlhf.evaluation.pairs import evaluate_pairs, held_out_summary
from rlhf.modeling.export import export_model
from rlhf.modeling.forward import batch_scores
from rlhf.modeling.load import check_context, load_tokenizer, load_value_model, packing_support, stage_pack_length
from rlhf.modeling.roles import ValueModel
from rlhf.run.app import stage_main
from rlhf.run.stage import Run

logger = logging.getLogger("rlhf.reward")


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


def run(cfg: RewardConfig) -> dict[str, Any]:
    run, accum = Run.open("reward", "Reward model", cfg, cfg.train, validate_reward)
    tok, d, r = load_tokenizer(cfg.model), cfg.data, cfg.reward
    data = stage_data(d, cfg.train, cfg.seed, tok, 1, "reward")
    held_out = run.held_out(data.eval_rows, len(data.eval), data.unit, data.eval_source)

    model = ValueModel(load_value_model(cfg.model, tok, seed=cfg.seed, head_init_std=r.head_init_std))
    check_context(model, d.max_len, "data.max_len")
    shared = pair_shared_prompts(d, cfg.engine)  # data.shared_prompts: each pair's prompt run once per forward
    pack_len = stage_pack_length(d, packing_support(model), shared)
    collate = pair_collate(tok.pad_token_id, pack_len, only_if_saves=d.packing == "auto", shared=shared)
    if shared is not False:
        logger.info(SHARED_LINE[shared])
    engine = TrainEngine(model, engine_config(cfg.engine, run.info), optim_config(cfg.train), total_steps=data.total,
                         info=run.info, row_tokens=widest_row(d, pack_len))
    run.begin(engine, data.total, lambda: evaluate_pairs(engine, data.eval, data.eval_examples, tok.pad_token_id,
                                                   cfg.train.micro_batch_size, pack_len, shared=shared),
              _eval_line, memory=engine)

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
        **held_out,
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
