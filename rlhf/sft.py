"""Stage 1: supervised fine-tuning of a causal LM on demonstrations.

    python -m rlhf.sft                                       # the embedded default, CPU, minutes
    python -m rlhf.sft model.name_or_path=/models/opt-1.3b data.path=sft.jsonl train.lr=1e-5
    torchrun --nproc_per_node 2 -m rlhf.sft engine=zero3     # same run, sharded over 2 ranks

Choices: the loss is the token-level cross-entropy on response tokens only (prompt and padding
are -100), averaged over all response tokens of the global batch (not per sequence), as
DeepSpeed-Chat. With `data.packing` (auto: where the model supports it) a micro-batch's rows are
packed end to end without padding (rlhf/data/packing.py); the loss and its normalisation are the same. Global batch = micro batch x accumulation x world size; rows are read in a
seeded per-epoch order (rlhf/data/stage.py), so a resumed run sees exactly the rows it would have.
Evaluation before training, every `train.eval_every` steps and at the end: perplexity on the
held-out rows and the gold score of greedy generations on `data.eval_prompts_path`.
Writes to `output_dir`: config.yaml, metrics.jsonl, sft.png, checkpoints/, model/ (HF), summary.json.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from engine import TrainEngine
from rlhf.app import Throughput, stage_main
from rlhf.config import SFTConfig, engine_config, optim_config, validate_sft
from rlhf.data import collate_sft, parse_sft, tokenize_sft
from rlhf.data.packing import batch_tokens, pack_length_of, pack_sft, packing_saves
from rlhf.data.stage import StepOrder, stage_rows
from rlhf.data.tokenize import IGNORE_INDEX
from rlhf.evaluate import gold_eval, gold_line, gold_summary, load_eval_prompts, perplexity
from rlhf.models import check_context, export_model, load_causal_lm, load_tokenizer, use_packing
from rlhf.roles import Policy
from rlhf.stage import Run

logger = logging.getLogger("rlhf.sft")


def sft_loss(policy: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Summed next-token cross-entropy over response tokens under a `Policy` role, and their count
    (the engine's weight). With engine.kernels the log-probs come from hidden states."""
    labels = batch["labels"][:, 1:]  # (B, L-1): token t+1 is predicted at position t
    # A packed batch (rlhf/data/packing.py) has no attention mask and per-row position ids.
    loss_sum = policy(batch["input_ids"], batch["attention_mask"], batch.get("position_ids"), targets=labels,
                      reduction="sum")
    return loss_sum, (labels != IGNORE_INDEX).sum(), {}


def evaluate(engine: TrainEngine, cfg: SFTConfig, tok: Any, eval_feats: list, prompts: list) -> dict[str, Any]:
    info = engine.info
    out: dict[str, Any] = {}
    if eval_feats:
        # NOTE: on the gathered training module, not the generator: the injected generator has no module
        with engine.gathered_parameters():
            out.update(perplexity(engine.unwrapped, eval_feats, tok.pad_token_id, cfg.train.micro_batch_size,
                                  rank=info.rank, world=info.world_size, device=info.device))
    if prompts:
        with engine.generation() as generator:
            out.update(gold_eval(generator, prompts, tok, cfg.eval, rank=info.rank, world=info.world_size,
                                 device=info.device))
    return out


def run(cfg: SFTConfig) -> dict[str, Any]:
    run, accum = Run.open("sft", "SFT", cfg, cfg.train, validate_sft)
    info = run.info

    # ---- data
    tok = load_tokenizer(cfg.model)
    d = cfg.data
    train_rows, eval_rows = stage_rows(d, stage=0)
    train_feats, stats = tokenize_sft(parse_sft(train_rows, tok), tok, d.max_len, d.max_prompt_len, d.overlong, d.add_bos)
    eval_feats, _ = tokenize_sft(parse_sft(eval_rows, tok), tok, d.max_len, d.max_prompt_len, d.overlong, d.add_bos)
    prompts = load_eval_prompts(d, tok)
    order = StepOrder(len(train_feats), cfg.train.global_batch_size, cfg.seed)
    total = cfg.train.max_steps or cfg.train.epochs * order.steps_per_epoch
    logger.info("SFT data: %d train rows (%s), %d held-out rows, %d eval prompts; %d steps of %d rows (%d per epoch)",
                len(train_feats), stats, len(eval_feats), len(prompts), total, cfg.train.global_batch_size,
                order.steps_per_epoch)

    # ---- model + engine
    model = Policy(load_causal_lm(cfg.model, tok, seed=cfg.seed), fused=cfg.engine.kernels)
    check_context(model, cfg.data.max_len, "data.max_len")
    packed, pack_len = use_packing(d.packing, model), pack_length_of(d)
    only_if_saves = d.packing == "auto"
    engine = TrainEngine(model, engine_config(cfg.engine, info), optim_config(cfg.train), total_steps=total, info=info)
    run.begin(engine, total, lambda: evaluate(engine, cfg, tok, eval_feats, prompts), _eval_line, memory=engine)

    def collate(rows: list[dict]) -> dict:
        if packed and (not only_if_saves or packing_saves([len(r["input_ids"]) for r in rows], pack_len)):
            return pack_sft(rows, tok.pad_token_id, pack_len)
        return collate_sft(rows, tok.pad_token_id)

    # ---- train
    meter, last = Throughput(), {}
    for step in run.steps():
        idx = order.rank_rows(step, info.rank, info.world_size, accum)
        batches = [collate([train_feats[i] for i in rows]) for rows in idx]
        meter.add(sum(batch_tokens(b) for b in batches))
        out = engine.train_step(batches, sft_loss)
        run.check(out)
        if run.logs(step):
            tps = meter.rate()
            last = dict(loss=out["loss"], lr=out["lr"], grad_norm=out["grad_norm"], tokens_per_s=tps,
                        skipped_steps=engine.skipped_steps, loss_scale=out["loss_scale"], epoch=step / order.steps_per_epoch)
            run.log_train(step, last, dict(loss=f"{out['loss']:.3f}", lr=f"{out['lr']:.2e}", tok_s=f"{tps:,.0f}"))

    # ---- final evaluation, export, summary
    after = run.evaluate_after()
    model_dir = export_model(engine, tok, cfg.output_dir, cfg.model, add_bos=cfg.data.add_bos)
    before = run.before
    return run.finish({
        "train_rows": len(train_feats),
        "final_train_loss": last.get("loss"),
        "eval_loss_before": before.get("loss"),
        "eval_loss_after": after.get("loss"),
        "perplexity_after": after.get("perplexity"),
        **gold_summary(before, after),
        "skipped_steps": engine.skipped_steps,
    }, model_dir, PLOT, after.get("samples", []))


PLOT = [
    ("loss", [("train", "train", "loss"), ("held-out", "eval", "loss")]),
    ("gold score (% exact)", [("held-out (greedy)", "eval", "gold_score")]),
]


def _eval_line(ev: dict) -> str:
    parts = []
    if ev.get("loss") is not None:
        parts.append(f"eval loss {ev['loss']:.4f} (ppl {ev['perplexity']:.3f})")
    if gold := gold_line(ev):
        parts.append(gold)
    return ", ".join(parts) or "no eval data"


def main() -> None:
    stage_main("sft", SFTConfig, run)


if __name__ == "__main__":
    main()
