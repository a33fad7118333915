"""Validation of a typed config, once, before any model loads: ranges, choices, and the batch-size
arithmetic (global = micro x accumulation x world size). Each error is a ConfigError naming the key
(`train.lr`, ...). The registries a key names (advantage estimators, preference losses, reward sources)
are imported from the layers that define them, below this one."""
from __future__ import annotations

import importlib.util
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import replace as dataclasses_replace
from typing import Any

from engine import OptimConfig, validate_engine_config, validate_optim_config
from engine.config import EngineConfig, resolve_precision
from rlhf.algos.online_dpo import PAIR_LOSSES
from rlhf.algos.preference import LOSS_TYPES, UNPAIRED_LOSS_TYPES
from rlhf.algos.rl import ADVANTAGE_ESTIMATORS, IS_CORRECTIONS, IS_LEVELS, KL_ESTIMATORS, LOSS_AGGREGATIONS, policy_loss_fn
from rlhf.config.schema import (
    REWARD_ENSEMBLE_AGGREGATES, PPOTrainConfig,
    DTYPES, PRECISIONS, REWARD_SOURCES, AlarmsConfig, CadenceConfig, DataConfig, DPOConfig, EvaluateConfig,
    GenerationConfig, LoggerConfig, ModelConfig, OptimGroupConfig, PPOConfig, RewardConfig, RewardSourcesConfig,
    RolloutConfig, SERVED_REWARDS, ServeConfig, SFTConfig, StageConfig, TrainConfig,
)
from rlhf.core.errors import ConfigError
from rlhf.core.plugins import load_function

STAGES = ("sft", "reward", "ppo")  # the data_split shares, in order


def parse_data_split(data_split: str | Sequence[float]) -> tuple[float, float, float]:
    """"2,4,4" or [2, 4, 4] -> normalised proportions; ValueError naming data.data_split."""
    try:
        parts = data_split.split(",") if isinstance(data_split, str) else list(data_split)
        weights = [float(p) for p in parts]
    except (TypeError, ValueError):
        msg = f"data.data_split must be 3 comma-separated numbers like '2,4,4', got {data_split!r}"
        raise ValueError(msg) from None
    if len(weights) != 3:
        raise ValueError(f"data.data_split needs 3 weights (sft, reward, ppo), got {len(weights)}: {data_split!r}")
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"data.data_split weights must be finite and >= 0, got {data_split!r}")
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"data.data_split weights must not all be zero, got {data_split!r}")
    return tuple(w / total for w in weights)  # type: ignore[return-value]


def data_sources(path: Any) -> list[str]:
    """data.path as its list of sources (a string is one); ConfigError unless each is a non-empty string."""
    paths = [path] if isinstance(path, str) else list(path) if isinstance(path, (list, tuple)) else None
    if not paths or not all(isinstance(p, str) and p for p in paths):
        raise ConfigError("data.path must be a file, a directory or a datasets hub name, or a list of them "
                          f"([a.jsonl,b.jsonl]), got {path!r}")
    return paths


def mix_weights(d: DataConfig) -> list[float] | None:
    """data.weights normalised to sum to 1, one per data.path source; None when not given (the sources'
    sizes weigh them). ConfigError naming data.weights (or data.mix_size)."""
    n = len(data_sources(d.path))
    _need(d.mix_size is None or (isinstance(d.mix_size, int) and d.mix_size >= 1),
          f"data.mix_size must be null (the sum of the sources' rows) or >= 1, got {d.mix_size!r}")
    if not d.weights:
        return None
    w = list(d.weights)
    _need(len(w) == n, f"data.weights needs one weight per data.path source ({n}), got {len(w)}: {w}")
    _need(all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in w),
          f"data.weights must be finite and >= 0, got {w}")
    _need(sum(w) > 0, f"data.weights must not all be zero, got {w}")
    return [x / sum(w) for x in w]



def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


ATTN_IMPLEMENTATIONS = (None, "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


# What engine.deterministic=true can honour: flash attention's backward and flex attention's compiled kernels
# have no deterministic mode that torch.use_deterministic_algorithms reaches.
DETERMINISTIC_ATTENTION = (None, "eager", "sdpa")
FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def validate_attention(m: ModelConfig, e: EngineConfig, info, prefix: str = "model") -> None:
    """model.attn_implementation against this run: flash attention needs CUDA and its package (else
    transformers' ImportError deep in the load), and engine.deterministic=true only the implementations it
    can make deterministic (DETERMINISTIC_ATTENTION); eval.greedy=false under it: `deterministic_notes`."""
    attn, key = m.attn_implementation, f"{prefix}.attn_implementation"
    _need(not e.deterministic or attn in DETERMINISTIC_ATTENTION,
          f"engine.deterministic=true cannot make {key}={attn} deterministic (no deterministic kernels reach it): "
          f"use {key}=sdpa or eager, or engine.deterministic=false")
    if attn in FLASH_PACKAGES:
        _need(info.device.type == "cuda", f"{key}={attn} runs on CUDA only, and this run is on "
              f"{info.device.type}: use sdpa or eager (or null, transformers' default)")
        _need(importlib.util.find_spec(FLASH_PACKAGES[attn]) is not None,
              f"{key}={attn} needs the {FLASH_PACKAGES[attn]} package, which is not installed: install it, or use "
              "sdpa or eager")


def deterministic_notes(e: EngineConfig, g: GenerationConfig, prefix: str = "eval") -> None:
    """engine.deterministic=true with a sampled evaluation (`{prefix}.greedy=false`): repeatable, but its row
    seeds come from torch's RNG, so not batch-invariant (docs/engine.md, "Not covered"): said once, as a warning."""
    if e.deterministic and not g.greedy:
        logging.getLogger("rlhf").warning(
            "engine.deterministic=true with %s.greedy=false: the sampled evaluation repeats on this machine and "
            "world size, but is not batch-invariant (its row seeds come from torch's RNG): another world size or "
            "%s.batch_size samples other responses; %s.greedy=true is covered", prefix, prefix, prefix)


def validate_model(m: ModelConfig, prefix: str = "model") -> None:
    _need(m.attn_implementation in ATTN_IMPLEMENTATIONS,
          f"{prefix}.attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {m.attn_implementation!r}")
    if m.fallback_to_config and m.name_or_path is not None and not os.path.exists(m.name_or_path):
        _need(bool(m.config) and m.tokenizer is not None,
              f"{prefix}.name_or_path={m.name_or_path!r} does not exist and {prefix}.fallback_to_config needs "
              f"{prefix}.config and {prefix}.tokenizer to build a model instead")
        return
    _need(m.name_or_path is not None or bool(m.config), f"{prefix}.name_or_path or {prefix}.config must be set")
    check_model_path(m.name_or_path, f"{prefix}.name_or_path")
    _need(m.name_or_path is not None or "model_type" in m.config,
          f"{prefix}.config needs a model_type (e.g. llama) to build a model without {prefix}.name_or_path")
    _need(m.name_or_path is not None or m.tokenizer is not None,
          f"{prefix}.tokenizer must be set when {prefix}.name_or_path is null (a model built from a config)")
    _need(m.dtype in DTYPES, f"{prefix}.dtype must be one of {DTYPES}, got {m.dtype!r}")
    _need(m.save_dtype in DTYPES[1:], f"{prefix}.save_dtype must be one of {DTYPES[1:]}, got {m.save_dtype!r}")
    lo = m.lora
    _need(lo.r >= 0, f"{prefix}.lora.r must be >= 0 (0 disables LoRA), got {lo.r}")
    if lo.r > 0:
        _need(lo.alpha > 0, f"{prefix}.lora.alpha must be > 0, got {lo.alpha}")
        _need(0 <= lo.dropout < 1, f"{prefix}.lora.dropout must be in [0, 1), got {lo.dropout}")
        tm = lo.target_modules
        _need(tm == "all-linear" or (isinstance(tm, list) and tm and all(isinstance(t, str) for t in tm)),
              f"{prefix}.lora.target_modules must be 'all-linear' or a non-empty list of module names, got {tm!r}")
        _need(lo.merge_on_save or m.name_or_path is not None,
              f"{prefix}.lora.merge_on_save=false saves only the adapter, which needs a base model on disk: "
              f"set {prefix}.name_or_path (a model built from {prefix}.config has none)")


def check_model_path(path: str | None, key: str) -> None:
    """A model is a directory (config.json, or an adapter's adapter_config.json) or a hub name, never a
    file: a weights or config file named directly would fail later as a malformed hub repo id."""
    _need(path is None or not os.path.isfile(os.path.expanduser(path)),
          f"{key}={path!r} is a file: it must be a model directory (holding config.json, or an adapter's "
          f"adapter_config.json), a stage's output_dir, or a hub name; name the directory that holds it")


def validate_data(d: DataConfig, *, needs_response: bool = True, needs_path: bool = True) -> None:
    if needs_path:
        _need(bool(d.path), "data.path must be set (a file, a directory or a datasets hub name)")
    if d.path or d.weights:
        mix_weights(d)  # data.path's sources, data.weights, data.mix_size
    _need(d.eval_size == 0 or 0 < d.eval_size < 1 or (d.eval_size >= 1 and float(d.eval_size).is_integer()),
          f"data.eval_size must be a fraction in [0, 1) or a whole number of rows (>= 1), got {d.eval_size}")
    _need(d.eval_fraction is None or 0 <= d.eval_fraction < 1,
          f"data.eval_fraction must be in [0, 1) (or null: data.eval_size), got {d.eval_fraction}")
    _need(d.num_eval_prompts >= 0, f"data.num_eval_prompts must be >= 0, got {d.num_eval_prompts}")
    _need(d.max_prompt_len >= 1, f"data.max_prompt_len must be >= 1, got {d.max_prompt_len}")
    if needs_response:
        _need(d.max_len > d.max_prompt_len,
              f"data.max_len ({d.max_len}) must exceed data.max_prompt_len ({d.max_prompt_len})")
    _need(d.overlong in ("truncate", "drop"), f"data.overlong must be 'truncate' or 'drop', got {d.overlong!r}")
    _need(d.packing in ("auto", True, False), f"data.packing must be auto, true or false, got {d.packing!r}")
    _need(d.pack_length is None or d.pack_length == 0 or d.pack_length >= d.max_len,
          f"data.pack_length must be null (= data.max_len), 0 (one row per micro-batch) or >= data.max_len "
          f"({d.max_len}, the longest row), got {d.pack_length}")
    if d.data_split is not None:
        try:
            parse_data_split(d.data_split)
        except ValueError as e:
            raise ConfigError(str(e)) from None


# logger=<name> -> (the module it imports, the pip extra that installs it); csv needs no library
LOGGER_LIBRARIES = {"wandb": ("wandb", "wandb"), "tensorboard": ("tensorboardX", "tensorboard"),
                    "mlflow": ("mlflow", "mlflow"), "trackio": ("trackio", "trackio"), "csv": (None, None)}


def enabled_loggers(lg: LoggerConfig) -> list[str]:
    """The loggers `lg` turns on besides metrics.jsonl, in LOGGER_LIBRARIES' order (wandb with mode=disabled: off)."""
    return [n for n in LOGGER_LIBRARIES if getattr(lg, n) is True and not (n == "wandb" and lg.mode == "disabled")]


def validate_logger(lg: LoggerConfig) -> None:
    for name in LOGGER_LIBRARIES:
        _need(isinstance(getattr(lg, name), bool), f"logger.{name} must be true or false, got {getattr(lg, name)!r}")
    _need(lg.mode in ("online", "offline", "disabled"),
          f"logger.mode must be online, offline or disabled, got {lg.mode!r}")
    _need(bool(lg.project), "logger.project must be a non-empty name (the W&B / trackio project, the MLflow experiment)")
    for name in enabled_loggers(lg):
        module, extra = LOGGER_LIBRARIES[name]
        # NOTE: found, not imported: the library loads only on the main rank, when the run opens its logs
        _need(module is None or importlib.util.find_spec(module) is not None,
              f"logger.{name}=true (logger={name}) needs the {module} package, which is not installed: "
              f"pip install -e \".[{extra}]\" (or pip install {module})")


def validate_generation(g: GenerationConfig, prefix: str) -> None:
    _need(g.max_new_tokens >= 1, f"{prefix}.max_new_tokens must be >= 1, got {g.max_new_tokens}")
    _need(g.temperature > 0, f"{prefix}.temperature must be > 0, got {g.temperature}")
    _need(g.top_k >= 0, f"{prefix}.top_k must be >= 0 (0 = off), got {g.top_k}")
    _need(0 < g.top_p <= 1, f"{prefix}.top_p must be in (0, 1], got {g.top_p}")
    _need(g.batch_size >= 1, f"{prefix}.batch_size must be >= 1, got {g.batch_size}")
    if g.judge is not None:
        load_function(g.judge, f"{prefix}.judge")  # ConfigError naming eval.judge when not importable / callable


def fit_micro(micro: int, batch: int, world: int, key: str, batch_key: str) -> int:
    """A micro-batch is at most what one rank holds of the batch it splits: more ranks than the
    defaults were written for (32 rows on 1 rank) lower it to `batch / world` (logged), so the
    defaults run as they are under torchrun; a micro-batch that fits is kept as given."""
    if micro >= 1 and micro * world > batch and batch % world == 0 and batch >= world:
        logging.getLogger("rlhf").info("%s: %d -> %d (%s=%d over %d ranks)", key, micro, batch // world, batch_key,
                                       batch, world)
        return batch // world
    return micro


def validate_cadence(t: CadenceConfig, prefix: str = "train") -> None:
    """The keys every stage's train group has: its length, log / eval / save cadence, skips, resume."""
    _need(t.epochs >= 1 or t.max_steps > 0, f"{prefix}.epochs must be >= 1 (or set {prefix}.max_steps), got {t.epochs}")
    _need(t.max_steps >= 0, f"{prefix}.max_steps must be >= 0 (0 = run all epochs), got {t.max_steps}")
    for key in ("eval_every", "save_every", "keep_last_n"):
        _need(getattr(t, key) >= 0, f"{prefix}.{key} must be >= 0, got {getattr(t, key)}")
    _need(t.log_every >= 1, f"{prefix}.log_every must be >= 1, got {t.log_every}")
    _need(t.max_consecutive_skips >= 1, f"{prefix}.max_consecutive_skips must be >= 1, got {t.max_consecutive_skips}")
    _need(isinstance(t.resume, (bool, str)),
          f"{prefix}.resume must be true, false, auto or a checkpoint path, got {t.resume!r}")


def validate_train(t: TrainConfig, world_size: int, prefix: str = "train") -> int:
    """Check ranges and global = micro x accumulation x world; returns the accumulation steps."""
    validate_cadence(t, prefix)
    _need(t.micro_batch_size >= 1, f"{prefix}.micro_batch_size must be >= 1, got {t.micro_batch_size}")
    t.micro_batch_size = fit_micro(t.micro_batch_size, t.global_batch_size, world_size, f"{prefix}.micro_batch_size",
                                   f"{prefix}.global_batch_size")
    per_step = t.micro_batch_size * world_size
    _need(
        t.global_batch_size >= per_step and t.global_batch_size % per_step == 0,
        f"{prefix}.global_batch_size ({t.global_batch_size}) must be a multiple of {prefix}.micro_batch_size "
        f"({t.micro_batch_size}) x world size ({world_size}) = {per_step}",
    )
    _need(t.warmup_steps >= 0, f"{prefix}.warmup_steps must be >= 0, got {t.warmup_steps}")
    return t.global_batch_size // per_step


def optim_config(t: OptimGroupConfig, prefix: str = "train") -> OptimConfig:
    """The engine's OptimConfig of an optimizer group (train, actor, critic); errors name `prefix`.*."""
    if len(t.betas) != 2:
        raise ConfigError(f"{prefix}.betas must be two numbers, got {t.betas}")
    return OptimConfig(
        lr=t.lr, weight_decay=t.weight_decay, betas=(float(t.betas[0]), float(t.betas[1])), eps=t.eps,
        scheduler=t.scheduler, warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio, grad_clip=t.grad_clip,
    )


def check_optim(t: OptimGroupConfig, prefix: str = "train") -> None:
    try:
        validate_optim_config(optim_config(t, prefix), total_steps=1)
    except ValueError as e:
        raise ConfigError(str(e).replace("optim.", f"{prefix}.")) from None


def engine_config(e: EngineConfig, info, *, frozen: bool = False) -> EngineConfig:
    """The `engine` group as the engine takes it: precision "auto" resolved for this device, validated."""
    _need(e.precision in PRECISIONS, f"engine.precision must be one of {PRECISIONS}, got {e.precision!r}")
    cfg = resolve_precision(e, info.device)
    try:
        validate_engine_config(cfg, info, frozen=frozen)
    except ValueError as e2:
        raise ConfigError(str(e2)) from None
    return cfg


def validate_stage(cfg: StageConfig, info) -> int:
    """The keys every row-trained stage has (output_dir, seed, model, data, logger, train, engine), checked
    before any model loads; returns the accumulation steps."""
    _need(bool(cfg.output_dir), "output_dir must be set")
    _need(cfg.seed >= 0, f"seed must be >= 0, got {cfg.seed}")
    _need(cfg.engine.placement == "colocated", f"engine.placement={cfg.engine.placement}: a split placement (ranks that "
          "only generate) is for RL, python -m rlhf.ppo; this stage trains on every rank")
    validate_model(cfg.model)
    validate_attention(cfg.model, cfg.engine, info)
    validate_data(cfg.data)
    validate_logger(cfg.logger)
    check_optim(cfg.train)
    engine_config(cfg.engine, info)
    return validate_train(cfg.train, info.world_size)


def validate_sft(cfg: SFTConfig, info) -> int:
    """Everything an SFT run needs, checked before any model loads; returns accumulation steps."""
    _need(not cfg.data.shared_prompts, "data.shared_prompts=true shares a pair's prompt between its two rows "
          "(python -m rlhf.reward, rlhf.dpo); an SFT row has no partner: leave it null")
    _need(cfg.starts.n >= 1, f"starts.n is the number of starts compared (1 = the one start of `seed`), got {cfg.starts.n}")
    _need(cfg.starts.n == 1 or cfg.starts.steps >= 1,
          f"starts.steps is how many steps each of the starts.n={cfg.starts.n} starts trains before they are "
          f"compared (>= 1), got {cfg.starts.steps}")
    return _validate_generating_stage(cfg, info)


def _validate_generating_stage(cfg: SFTConfig, info) -> int:
    validate_generation(cfg.eval, "eval")
    deterministic_notes(cfg.engine, cfg.eval)
    return validate_stage(cfg, info)


# the pair stages' log line when data.shared_prompts resolves to on or auto
SHARED_LINE = {True: "each pair's prompt runs once per forward, its two rows on its KV cache (data.shared_prompts=true)",
               None: "each pair's prompt runs once per forward, its two rows on its KV cache, in the micro-batches where "
                     "that computes the fewest token positions (data.shared_prompts=null; false = never)"}


def pair_shared_prompts(d: DataConfig, e: EngineConfig) -> bool | None:
    """data.shared_prompts resolved for a pair stage (reward, dpo): True (every micro-batch), False (none), or
    None (auto: the micro-batches where it computes the fewest token slots, rlhf/data/packing.py pair_layout).
    null is auto unless data.packing=true packs every batch or engine.activation_checkpointing recomputes
    blocks (which then keep no KV cache): then off; true with either is a ConfigError."""
    flag = d.shared_prompts
    if flag and d.packing is True:
        raise ConfigError("data.shared_prompts=true runs each pair's prompt once on a padded batch, and "
                          "data.packing=true packs the rows without padding: set one of them false")
    if flag and e.activation_checkpointing:
        raise ConfigError("data.shared_prompts=true runs each pair's responses on their prompt's KV cache, which "
                          "a block under engine.activation_checkpointing does not keep: set one of them false")
    if flag is None:
        return False if d.packing is True or e.activation_checkpointing else None
    return bool(flag)


def validate_reward(cfg: RewardConfig, info) -> int:
    """Everything a reward run needs, checked before any model loads; returns accumulation steps."""
    _need(math.isfinite(cfg.reward.margin), f"reward.margin must be a finite number (the pairwise loss's margin), "
          f"got {cfg.reward.margin}")
    _need(cfg.reward.score_reg >= 0, f"reward.score_reg must be >= 0, got {cfg.reward.score_reg}")
    std = cfg.reward.head_init_std
    _need(std is None or std >= 0, f"reward.head_init_std must be >= 0 (0 = zeros) or null, got {std}")
    f = cfg.reward.head_only_fraction
    _need(0 <= f < 1, f"reward.head_only_fraction must be in [0, 1) (0 = off), got {f}")
    pair_shared_prompts(cfg.data, cfg.engine)
    return validate_stage(cfg, info)


def rollout_rows(r: RolloutConfig) -> int:
    """Rows (sampled responses) per RL step, over every rank."""
    return r.prompts_per_step * r.n_samples_per_prompt


def trainer_truncation(cfg: PPOConfig) -> tuple[int, float] | None:
    """ppo.trainer_logprobs=sampler with a truncating sampler: (rollout.top_k, rollout.top_p), the truncation the
    trainer's log-probs are taken under; None (the full distribution) otherwise."""
    r = cfg.rollout
    if cfg.ppo.trainer_logprobs != "sampler" or (r.top_k == 0 and r.top_p >= 1.0):
        return None
    return r.top_k, r.top_p


def score_batch_size(r: RolloutConfig, world_size: int) -> int:
    """Rows per no-grad scoring forward on one rank: rollout.score_batch_size, null = 2 x the training
    micro-batch (no activations are kept for a backward), at most the step's rows per rank."""
    per_rank = rollout_rows(r) // world_size
    return min(r.score_batch_size or 2 * r.micro_batch_size, max(per_rank, 1))


def trained_row_tokens(cfg) -> int:
    """The longest row an RL update trains on: the prompt and the response, or (rollout.env, multi-turn) the
    episode's token budget (rollout.max_episode_tokens, null = max_turns x max_new_tokens)."""
    r = cfg.rollout
    return cfg.data.max_prompt_len + ((r.max_episode_tokens or r.max_turns * r.max_new_tokens) if r.env
                                      else r.max_new_tokens)


def score_batch_tokens(r: RolloutConfig) -> int | None:
    """Tokens per no-grad scoring forward on one rank with rollout.micro_batch_tokens (None: row counts): the
    update's budget times the rows' ratio, rollout.score_batch_size / rollout.micro_batch_size (null: 2)."""
    if r.micro_batch_tokens is None:
        return None
    return r.micro_batch_tokens * (r.score_batch_size or 2 * r.micro_batch_size) // r.micro_batch_size


def shared_prompts(cfg) -> bool:
    """rollout.shared_prompt_forward resolved: null = on unless data.packing=true packs the RL forwards."""
    flag = cfg.rollout.shared_prompt_forward
    if flag and cfg.data.packing is True:
        raise ConfigError("rollout.shared_prompt_forward=true runs each shared prompt once on a padded batch, and "
                          "data.packing=true packs the RL forwards without padding: set one of them false")
    if cfg.rollout.length_buckets is not None:
        _need(cfg.rollout.length_buckets >= 1, f"rollout.length_buckets must be >= 1 or null (auto), got "
              f"{cfg.rollout.length_buckets}")
        _need(flag is not False and cfg.data.packing is not True, "rollout.length_buckets splits the forwards of rows "
              "that share a prompt (rollout.shared_prompt_forward), which is off here: leave it null")
    return cfg.data.packing is not True if flag is None else bool(flag)


# ppo.old_logprobs: the actor's scoring forward every step | the sampler's log-probs | chosen by the measured gap
OLD_LOGPROBS = ("recompute", "sampler", "auto")


def validate_dpo(cfg: DPOConfig, info) -> int:
    """Everything a DPO run needs, checked before any model loads; returns accumulation steps."""
    p = cfg.dpo
    kinds = LOSS_TYPES + UNPAIRED_LOSS_TYPES
    _need(p.loss_type in kinds, f"dpo.loss_type must be one of {kinds}, got {p.loss_type!r}")
    _need(p.beta > 0, f"dpo.beta must be > 0, got {p.beta}")
    _need(0 <= p.label_smoothing < 0.5, f"dpo.label_smoothing must be in [0, 0.5), got {p.label_smoothing}")
    _need(p.label_smoothing == 0 or p.loss_type in ("sigmoid", "robust"),
          f"dpo.label_smoothing applies to dpo.loss_type=sigmoid or robust, not {p.loss_type!r}")
    _need(p.gamma == 0 or p.loss_type == "simpo", f"dpo.gamma applies to dpo.loss_type=simpo, not {p.loss_type!r}")
    _need(p.sft_coef >= 0, f"dpo.sft_coef must be >= 0, got {p.sft_coef}")
    for key in ("desirable_weight", "undesirable_weight"):
        value = getattr(p, key)
        _need(value > 0 and math.isfinite(value), f"dpo.{key} must be a finite number > 0, got {value}")
        _need(value == 1 or p.loss_type == "kto", f"dpo.{key} applies to dpo.loss_type=kto, not {p.loss_type!r}")
    _need(p.reference in ("precompute", "online"), f"dpo.reference must be 'precompute' or 'online', got {p.reference!r}")
    pair_shared_prompts(cfg.data, cfg.engine)
    return _validate_generating_stage(cfg, info)  # the keys DPO shares with SFT: model, data, eval, train, engine


def validate_ppo(cfg: PPOConfig, info) -> None:
    """Everything a PPO run needs, checked before any model loads."""
    _need(bool(cfg.output_dir), "output_dir must be set")
    _need(cfg.seed >= 0, f"seed must be >= 0, got {cfg.seed}")
    for key in ("actor", "critic"):
        group = getattr(cfg, key)
        _need(bool(group.model), f"{key}.model must be set (a HF directory, hub name or a stage's output_dir)")
        check_model_path(group.model, f"{key}.model")
        validate_model(dataclasses_replace(cfg.model, name_or_path=group.model, lora=group.lora,
                                           fallback_to_config=False), prefix=key)
        check_optim(group, prefix=key)
    for key in ("reference", "reward_model", "teacher"):
        check_model_path(getattr(cfg, key).model, f"{key}.model")
    validate_data(cfg.data, needs_response=False)
    validate_logger(cfg.logger)
    validate_generation(cfg.eval, "eval")
    validate_attention(cfg.model, cfg.engine, info)
    deterministic_notes(cfg.engine, cfg.eval)
    p, r = cfg.ppo, cfg.rollout
    _need(p.kl_coef >= 0, f"ppo.kl_coef must be >= 0, got {p.kl_coef}")
    _need(p.kl_estimator in KL_ESTIMATORS, f"ppo.kl_estimator must be one of {KL_ESTIMATORS}, got {p.kl_estimator!r}")
    if p.adaptive_kl:  # it moves ppo.kl_coef, or ppo.kl_loss_coef when the KL is in the loss alone
        key, start = ("kl_loss_coef", p.kl_loss_coef) if not p.kl_coef and p.kl_loss_coef > 0 else ("kl_coef", p.kl_coef)
        _need(p.kl_target > 0 and p.kl_horizon > 0, "ppo.kl_target and ppo.kl_horizon must be > 0 with ppo.adaptive_kl")
        _need(p.kl_coef_min is None or 0 <= p.kl_coef_min <= start, "ppo.kl_coef_min (the adaptive coefficient's "
              f"floor) must be between 0 and ppo.{key}={start} (where the controller starts), or null (= "
              f"ppo.{key}), got {p.kl_coef_min}")
    else:
        _need(p.kl_coef_min in (0, None), f"ppo.kl_coef_min={p.kl_coef_min} is the floor of the adaptive KL coefficient: "
              "it needs ppo.adaptive_kl=true (with a fixed coefficient, set ppo.kl_coef)")
    _need(p.advantage_estimator in ADVANTAGE_ESTIMATORS, f"ppo.advantage_estimator must be one of "
          f"{tuple(ADVANTAGE_ESTIMATORS)} (registered in rlhf/algos/rl.py), got {p.advantage_estimator!r}")
    est = ADVANTAGE_ESTIMATORS[p.advantage_estimator]
    # An outcome estimator (token_rewards=False) with ppo.kl_coef > 0 reads score - kl_coef x the response's
    # summed KL (RLOO's KL in the reward; rlhf/rl/experience.py); kl_coef=0 leaves the score as it is.
    policy_loss_fn(p.policy_loss)  # ConfigError naming ppo.policy_loss and the registered losses
    _need(p.is_correction in IS_CORRECTIONS, f"ppo.is_correction must be one of {IS_CORRECTIONS}, got {p.is_correction!r}")
    _need(p.trainer_logprobs in ("full", "sampler"), f"ppo.trainer_logprobs must be full or sampler, got "
          f"{p.trainer_logprobs!r}")
    _need(p.trainer_logprobs == "full" or not cfg.engine.kernels, "ppo.trainer_logprobs=sampler truncates the "
          "logits by top-k / top-p, which the fused log-prob kernel (engine.kernels=true) does not: set one of them off")
    _need(p.is_level in IS_LEVELS, f"ppo.is_level must be one of {IS_LEVELS}, got {p.is_level!r}")
    _need(math.isfinite(p.is_cap) and p.is_cap > 0, f"ppo.is_cap must be a finite number > 0 (the TIS cap), got {p.is_cap}")
    _need(0 <= p.is_low < 1 < p.is_high and math.isfinite(p.is_high),
          f"ppo.is_low and ppo.is_high must satisfy 0 <= is_low < 1 < is_high (finite): the MIS bounds around "
          f"ratio 1, got [{p.is_low}, {p.is_high}]")
    shared_prompts(cfg)  # rollout.shared_prompt_forward=true with data.packing=true: a ConfigError
    _need(cfg.data.shared_prompts is None, "data.shared_prompts is the pair stages' (python -m rlhf.reward, "
          "rlhf.dpo); the RL stage's rows share prompts under rollout.shared_prompt_forward")
    _need(p.old_logprobs in OLD_LOGPROBS, f"ppo.old_logprobs must be one of {OLD_LOGPROBS}, got {p.old_logprobs!r}")
    _need(math.isfinite(p.old_logprobs_max_gap) and p.old_logprobs_max_gap >= 0,
          f"ppo.old_logprobs_max_gap must be a finite number >= 0 (nats per token), got {p.old_logprobs_max_gap}")
    _need(p.old_logprobs_check_every >= 1, f"ppo.old_logprobs_check_every must be >= 1 (steps), got "
          f"{p.old_logprobs_check_every}")
    _need(p.old_logprobs != "sampler" or p.is_correction == "none",
          f"ppo.old_logprobs=sampler takes the old log-probs from the sampler, so ppo.is_correction={p.is_correction} "
          "would weigh every token by exp(logp_gen - logp_gen) = 1: the correction needs the trainer's log-probs "
          "beside the sampler's (ppo.old_logprobs=recompute, or auto, which then recomputes every step)")
    longest = cfg.data.max_prompt_len + r.max_new_tokens
    _need(r.micro_batch_tokens is None or r.micro_batch_tokens >= longest,
          f"rollout.micro_batch_tokens must be null (row counts) or >= data.max_prompt_len + rollout.max_new_tokens "
          f"= {longest} (one whole row per forward), got {r.micro_batch_tokens}")
    _need(r.score_batch_size is None or r.score_batch_size >= 1,
          f"rollout.score_batch_size must be >= 1 (null = 2 x rollout.micro_batch_size), got {r.score_batch_size}")
    _need(0 <= p.overlong_buffer < r.max_new_tokens,
          f"ppo.overlong_buffer must be in [0, rollout.max_new_tokens={r.max_new_tokens}) (0 = off), got {p.overlong_buffer}")
    _need(math.isfinite(p.overlong_penalty) and p.overlong_penalty >= 0,
          f"ppo.overlong_penalty must be a finite number >= 0, got {p.overlong_penalty}")
    _need(p.kl_loss_coef >= 0, f"ppo.kl_loss_coef must be >= 0 (0 = no KL loss), got {p.kl_loss_coef}")
    _need(p.kl_loss_estimator in KL_ESTIMATORS,
          f"ppo.kl_loss_estimator must be one of {KL_ESTIMATORS}, got {p.kl_loss_estimator!r}")
    _need(p.loss_agg in LOSS_AGGREGATIONS, f"ppo.loss_agg must be one of {LOSS_AGGREGATIONS}, got {p.loss_agg!r}")
    _need(p.clip_reward_value > 0, f"ppo.clip_reward_value must be > 0, got {p.clip_reward_value}")
    _need(0 <= p.gamma <= 1 and 0 <= p.lam <= 1, f"ppo.gamma and ppo.lam must be in [0, 1], got {p.gamma}, {p.lam}")
    _need(p.cliprange > 0 and p.cliprange_value > 0, "ppo.cliprange and ppo.cliprange_value must be > 0")
    for key in ("cliprange_low", "cliprange_high"):
        v = getattr(p, key)
        _need(v is None or v > 0, f"ppo.{key} must be > 0 (null = ppo.cliprange), got {v}")
    _need(p.ppo_epochs >= 1, f"ppo.ppo_epochs must be >= 1, got {p.ppo_epochs}")
    _need(p.ptx_coef >= 0, f"ppo.ptx_coef must be >= 0, got {p.ptx_coef}")
    _need(0 <= p.ema_decay < 1, f"ppo.ema_decay must be in [0, 1) (0 = off), got {p.ema_decay}")
    _need(r.max_new_tokens >= 1, f"rollout.max_new_tokens must be >= 1, got {r.max_new_tokens}")
    _need(r.temperature > 0, f"rollout.temperature must be > 0, got {r.temperature}")
    _need(r.top_k >= 0 and 0 < r.top_p <= 1, "rollout.top_k must be >= 0 and rollout.top_p in (0, 1]")
    w = info.world_size
    for key in ("prompts_per_step", "n_samples_per_prompt", "mini_batch_size", "micro_batch_size"):
        _need(getattr(r, key) >= 1, f"rollout.{key} must be >= 1, got {getattr(r, key)}")
    if est.needs_group:  # a group of one is its own baseline: advantage 0, actor_loss 0 every step
        _need(r.n_samples_per_prompt >= 2, f"ppo.advantage_estimator={p.advantage_estimator} scores each response "
              "against the others of its prompt, so with one response per prompt every advantage is 0 and nothing "
              f"is learnt: it needs rollout.n_samples_per_prompt >= 2, got {r.n_samples_per_prompt} (algorithm="
              f"{p.advantage_estimator} sets 8)")
    if p.dynamic_sampling:
        _need(r.n_samples_per_prompt >= 2, "ppo.dynamic_sampling drops prompt groups whose scores are all equal: "
              f"it needs rollout.n_samples_per_prompt >= 2, got {r.n_samples_per_prompt}")
    # Batch sizes: prompts_per_step counts prompts; every other size counts rows (sampled responses).
    # Each rank answers whole prompts (all n samples of a prompt on one rank), so a group never spans ranks.
    _need(r.prompts_per_step % w == 0, f"rollout.prompts_per_step ({r.prompts_per_step}) must be a multiple of "
          f"the world size ({w}): each rank samples every response of its own prompts")
    r.micro_batch_size = fit_micro(r.micro_batch_size, r.mini_batch_size, w, "rollout.micro_batch_size",
                                   "rollout.mini_batch_size")
    _need(r.mini_batch_size % (r.micro_batch_size * w) == 0,
          f"rollout.mini_batch_size ({r.mini_batch_size}) must be a multiple of rollout.micro_batch_size "
          f"({r.micro_batch_size}) x world size ({w})")
    rows = rollout_rows(r)
    what = (f"rollout.prompts_per_step ({r.prompts_per_step})" if r.n_samples_per_prompt == 1 else
            f"the rows per step, rollout.prompts_per_step x rollout.n_samples_per_prompt "
            f"({r.prompts_per_step} x {r.n_samples_per_prompt} = {rows}),")
    _need(rows % r.mini_batch_size == 0,
          f"{what} must be a multiple of rollout.mini_batch_size ({r.mini_batch_size}, rows)")
    validate_cadence(cfg.train)
    validate_best(cfg.train, cfg.ppo.objective)
    validate_reward_sources(cfg.reward)
    validate_alarms(cfg.alarms)
    validate_objective(cfg)
    validate_env(r, p.objective)
    validate_split(cfg)
    engine_config(cfg.engine, info)


def validate_best(t: PPOTrainConfig, objective: str = "rl") -> None:
    """train.export_best / train.early_stop_patience / train.kl_budget: a count >= 0, a budget > 0, and
    evaluations to choose by."""
    _need(t.kl_budget is None or (isinstance(t.kl_budget, (int, float)) and not isinstance(t.kl_budget, bool)
                                  and math.isfinite(t.kl_budget) and t.kl_budget > 0),
          f"train.kl_budget is the held-out KL to the reference a run may reach (nats, > 0; null = no budget), "
          f"got {t.kl_budget!r}")
    _need(t.kl_budget is None or objective != "distill",
          "train.kl_budget bounds the KL to the reference; algorithm=distill has none (its held-out kl is the "
          "student's KL to the teacher, which it minimises): drop train.kl_budget")
    _need(t.kl_budget is None or t.eval_every > 0,
          f"train.kl_budget is checked at the held-out evaluations every train.eval_every steps: set "
          f"train.eval_every > 0, got {t.eval_every}")
    _need(isinstance(t.early_stop_patience, int) and not isinstance(t.early_stop_patience, bool)
          and t.early_stop_patience >= 0, f"train.early_stop_patience must be an integer >= 0 (evaluations without "
          f"a better held-out score; 0 = never stop early), got {t.early_stop_patience!r}")
    _need(not (t.export_best or t.early_stop_patience) or t.eval_every > 0,
          f"train.export_best / train.early_stop_patience choose by the held-out evaluations every train.eval_every "
          f"steps: set train.eval_every > 0, got {t.eval_every}")


ROLLOUT_MODES = ("sync", "async")


def validate_split(cfg: PPOConfig) -> None:
    """rollout.mode / rollout.max_staleness and what engine.placement=split supports (docs/engine.md)."""
    r, e, p = cfg.rollout, cfg.engine, cfg.ppo
    _need(r.mode in ROLLOUT_MODES, f"rollout.mode must be one of {ROLLOUT_MODES}, got {r.mode!r}")
    _need(not isinstance(r.max_staleness, bool) and isinstance(r.max_staleness, int) and r.max_staleness >= 0,
          f"rollout.max_staleness must be an integer >= 0 (steps; 0 = synchronous), got {r.max_staleness!r}")
    _need(r.mode == "sync" or e.placement == "split", "rollout.mode=async overlaps generation on some ranks with "
          "training on the others: it needs engine.placement=split (and engine.generation_ranks)")
    if e.placement != "split":
        return
    _need(e.generation in ("auto", "hf", "vllm"), f"engine.placement=split: the generation ranks run transformers "
          f"generate on their copy of the model, or a vLLM engine fed from it (the injected layout is not streamed "
          f"yet): engine.generation={e.generation} is not supported, use auto, hf or vllm")
    _need(p.objective == "rl", f"engine.placement=split runs ppo.objective=rl (PPO, GRPO, RLOO, REINFORCE++), "
          f"not {p.objective}")
    if r.mode == "async" and r.max_staleness > 0:
        _need(p.old_logprobs != "sampler", "rollout.mode=async with rollout.max_staleness > 0 samples with weights "
              "older than those trained: ppo.old_logprobs=sampler would take the stale policy's log-probs as the old "
              "ones; use recompute or auto (recomputed on every step in async mode)")


OBJECTIVES = ("rl", "online_dpo", "distill")  # ppo.objective; algorithm=online_dpo / distill set the others


def validate_objective(cfg: PPOConfig) -> None:
    """ppo.objective and the keys it reads: online_dpo.* (online DPO), teacher.* (distillation)."""
    p, r, o = cfg.ppo, cfg.rollout, cfg.online_dpo
    _need(p.objective in OBJECTIVES, f"ppo.objective must be one of {OBJECTIVES}, got {p.objective!r}")
    est = ADVANTAGE_ESTIMATORS[p.advantage_estimator]
    if p.objective == "online_dpo":
        _need(r.n_samples_per_prompt >= 2, "ppo.objective=online_dpo pairs the best and the worst response to each "
              f"prompt: it needs rollout.n_samples_per_prompt >= 2, got {r.n_samples_per_prompt}")
        _need(not est.needs_critic, f"ppo.objective=online_dpo trains no critic, but ppo.advantage_estimator="
              f"{p.advantage_estimator} would load one: use algorithm=online_dpo (it sets a critic-free one)")
        _need(o.loss_type in PAIR_LOSSES, f"online_dpo.loss_type must be one of {PAIR_LOSSES}, got {o.loss_type!r}")
        _need(math.isfinite(o.beta) and o.beta > 0, f"online_dpo.beta must be > 0, got {o.beta}")
        _need(math.isfinite(o.sft_coef) and o.sft_coef >= 0, f"online_dpo.sft_coef must be >= 0, got {o.sft_coef}")
        for key in ("kl_coef", "kl_loss_coef", "ptx_coef"):  # the DPO loss is the whole actor loss
            _need(getattr(p, key) == 0, f"ppo.{key} must be 0 with ppo.objective=online_dpo (the DPO loss, its KL "
                  f"to the reference in online_dpo.beta, is the whole actor loss), got {getattr(p, key)}")
        _need(p.is_correction == "none", f"ppo.is_correction={p.is_correction} weighs the policy-gradient loss by the "
              "sampler/trainer ratio; ppo.objective=online_dpo trains on the DPO loss, which has none: set "
              "ppo.is_correction=none")
    if p.objective == "distill":
        _need(bool(cfg.teacher.model), "ppo.objective=distill (algorithm=distill) needs teacher.model: the frozen "
              "causal LM (a HF directory or a stage's output_dir, e.g. a PPO run's) whose per-token log-probs the "
              "student is trained towards")
        _need(p.kl_coef > 0, "ppo.kl_coef is the weight of the per-token reverse KL to the teacher, the only reward "
              f"of ppo.objective=distill: it must be > 0, got {p.kl_coef}")
        _need(not p.adaptive_kl, "ppo.adaptive_kl would move the distillation weight (ppo.kl_coef) towards "
              "ppo.kl_target: not with ppo.objective=distill")
        rw = cfg.reward
        _need(list(rw.sources) == ["model"] and not rw.weights and rw.function is None,
              "reward.sources/weights/function are not read by ppo.objective=distill (the per-token reverse KL to "
              f"teacher.model is the only reward; no reward model is loaded): leave them unset, got "
              f"sources={list(rw.sources)}, weights={list(rw.weights)}, function={rw.function!r}")
    else:
        _need(cfg.teacher.model is None, f"teacher.model is read only by algorithm=distill (ppo.objective=distill), "
              f"not by ppo.objective={p.objective}: unset it, or use algorithm=distill")
    _need(p.objective != "distill" or cfg.reference.model is None,
          "reference.model is not read by ppo.objective=distill (the teacher takes the reference's place): unset it")


def validate_reward_sources(rw: RewardSourcesConfig) -> None:
    """Known, distinct sources; one finite weight each; reward.function importable iff the function source."""
    _need(len(rw.sources) >= 1, f"reward.sources must name at least one of {REWARD_SOURCES}")
    for name in rw.sources:
        _need(name in REWARD_SOURCES, f"reward.sources: unknown source {name!r}; choose from {REWARD_SOURCES}")
    _need(len(set(rw.sources)) == len(rw.sources), f"reward.sources names a source twice: {list(rw.sources)}")
    _need(not rw.weights or len(rw.weights) == len(rw.sources),
          f"reward.weights has {len(rw.weights)} weights for {len(rw.sources)} reward.sources {list(rw.sources)}")
    _need(all(math.isfinite(w) for w in rw.weights), f"reward.weights must be finite numbers, got {list(rw.weights)}")
    if "function" in rw.sources:
        load_function(rw.function)  # ConfigError naming reward.function when not importable / callable
    else:
        _need(rw.function is None, f"reward.function={rw.function!r} is set but 'function' is not in "
                                   f"reward.sources {list(rw.sources)} (add it, e.g. reward.sources=[function])")
    validate_reward_ensemble(rw)
    if "http" in rw.sources:
        validate_http_source(rw)
    else:
        _need(rw.url is None, f"reward.url={rw.url!r} is set but 'http' is not in reward.sources {list(rw.sources)} "
                              f"(add it, e.g. reward.sources=[http])")


def validate_reward_ensemble(rw: RewardSourcesConfig) -> None:
    """reward.ensemble_*: an aggregate by name, a finite lambda >= 0, models only with the model source."""
    _need(rw.ensemble_agg in REWARD_ENSEMBLE_AGGREGATES, f"reward.ensemble_agg must be one of "
          f"{REWARD_ENSEMBLE_AGGREGATES}, got {rw.ensemble_agg!r}")
    _need(isinstance(rw.ensemble_lambda, (int, float)) and math.isfinite(rw.ensemble_lambda) and rw.ensemble_lambda >= 0,
          f"reward.ensemble_lambda must be a finite number >= 0, got {rw.ensemble_lambda!r}")
    models = list(rw.ensemble_models)
    _need(not models or "model" in rw.sources, f"reward.ensemble_models={models} scores beside the reward model, but "
          f"'model' is not in reward.sources {list(rw.sources)} (add it, or leave reward.ensemble_models empty)")
    _need(all(isinstance(m, str) and m for m in models), f"reward.ensemble_models must be paths (non-empty), got {models}")


def validate_http_source(rw: RewardSourcesConfig) -> None:
    """The http source's keys: a URL with a scheme and host, positive finite times, counts >= 1 (retries >= 0)."""
    url = rw.url or ""
    scheme, _, rest = url.partition("://")
    _need(scheme in ("http", "https") and bool(rest.split("/")[0]),
          f"reward.url must be the reward server's base URL, e.g. http://127.0.0.1:8000 (python -m rlhf.serve), "
          f"got {rw.url!r}")
    for key in ("timeout_s", "backoff_s", "down_timeout_s"):
        v = getattr(rw, key)
        _need(isinstance(v, (int, float)) and math.isfinite(v) and v > 0, f"reward.{key} must be a finite number of "
              f"seconds > 0, got {v!r}")
    for key, low in (("max_concurrency", 1), ("request_rows", 1), ("retries", 0)):
        v = getattr(rw, key)
        _need(isinstance(v, int) and v >= low, f"reward.{key} must be an integer >= {low}, got {v!r}")


def validate_env(r: RolloutConfig, objective: str = "rl") -> None:
    """The multi-turn keys (rollout.env and the ones it reads; rlhf/rl/multiturn.py). That the class is an
    Environment subclass is checked when the RL stage loads it (rlhf/rl/environments/base.py
    load_environment), before any model loads."""
    _need(r.max_turns >= 1, f"rollout.max_turns must be >= 1, got {r.max_turns}")
    _need(r.max_episode_tokens is None or r.max_episode_tokens >= 1,
          f"rollout.max_episode_tokens must be >= 1 (null = rollout.max_turns x rollout.max_new_tokens), "
          f"got {r.max_episode_tokens}")
    _need(isinstance(r.turn_stop, (list, tuple)) and all(isinstance(x, str) and x for x in r.turn_stop),
          f"rollout.turn_stop must be a list of non-empty strings (e.g. ['</call>']), got {r.turn_stop!r}")
    _need(r.env_workers >= 0, f"rollout.env_workers must be >= 0 (0 = the environments in this process), "
          f"got {r.env_workers}")
    _need(math.isfinite(r.env_timeout_s) and r.env_timeout_s > 0,
          f"rollout.env_timeout_s must be a finite number > 0 (seconds), got {r.env_timeout_s}")
    _need(0 <= r.max_env_failure_fraction <= 1,
          f"rollout.max_env_failure_fraction must be in [0, 1], got {r.max_env_failure_fraction}")
    if r.env is None:
        return
    load_function(r.env, "rollout.env")  # 'module:Class', importable (ConfigError naming rollout.env)
    _need(objective in ("rl",), f"rollout.env (multi-turn episodes) works with ppo.objective=rl, "
          f"got ppo.objective={objective}")


def validate_alarms(a: AlarmsConfig) -> None:
    _need(a.window >= 2, f"alarms.window must be >= 2 (steps in a trend), got {a.window}")
    for key in ("kl_slope", "length_drift", "clipfrac", "gold_drop"):
        _need(getattr(a, key) >= 0, f"alarms.{key} must be >= 0, got {getattr(a, key)}")
    _need(0 <= a.entropy_ratio <= 1, f"alarms.entropy_ratio must be in [0, 1], got {a.entropy_ratio}")
    _need(0 <= a.tool_collapse <= 1, f"alarms.tool_collapse must be in [0, 1], got {a.tool_collapse}")
    _need(math.isfinite(a.gen_kl) and a.gen_kl > 0,
          f"alarms.gen_kl must be a finite number > 0 (nats per token), got {a.gen_kl}")
    _need(math.isfinite(a.disagreement_ratio) and a.disagreement_ratio > 1, f"alarms.disagreement_ratio must be a "
          f"finite number > 1 (a growth of the reward ensemble's std over its baseline), got {a.disagreement_ratio}")


def unused_sources(cfg: PPOConfig | ServeConfig) -> set[str]:
    """Model keys a PPO run will not read: critic.model without a critic, unless it is the reward
    model's default path and the reward model is a reward source; rlhf.serve's reward.model unless it
    serves the model."""
    if isinstance(cfg, ServeConfig):
        return set() if cfg.reward.source not in SERVED_REWARDS or served_source(cfg.reward) == "model" else \
            {"reward.model"}
    est = ADVANTAGE_ESTIMATORS.get(cfg.ppo.advantage_estimator)
    needs_rm = "model" in cfg.reward.sources and cfg.ppo.objective != "distill"  # distillation: no reward model
    if est is not None and not est.needs_critic and not (needs_rm and cfg.reward_model.model is None):
        return {"critic.model"}
    return set()


EVALUATE_MODES = ("auto", "policy", "reward")


def validate_evaluate(cfg: EvaluateConfig, info) -> None:
    """Everything an evaluation needs, checked before any model loads."""
    _need(bool(cfg.output_dir), "output_dir must be set")
    _need(cfg.mode in EVALUATE_MODES, f"mode must be one of {EVALUATE_MODES}, got {cfg.mode!r}")
    _need(cfg.batch_size >= 1, f"batch_size must be >= 1, got {cfg.batch_size}")
    m = cfg.model
    _need(bool(m.name_or_path), "model.name_or_path must be set: the model to evaluate (a HF directory, "
                                "a hub name or a stage's output_dir such as outputs/sft)")
    _need(not m.fallback_to_config, "model.fallback_to_config must be false: evaluate a trained model, "
                                    "not one built with random weights")
    _need(m.lora.r == 0, f"model.lora.r must be 0 (an adapter directory is loaded merged), got {m.lora.r}")
    validate_model(m)
    validate_attention(m, cfg.engine, info)
    validate_data(cfg.data, needs_path=False)
    validate_logger(cfg.logger)
    validate_generation(cfg.eval, "eval")
    deterministic_notes(cfg.engine, cfg.eval)
    engine_config(cfg.engine, info)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def served_source(r) -> str:
    """reward.source of `python -m rlhf.serve` with auto resolved: function when reward.function is set, else model."""
    return ("function" if r.function else "model") if r.source == "auto" else r.source


def validate_serve(cfg: ServeConfig, info, api_key: str | None) -> str:
    """Everything `python -m rlhf.serve` needs, checked before any model loads (`api_key`: server.api_key or
    the environment's RLHF_REWARD_API_KEY); returns the reward source served (model | judge | function)."""
    _need(bool(cfg.output_dir), "output_dir must be set")
    r, s = cfg.reward, cfg.server
    _need(r.source in SERVED_REWARDS, f"reward.source must be one of {SERVED_REWARDS}, got {r.source!r}")
    source = served_source(r)
    if source == "function":
        _need(bool(r.function), "reward.source=function needs reward.function=module:function")
        load_function(r.function, "reward.function")
    else:
        _need(r.function is None, f"reward.function={r.function!r} is set but reward.source={r.source} serves "
                                  f"{source}: drop one of them")
    if source == "model":
        _need(bool(r.model), "reward.model must be set: the reward model to serve (a reward stage's output_dir, "
                             "e.g. outputs/reward, a HF directory or a hub name)")
        check_model_path(r.model, "reward.model")
        validate_model(dataclasses_replace(cfg.model, name_or_path=r.model, fallback_to_config=False), prefix="model")
        validate_attention(cfg.model, cfg.engine, info)
        validate_data(cfg.data, needs_path=False)
        engine_config(cfg.engine, info, frozen=True)
    _need(isinstance(s.host, str) and bool(s.host), f"server.host must be an address to bind, got {s.host!r}")
    _need(isinstance(s.port, int) and 0 <= s.port <= 65535, f"server.port must be in [0, 65535] (0 = a free one), "
          f"got {s.port!r}")
    _need(api_key is None or (isinstance(api_key, str) and len(api_key) >= 8),
          "server.api_key (or RLHF_REWARD_API_KEY) must be at least 8 characters")
    _need(api_key is not None or s.host in LOOPBACK_HOSTS,
          f"server.host={s.host} serves beyond this machine: set an API key (server.api_key, or the environment "
          f"variable RLHF_REWARD_API_KEY); without one only a loopback host ({', '.join(LOOPBACK_HOSTS)}) is served")
    for key in ("max_batch", "max_rows"):
        _need(isinstance(getattr(s, key), int) and getattr(s, key) >= 1,
              f"server.{key} must be an integer >= 1, got {getattr(s, key)!r}")
    for key, low in (("max_wait_ms", 0.0), ("max_body_mb", 1e-6), ("log_every_s", 1e-6)):
        v = getattr(s, key)
        _need(math.isfinite(v) and v >= low, f"server.{key} must be a finite number {'>= 0' if low == 0 else '> 0'}, "
              f"got {v!r}")
    return source
