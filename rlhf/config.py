"""Typed configuration of the stage apps: Hydra YAML (conf/) -> these dataclasses, once, at start.

The dataclasses hold every key and its default: they are Hydra structured configs, stored in
Hydra's ConfigStore as `<stage>_schema` (`register_schemas`), and each conf/<stage>.yaml starts its
defaults list from its schema. The YAML holds only what differs: the config-group choices (model,
data, engine, logger; a group's option file holds only its own values), values that must win over a
group's (reward's model.name_or_path), `${...}` interpolations, and the hydra: settings. A misspelt
key or a value of the wrong type fails at composition (`compose`, rlhf/cli.py for the command line)
or in `to_config`; `validate_*` check ranges and the batch-size arithmetic, each error naming the key
(`train.lr`, ...), before any model is loaded. A function receives only the sub-config it uses. The
`engine` group's schema is the engine's own EngineConfig (engine/config.py), with precision "auto"
as the stages' default (`resolve_precision` makes it bf16 on CUDA and on bf16-capable CPUs, else fp32).

Each field's trailing `# comment` (else the comment block above it) is its one-line description in
`--help` (rlhf/cli.py): write one for every new field. `metadata={"hub": "model"|"dataset"}` marks
a key that may hold a hub name, checked up front when the hub is unreachable (rlhf/hub.py).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from dataclasses import replace as dataclasses_replace
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import II, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from engine.config import PRECISIONS as ENGINE_PRECISIONS
from engine.config import EngineConfig, resolve_precision

ROOT = Path(__file__).resolve().parents[1]  # the project checkout: conf/, data/, scripts/
PRECISIONS = ("auto", *ENGINE_PRECISIONS)
DTYPES = ("auto", "fp32", "bf16", "fp16")
T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key."""


def _root_path(sub: str = "") -> str:
    return str(ROOT / sub) if sub else str(ROOT)


def _tokenizer_unless_model(name_or_path: str | None, fallback_to_config: bool, tokenizer: str) -> str | None:
    """`tokenizer` for a model built from `model.config` (no name_or_path, or the fallback case),
    else null: a loaded model brings its own tokenizer unless `model.tokenizer` is set explicitly."""
    if name_or_path is None or (fallback_to_config and not os.path.exists(name_or_path)):
        return tokenizer
    return None


if not OmegaConf.has_resolver("root"):
    # ${root:data/default/sft_train.jsonl} -> an absolute path inside the checkout, so the shipped
    # data is found from any working directory.
    OmegaConf.register_new_resolver("root", _root_path)
    # The tiny preset's tokenizer: ${tokenizer_unless_model:${.name_or_path},${.fallback_to_config},...}
    OmegaConf.register_new_resolver("tokenizer_unless_model", _tokenizer_unless_model)


# ----------------------------------------------------------------------------- groups


@dataclass(kw_only=True)
class LoraConfig:
    r: int = 0  # 0 = no LoRA
    alpha: int = 16  # LoRA scaling: the update is (alpha / r) * B @ A
    dropout: float = 0.0  # dropout on the LoRA input
    target_modules: Any = "all-linear"  # a list of module names, or "all-linear" (peft)
    only_adapters: bool = True  # train only the adapters (base frozen); false = base trains too
    merge_on_save: bool = True  # save the merged full model; false = peft adapter dir on the base


@dataclass(kw_only=True)
class ModelConfig:
    # A local HF directory, a hub name, or a previous stage's output directory (its model/ is
    # used); null = build from `config` with random weights.
    name_or_path: str | None = field(default=None, metadata={"hub": "model"})
    # A local tokenizer directory or hub name; null = the tokenizer saved with name_or_path. It must
    # fit the model (every id has an embedding row, the same bos/eos ids).
    tokenizer: str | None = field(default=None, metadata={"hub": "model"})
    # HF config kwargs (model_type, sizes...) of a model built without weights (name_or_path null);
    # a key the family's config class does not have is an error; ignored when a model is loaded.
    config: dict[str, Any] = field(default_factory=dict)
    dtype: str = "auto"  # weights as loaded/stored for frozen models; trainable ones keep fp32 masters
    save_dtype: str = "fp32"  # dtype of the exported HF weights
    trust_remote_code: bool = False  # let transformers run the model repo's own Python code
    # transformers' attention kernel: eager | sdpa | flash_attention_2 | ...; null = transformers' own
    # choice (sdpa where the family has it). The tiny default sets eager: on CPU for its 50-token rows
    # eager's matmuls beat sdpa's flash kernel (conf/model/tiny.yaml).
    attn_implementation: str | None = None  # transformers' attention kernel (eager | sdpa | ...); null = its default
    # When name_or_path is a local path that does not exist, build from `config` instead (logged).
    # The reward stage's default, so that it runs before the SFT stage has; off everywhere else.
    fallback_to_config: bool = False  # name_or_path missing on disk -> build from config (logged)
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters (r=0: none)


@dataclass(kw_only=True)
class DataConfig:
    # A .jsonl/.json/.parquet file, a directory, or a `datasets` hub name
    path: str = field(default="", metadata={"hub": "dataset"})
    split: str = "train"  # for directories and hub names
    # Held-out rows; null = carve eval_fraction of `path` off
    eval_path: str | None = field(default=None, metadata={"hub": "dataset"})
    eval_split: str = "test"  # split of eval_path when it is a directory or hub name
    eval_fraction: float = 0.02  # share of `path` held out when eval_path is null
    # Prompts (with `answer` or default-task) for the gold score
    eval_prompts_path: str | None = field(default=None, metadata={"hub": "dataset"})
    num_eval_prompts: int = 200  # first N of eval_prompts_path; 0 = all
    data_split: Any = None  # "2,4,4" or [2,4,4]: this stage takes its share (DeepSpeed-Chat)
    split_seed: int = 1234  # seed of the data_split shares and the eval_fraction hold-out
    max_len: int = 64  # tokens of prompt + response (+ bos/eos)
    max_prompt_len: int = 48  # prompt tokens (+ bos); longer prompts follow `overlong`
    overlong: str = "truncate"  # truncate | drop (see rlhf/data/tokenize.py)
    add_bos: bool = True  # prepend the tokenizer's bos token (when it has one)
    # Padding-free training batches (rlhf/data/packing.py): auto = where the model supports it
    # (rlhf/models.py PACKABLE_MODEL_TYPES) and a micro-batch packs into fewer token slots than padded;
    # true = every micro-batch packed (a ConfigError on other models); false = padded batches
    packing: Any = "auto"
    # Tokens per packed row: null = max_len (rows of at most max_len tokens, [P, max_len]; CPU sdpa
    # computes the whole block-diagonal mask, so this keeps attention below the padded batch's);
    # 0 = the whole micro-batch in one row [1, sum(len)] (flash-attention varlen on GPU)
    pack_length: int | None = None
    cache_dir: str | None = None  # datasets cache for hub names


def stage_engine() -> EngineConfig:
    """The stages' `engine` default: the engine's defaults with precision "auto" (resolve_precision)."""
    return EngineConfig(precision="auto")


@dataclass(kw_only=True)
class LoggerConfig:
    backend: str = "local"  # local | wandb (both write metrics.jsonl)
    project: str = "rlhf"  # wandb project
    entity: str | None = None  # wandb entity (team or user); null = the default one
    name: str | None = None  # wandb run name; null = wandb picks one
    mode: str = "offline"  # wandb: online | offline | disabled


@dataclass(kw_only=True)
class TrainConfig:
    epochs: int = 1  # passes over the training rows
    max_steps: int = 0  # > 0 caps the optimizer steps (also with several epochs)
    micro_batch_size: int = 32  # rows per forward on one rank (at most global_batch_size / world size)
    global_batch_size: int = 32  # rows per optimizer step = micro x accumulation x world size
    lr: float = 1e-3  # peak learning rate (AdamW)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW (beta1, beta2)
    eps: float = 1e-8  # AdamW epsilon
    scheduler: str = "cosine"  # constant | linear | cosine
    warmup_steps: int = 0  # linear warmup from 0 to lr over these optimizer steps
    min_lr_ratio: float = 0.1  # linear/cosine decay ends at lr x this
    grad_clip: float = 1.0  # max global gradient norm (0 = no clipping)
    log_every: int = 10  # steps between metrics.jsonl records
    eval_every: int = 0  # steps between evaluations (0 = only before and after training)
    save_every: int = 0  # steps between sharded checkpoints and at the end (0 = none at all)
    keep_last_n: int = 2  # sharded checkpoints kept in output_dir/checkpoints (older ones deleted)
    resume: Any = False  # false | true (latest in output_dir/checkpoints) | a checkpoint path
    overwrite: bool = False  # a fresh run into an output_dir holding a previous run replaces it (else: refused)
    max_consecutive_skips: int = 20  # non-finite steps in a row before the run stops with an error


@dataclass(kw_only=True)
class GenerationConfig:
    """Generations on data.eval_prompts_path, scored by the gold judge."""

    max_new_tokens: int = 16  # response tokens generated per prompt
    greedy: bool = True  # argmax decoding; false = sample with temperature/top_k/top_p
    temperature: float = 1.0  # sampling temperature (greedy=false)
    top_k: int = 0  # sample among the k most likely tokens (0 = off)
    top_p: float = 1.0  # nucleus sampling: the smallest set with this probability (1 = off)
    batch_size: int = 100  # prompts per generation batch on one rank


@dataclass(kw_only=True)
class StageConfig:
    """What the SFT, reward and DPO stages share: one model trained on one dataset."""
    output_dir: str  # the run's directory: config.yaml, metrics.jsonl, checkpoints/, model/, ...
    seed: int = 1234  # random init, dropout and data order
    model: ModelConfig = field(default_factory=ModelConfig)  # the model trained (and its tokenizer)
    data: DataConfig = field(default_factory=DataConfig)  # training and held-out data
    engine: EngineConfig = field(default_factory=stage_engine)  # parallelism and precision
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # where metrics go besides metrics.jsonl
    train: TrainConfig = field(default_factory=TrainConfig)  # optimizer, schedule, logging and checkpoints


@dataclass(kw_only=True)
class SFTConfig(StageConfig):
    output_dir: str = "outputs/sft"
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        epochs=5, warmup_steps=100, min_lr_ratio=0.05, eval_every=250, save_every=500,
    ))  # optimizer, schedule, logging and checkpoints
    eval: GenerationConfig = field(default_factory=GenerationConfig)  # greedy generations for the gold score


@dataclass(kw_only=True)
class RewardLossConfig:
    """The pairwise loss and the fresh head's init. head_init_std defaults to 0: a zero head gives the
    backbone no gradient until the head has learnt a direction from the SFT features, so a random
    head does not first pull the backbone around. Measured on the embedded default (one SFT output,
    seed 1234; reward seeds 1234 / 1 / 2, 625 steps): held-out accuracy 0.833 / 0.907 / 0.927 with
    the model's own normal(0, 0.02) head, 0.883 / 0.913 / 0.913 with zeros (worst seed +5 points,
    spread 0.094 -> 0.030), at no cost in time."""

    margin: float = 0.0  # loss = -log sigmoid(r_chosen - r_rejected - margin)
    score_reg: float = 0.0  # + score_reg * (r_chosen^2 + r_rejected^2) / 2: keeps scores near 0
    # A fresh scalar head's init: normal(0, head_init_std), 0 = zeros (every pair a tie before
    # training: "before" accuracy 0), null = the model's own (normal(0, initializer_range)).
    # A head loaded from a reward checkpoint is kept as it is.
    head_init_std: float | None = 0.0
    # The first steps train the head alone, then everything (LP-FT, Kumar et al. 2022): the backbone
    # gets exact-zero gradients until then (with train.weight_decay > 0 AdamW still decays it). 0.2
    # (issue #18): without it the embedded default's reward model either learnt the reverse and
    # upper-case pairs or stalled on them (held-out 0.78-0.90 in 3 of 8 runs that differ only in
    # rounding); with it, six such runs ended at 0.913-0.978, none stalled.
    head_only_fraction: float = 0.2  # the first fraction of the steps trains the scalar head alone (LP-FT)


@dataclass(kw_only=True)
class RewardConfig(StageConfig):
    output_dir: str = "outputs/reward"
    # max_steps=1250: 5 passes over the 8,000 shipped pairs (178-209 s in bf16 on 2 CPU cores). At 625 steps
    # (2.5 passes) the held-out accuracy was still rising and ended at 0.88-0.91 by seed; at 1000 the
    # pipeline's seeds 1234 / 1 / 2 gave 0.930 / 0.900 / 0.947, seed 1 flat at 0.90 from step 750; at
    # 1250 seed 1 reached 0.935 (lr 5e-4 instead: 0.79; 2e-4: no better than 3e-4), issue #18.
    # Runs that differ only in rounding (threads, micro-batch 16 x 2 vs 32, fp32, two ranks) ended at
    # 0.962 / 0.935 / 0.898 / 0.943 / 0.905 from one SFT output (seed 1234); warmup_steps=100 gave
    # 0.930-0.938 over four such runs but 0.785 on seed 1, so it was not adopted; what holds it is
    # RewardLossConfig.head_only_fraction (issue #18).
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        epochs=5, max_steps=1250, lr=3e-4, warmup_steps=20, eval_every=125, save_every=125,
    ))  # optimizer, schedule, logging and checkpoints
    reward: RewardLossConfig = field(default_factory=RewardLossConfig)  # the pairwise loss and the fresh head's init


@dataclass(kw_only=True)
class DPOAlgoConfig:
    """The preference loss (rlhf/dpo_math.py) and where the reference log-probs come from."""

    loss_type: str = "sigmoid"  # sigmoid (DPO) | ipo | hinge | robust | simpo (reference-free)
    beta: float = 0.1  # inverse temperature of the implicit reward beta * (logp - logp_ref)
    label_smoothing: float = 0.0  # sigmoid: conservative DPO; robust: the assumed label flip rate; in [0, 0.5)
    gamma: float = 0.0  # simpo: the target reward margin
    # > 0: + sft_coef x the chosen response's NLL per token (RPO); 0 = plain DPO. Default 1 (measured on
    # the embedded default from the SFT output, lr 3e-4, 100 steps: gold 66 -> 98.5 with 1, while with 0
    # the chosen answers' likelihood falls too: reverse/sort drop, gold 80.5 at step 50, 86.5 at 100 with
    # sort still at 39)
    sft_coef: float = 1.0
    # precompute: one pass over the train + held-out pairs before training, then no reference model
    # while training; online: the reference scores each batch (a second frozen model, or with LoRA
    # the policy with its adapters disabled). simpo uses no reference either way.
    reference: str = "precompute"


@dataclass(kw_only=True)
class DPOConfig(StageConfig):
    output_dir: str = "outputs/dpo"
    # Measured on the embedded default (2 CPU cores, from the SFT output, dpo.sft_coef=1): held-out gold
    # 66 -> 91 at step 25, 98 at 50, 98.5 at 100; 100 steps read 3,200 of the 8,000 pairs, and the
    # reference pass covers only those, so the run stays well inside 5 minutes (three gold evaluations)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        max_steps=100, lr=3e-4, warmup_steps=10, eval_every=50, log_every=5,
    ))  # optimizer, schedule, logging and checkpoints
    dpo: DPOAlgoConfig = field(default_factory=DPOAlgoConfig)  # the loss and the reference
    eval: GenerationConfig = field(default_factory=GenerationConfig)  # greedy generations for the gold score


@dataclass(kw_only=True)
class TrainedModelConfig:
    """The actor or the critic in PPO: where it starts, its LoRA, its optimizer and schedule."""

    model: str = field(default="", metadata={"hub": "model"})  # a HF directory / hub name / previous stage output_dir
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters (r=0: none)
    lr: float = 1e-5  # peak learning rate (AdamW)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW (beta1, beta2)
    eps: float = 1e-8  # AdamW epsilon
    scheduler: str = "constant"  # constant | linear | cosine
    warmup_steps: int = 0  # linear warmup from 0 to lr over these PPO steps
    min_lr_ratio: float = 0.1  # linear/cosine decay ends at lr x this
    grad_clip: float = 1.0  # max global gradient norm (0 = no clipping)


@dataclass(kw_only=True)
class FrozenModelConfig:
    """The reference or the reward model: where it comes from; CPU offload between uses."""

    # A HF directory / hub name / stage output_dir; null = the actor's (reference) / the critic's (reward)
    model: str | None = field(default=None, metadata={"hub": "model"})
    offload: bool = False  # keep the weights on the CPU between uses


@dataclass(kw_only=True)
class PPOAlgoConfig:
    kl_coef: float = 0.1  # reward -= kl_coef x KL(actor || reference) on every response token
    kl_estimator: str = "k1"  # k1 | k2 | k3
    adaptive_kl: bool = False  # adapt kl_coef towards kl_target (Ziegler et al.)
    kl_target: float = 6.0  # adaptive_kl: the KL aimed at
    kl_horizon: float = 10000.0  # adaptive_kl: how slowly kl_coef adapts (rollout rows)
    clip_reward_value: float = 5.0  # reward model scores clipped to +-this
    # A name registered in rlhf/ppo_math.py: gae (PPO, needs the critic), grpo, rloo, reinforce_pp
    advantage_estimator: str = "gae"
    norm_by_std: bool = True  # grpo: divide by the group's std; false = Dr. GRPO (score - group mean)
    gamma: float = 1.0  # GAE discount
    lam: float = 0.95  # GAE lambda
    cliprange: float = 0.2  # policy ratio clipped to [1 - cliprange, 1 + cliprange]
    # Asymmetric clipping (DAPO's clip-higher): [1 - cliprange_low, 1 + cliprange_high]; null = cliprange
    cliprange_low: float | None = None  # lower side of the ratio clip; null = cliprange
    cliprange_high: float | None = None  # upper side of the ratio clip; null = cliprange
    # token_mean (PPO) | seq_mean_token_mean (GRPO) | seq_mean_token_sum (Dr. GRPO: / max_new_tokens)
    loss_agg: str = "token_mean"
    kl_loss_coef: float = 0.0  # > 0: + kl_loss_coef x KL(actor || reference) in the actor loss (GRPO)
    kl_loss_estimator: str = "k3"  # the KL loss's estimator: k1 | k2 | k3
    dynamic_sampling: bool = False  # drop prompt groups whose scores are all equal (DAPO), counted
    cliprange_value: float = 0.2  # value updates clipped to +-this around the old values
    ppo_epochs: int = 1  # passes over each step's rollouts
    whiten_advantages: bool = False  # normalise advantages to mean 0, std 1 (over all ranks)
    ptx_coef: float = 0.0  # > 0: add ptx_coef x the SFT loss on data.ptx_path to the actor loss
    ema_decay: float = 0.0  # > 0: keep an EMA of the actor (saved as model_ema/)


@dataclass(kw_only=True)
class RolloutConfig:
    prompts_per_step: int = 64  # prompts per step (global); each is answered n_samples_per_prompt times
    # Responses sampled per prompt (a prompt group: grpo/rloo baselines); rows per step =
    # prompts_per_step x n_samples_per_prompt, and the batch sizes below count rows
    n_samples_per_prompt: int = 1
    mini_batch_size: int = 32  # rows per optimizer step (global)
    micro_batch_size: int = 32  # rows per forward on one rank (at most mini_batch_size / world size)
    max_new_tokens: int = 16  # response tokens sampled per prompt
    temperature: float = 1.0  # sampling temperature
    top_k: int = 0  # sample among the k most likely tokens (0 = off)
    top_p: float = 1.0  # nucleus sampling (1 = off)


@dataclass(kw_only=True)
class PPOTrainConfig:
    epochs: int = 1  # passes over the prompts
    max_steps: int = 0  # > 0: exactly this many PPO steps (generation + update)
    log_every: int = 1  # steps between metrics.jsonl records
    eval_every: int = 10  # steps between evaluations (0 = only before and after training)
    save_every: int = 10  # steps between sharded checkpoints and at the end (0 = none at all)
    keep_last_n: int = 2  # sharded checkpoints kept in output_dir/checkpoints (older ones deleted)
    resume: Any = False  # false | true (latest in output_dir/checkpoints) | a checkpoint path
    overwrite: bool = False  # a fresh run into an output_dir holding a previous run replaces it (else: refused)
    max_consecutive_skips: int = 20  # non-finite steps in a row before the run stops with an error
    stop_on_alarm: bool = False  # a reward-hacking alarm (alarms.*) saves a checkpoint and ends the run cleanly


@dataclass(kw_only=True)
class RewardSourcesConfig:
    """Where the RL reward comes from (rlhf/rewards.py): one source, or a weighted sum of several."""

    sources: list[str] = field(default_factory=lambda: ["model"])  # model | judge | answer | function (several: summed)
    weights: list[float] = field(default_factory=list)  # one weight per source ([] = all 1.0)
    function: str | None = None  # the function source: module:function, called as fn(prompt, response, row) -> float


@dataclass(kw_only=True)
class AlarmsConfig:
    """Reward-hacking alarms (rlhf/alarms.py): every step, over the last `window` steps' metrics; each
    fires at or beyond its threshold (one WARN line, `alarm_<name>` in metrics.jsonl)."""

    enabled: bool = True  # compute the alarms (false: none is computed, logged or acted on)
    window: int = 10  # steps in each trend; the baseline is the first `window` steps of the run
    kl_slope: float = 0.1  # kl: least-squares growth of the rollouts' KL, nats per step, over the window
    entropy_ratio: float = 0.5  # entropy: window's mean entropy at most this x the baseline's
    length_drift: float = 0.5  # length: window's mean response length off the baseline's by this fraction
    clipfrac: float = 0.2  # clipfrac: window's mean policy clip fraction at least this
    gold_drop: float = 8.0  # gold: held-out gold score this many points below its best while the reward rose


@dataclass(kw_only=True)
class PPOConfig:
    output_dir: str = "outputs/ppo"  # the run's directory: config.yaml, metrics.jsonl, checkpoints/, model/, ...
    seed: int = 1234  # sampling, dropout and prompt order
    # Settings shared by the four models: tokenizer (null = the one saved with actor.model), dtype,
    # save_dtype, ...; name_or_path is unused here (the models are actor.model, critic.model, ...).
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)  # the prompts (path) and held-out prompts
    # SFT data for the ptx loss (null = data/default's demonstrations)
    ptx_path: str | None = field(default=None, metadata={"hub": "dataset"})
    engine: EngineConfig = field(default_factory=stage_engine)  # parallelism and precision (all four models)
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # where metrics go besides metrics.jsonl
    # NOTE: lora=${model.lora} (model.lora.r=8 gives both trained models adapters) is an OmegaConf
    # interpolation, resolved by `to_config`: a PPOConfig built in Python must set actor.lora and
    # critic.lora itself. It lives here, not in conf/ppo.yaml, because OmegaConf cannot merge an
    # interpolation from YAML into a dataclass-typed node (it can hold one as the default).
    actor: TrainedModelConfig = field(default_factory=lambda: TrainedModelConfig(
        model="outputs/sft", lora=II("model.lora"), lr=5e-5, warmup_steps=5,
    ))  # the policy trained (starts from SFT)
    critic: TrainedModelConfig = field(default_factory=lambda: TrainedModelConfig(
        model="outputs/reward", lora=II("model.lora"), lr=5e-4, warmup_steps=5,
    ))  # the value model trained (starts from the reward model)
    reference: FrozenModelConfig = field(default_factory=FrozenModelConfig)  # the frozen policy the KL is measured to
    reward_model: FrozenModelConfig = field(default_factory=FrozenModelConfig)  # the frozen scorer of responses
    ppo: PPOAlgoConfig = field(default_factory=PPOAlgoConfig)  # PPO's algorithm settings
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # generation and batch sizes of each step
    train: PPOTrainConfig = field(default_factory=PPOTrainConfig)  # step counts, logging and checkpoints
    eval: GenerationConfig = field(default_factory=GenerationConfig)  # greedy generations for the gold score
    reward: RewardSourcesConfig = field(default_factory=RewardSourcesConfig)  # the reward: model, judge, answer, function
    alarms: AlarmsConfig = field(default_factory=AlarmsConfig)  # reward-hacking alarms and their thresholds


    def unused_sources(self) -> set[str]:
        """Model keys this run will not read: critic.model without a critic, unless it is the reward
        model's default path and the reward model is a reward source."""
        from rlhf.ppo_math import ADVANTAGE_ESTIMATORS

        est = ADVANTAGE_ESTIMATORS.get(self.ppo.advantage_estimator)
        needs_rm = "model" in self.reward.sources
        if est is not None and not est.needs_critic and not (needs_rm and self.reward_model.model is None):
            return {"critic.model"}
        return set()


@dataclass(kw_only=True)
class EvaluateConfig:
    """`python -m rlhf.evaluate`: one model scored on held-out data exactly as the stages score theirs."""

    output_dir: str = "outputs/evaluate"  # config.yaml, metrics.jsonl, samples.jsonl and summary.json go here
    mode: str = "auto"  # auto (reward when the model's architectures end in ForSequenceClassification) | policy | reward
    seed: int = 1234  # seeds torch before loading (and the draws of eval.greedy=false)
    batch_size: int = 32  # rows per forward (perplexity, pair scoring); a stage's micro batch gives its figures exactly
    default_pairs_path: str | None = None  # mode=reward with data.eval_path=null scores these pairs
    model: ModelConfig = field(default_factory=ModelConfig)  # a stage's output_dir, a HF dir or hub name; its tokenizer
    data: DataConfig = field(default_factory=DataConfig)  # eval_prompts_path, eval_path, tokenization as the stages
    engine: EngineConfig = field(default_factory=stage_engine)  # sharding, precision, generation path
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # where metrics.jsonl also goes (wandb)
    eval: GenerationConfig = field(default_factory=GenerationConfig)  # mode=policy: generations (as the stages' eval.*)


# ----------------------------------------------------------------------------- Hydra

SCHEMAS = {"sft": SFTConfig, "reward": RewardConfig, "dpo": DPOConfig, "ppo": PPOConfig, "evaluate": EvaluateConfig}


def register_schemas() -> None:
    """Each stage's dataclass into Hydra's ConfigStore as `<stage>_schema`, the first entry of
    conf/<stage>.yaml's defaults list (done on import: composing needs it)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for stage, schema in SCHEMAS.items():
        cs.store(name=f"{stage}_schema", node=schema)


register_schemas()


def compose(config_name: str, overrides: list[str] | tuple[str, ...] = (), *, return_hydra_config: bool = False,
            job_name: str | None = None) -> DictConfig:
    """conf/<config_name>.yaml with `overrides`, composed by Hydra outside a Hydra app (`--help`,
    scripts/stage_plan.py, tests). A key the schema lacks or a value of the wrong type, on the command
    line or in a YAML file, raises ConfigError naming the key."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    # job_name: hydra.job.name (in a run: the app's module); Hydra cannot always tell it from the stack
    job_name = job_name or config_name
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf"), job_name=job_name):
            return hydra_compose(config_name, overrides=list(overrides), return_hydra_config=return_hydra_config)
    except HydraException as e:
        cause = e.__cause__
        key = getattr(cause, "full_key", None) if isinstance(cause, OmegaConfBaseException) else None
        if key:
            raise ConfigError(f"config key {key!r}: {str(cause).splitlines()[0]}") from None
        raise ConfigError(f"config: {str(e).splitlines()[0]}") from None


# ----------------------------------------------------------------------------- conversion


def to_config(cfg: DictConfig | dict, schema: type[T]) -> T:
    """Hydra's config -> the dataclass `schema`; unknown keys and wrong types raise ConfigError."""
    raw = OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg
    raw = OmegaConf.masked_copy(raw, [k for k in raw if k != "hydra"]) if "hydra" in raw else raw
    try:
        raw = OmegaConf.create(OmegaConf.to_container(raw, resolve=True))  # ${...} resolved before typing
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


ATTN_IMPLEMENTATIONS = (None, "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def validate_model(m: ModelConfig, prefix: str = "model") -> None:
    _need(m.attn_implementation in ATTN_IMPLEMENTATIONS,
          f"{prefix}.attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {m.attn_implementation!r}")
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


def validate_data(d: DataConfig, *, needs_response: bool = True, needs_path: bool = True) -> None:
    from rlhf.data.split import parse_data_split

    if needs_path:
        _need(bool(d.path), "data.path must be set (a file, a directory or a datasets hub name)")
    _need(0 <= d.eval_fraction < 1, f"data.eval_fraction must be in [0, 1), got {d.eval_fraction}")
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


def fit_micro(micro: int, batch: int, world: int, key: str, batch_key: str) -> int:
    """A micro-batch is at most what one rank holds of the batch it splits: more ranks than the
    defaults were written for (32 rows on 1 rank) lower it to `batch / world` (logged), so the
    defaults run as they are under torchrun; a micro-batch that fits is kept as given."""
    if micro >= 1 and micro * world > batch and batch % world == 0 and batch >= world:
        logging.getLogger("rlhf").info("%s: %d -> %d (%s=%d over %d ranks)", key, micro, batch // world, batch_key,
                                       batch, world)
        return batch // world
    return micro


def validate_cadence(t: TrainConfig | PPOTrainConfig, prefix: str = "train") -> None:
    """The keys every stage's train group has: its length, log / eval / save cadence, skips, resume."""
    _need(t.epochs >= 1 or t.max_steps > 0, f"{prefix}.epochs must be >= 1 (or set {prefix}.max_steps), got {t.epochs}")
    _need(t.max_steps >= 0, f"{prefix}.max_steps must be >= 0 (0 = run all epochs), got {t.max_steps}")
    for key in ("eval_every", "save_every", "keep_last_n"):
        _need(getattr(t, key) >= 0, f"{prefix}.{key} must be >= 0, got {getattr(t, key)}")
    _need(t.log_every >= 1, f"{prefix}.log_every must be >= 1, got {t.log_every}")
    _need(t.max_consecutive_skips >= 1, f"{prefix}.max_consecutive_skips must be >= 1, got {t.max_consecutive_skips}")
    _need(isinstance(t.resume, (bool, str)), f"{prefix}.resume must be true, false or a checkpoint path, got {t.resume!r}")


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


def engine_config(e: EngineConfig, info, *, frozen: bool = False) -> EngineConfig:
    """The `engine` group as the engine takes it: precision "auto" resolved for this device, validated."""
    from engine import validate_engine_config

    _need(e.precision in PRECISIONS, f"engine.precision must be one of {PRECISIONS}, got {e.precision!r}")
    cfg = resolve_precision(e, info.device)
    try:
        validate_engine_config(cfg, info, frozen=frozen)
    except ValueError as e2:
        raise ConfigError(str(e2)) from None
    return cfg


def validate_sft(cfg: SFTConfig, info) -> int:
    """Everything an SFT run needs, checked before any model loads; returns accumulation steps."""
    _need(bool(cfg.output_dir), "output_dir must be set")
    _need(cfg.seed >= 0, f"seed must be >= 0, got {cfg.seed}")
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
    _need(cfg.seed >= 0, f"seed must be >= 0, got {cfg.seed}")
    validate_model(cfg.model)
    validate_data(cfg.data)
    validate_logger(cfg.logger)
    _need(cfg.reward.score_reg >= 0, f"reward.score_reg must be >= 0, got {cfg.reward.score_reg}")
    std = cfg.reward.head_init_std
    _need(std is None or std >= 0, f"reward.head_init_std must be >= 0 (0 = zeros) or null, got {std}")
    f = cfg.reward.head_only_fraction
    _need(0 <= f < 1, f"reward.head_only_fraction must be in [0, 1) (0 = off), got {f}")
    check_optim(cfg.train)
    engine_config(cfg.engine, info)
    return validate_train(cfg.train, info.world_size)


def rollout_rows(r: RolloutConfig) -> int:
    """Rows (sampled responses) per RL step, over every rank."""
    return r.prompts_per_step * r.n_samples_per_prompt


def validate_dpo(cfg: DPOConfig, info) -> int:
    """Everything a DPO run needs, checked before any model loads; returns accumulation steps."""
    from rlhf.dpo_math import LOSS_TYPES

    p = cfg.dpo
    _need(p.loss_type in LOSS_TYPES, f"dpo.loss_type must be one of {LOSS_TYPES}, got {p.loss_type!r}")
    _need(p.beta > 0, f"dpo.beta must be > 0, got {p.beta}")
    _need(0 <= p.label_smoothing < 0.5, f"dpo.label_smoothing must be in [0, 0.5), got {p.label_smoothing}")
    _need(p.label_smoothing == 0 or p.loss_type in ("sigmoid", "robust"),
          f"dpo.label_smoothing applies to dpo.loss_type=sigmoid or robust, not {p.loss_type!r}")
    _need(p.gamma == 0 or p.loss_type == "simpo", f"dpo.gamma applies to dpo.loss_type=simpo, not {p.loss_type!r}")
    _need(p.sft_coef >= 0, f"dpo.sft_coef must be >= 0, got {p.sft_coef}")
    _need(p.reference in ("precompute", "online"), f"dpo.reference must be 'precompute' or 'online', got {p.reference!r}")
    return validate_sft(cfg, info)  # the keys DPO shares with SFT: model, data, eval, train, engine


def validate_ppo(cfg: PPOConfig, info) -> None:
    """Everything a PPO run needs, checked before any model loads."""
    from rlhf.ppo_math import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS

    _need(bool(cfg.output_dir), "output_dir must be set")
    _need(cfg.seed >= 0, f"seed must be >= 0, got {cfg.seed}")
    for key in ("actor", "critic"):
        group = getattr(cfg, key)
        _need(bool(group.model), f"{key}.model must be set (a HF directory, hub name or a stage's output_dir)")
        validate_model(dataclasses_replace(cfg.model, name_or_path=group.model, lora=group.lora,
                                           fallback_to_config=False), prefix=key)
        check_optim(group, prefix=key)
    validate_data(cfg.data, needs_response=False)
    validate_logger(cfg.logger)
    validate_generation(cfg.eval, "eval")
    p, r = cfg.ppo, cfg.rollout
    _need(p.kl_coef >= 0, f"ppo.kl_coef must be >= 0, got {p.kl_coef}")
    _need(p.kl_estimator in KL_ESTIMATORS, f"ppo.kl_estimator must be one of {KL_ESTIMATORS}, got {p.kl_estimator!r}")
    if p.adaptive_kl:
        _need(p.kl_target > 0 and p.kl_horizon > 0, "ppo.kl_target and ppo.kl_horizon must be > 0 with ppo.adaptive_kl")
    _need(p.advantage_estimator in ADVANTAGE_ESTIMATORS, f"ppo.advantage_estimator must be one of "
          f"{tuple(ADVANTAGE_ESTIMATORS)} (registered in rlhf/ppo_math.py), got {p.advantage_estimator!r}")
    est = ADVANTAGE_ESTIMATORS[p.advantage_estimator]
    if not est.token_rewards:
        _need(p.kl_coef == 0 and not p.adaptive_kl,
              f"ppo.advantage_estimator={p.advantage_estimator} reads only each response's score, so a KL "
              f"penalty in the reward (ppo.kl_coef={p.kl_coef}, ppo.adaptive_kl={p.adaptive_kl}) would be "
              "ignored: set ppo.kl_coef=0 and put the KL in the loss with ppo.kl_loss_coef (algorithm="
              f"{p.advantage_estimator} does both)")
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
    validate_reward_sources(cfg.reward)
    validate_alarms(cfg.alarms)
    engine_config(cfg.engine, info)


def validate_reward_sources(rw: RewardSourcesConfig) -> None:
    """Known, distinct sources; one finite weight each; reward.function importable iff the function source."""
    import math

    from rlhf.rewards import SOURCES, load_function

    _need(len(rw.sources) >= 1, f"reward.sources must name at least one of {SOURCES}")
    for name in rw.sources:
        _need(name in SOURCES, f"reward.sources: unknown source {name!r}; choose from {SOURCES}")
    _need(len(set(rw.sources)) == len(rw.sources), f"reward.sources names a source twice: {list(rw.sources)}")
    _need(not rw.weights or len(rw.weights) == len(rw.sources),
          f"reward.weights has {len(rw.weights)} weights for {len(rw.sources)} reward.sources {list(rw.sources)}")
    _need(all(math.isfinite(w) for w in rw.weights), f"reward.weights must be finite numbers, got {list(rw.weights)}")
    if "function" in rw.sources:
        load_function(rw.function)  # ConfigError naming reward.function when not importable / callable
    else:
        _need(rw.function is None, f"reward.function={rw.function!r} is set but 'function' is not in "
                                   f"reward.sources {list(rw.sources)} (add it, e.g. reward.sources=[function])")


def validate_alarms(a: AlarmsConfig) -> None:
    _need(a.window >= 2, f"alarms.window must be >= 2 (steps in a trend), got {a.window}")
    for key in ("kl_slope", "length_drift", "clipfrac", "gold_drop"):
        _need(getattr(a, key) >= 0, f"alarms.{key} must be >= 0, got {getattr(a, key)}")
    _need(0 <= a.entropy_ratio <= 1, f"alarms.entropy_ratio must be in [0, 1], got {a.entropy_ratio}")


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
    validate_data(cfg.data, needs_path=False)
    validate_logger(cfg.logger)
    validate_generation(cfg.eval, "eval")
    engine_config(cfg.engine, info)
