"""Typed configuration of the stage apps: Hydra YAML (conf/) -> these dataclasses, once, at start.

Every key lives in the YAML with its default (so `--cfg job` shows everything); the dataclasses
are the schema: a misspelt key or a value of the wrong type fails in `to_config`, and `validate_*`
check ranges and the batch-size arithmetic, each error naming the key (`train.lr`, ...), before any
model is loaded. A function receives only the sub-config it uses.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

ROOT = Path(__file__).resolve().parents[1]  # the project checkout: conf/, data/, scripts/
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DTYPES = ("auto", "fp32", "bf16", "fp16")
T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key."""


def _root_path(sub: str = "") -> str:
    return str(ROOT / sub) if sub else str(ROOT)


if not OmegaConf.has_resolver("root"):
    # ${root:data/default/sft_train.jsonl} -> an absolute path inside the checkout, so the shipped
    # data is found from any working directory.
    OmegaConf.register_new_resolver("root", _root_path)


# ----------------------------------------------------------------------------- groups


@dataclass(kw_only=True)
class LoraConfig:
    r: int = 0  # 0 = no LoRA
    alpha: int = 16
    dropout: float = 0.0
    target_modules: Any = "all-linear"  # a list of module names, or "all-linear" (peft)
    only_adapters: bool = True  # train only the adapters (base frozen); false = base trains too
    merge_on_save: bool = True  # save the merged full model; false = peft adapter dir on the base


@dataclass(kw_only=True)
class ModelConfig:
    # A local HF directory, a hub name, or a previous stage's output directory (its model/ is
    # used); null = build from `config` with random weights.
    name_or_path: str | None = None
    tokenizer: str | None = None  # null = the tokenizer saved with name_or_path
    config: dict[str, Any] = field(default_factory=dict)  # HF config kwargs (model_type, sizes...)
    dtype: str = "auto"  # weights as loaded/stored for frozen models; trainable ones keep fp32 masters
    save_dtype: str = "fp32"  # dtype of the exported HF weights
    trust_remote_code: bool = False
    # When name_or_path is a local path that does not exist, build from `config` instead (logged).
    # The reward stage's default, so that it runs before the SFT stage has; off everywhere else.
    fallback_to_config: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass(kw_only=True)
class DataConfig:
    path: str = ""  # a .jsonl/.json/.parquet file, a directory, or a `datasets` hub name
    split: str = "train"  # for directories and hub names
    eval_path: str | None = None  # held-out rows; null = carve eval_fraction of `path` off
    eval_split: str = "test"  # split of eval_path when it is a directory or hub name
    eval_fraction: float = 0.02
    eval_prompts_path: str | None = None  # prompts (with `answer` or default-task) for the gold score
    num_eval_prompts: int = 200  # first N of eval_prompts_path; 0 = all
    data_split: Any = None  # "2,4,4" or [2,4,4]: this stage takes its share (DeepSpeed-Chat)
    split_seed: int = 1234
    max_len: int = 64  # tokens of prompt + response (+ bos/eos)
    max_prompt_len: int = 48
    overlong: str = "truncate"  # truncate | drop (see rlhf/data/tokenize.py)
    add_bos: bool = True
    cache_dir: str | None = None  # datasets cache for hub names


@dataclass(kw_only=True)
class EngineGroupConfig:
    stage: int = 0
    offload: bool = False
    precision: str = "auto"  # auto = bf16 on CUDA, fp32 on CPU
    activation_checkpointing: bool = False
    initial_loss_scale: float = 65536.0
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0
    find_unused_parameters: bool = False


@dataclass(kw_only=True)
class LoggerConfig:
    backend: str = "local"  # local | wandb (both write metrics.jsonl)
    project: str = "rlhf"
    entity: str | None = None
    name: str | None = None
    mode: str = "offline"  # wandb: online | offline | disabled


@dataclass(kw_only=True)
class TrainConfig:
    epochs: int = 1
    max_steps: int = 0  # > 0 caps the optimizer steps (also with several epochs)
    micro_batch_size: int = 32  # rows per forward on one rank
    global_batch_size: int = 32  # rows per optimizer step = micro x accumulation x world size
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    scheduler: str = "cosine"  # constant | linear | cosine
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    log_every: int = 10  # steps between metrics.jsonl records
    eval_every: int = 0  # steps between evaluations (0 = only before and after training)
    save_every: int = 0  # steps between sharded checkpoints (0 = none until the end)
    keep_last_n: int = 2
    resume: Any = False  # false | true (latest in output_dir/checkpoints) | a checkpoint path
    max_consecutive_skips: int = 20  # non-finite steps in a row before the run stops with an error


@dataclass(kw_only=True)
class GenerationConfig:
    max_new_tokens: int = 16
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    batch_size: int = 100


@dataclass(kw_only=True)
class SFTConfig:
    output_dir: str = "outputs/sft"
    seed: int = 1234
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineGroupConfig = field(default_factory=EngineGroupConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: GenerationConfig = field(default_factory=GenerationConfig)


@dataclass(kw_only=True)
class RewardLossConfig:
    margin: float = 0.0  # loss = -log sigmoid(r_chosen - r_rejected - margin)
    score_reg: float = 0.0  # + score_reg * (r_chosen^2 + r_rejected^2) / 2: keeps scores near 0


@dataclass(kw_only=True)
class RewardConfig:
    output_dir: str = "outputs/reward"
    seed: int = 1234
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineGroupConfig = field(default_factory=EngineGroupConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardLossConfig = field(default_factory=RewardLossConfig)


# ----------------------------------------------------------------------------- conversion


def to_config(cfg: DictConfig | dict, schema: type[T]) -> T:
    """Hydra's config -> the dataclass `schema`; unknown keys and wrong types raise ConfigError."""
    raw = OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg
    raw = OmegaConf.masked_copy(raw, [k for k in raw if k != "hydra"]) if "hydra" in raw else raw
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), raw)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        msg = str(e).splitlines()[0]
        raise ConfigError(f"config key {key!r}: {msg}" if key else f"config: {msg}") from None


def as_yaml(config: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def validate_model(m: ModelConfig, prefix: str = "model") -> None:
    if m.fallback_to_config and m.name_or_path is not None and not os.path.exists(m.name_or_path):
        _need(bool(m.config) and m.tokenizer is not None,
              f"{prefix}.name_or_path={m.name_or_path!r} does not exist and {prefix}.fallback_to_config needs "
              f"{prefix}.config and {prefix}.tokenizer to build a model instead")
        return
    _need(m.name_or_path is not None or bool(m.config), f"{prefix}.name_or_path or {prefix}.config must be set")
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


def validate_data(d: DataConfig, *, needs_response: bool = True) -> None:
    from rlhf.data.split import parse_data_split

    _need(bool(d.path), "data.path must be set (a file, a directory or a datasets hub name)")
    _need(0 <= d.eval_fraction < 1, f"data.eval_fraction must be in [0, 1), got {d.eval_fraction}")
    _need(d.num_eval_prompts >= 0, f"data.num_eval_prompts must be >= 0, got {d.num_eval_prompts}")
    _need(d.max_prompt_len >= 1, f"data.max_prompt_len must be >= 1, got {d.max_prompt_len}")
    if needs_response:
        _need(d.max_len > d.max_prompt_len,
              f"data.max_len ({d.max_len}) must exceed data.max_prompt_len ({d.max_prompt_len})")
    _need(d.overlong in ("truncate", "drop"), f"data.overlong must be 'truncate' or 'drop', got {d.overlong!r}")
    if d.data_split is not None:
        try:
            parse_data_split(d.data_split)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def validate_logger(lg: LoggerConfig) -> None:
    _need(lg.backend in ("local", "wandb"), f"logger.backend must be 'local' or 'wandb', got {lg.backend!r}")
    _need(lg.mode in ("online", "offline", "disabled"),
          f"logger.mode must be online, offline or disabled, got {lg.mode!r}")


def validate_generation(g: GenerationConfig, prefix: str) -> None:
    _need(g.max_new_tokens >= 1, f"{prefix}.max_new_tokens must be >= 1, got {g.max_new_tokens}")
    _need(g.temperature > 0, f"{prefix}.temperature must be > 0, got {g.temperature}")
    _need(g.top_k >= 0, f"{prefix}.top_k must be >= 0 (0 = off), got {g.top_k}")
    _need(0 < g.top_p <= 1, f"{prefix}.top_p must be in (0, 1], got {g.top_p}")
    _need(g.batch_size >= 1, f"{prefix}.batch_size must be >= 1, got {g.batch_size}")


def validate_train(t: TrainConfig, world_size: int, prefix: str = "train") -> int:
    """Check ranges and global = micro x accumulation x world; returns the accumulation steps."""
    _need(t.epochs >= 1 or t.max_steps > 0, f"{prefix}.epochs must be >= 1 (or set {prefix}.max_steps), got {t.epochs}")
    _need(t.max_steps >= 0, f"{prefix}.max_steps must be >= 0 (0 = run all epochs), got {t.max_steps}")
    _need(t.micro_batch_size >= 1, f"{prefix}.micro_batch_size must be >= 1, got {t.micro_batch_size}")
    per_step = t.micro_batch_size * world_size
    _need(
        t.global_batch_size >= per_step and t.global_batch_size % per_step == 0,
        f"{prefix}.global_batch_size ({t.global_batch_size}) must be a multiple of {prefix}.micro_batch_size "
        f"({t.micro_batch_size}) x world size ({world_size}) = {per_step}",
    )
    for key in ("log_every", "eval_every", "save_every", "keep_last_n", "warmup_steps"):
        _need(getattr(t, key) >= 0, f"{prefix}.{key} must be >= 0, got {getattr(t, key)}")
    _need(t.log_every >= 1, f"{prefix}.log_every must be >= 1, got {t.log_every}")
    _need(t.max_consecutive_skips >= 1, f"{prefix}.max_consecutive_skips must be >= 1")
    _need(isinstance(t.resume, (bool, str)), f"{prefix}.resume must be true, false or a checkpoint path, got {t.resume!r}")
    return t.global_batch_size // per_step


def optim_config(t: TrainConfig, prefix: str = "train"):
    """The engine's OptimConfig from a train group (engine errors re-raised naming `prefix`.*)."""
    from engine import OptimConfig

    if len(t.betas) != 2:
        raise ConfigError(f"{prefix}.betas must be two numbers, got {t.betas}")
    return OptimConfig(
        lr=t.lr, weight_decay=t.weight_decay, betas=(float(t.betas[0]), float(t.betas[1])), eps=t.eps,
        scheduler=t.scheduler, warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio, grad_clip=t.grad_clip,
    )


def check_optim(t: TrainConfig, prefix: str = "train") -> None:
    from engine import validate_optim_config

    try:
        validate_optim_config(optim_config(t, prefix), total_steps=1)
    except ValueError as e:
        raise ConfigError(str(e).replace("optim.", f"{prefix}.")) from None


def engine_config(e: EngineGroupConfig, info, *, frozen: bool = False):
    """The engine's EngineConfig (precision "auto" resolved for this device), validated."""
    from engine import EngineConfig, validate_engine_config

    _need(e.precision in PRECISIONS, f"engine.precision must be one of {PRECISIONS}, got {e.precision!r}")
    precision = e.precision
    if precision == "auto":
        precision = "bf16" if info.device.type == "cuda" else "fp32"
    cfg = EngineConfig(
        stage=e.stage, offload=e.offload, precision=precision, activation_checkpointing=e.activation_checkpointing,
        initial_loss_scale=e.initial_loss_scale, loss_scale_window=e.loss_scale_window,
        min_loss_scale=e.min_loss_scale, find_unused_parameters=e.find_unused_parameters,
    )
    try:
        validate_engine_config(cfg, info, frozen=frozen)
    except ValueError as e2:
        raise ConfigError(str(e2)) from None
    return cfg


def validate_sft(cfg: SFTConfig, info) -> int:
    """Everything an SFT run needs, checked before any model loads; returns accumulation steps."""
    _need(bool(cfg.output_dir), "output_dir must be set")
    validate_model(cfg.model)
    validate_data(cfg.data)
    validate_logger(cfg.logger)
    validate_generation(cfg.eval, "eval")
    check_optim(cfg.train)
    engine_config(cfg.engine, info)
    return validate_train(cfg.train, info.world_size)


def validate_reward(cfg: RewardConfig, info) -> int:
    """Everything a reward run needs, checked before any model loads; returns accumulation steps."""
    _need(bool(cfg.output_dir), "output_dir must be set")
    validate_model(cfg.model)
    validate_data(cfg.data)
    validate_logger(cfg.logger)
    _need(cfg.reward.score_reg >= 0, f"reward.score_reg must be >= 0, got {cfg.reward.score_reg}")
    check_optim(cfg.train)
    engine_config(cfg.engine, info)
    return validate_train(cfg.train, info.world_size)
