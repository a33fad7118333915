"""`python -m rlhf.evaluate`: any model scored on held-out data exactly as the stages score theirs.

    python -m rlhf.evaluate model.name_or_path=outputs/sft             # gold score + held-out perplexity
    python -m rlhf.evaluate model.name_or_path=outputs/ppo data.eval_prompts_path=my_prompts.jsonl
    python -m rlhf.evaluate model.name_or_path=outputs/reward data.eval_path=pairs.jsonl   # mode auto -> reward
    torchrun --nproc_per_node 2 -m rlhf.evaluate engine=zero3 model.name_or_path=/models/opt-1.3b

The figures come from rlhf/evaluation/ (`gold_eval`: generations scored by the gold judge,
`perplexity`, `evaluate_pairs`), the same functions the stages call.

The command loads the model into a `TrainEngine` whose optimizer never steps: the same wrappers,
precision policy and `engine.generation()` path as the stage that trained it, so its figures are the
stage's own held-out figures (same names in summary.json). mode=policy: `gold_eval` on
`data.eval_prompts_path` (a prompt is scored by exact match with its `answer` field, else by the default
task's judge; a file none of whose prompts can be scored is an error, some unscorable ones a warning)
and `perplexity` on SFT rows (`data.eval_path`, else the held-out share of `data.path` carved as the SFT
stage carves it: data.eval_size, data.split_seed). mode=reward: the reward stage's held-out pair figures
on `data.eval_path`, else `default_pairs_path` (conf/evaluate.yaml: the shipped held-out pairs while
data.path is the shipped file), else the reward stage's held-out share of `data.path`. A stage's
output_dir/eval_rows.jsonl, as data.eval_path, is the rows that stage evaluated on.
Writes to `output_dir`: config.yaml, metrics.jsonl, samples.jsonl (every prompt or pair), summary.json
(eval_source / eval_rows and eval_prompts_source name what was scored).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from engine import OptimConfig, TrainEngine, hf_base_model, init_distributed, set_deterministic
from rlhf.config import DataConfig, EvaluateConfig, GenerationConfig, ModelConfig
from rlhf.config.validate import engine_config, validate_evaluate
from rlhf.core.errors import ConfigError
from rlhf.core.hub import check_local
from rlhf.data import load_rows, parse_pairs, parse_sft, tokenize_pairs, tokenize_sft
from rlhf.data.stage import held_out_line, held_out_source, stage_rows
from rlhf.evaluation.gold import EvalPrompt, gold_applies, gold_eval, judged, load_eval_prompts
from rlhf.evaluation.pairs import held_out_summary, pair_metrics, score_pairs
from rlhf.evaluation.perplexity import perplexity
from rlhf.modeling.load import (
    check_generation_backend, check_reward_model, load_causal_lm, load_tokenizer, load_value_model, resolve_model_path,
    value_model_reason,
)
from rlhf.modeling.roles import Policy, ValueModel
from rlhf.run.app import save_config, seed_everything, setup_logging, stage_main
from rlhf.run.runlog import RunLog, format_summary, write_summary

logger = logging.getLogger("rlhf.evaluate")


# ----------------------------------------------------------------------------- the command


def detect_mode(m: ModelConfig) -> str:
    """'reward' when the model's config names a *ForSequenceClassification architecture (an adapter
    directory: task_type SEQ_CLS), else 'policy'."""
    path = m.name_or_path
    if os.path.isdir(path):
        return "reward" if value_model_reason(resolve_model_path(path)) else "policy"
    from transformers import AutoConfig

    try:
        archs = AutoConfig.from_pretrained(path, trust_remote_code=m.trust_remote_code).architectures or []
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.name_or_path={path!r}: cannot read its config ({e}); set mode=policy or "
                          "mode=reward") from None
    return "reward" if any(a.endswith("ForSequenceClassification") for a in archs) else "policy"


def held_out_rows(d: DataConfig, stage: int) -> tuple[list, str | None]:
    """Held-out rows and where they come from (`held_out_source`): data.eval_path, else `stage`'s held-out
    share of data.path (0: the SFT stage's rows, 1: the reward stage's pairs); none without either."""
    if d.eval_path:
        return load_rows(d.eval_path, d.eval_split, d.cache_dir, key="data.eval_path"), held_out_source(d, stage)
    if not d.path:
        return [], None
    return stage_rows(d, stage=stage)[1], held_out_source(d, stage)


def scorable(prompts: Sequence[EvalPrompt], key: str, g: GenerationConfig) -> None:
    """Error when no prompt can be scored (no eval.judge, no `answer` field and not a default-task
    prompt); a warning when some cannot (the gold score is then the mean over those that can, as in
    the stages)."""
    scored = {id(p) for p in judged(prompts, g)}
    unscored = [p for p in prompts if id(p) not in scored]
    if prompts and len(unscored) == len(prompts):
        raise ConfigError(f"{key}: none of its {len(prompts)} prompts can be scored: give each an `answer` "
                          "field (exact match), use the default task's prompts (the gold judge) or name your "
                          f"own judge (eval.judge=module:fn), or set {key}=null to measure perplexity only")
    if unscored:
        logger.warning("%s: %d of %d prompts have no `answer` and no gold judge: the gold score is over the other %d",
                       key, len(unscored), len(prompts), len(prompts) - len(unscored))


def eval_engine(model: torch.nn.Module, cfg: EvaluateConfig, info) -> TrainEngine:
    """The model in the engine the stages train it in (its optimizer is built, never stepped)."""
    return TrainEngine(model, engine_config(cfg.engine, info), OptimConfig(), total_steps=1, info=info,
                       row_tokens=cfg.data.max_len)


def evaluate_policy(cfg: EvaluateConfig, tok: Any, info) -> tuple[dict[str, Any], list[dict]]:
    d = cfg.data
    check_generation_backend(cfg.engine.generation, cfg.model, tok, "model", info.device.type)
    prompts = load_eval_prompts(d, tok)
    scorable(prompts, "data.eval_prompts_path", cfg.eval)
    rows, source = held_out_rows(d, stage=0)
    feats, stats = tokenize_sft(parse_sft(rows, tok), tok, d.max_len, d.max_prompt_len, d.overlong, d.add_bos,
                                d.assistant_only_loss)
    if not prompts and not feats:
        raise ConfigError("nothing to evaluate: set data.eval_prompts_path (generations) and/or data.eval_path "
                          "or data.path with data.eval_size > 0 (perplexity)")
    logger.info("evaluating a policy: %d eval prompts, %d held-out SFT rows (%s)", len(prompts), len(feats), stats)
    logger.info(held_out_line(len(feats), "rows", source if rows else None))
    gold = gold_applies(prompts, f"data.eval_prompts_path={d.eval_prompts_path}" if d.eval_prompts_path else None,
                        cfg.eval)
    engine = eval_engine(Policy(load_causal_lm(cfg.model, tok, seed=cfg.seed, lora=False), fused=cfg.engine.kernels, max_logits_mb=cfg.engine.max_logits_mb),
                         cfg, info)
    out: dict[str, Any] = {"eval_prompts": len(prompts), "eval_prompts_source": gold["eval_prompts_source"],
                           "gold_score": None, "eval_source": source if rows else None, "eval_rows": len(feats),
                           "eval_loss": None, "perplexity": None}
    samples: list[dict] = []
    if feats:
        with engine.gathered_parameters():  # what the SFT stage's generation() gathers for its perplexity
            ppl = perplexity(engine.unwrapped, feats, tok.pad_token_id, cfg.batch_size, rank=info.rank,
                             world=info.world_size, device=info.device)
        out.update(eval_loss=ppl["loss"], perplexity=ppl["perplexity"])
    if prompts:
        with engine.generation() as generator:
            ev = gold_eval(generator, prompts, tok, cfg.eval, info, n_samples=len(prompts))
        samples = [{"prompt": s["prompt"], "response": s["response"], "score": s["gold"], "answer": p.answer,
                    "task": p.task} for s, p in zip(ev.pop("samples"), prompts)]
        out.update(ev)
        out["generation_path"] = engine.generation_path
    return out, samples


def evaluate_reward(cfg: EvaluateConfig, tok: Any, info) -> tuple[dict[str, Any], list[dict]]:
    d = cfg.data
    if not d.eval_path and cfg.default_pairs_path:
        rows, source = load_rows(cfg.default_pairs_path, d.eval_split, d.cache_dir, key="default_pairs_path"), \
            f"default_pairs_path={cfg.default_pairs_path}"
    else:
        rows, source = held_out_rows(d, stage=1)
    if not rows:
        raise ConfigError("mode=reward needs preference pairs: set data.eval_path (e.g. a reward stage's "
                          "output_dir/eval_rows.jsonl), or data.path with data.eval_size > 0 (its held-out share)")
    examples = parse_pairs(rows, tok)
    feats, stats = tokenize_pairs(examples, tok, d.max_len, d.max_prompt_len, d.overlong, d.add_bos)
    if not feats:
        raise ConfigError(f"{source}: no pairs left to score ({stats})")
    logger.info("evaluating a reward model: %d held-out pairs (%s)", len(feats), stats)
    logger.info(held_out_line(len(feats), "pairs", source))
    model = load_value_model(cfg.model, tok, seed=cfg.seed, lora=False)
    base = hf_base_model(model)
    if base.config.num_labels != 1:
        raise ConfigError(f"model.name_or_path={cfg.model.name_or_path!r} has {base.config.num_labels} outputs: "
                          "a reward model has one (num_labels=1)")
    if not any(a.endswith("ForSequenceClassification") for a in (base.config.architectures or [])):
        logger.warning("%s is not a sequence-classification checkpoint: its score head is freshly initialised, "
                       "so these figures are those of an untrained head", cfg.model.name_or_path)
    engine = eval_engine(ValueModel(model), cfg, info)
    scored = score_pairs(engine, feats, tok.pad_token_id, cfg.batch_size)
    ev = pair_metrics(scored, examples)
    out = {"eval_pairs": len(feats), "eval_source": source, "eval_rows": len(feats), **held_out_summary(ev),
           "eval_score_std": ev["score_std"]}
    samples = [{"prompt": examples[i].prompt, "chosen": examples[i].chosen, "rejected": examples[i].rejected,
                "chosen_score": c, "rejected_score": r} for i, c, r in scored]
    return out, samples


def run(cfg: EvaluateConfig) -> dict[str, Any]:
    t_start = time.time()
    set_deterministic(cfg.engine.deterministic)
    info = init_distributed(timeout_s=cfg.engine.timeout_s)
    setup_logging(info.is_main)
    validate_evaluate(cfg, info)
    check_local(cfg.model.name_or_path, "model.name_or_path")
    seed_everything(cfg.seed)
    out_dir = cfg.output_dir
    mode = detect_mode(cfg.model) if cfg.mode == "auto" else cfg.mode
    logger.info("mode=%s%s", mode, " (detected from the model's config)" if cfg.mode == "auto" else "")
    if mode == "reward":  # mode=reward on a policy would report a random head's figures
        check_reward_model(cfg.model.name_or_path, "model.name_or_path (mode=reward)")
    tok = load_tokenizer(cfg.model)
    figures, samples = (evaluate_policy if mode == "policy" else evaluate_reward)(cfg, tok, info)
    summary: dict[str, Any] = {}
    if info.is_main:
        save_config(out_dir, cfg)
        log = RunLog(out_dir, cfg.logger, is_main=True)
        log.log(0, "eval", mode=mode, **figures)
        log.samples(0, samples)  # samples.jsonl (each with step 0) and each logger's table
        log.finish()
        summary = {"stage": "evaluate", "mode": mode, "model": cfg.model.name_or_path,
                   "time_s": round(time.time() - t_start, 1), **figures}
        write_summary(out_dir, summary)
        for s in samples[:3]:
            if mode == "policy":
                print(f"  sample: {s['prompt']!r} -> {s['response']!r} (gold {s['score']})")
            else:
                print(f"  pair: {s['prompt']!r}: chosen {s['chosen_score']:.3f}, rejected {s['rejected_score']:.3f}")
        print(f"evaluation done ({out_dir}):\n{format_summary(summary)}", flush=True)
    return summary


def main() -> None:
    stage_main("evaluate", EvaluateConfig, run)


if __name__ == "__main__":
    main()
