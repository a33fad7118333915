"""Typed configuration of the stage apps: Hydra YAML (conf/) -> these dataclasses, once, at start.
(No torch import here, nor in compose.py: scripts/stage_plan.py composes a stage's config in well under
a second; validate.py, which reads the registries, does import it.)

The dataclasses hold every key and its default: they are Hydra structured configs, stored in
Hydra's ConfigStore as `<stage>_schema` (`register_schemas`), and each conf/<stage>.yaml starts its
defaults list from its schema. The YAML holds only what differs: the config-group choices (model,
data, engine, logger; a group's option file holds only its own values), values that must win over a
group's (reward's model.name_or_path), `${...}` interpolations, and the hydra: settings. A misspelt
key or a value of the wrong type fails at composition (`compose`, rlhf/config/cli.py for the command line)
or in `to_config`; `validate_*` check ranges and the batch-size arithmetic, each error naming the key
(`train.lr`, ...), before any model is loaded. A function receives only the sub-config it uses. The
`engine` group's schema is the engine's own EngineConfig (engine/config.py), with precision "auto"
as the stages' default (`resolve_precision` makes it bf16 on CUDA and on bf16-capable CPUs, else fp32).

Each field's trailing `# comment` (else the comment block above it) is its one-line description in
`--help` (rlhf/config/cli.py): write one for every new field. `metadata={"hub": "model"|"dataset"}` marks
a key that may hold a hub name, checked up front when the hub is unreachable (rlhf/core/hub.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import II

from engine.config import EngineConfig, PRECISIONS as ENGINE_PRECISIONS

PRECISIONS = ("auto", *ENGINE_PRECISIONS)
REWARD_SOURCES = ("model", "judge", "answer", "function", "http")  # reward.sources; each built in rlhf/rl/rewards.py
REWARD_ENSEMBLE_AGGREGATES = ("mean", "min", "mean_minus_std")  # reward.ensemble_agg (rlhf/rl/rewards.py ensemble_reward)
SERVED_REWARDS = ("auto", "model", "judge", "function")  # reward.source of `python -m rlhf.serve`
DTYPES = ("auto", "fp32", "bf16", "fp16")


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
    # A .jsonl/.json/.parquet file, a directory, or a `datasets` hub name; or a list of them
    # ([a.jsonl,b.jsonl]): a mixture by `weights` (rlhf/data/mix.py), each source's shape detected on its own
    path: Any = field(default="", metadata={"hub": "dataset"})
    # One weight >= 0 per data.path entry: each source gives round(weight / sum x mix_size) training rows
    # (drawn without replacement while it has enough, else repeated); [] = by the sources' sizes
    weights: list[float] = field(default_factory=list)
    # Training rows of a data.path mixture; null = the sum of the sources' training rows
    mix_size: int | None = None
    split: str = "train"  # for directories and hub names
    # Held-out rows; null = hold eval_size of `path` out (the conf/data defaults name the shipped
    # task's held-out file only while `path` is the shipped file)
    eval_path: str | None = field(default=None, metadata={"hub": "dataset"})
    eval_split: str = "test"  # split of eval_path when it is a directory or hub name
    # Held out of `path` when eval_path is null: a fraction in [0, 1) or a number of rows (>= 1); 0 = none
    eval_size: float = 0.02
    eval_fraction: float | None = None  # the former name of eval_size (a fraction); when set, it wins
    # Prompts (with `answer` or default-task) for the gold score; the conf/data defaults name the
    # shipped task's only while `path` is the shipped file
    eval_prompts_path: str | None = field(default=None, metadata={"hub": "dataset"})
    num_eval_prompts: int = 200  # first N of eval_prompts_path (PPO: of its held-out prompts); 0 = all
    data_split: Any = None  # "2,4,4" or [2,4,4]: this stage takes its share (DeepSpeed-Chat)
    split_seed: int = 1234  # seed of the data_split shares and the eval_size hold-out
    max_len: int = 64  # tokens of prompt + response (+ bos/eos)
    max_prompt_len: int = 48  # prompt tokens (+ bos); longer prompts follow `overlong`
    overlong: str = "truncate"  # truncate | drop (see rlhf/data/tokenize.py)
    add_bos: bool = True  # prepend the tokenizer's bos token (when it has one)
    # Conversations ({messages}, ShareGPT rows): the loss on every assistant turn, with the end-of-turn
    # tokens its chat template writes (rlhf/data/chat.py); false = on the whole rendered transcript
    assistant_only_loss: bool = True
    # Padding-free training batches (rlhf/data/packing.py): auto = where the model supports it
    # (rlhf/modeling/load.py PACKABLE_MODEL_TYPES) and a micro-batch packs into fewer token slots than padded;
    # true = every micro-batch packed (a ConfigError on other models); false = padded batches
    packing: Any = "auto"
    # Tokens per packed row: null = max_len (rows of at most max_len tokens, [P, max_len]; CPU sdpa
    # computes the whole block-diagonal mask, so this keeps attention below the padded batch's);
    # 0 = the whole micro-batch in one row [1, sum(len)] (flash-attention varlen on GPU)
    pack_length: int | None = None
    # Pair stages (reward, dpo and its kto rows): a pair's two rows run their common prompt once per forward,
    # its KV cache shared by both (rlhf/data/tokenize.py collate_shared_pairs; ~35% fewer positions on the
    # shipped pairs). null = per micro-batch, where that computes the fewest token slots of padded, packed
    # (data.packing=auto) and shared (rlhf/data/packing.py pair_layout), and off under data.packing=true or
    # engine.activation_checkpointing (a checkpointed block keeps no KV cache); true = every micro-batch
    # (a ConfigError with either); false = never. The RL stage's: rollout.shared_prompt_forward
    shared_prompts: bool | None = None
    cache_dir: str | None = None  # datasets cache for hub names


def stage_engine() -> EngineConfig:
    """The stages' `engine` default: the engine's defaults with precision "auto" (resolve_precision)."""
    return EngineConfig(precision="auto")


@dataclass(kw_only=True)
class LoggerConfig:
    """Where a run's figures go besides metrics.jsonl (always written, main rank only): conf/logger/<name>.yaml
    turns one on, `logger=[tensorboard,wandb]` several (rlhf/run/loggers.py)."""

    wandb: bool = False  # Weights & Biases (logger=wandb)
    tensorboard: bool = False  # TensorBoard event files through tensorboardX (logger=tensorboard; pip extra tensorboard)
    mlflow: bool = False  # MLflow through mlflow-skinny (logger=mlflow; pip extra mlflow)
    trackio: bool = False  # trackio's local store (logger=trackio; pip extra trackio; TRACKIO_DIR picks the store)
    csv: bool = False  # one <kind>_<name>.csv per scalar, as DeepSpeed's csv_monitor (logger=csv)
    project: str = "rlhf"  # the W&B / trackio project, the MLflow experiment
    entity: str | None = None  # wandb entity (team or user); null = the default one
    name: str | None = None  # the run's name in W&B, MLflow and trackio; null = each picks one
    mode: str = "offline"  # wandb: online | offline | disabled
    tensorboard_dir: str | None = None  # event files' directory; null = <output_dir>/tensorboard
    mlflow_tracking_uri: str | None = None  # null = MLFLOW_TRACKING_URI, else a file store in <output_dir>/mlruns
    csv_dir: str | None = None  # the CSV files' directory; null = <output_dir>/csv


@dataclass(kw_only=True)
class OptimGroupConfig:
    """One optimizer and its schedule: the keys the `train` group and PPO's `actor`/`critic` groups share."""

    lr: float = 1e-3  # peak learning rate (AdamW)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW (beta1, beta2)
    eps: float = 1e-8  # AdamW epsilon
    scheduler: str = "cosine"  # constant | linear | cosine
    warmup_steps: int = 0  # linear warmup from 0 to lr over these optimizer steps
    min_lr_ratio: float = 0.1  # linear/cosine decay ends at lr x this
    grad_clip: float = 1.0  # max global gradient norm (0 = no clipping)


@dataclass(kw_only=True)
class CadenceConfig:
    """A run's length, its log / eval / save cadence, resume and the non-finite-step limit: the keys the
    `train` group of every stage has (PPO's counts PPO steps, each a generation and an update)."""

    epochs: int = 1  # passes over the training rows (PPO: the prompts)
    max_steps: int = 0  # > 0 caps the steps (also with several epochs)
    log_every: int = 10  # steps between metrics.jsonl records
    eval_every: int = 0  # steps between evaluations (0 = only before and after training)
    save_every: int = 0  # steps between sharded checkpoints and at the end (0 = none at all)
    keep_last_n: int = 2  # sharded checkpoints kept in output_dir/checkpoints (older ones deleted)
    resume: Any = False  # false | true (continue from output_dir's latest checkpoint) | auto (if there is one) | a path
    overwrite: bool = False  # a fresh run into an output_dir holding a previous run replaces it (else: refused)
    max_consecutive_skips: int = 20  # non-finite steps in a row before the run stops with an error


@dataclass(kw_only=True)
class TrainConfig(CadenceConfig, OptimGroupConfig):
    micro_batch_size: int = 32  # rows per forward on one rank (at most global_batch_size / world size)
    global_batch_size: int = 32  # rows per optimizer step = micro x accumulation x world size


@dataclass(kw_only=True)
class GenerationConfig:
    """Generations on data.eval_prompts_path, scored by the gold judge."""

    max_new_tokens: int = 16  # response tokens generated per prompt
    greedy: bool = True  # argmax decoding; false = sample with temperature/top_k/top_p
    temperature: float = 1.0  # sampling temperature (greedy=false)
    top_k: int = 0  # sample among the k most likely tokens (0 = off)
    top_p: float = 1.0  # nucleus sampling: the smallest set with this probability (1 = off)
    batch_size: int = 100  # prompts per generation batch on one rank
    # Your own gold judge, module:function, called as fn(prompt, response, row) -> a score (1 = right, 0 =
    # wrong) on every held-out prompt; null = the built-in judge (an `answer` field, or the shipped task)
    judge: str | None = None


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
class StartsConfig:
    """Several starts of one run, the best continued (rlhf/run/stage.py `Run.best_start`): start k (1..n)
    takes seed + 1000 x (k - 1) for the model's initialisation and the data order and trains `steps`
    optimizer steps of the run's schedule; the start with the lowest held-out loss then trains to the
    end, exactly as the run `seed=<its seed>` would (the others' steps are the cost). Dodge et al. 2020,
    "Fine-Tuning Pretrained Language Models: Weight Initializations, Data Orders, and Early Stopping",
    found that a seed's fate shows early in training and recommend starting many and stopping the
    unpromising early; on the embedded default, which starts learn to copy digits shows at step 250
    (docs/results-log.md)."""

    n: int = 1  # starts compared (1: the one start seeded by `seed`)
    steps: int = 250  # optimizer steps each start trains before the comparison (< the run's steps)


@dataclass(kw_only=True)
class SFTConfig(StageConfig):
    output_dir: str = "outputs/sft"
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        epochs=5, warmup_steps=100, min_lr_ratio=0.05, eval_every=250, save_every=500,
    ))  # optimizer, schedule, logging and checkpoints
    eval: GenerationConfig = field(default_factory=GenerationConfig)  # greedy generations for the gold score
    starts: StartsConfig = field(default_factory=StartsConfig)  # several starts, the best by held-out loss continued


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
    """The preference loss (rlhf/algos/preference.py) and where the reference log-probs come from."""

    # sigmoid (DPO) | ipo | hinge | robust | simpo (reference-free) | kto (unpaired rows {prompt, response,
    # label}; pairs are split into a desirable and an undesirable row)
    loss_type: str = "sigmoid"
    beta: float = 0.1  # inverse temperature of the implicit reward beta * (logp - logp_ref)
    label_smoothing: float = 0.0  # sigmoid: conservative DPO; robust: the assumed label flip rate; in [0, 0.5)
    gamma: float = 0.0  # simpo: the target reward margin
    # kto: lambda_D and lambda_U, the weights of desirable and undesirable rows' losses; keep
    # lambda_D n_D / (lambda_U n_U) in [1, 4/3] (KTO eq. 8, TRL): upweight the rarer kind
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0  # kto: lambda_U (see desirable_weight)
    # > 0: + sft_coef x the chosen (kto: each desirable) response's NLL per token (RPO); 0 = plain DPO. Default 1 (measured on
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
class TrainedModelConfig(OptimGroupConfig):
    """The actor or the critic in PPO: where it starts, its LoRA, its optimizer and schedule."""

    model: str = field(default="", metadata={"hub": "model"})  # a HF directory / hub name / previous stage output_dir
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters (r=0: none)


@dataclass(kw_only=True)
class FrozenModelConfig:
    """The reference or the reward model: where it comes from; CPU offload between uses."""

    # A HF directory / hub name / stage output_dir; null = the actor's (reference) / the critic's (reward)
    model: str | None = field(default=None, metadata={"hub": "model"})
    offload: bool = False  # keep the weights on the CPU between uses


@dataclass(kw_only=True)
class PPOAlgoConfig:
    # reward -= kl_coef x KL(actor || reference) on every response token (outcome estimators, grpo/rloo:
    # score -= kl_coef x the response's summed KL)
    kl_coef: float = 0.1
    kl_estimator: str = "k1"  # k1 | k2 | k3
    # adapt kl_coef towards kl_target (Ziegler et al.); with kl_coef = 0 and kl_loss_coef > 0 (the KL in the loss
    # alone, GRPO's placement) it adapts kl_loss_coef instead, logged per step as kl_loss_coef
    adaptive_kl: bool = False
    kl_target: float = 6.0  # adaptive_kl: the KL aimed at
    kl_horizon: float = 10000.0  # adaptive_kl: how slowly kl_coef adapts (rollout rows)
    # adaptive_kl: the coefficient never falls below this (0 = no floor; null = kl_coef, a KL budget: the
    # controller only adds to the penalty while the KL is over kl_target; rlhf/algos/rl.py AdaptiveKLController)
    kl_coef_min: float | None = 0.0
    clip_reward_value: float = 5.0  # reward model scores clipped to +-this
    # A name registered in rlhf/algos/rl.py: gae (PPO, needs the critic), grpo, rloo, reinforce_pp
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
    # The actor's policy loss, a name registered in rlhf/algos/rl.py: clip (PPO's clipped surrogate),
    # gspo (sequence-level ratio, Zheng et al. 2025), cispo (clipped IS weight, MiniMax-M1)
    policy_loss: str = "clip"
    # Correct for the sampler/trainer gap (rho = pi_trainer / pi_sampler of each sampled token): none |
    # tis (truncated IS, weight min(rho, is_cap)) | mis (masked IS, weight rho in [is_low, is_high], else 0)
    is_correction: str = "none"  # none | tis | mis: importance weights for the sampler/trainer gap
    is_cap: float = 2.0  # tis: the cap C on the importance weight (> 0)
    is_low: float = 0.5  # mis: rho below this is masked (0 <= is_low < 1)
    is_high: float = 2.0  # mis: rho above this is masked (> 1)
    is_level: str = "token"  # token (rho per token) | sequence (rho = the response's geometric mean, one weight)
    # Where the update's old log-probs come from (rlhf/rl/old_logprobs.py): recompute (the actor's scoring
    # forward, every step) | sampler (the sampler's own, Rollout.logp_gen: that forward skipped; the gap
    # measured on the first step and every old_logprobs_check_every steps, and a gap over
    # old_logprobs_max_gap falls back to recompute for the rest of the run) | auto (recompute on the first 2
    # steps and every old_logprobs_check_every; the sampler's reused while the last check stayed under)
    # The distribution the trainer's log-probs are taken under (old, new and reference alike): full (softmax
    # of logits / temperature over the whole vocabulary) | sampler (with rollout.top_k / rollout.top_p
    # truncating it as the sampler did, renormalised: the ratio and the sampler gap compare the distribution
    # the tokens were drawn from; the same as full while top_k=0 and top_p=1). Not with engine.kernels.
    trainer_logprobs: str = "full"  # full | sampler: the trainer's log-probs over the whole vocabulary, or truncated by rollout.top_k/top_p as sampled
    old_logprobs: str = "auto"  # recompute | sampler | auto: the update's old log-probs (sampler: no actor scoring forward)
    old_logprobs_max_gap: float = 1e-3  # sampler/auto: the largest gen_logprob_gap (mean |trainer - sampler| per token) reused
    old_logprobs_check_every: int = 10  # sampler/auto: recompute (and measure the gap) every this many steps
    # What trains the actor: rl (ppo.advantage_estimator + ppo.policy_loss), online_dpo (the DPO-family
    # loss on each step's best-vs-worst sampled pairs, online_dpo.*), distill (the reference's place
    # taken by teacher.model, the per-token reverse KL to it the only reward); algorithm= sets it
    objective: str = "rl"
    # DAPO's overlong reward shaping: responses in the last overlong_buffer tokens of
    # rollout.max_new_tokens lose up to overlong_penalty (a linear ramp) from their score; 0 = off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0  # the penalty at the full budget
    cliprange_value: float = 0.2  # value updates clipped to +-this around the old values
    ppo_epochs: int = 1  # passes over each step's rollouts
    whiten_advantages: bool = False  # normalise advantages to mean 0, std 1 (over all ranks)
    ptx_coef: float = 0.0  # > 0: add ptx_coef x the SFT loss on data.ptx_path to the actor loss
    ema_decay: float = 0.0  # > 0: keep an EMA of the actor (saved as model_ema/)


@dataclass(kw_only=True)
class OnlineDPOConfig:
    """algorithm=online_dpo (ppo.objective=online_dpo): the DPO-family loss of rlhf/algos/preference.py on
    each step's pairs, the best vs the worst scored response of every prompt group (rlhf/rl/online_dpo.py)."""

    loss_type: str = "sigmoid"  # sigmoid (DPO) | ipo | hinge | robust | simpo (reference-free), as dpo.loss_type
    beta: float = 0.1  # inverse temperature of the implicit reward beta * (logp - logp_ref), summed over the response
    sft_coef: float = 0.0  # > 0: + sft_coef x the chosen response's NLL per token (RPO), as dpo.sft_coef


@dataclass(kw_only=True)
class RolloutConfig:
    prompts_per_step: int = 64  # prompts per step (global); each is answered n_samples_per_prompt times
    # Responses sampled per prompt (a prompt group: grpo/rloo baselines); rows per step =
    # prompts_per_step x n_samples_per_prompt, and the batch sizes below count rows
    n_samples_per_prompt: int = 1
    mini_batch_size: int = 32  # rows per optimizer step (global)
    micro_batch_size: int = 32  # rows per forward on one rank (at most mini_batch_size / world size)
    # Rows per scoring forward on one rank (reference, critic, reward model, and the actor when it recomputes
    # the old log-probs): no gradient, no activations kept, so larger than the training micro-batch; null =
    # 2 x micro_batch_size (at most the step's rows per rank)
    score_batch_size: int | None = None  # rows per no-grad scoring forward on one rank (null = 2 x micro_batch_size)
    # Micro-batches by a budget of computed tokens instead of rows, for the update's and the scoring's forwards
    # on each rank: rows grouped by length, each forward trimmed to its own width (packed: its real tokens),
    # a prompt's samples together under shared_prompt_forward; micro_batch_size and score_batch_size then only
    # size nothing but the ptx batches. null = row counts (rlhf/data/microbatch.py; docs/algorithms.md)
    micro_batch_tokens: int | None = None  # tokens (rows x trimmed width) per forward on one rank; null = rows
    # Rows of one forward that share a prompt (GRPO/RLOO's n samples of each prompt) run the prompt once,
    # its KV cache gathered for each row, and only their responses on it: the scoring and update forwards
    # of every model give the same values up to rounding with fewer tokens (rlhf/modeling/roles.py
    # shared_prompt_forward; docs/engine.md). null = on unless data.packing=true packs the rows instead.
    shared_prompt_forward: bool | None = None  # run a prompt shared by several rows of a forward once (null = unless packed)
    # Under shared_prompt_forward, a forward's responses run on their prompts' cache in sub-batches by length,
    # each at its own width (the padding of short responses to the longest not computed), at most this many;
    # 1 = one sub-batch trimmed to the longest response. null = auto: 8 on the CPU where the model's
    # parameters are whole, 1 on CUDA (unmeasured there) and under FSDP2 (each sub-batch would all-gather the
    # parameters again). rlhf/modeling/roles.py length_buckets; docs/engine.md
    length_buckets: int | None = None  # sub-batches by response length of a shared-prompt forward (null = auto)
    max_new_tokens: int = 16  # response tokens sampled per prompt
    temperature: float = 1.0  # sampling temperature
    top_k: int = 0  # sample among the k most likely tokens (0 = off)
    top_p: float = 1.0  # nucleus sampling (1 = off)
    # Multi-turn rollouts (rlhf/rl/multiturn.py, docs/environments.md): an Environment subclass as
    # module:Class (the built-in calculator: rlhf.rl.environments.calculator:Calculator); null = one turn
    env: str | None = None  # multi-turn environment module:Class (null = single-turn responses)
    max_turns: int = 4  # with rollout.env: model turns per episode at most (each up to max_new_tokens)
    # with rollout.env: response-side tokens of one episode (model turns + observations) at most; null =
    # max_turns x max_new_tokens
    max_episode_tokens: int | None = None  # with rollout.env: token budget of one episode (null = max_turns x max_new_tokens)
    turn_stop: list[str] = field(default_factory=list)  # with rollout.env: strings that end a model turn besides EOS (e.g. "</call>")
    env_workers: int = 2  # with rollout.env: worker processes running the environments (0 = in this process, no timeout)
    env_timeout_s: float = 30.0  # with rollout.env and env_workers > 0: seconds one reset/step call may take
    # with rollout.env: a step where more than this fraction of the episodes fail (raise, time out, garbage)
    # stops the run with an error naming the environment
    max_env_failure_fraction: float = 0.5  # with rollout.env: fraction of a step's episodes allowed to fault
    # engine.placement=split (docs/engine.md, "Split placement"): sync = the generation ranks sample step s
    # with the weights after step s-1 (the trainers wait, as colocated); async = with weights at most
    # max_staleness steps old, so generation overlaps training (the importance correction, ppo.is_correction,
    # weighs each token against the version trained)
    mode: str = "sync"  # sync | async (engine.placement=split: generation overlaps training, weights up to max_staleness steps old)
    max_staleness: int = 1  # rollout.mode=async: step s is sampled with the weights after step s-1-k, k <= this (0 = sync)


@dataclass(kw_only=True)
class PPOTrainConfig(CadenceConfig):
    stop_on_alarm: bool = False  # a reward-hacking alarm (alarms.*) saves a checkpoint and ends the run cleanly
    # The held-out evaluation that picks the exported actor: gold where a judge applies, else the held-out
    # (sampled) reward; an evaluation every train.eval_every steps and after the last
    export_best: bool = False  # export the actor of the best held-out evaluation as model/ (not the last step's); summary says which
    early_stop_patience: int = 0  # stop after this many evaluations in a row without a better held-out score (0 = never)
    # A KL budget (nats; null = none): an evaluation whose held-out KL to the reference is over it ends the run,
    # and the actor of the last evaluation within it is exported (with export_best: the best within it)
    kl_budget: float | None = None


@dataclass(kw_only=True)
class RewardSourcesConfig:
    """Where the RL reward comes from (rlhf/rl/rewards.py): one source, or a weighted sum of several."""

    sources: list[str] = field(default_factory=lambda: ["model"])  # model | judge | answer | function (several: summed)
    weights: list[float] = field(default_factory=list)  # one weight per source ([] = all 1.0)
    function: str | None = None  # the function source: module:function, called as fn(prompt, response, row) -> float
    # The http source (rlhf/rl/remote.py): a `python -m rlhf.serve` server (or any server speaking its
    # POST /score), e.g. http://127.0.0.1:8000; its API key from the environment variable RLHF_REWARD_API_KEY
    url: str | None = None  # the http source: the reward server's base URL (POST <url>/score)
    timeout_s: float = 30.0  # the http source: seconds one request may take before it counts as a timeout and is retried
    max_concurrency: int = 4  # the http source: requests in flight at once (each of at most request_rows rows)
    retries: int = 3  # the http source: retries of a failed request (exponential backoff with jitter) before its rows are masked
    backoff_s: float = 0.5  # the http source: the first retry waits about this long, each next one twice as long (x0.5-1.5 jitter)
    request_rows: int = 64  # the http source: rows per request (a step's rows split into requests of this many)
    # the http source: a server unreachable (connections refused) for longer than this stops the run with an
    # error naming reward.url, a checkpoint of the last completed step written first
    down_timeout_s: float = 120.0
    # A reward-model ensemble (rlhf/rl/rewards.py RewardEnsemble): these reward models score every response
    # beside reward_model.model (the model source then is the ensemble; scripts/run_all.sh RM_ENSEMBLE=N
    # trains them); their scores combine by ensemble_agg, and their std per row is the step's reward_disagreement
    ensemble_models: list[str] = field(default_factory=list)  # more reward models scoring beside reward_model.model ([] = one)
    ensemble_agg: str = "mean"  # mean | min | mean_minus_std (mean - ensemble_lambda x std): the ensemble's reward
    ensemble_lambda: float = 1.0  # mean_minus_std: the weight of the members' std (>= 0)


@dataclass(kw_only=True)
class AlarmsConfig:
    """Reward-hacking alarms (rlhf/rl/alarms.py): every step, over the last `window` steps' metrics; each
    fires at or beyond its threshold (one WARN line, `alarm_<name>` in metrics.jsonl)."""

    enabled: bool = True  # compute the alarms (false: none is computed, logged or acted on)
    window: int = 10  # steps in each trend; the baseline is the first `window` steps of the run
    kl_slope: float = 0.1  # kl: least-squares growth of the rollouts' KL, nats per step, over the window
    entropy_ratio: float = 0.5  # entropy: window's mean entropy at most this x the baseline's
    length_drift: float = 0.5  # length: window's mean response length off the baseline's by this fraction
    clipfrac: float = 0.2  # clipfrac: window's mean policy clip fraction at least this
    gold_drop: float = 8.0  # gold: held-out gold score this many points below its best while the reward rose
    gen_kl: float = 0.01  # gen: the step's gen_kl (k3 KL, sampler || trainer, per token) at least this
    # tools (rollout.env): window's mean tool calls or turns per episode at most this x the baseline's
    tool_collapse: float = 0.5  # tools: tool calls / turns per episode collapsed to this fraction of the baseline
    disagreement_ratio: float = 2.0  # disagreement: the reward ensemble's window mean std at least this x the baseline's


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
        model="outputs/sft", lora=II("model.lora"), lr=5e-5, scheduler="constant", warmup_steps=5,
    ))  # the policy trained (starts from SFT)
    critic: TrainedModelConfig = field(default_factory=lambda: TrainedModelConfig(
        model="outputs/reward", lora=II("model.lora"), lr=5e-4, scheduler="constant", warmup_steps=5,
    ))  # the value model trained (starts from the reward model)
    reference: FrozenModelConfig = field(default_factory=FrozenModelConfig)  # the frozen policy the KL is measured to
    reward_model: FrozenModelConfig = field(default_factory=FrozenModelConfig)  # the frozen scorer of responses
    # algorithm=distill: the frozen teacher (a causal LM with the actor's tokenizer, any size) scoring the
    # student's sampled tokens; it takes the reference's place. Read only by ppo.objective=distill
    teacher: FrozenModelConfig = field(default_factory=FrozenModelConfig)
    online_dpo: OnlineDPOConfig = field(default_factory=OnlineDPOConfig)  # algorithm=online_dpo: the pair loss
    ppo: PPOAlgoConfig = field(default_factory=PPOAlgoConfig)  # PPO's algorithm settings
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # generation and batch sizes of each step
    train: PPOTrainConfig = field(default_factory=lambda: PPOTrainConfig(
        log_every=1, eval_every=10, save_every=10,
    ))  # step counts, logging and checkpoints
    eval: GenerationConfig = field(default_factory=GenerationConfig)  # greedy generations for the gold score
    reward: RewardSourcesConfig = field(default_factory=RewardSourcesConfig)  # the reward: model, judge, answer, function
    alarms: AlarmsConfig = field(default_factory=AlarmsConfig)  # reward-hacking alarms and their thresholds


@dataclass(kw_only=True)
class EvaluateConfig:
    """`python -m rlhf.evaluate`: one model scored on held-out data exactly as the stages score theirs."""

    output_dir: str = "outputs/evaluate"  # config.yaml, metrics.jsonl, samples.jsonl and summary.json go here
    mode: str = "auto"  # auto (reward when the model's architectures end in ForSequenceClassification) | policy | reward
    seed: int = 1234  # seeds torch before loading (and the draws of eval.greedy=false)
    batch_size: int = 32  # rows per forward (perplexity, pair scoring); a stage's micro batch gives its figures exactly
    # mode=reward with data.eval_path=null scores these pairs (conf/evaluate.yaml: the shipped held-out
    # pairs while data.path is the shipped file); null = the reward stage's held-out share of data.path
    default_pairs_path: str | None = None  # mode=reward without data.eval_path: these pairs (null: data.path's held-out share)
    model: ModelConfig = field(default_factory=ModelConfig)  # a stage's output_dir, a HF dir or hub name; its tokenizer
    data: DataConfig = field(default_factory=DataConfig)  # eval_prompts_path, eval_path, tokenization as the stages
    engine: EngineConfig = field(default_factory=stage_engine)  # sharding, precision, generation path
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # where metrics.jsonl also goes (wandb)
    eval: GenerationConfig = field(default_factory=GenerationConfig)  # mode=policy: generations (as the stages' eval.*)


@dataclass(kw_only=True)
class ServedRewardConfig:
    """What `python -m rlhf.serve` scores with: a reward model, the gold judge or a function."""

    source: str = "auto"  # auto (function when reward.function is set, else model) | model | judge | function
    # The reward model: a reward stage's output_dir (its model/ is read) or a HF directory / hub name
    model: str | None = field(default="outputs/reward", metadata={"hub": "model"})
    function: str | None = None  # module:function, per row fn(prompt, response, row) or TRL's batched convention


@dataclass(kw_only=True)
class ServerConfig:
    """The HTTP side of `python -m rlhf.serve` (rlhf/rl/service.py)."""

    host: str = "127.0.0.1"  # the address bound; another than loopback needs an API key
    port: int = 8000  # the TCP port (0 = a free one, printed at start)
    # The key clients send as `Authorization: Bearer <key>`; null = the environment variable
    # RLHF_REWARD_API_KEY, or none (refused unless host is a loopback address)
    api_key: str | None = None
    max_batch: int = 64  # rows per scoring forward: rows of concurrent requests are batched up to this
    max_wait_ms: float = 5.0  # how long the first queued row waits for others to fill a batch
    max_rows: int = 4096  # rows one request may carry (more: refused with 413)
    max_body_mb: float = 16.0  # bytes one request body may have, in MiB (more: refused with 413)
    log_every_s: float = 30.0  # seconds between the server's log lines of request counts, latencies and batch sizes


@dataclass(kw_only=True)
class ServeConfig:
    """`python -m rlhf.serve`: a reward model, the judge or a function scored over HTTP."""

    output_dir: str = "outputs/serve"  # config.yaml and, when the server stops, summary.json (its counts) go here
    seed: int = 1234  # seeds torch before loading (a model built from a config)
    model: ModelConfig = field(default_factory=ModelConfig)  # tokenizer and dtype for the reward model (name_or_path unused)
    data: DataConfig = field(default_factory=DataConfig)  # max_len, max_prompt_len, overlong, add_bos: text rows' tokenization
    engine: EngineConfig = field(default_factory=stage_engine)  # device and precision of the reward model
    reward: ServedRewardConfig = field(default_factory=ServedRewardConfig)  # what scores the rows
    server: ServerConfig = field(default_factory=ServerConfig)  # address, key, batching and limits


SCHEMAS = {"sft": SFTConfig, "reward": RewardConfig, "dpo": DPOConfig, "ppo": PPOConfig, "evaluate": EvaluateConfig,
           "serve": ServeConfig}
