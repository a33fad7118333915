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
held-out rows (data.eval_path, else data.eval_size of data.path) and the gold score of greedy
generations on `data.eval_prompts_path` where a judge applies (rlhf/evaluation/gold.py).
Writes to `output_dir`: config.yaml, metrics.jsonl, sft.png, checkpoints/, model/ (HF), eval_rows.jsonl
(the held-out rows), summary.json (with eval_source / eval_rows and eval_prompts_source: what it evaluated on).
"""
from __future__ import annotations

import logging
from typing import Any

from engine import TrainEngine
from rlhf.config import SFTConfig
from rlhf.core.errors import ConfigError
from rlhf.config.validate import engine_config, optim_config, validate_sft
from rlhf.data import collate_sft
from rlhf.data.packing import pack_sft, packs, widest_row
from rlhf.data.stage import StepOrder, stage_data
from rlhf.evaluation.gold import eval_line, gold_of, gold_set, gold_summary
from rlhf.evaluation.perplexity import perplexity
from rlhf.modeling.export import export_model
from rlhf.modeling.forward import sft_loss
from rlhf.modeling.load import (check_causal_lm, check_context, check_generation_backend, load_causal_lm,
                                load_tokenizer, packing_support, stage_pack_length)
from rlhf.modeling.roles import Policy
from rlhf.run.app import stage_main
from rlhf.run.stage import Run

logger = logging.getLogger("rlhf.sft")


def evaluate(engine: TrainEngine, cfg: SFTConfig, tok: Any, eval_feats: list, prompts: list) -> dict[str, Any]:
    info, out = engine.info, {}
    if eval_feats:
        # NOTE: on the gathered training module, not the generator: the injected generator has no module
        with engine.gathered_parameters():
            out.update(perplexity(engine.unwrapped, eval_feats, tok.pad_token_id, cfg.train.micro_batch_size,
                                  rank=info.rank, world=info.world_size, device=info.device))
    return {**out, **gold_of(engine, prompts, tok, cfg.eval)}


def run(cfg: SFTConfig) -> dict[str, Any]:
    run, accum = Run.open("sft", "SFT", cfg, cfg.train, validate_sft)
    check_causal_lm(cfg.model.name_or_path, "model")  # a reward model's directory: refused before the data
    tok, d = load_tokenizer(cfg.model), cfg.data
    check_generation_backend(cfg.engine.generation, cfg.model, tok, "model", run.info.device.type)  # its evaluations
    data = stage_data(d, cfg.train, cfg.seed, tok, 0, "SFT")
    held_out = run.held_out(data.eval_rows, len(data.eval), data.unit, data.eval_source)
    prompts, gold = gold_set(d, tok, cfg.eval)

    pack_len = None

    def build(seed: int) -> TrainEngine:
        nonlocal pack_len
        model = Policy(load_causal_lm(cfg.model, tok, seed=seed), fused=cfg.engine.kernels, max_logits_mb=cfg.engine.max_logits_mb)
        check_context(model, d.max_len, "data.max_len")
        pack_len = stage_pack_length(d, packing_support(model))
        return TrainEngine(model, engine_config(cfg.engine, run.info), optim_config(cfg.train), total_steps=data.total,
                           info=run.info, row_tokens=widest_row(d, pack_len))

    def batch(idx: list[int]) -> dict:
        rows = [data.train[i] for i in idx]
        if packs([len(r["input_ids"]) for r in rows], pack_len, d.packing == "auto"):
            return pack_sft(rows, tok.pad_token_id, pack_len)
        return collate_sft(rows, tok.pad_token_id)

    def order_of(seed: int) -> StepOrder:  # the rows' order: the run's own, or a start's (starts.n > 1)
        return data.order if seed == cfg.seed else StepOrder(len(data.train), cfg.train.global_batch_size, seed)

    if cfg.starts.n > 1 and not data.eval:
        raise ConfigError(f"starts.n={cfg.starts.n} compares the starts by their held-out loss: this run has no held-out "
                          "rows (set data.eval_path, or data.eval_size > 0)")
    keys = ("loss", "lr", "grad_norm", "loss_scale")
    epoch = {"extra": lambda step: {"epoch": step / data.order.steps_per_epoch}}
    seed = run.best_start(cfg.starts, data.total, build, order_of, lambda e: evaluate(e, cfg, tok, data.eval, prompts),
                          accum, batch, sft_loss, keys, **epoch)
    engine = build(seed)
    run.begin(engine, data.total, lambda: evaluate(engine, cfg, tok, data.eval, prompts), _eval_line, memory=engine,
              state_fn=lambda: {"start_seed": seed})
    last = run.loop(engine, order_of(seed), accum, batch, sft_loss, keys,
                    {"loss": ("loss", ".3f"), "lr": ("lr", ".2e"), "tok_s": ("tokens_per_s", ",.0f")}, **epoch)

    before, after = run.before, run.evaluate_after()
    return run.finish({
        "train_rows": len(data.train),
        **held_out,
        **gold,
        "final_train_loss": last.get("loss"),
        "eval_loss_before": before.get("loss"),
        "eval_loss_after": after.get("loss"),
        "perplexity_after": after.get("perplexity"),
        **gold_summary(before, after),
        "skipped_steps": engine.skipped_steps,
        **run.starts_summary(),
    }, export_model(engine, tok, cfg.output_dir, cfg.model, add_bos=d.add_bos), PLOT, after.get("samples", []))


PLOT = [
    ("loss", [("train", "train", "loss"), ("held-out", "eval", "loss")]),
    ("gold score (% exact)", [("held-out (greedy)", "eval", "gold_score")]),
]


def _eval_line(ev: dict) -> str:
    own = f"eval loss {ev['loss']:.4f} (ppl {ev['perplexity']:.3f})" if ev.get("loss") is not None else None
    return eval_line(own, ev, "no eval data")


def main() -> None:
    stage_main("sft", SFTConfig, run)


if __name__ == "__main__":
    main()
