"""Coming from DeepSpeed: a `ds_config.json` read onto our config with `engine.ds_config=PATH`.

    python -m rlhf.sft engine.ds_config=ds_zero2.json                  # the file's settings
    python -m rlhf.sft engine.ds_config=ds_zero2.json train.lr=1e-4    # the command line wins
    python -m rlhf.sft engine.ds_config=ds_zero2.json --cfg job        # what the config became

`map_ds_config` is pure: a parsed ds_config -> {our dotted key: value}, and the DeepSpeed keys that
set nothing here, each with the reason. `ds_overrides` (called by rlhf/run/app.py before Hydra runs)
turns the mapping into Hydra overrides placed before the user's, leaving out every key the command
line sets itself (directly, or through a config group chosen there, e.g. `engine=zero3` sets
engine.stage), so Hydra composes the file's values and the command line still wins.

Rules (docs/deepspeed.md has the whole table):
- "auto" (the Hugging Face integration's placeholder) and a key the file leaves out keep our value.
  The exceptions are the schedulers' end points, part of what the type means: WarmupDecayLR decays
  to warmup_min_lr (default 0), WarmupCosineLR to cos_min_ratio (default 1e-4).
- Batch sizes follow DeepSpeed: train_batch_size = train_micro_batch_size_per_gpu x
  gradient_accumulation_steps x world size (WORLD_SIZE, as torchrun sets it, else 1); any two give
  the third, one of train_batch_size/train_micro_batch_size_per_gpu alone means no accumulation.
  SFT/reward: -> train.global_batch_size, train.micro_batch_size. PPO: the optimizer-step batch ->
  rollout.mini_batch_size (rows), the micro batch -> rollout.micro_batch_size; the optimizer,
  scheduler and clipping go to actor.* and critic.* both.
- A feature we do not have (NVMe offload, pipeline, MoE, ...) is an error naming the key and what
  to use instead; a key that only tunes DeepSpeed's internals is listed as ignored with the reason;
  a key this module does not know is an error (a misspelt key would otherwise pass unnoticed).
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

from rlhf.config.cli import schema_keys
from rlhf.core.errors import ConfigError

AUTO = "auto"
# fp16.loss_scale > 0 (a static scale) = our dynamic scaler pinned: min = initial = the scale, and a
# window no run reaches, so it never grows; an overflowing step is still skipped, as DeepSpeed does.
STATIC_LOSS_SCALE_WINDOW = 2**31 - 1
SCHEDULERS = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}

INTERNALS = "tunes DeepSpeed's own bucketing/communication; FSDP2 and DDP schedule their own"
PROFILING = "DeepSpeed diagnostics; metrics.jsonl records each step's time split and the engine prints its memory plan"
# Top-level keys that change nothing here, with the reason.
IGNORED = {
    "prescale_gradients": "gradient averaging is DDP's/FSDP2's own, in fp32",
    "gradient_predivide_factor": "gradient averaging is DDP's/FSDP2's own, in fp32",
    "communication_data_type": "gradients are reduced in fp32 (MixedPrecisionPolicy reduce_dtype)",
    "fp32_allreduce": "gradients are reduced in fp32 already",
    "sparse_gradients": "embedding gradients are dense",
    "zero_allow_untested_optimizer": "the optimizer is always AdamW",
    "zero_force_ds_cpu_optimizer": "the CPU-offloaded optimizer step is torch's AdamW",
    "aio": "asynchronous NVMe I/O tuning; there is no NVMe offload",
    "checkpoint": "checkpoints are torch.distributed.checkpoint shards, written atomically, loadable at any world size",
    "data_types": "gradients accumulate in fp32 (fp32 master weights)",
    "dataloader_drop_last": "each stage builds its own data order from whole batches",
    "wall_clock_breakdown": PROFILING,
    "memory_breakdown": PROFILING,
    "dump_state": PROFILING,
    "flops_profiler": PROFILING,
    "comms_logger": PROFILING,
    "timers": PROFILING,
    "comet": "metrics go to metrics.jsonl and the loggers of logger=... (wandb, tensorboard, mlflow, trackio, csv), "
             "not Comet",
    "nebula": "checkpoints are written locally by torch.distributed.checkpoint",
    "disable_allgather": INTERNALS,
}
# Top-level features we do not have: an error while they are on, with what to use instead.
UNSUPPORTED = {
    "pipeline": "pipeline parallelism is not available: ZeRO stage 3 (zero_optimization.stage 3, engine.stage=3) "
                "shards a model too large for one device",
    "moe": "DeepSpeed's mixture-of-experts layers are not available: a transformers MoE model trains as any model",
    "tensor_parallel": "tensor parallelism is not available: use ZeRO stage 3 (engine.stage=3)",
    "sequence_parallel_size": "sequence parallelism is not available: use activation checkpointing "
                              "(engine.activation_checkpointing=true) for long sequences",
    "elasticity": "elastic training is not available: a run resumes from its checkpoint at another world size instead",
    "amp": "Apex AMP is not available: use the bf16 or fp16 block (engine.precision)",
    "torch_autocast": "DeepSpeed's torch_autocast mode is not available: use the bf16 or fp16 block (engine.precision)",
    "compile": "DeepSpeed's compile block (DeepCompile passes) is not available; remove it (engine.compile=true "
               "torch.compiles each transformer block instead, as DeepSpeed's engine.compile() does)",
    "compression_training": "DeepSpeed Compression is not available; remove the block",
    "data_efficiency": "DeepSpeed's data efficiency library is not available; remove the block",
    "curriculum_learning": "curriculum learning is not available; remove the block",
    "sparse_attention": "DeepSpeed's sparse attention is not available; remove the block",
    "progressive_layer_drop": "progressive layer drop is not available; remove the block",
    "eigenvalue": "eigenvalue computation is not available; remove the block",
    "quantize_training": "quantized training (MoQ) is not available; remove the block",
    "autotuning": "the autotuner is not available; set the ZeRO stage and micro-batch in the file or on the command line",
}
HANDLED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "fp16", "bf16",
           "bfloat16", "optimizer", "scheduler", "gradient_clipping", "zero_optimization", "activation_checkpointing",
           "steps_per_print", "wandb", "tensorboard", "csv_monitor", "hybrid_engine")

ZERO_INTERNALS = (
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter", "reduce_bucket_size",
    "contiguous_gradients", "grad_hooks", "round_robin_gradients", "sub_group_size", "elastic_checkpoint",
    "load_from_fp32_weights", "legacy_stage1", "memory_efficient_linear", "use_multi_rank_bucket_allreduce",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_model_persistence_threshold", "max_live_parameters",
    "max_reuse_distance", "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
    "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params", "module_granularity_threshold",
    "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings", "cpu_offload_use_pin_memory",
)
ZERO_SAVE = ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
             "gather_16bit_weights_on_model_save")
# ZeRO++ / MiCS: key -> its "off" value
ZERO_PLUS = {"zero_hpz_partition_size": 1, "zero_quantized_weights": False, "zero_quantized_gradients": False,
             "zero_quantized_nontrainable_weights": False, "mics_shard_size": -1, "mics_hierarchical_params_gather": False}
OFFLOAD_KEYS = ("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "fast_init", "ratio",
                "pipeline", "pipeline_read", "pipeline_write")


@dataclass(frozen=True)
class Targets:
    """The keys of one stage's schema that DeepSpeed keys land on (`targets_for`)."""

    app: str = "this app"  # for messages: "python -m rlhf.evaluate"
    optim: tuple[str, ...] = ()  # groups holding lr, betas, eps, weight_decay, scheduler, ..., grad_clip
    batch: tuple[str, str] | None = None  # (rows per optimizer step over all ranks, rows per forward on one rank)
    max_steps: str | None = None  # the run's optimizer steps, where the schedule ends (not PPO's steps)
    log_every: str | None = None
    logger: bool = False


def targets_for(schema: type, app: str = "this app") -> Targets:
    """Where DeepSpeed's keys go in `schema` (SFTConfig, PPOConfig, ...), found from its keys."""
    keys = {k.path for k in schema_keys(schema)}
    if "train.global_batch_size" in keys:
        batch = ("train.global_batch_size", "train.micro_batch_size")
    elif "rollout.mini_batch_size" in keys:
        batch = ("rollout.mini_batch_size", "rollout.micro_batch_size")
    else:
        batch = None
    return Targets(
        app=app, optim=tuple(p for p in ("train", "actor", "critic") if f"{p}.lr" in keys), batch=batch,
        max_steps="train.max_steps" if batch and batch[0].startswith("train.") else None,
        log_every="train.log_every" if "train.log_every" in keys else None, logger="logger.wandb" in keys,
    )


@dataclass
class Mapping:
    overrides: dict[str, Any] = field(default_factory=dict)  # our dotted key -> value, in the file's order
    sources: dict[str, str] = field(default_factory=dict)  # our key -> the DeepSpeed key(s) it came from
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (DeepSpeed key, why it sets nothing here)


# ----------------------------------------------------------------------------- value checks


def _is_auto(v: Any) -> bool:
    return isinstance(v, str) and v == AUTO


def _number(key: str, v: Any, *, integer: bool = False, minimum: float | None = None, above: float | None = None):
    """`v` as an int (`integer`) or float, else ConfigError naming the DeepSpeed `key`."""
    kind = "an integer" if integer else "a number"
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (not integer or float(v).is_integer())
    if ok:
        v = int(v) if integer else float(v)
        ok = (minimum is None or v >= minimum) and (above is None or v > above)
    if not ok:
        bound = f" >= {minimum:g}" if minimum is not None else f" > {above:g}" if above is not None else ""
        raise ConfigError(f"{key} must be {kind}{bound} (or \"auto\"), got {v!r}")
    return v


def _flag(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{key} must be true or false, got {v!r}")
    return v


def _block(key: str, v: Any, known: tuple[str, ...] | set[str] | None = None) -> dict:
    """`v` as a JSON object whose keys are all in `known`, else ConfigError naming the key."""
    if not isinstance(v, dict):
        raise ConfigError(f"{key} must be a JSON object, got {v!r}")
    if known is not None:
        unknown = [k for k in v if k not in known]
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]} is not a DeepSpeed key this mapping knows "
                              f"({key} takes: {', '.join(sorted(known))}); remove it from the file")
    return v


def _enabled(key: str, block: dict) -> bool | str:
    """A block's `enabled`: true, false (also when absent, DeepSpeed's default) or "auto"."""
    v = block.get("enabled", False)
    return v if _is_auto(v) else _flag(f"{key}.enabled", v)


# ----------------------------------------------------------------------------- the mapping


class _Mapper:
    def __init__(self, targets: Targets, world_size: int):
        self.t, self.world, self.m = targets, world_size, Mapping()

    def set(self, src: str, key: str, value: Any) -> None:
        self.m.overrides[key] = value
        self.m.sources[key] = src

    def ignore(self, src: str, reason: str) -> None:
        self.m.ignored.append((src, reason))

    def set_optim(self, src: str, name: str, value: Any) -> None:
        for group in self.t.optim:
            self.set(src, f"{group}.{name}", value)

    def auto(self, src: str) -> None:
        self.ignore(src, "auto: our value is kept")

    def trains_nothing(self, src: str) -> None:
        self.ignore(src, f"{self.t.app} trains nothing")

    # -- batch sizes
    def batch(self, ds: dict) -> None:
        names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        given = {}
        for k in names:
            if k in ds:
                if _is_auto(ds[k]):
                    self.auto(k)
                elif self.t.batch is None:
                    self.trains_nothing(k)
                else:
                    given[k] = _number(k, ds[k], integer=True, minimum=1)
        if not given:
            return
        total, micro, accum = (given.get(k) for k in names)
        w = self.world
        where = f"world size {w} (WORLD_SIZE)"
        if total is not None and micro is not None and accum is not None:
            if total != micro * accum * w:
                raise ConfigError(
                    f"train_batch_size ({total}) must equal train_micro_batch_size_per_gpu ({micro}) x "
                    f"gradient_accumulation_steps ({accum}) x {where} = {micro * accum * w} (DeepSpeed's rule)")
            src = ("train_batch_size (= micro x gradient_accumulation_steps x world size)",
                   "train_micro_batch_size_per_gpu")
        elif total is not None and (micro is not None or accum is not None):
            other, name = (micro, "train_micro_batch_size_per_gpu") if micro is not None else (
                accum, "gradient_accumulation_steps")
            if total % (other * w):
                raise ConfigError(f"train_batch_size ({total}) must be a multiple of {name} ({other}) x {where} = "
                                  f"{other * w}: DeepSpeed derives the third of the batch sizes from the other two")
            micro = micro if micro is not None else total // (accum * w)
            src = "train_batch_size", ("train_micro_batch_size_per_gpu" if name.startswith("train") else
                                       "train_batch_size / (gradient_accumulation_steps x world size)")
        elif micro is not None:
            accum = accum or 1  # DeepSpeed: the micro batch alone means no accumulation
            total = micro * accum * w
            src = ("train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size"
                   if "gradient_accumulation_steps" in given else "train_micro_batch_size_per_gpu x world size",
                   "train_micro_batch_size_per_gpu")
        elif total is not None:
            if total % w:
                raise ConfigError(f"train_batch_size ({total}) must be a multiple of the {where}: with no micro "
                                  "batch or accumulation given, DeepSpeed splits it evenly over the ranks")
            micro, src = total // w, ("train_batch_size", "train_batch_size / world size")
        else:
            raise ConfigError("gradient_accumulation_steps alone does not fix the batch: set train_batch_size or "
                              "train_micro_batch_size_per_gpu too (DeepSpeed's rule)")
        self.set(src[0], self.t.batch[0], total)
        self.set(src[1], self.t.batch[1], micro)

    # -- precision and loss scaling
    def precision(self, ds: dict) -> None:
        states = {}
        for k in ("fp16", "bf16", "bfloat16"):  # bfloat16: DeepSpeed's older name of bf16
            if k in ds:
                states[k] = _enabled(k, _block(k, ds[k]))
        bf16 = next((k for k in ("bf16", "bfloat16") if states.get(k) is True), None)
        if states.get("fp16") is True and bf16:
            raise ConfigError(f"fp16.enabled and {bf16}.enabled cannot both be true (DeepSpeed refuses it too)")
        if states.get("fp16") is True:
            self.set("fp16.enabled", "engine.precision", "fp16")
        elif bf16:
            self.set(f"{bf16}.enabled", "engine.precision", "bf16")
        elif states and AUTO not in states.values():  # mixed precision switched off: DeepSpeed trains in fp32
            self.set(" and ".join(f"{k}.enabled=false" for k in states), "engine.precision", "fp32")
        fp32 = "=false" in self.m.sources.get("engine.precision", "")
        for k, state in states.items():
            if state == AUTO:
                self.auto(f"{k}.enabled")
            elif state is False and not fp32:
                self.ignore(f"{k}.enabled", "false")
        for k in ("bf16", "bfloat16"):
            if k in ds:
                block = _block(k, ds[k], ("enabled", "immediate_grad_update", "check_grad_overflow",
                                          "bf16_master_weights_and_grads", "bf16_optimizer_states"))
                for sub in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
                    if sub in block and _flag(f"{k}.{sub}", block[sub]):
                        raise ConfigError(f"{k}.{sub}=true is not available: the engine keeps fp32 master weights, "
                                          "gradients and optimizer state under bf16; remove the key")
                for sub in ("immediate_grad_update", "check_grad_overflow"):
                    if sub in block:
                        self.ignore(f"{k}.{sub}", "bf16 optimizer internals: the step runs on fp32 master weights")

    def fp16(self, b: dict) -> None:
        _block("fp16", b, ("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
                           "hysteresis", "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"))
        rest = [k for k in b if k != "enabled"]
        if _enabled("fp16", b) is False:
            for k in rest:
                self.ignore(f"fp16.{k}", "fp16 is off (fp16.enabled=false)")
            return
        if "fp16_master_weights_and_grads" in b and _flag("fp16.fp16_master_weights_and_grads",
                                                          b["fp16_master_weights_and_grads"]):
            raise ConfigError("fp16.fp16_master_weights_and_grads=true is not available: the engine keeps fp32 "
                              "master weights and gradients under fp16; remove the key")
        if "auto_cast" in b:
            self.ignore("fp16.auto_cast", "the engine's mixed-precision policy casts the forward's inputs")
        scale = b.get("loss_scale", 0)
        static = not _is_auto(scale) and _number("fp16.loss_scale", scale, minimum=0) > 0
        for k in rest:
            v = b[k]
            if k in ("auto_cast", "fp16_master_weights_and_grads"):
                continue
            if _is_auto(v):
                self.auto(f"fp16.{k}")
            elif k == "loss_scale":
                if static:
                    src = f"fp16.loss_scale={v:g} (static: our dynamic scaler pinned, an overflowing step skipped)"
                    self.set(src, "engine.initial_loss_scale", float(v))
                    self.set(src, "engine.min_loss_scale", float(v))
                    self.set(src, "engine.loss_scale_window", STATIC_LOSS_SCALE_WINDOW)
                else:
                    self.ignore("fp16.loss_scale", "0 = dynamic loss scaling, which the engine does")
            elif static:
                self.ignore(f"fp16.{k}", f"fp16.loss_scale={scale:g} is a static scale")
            elif k == "initial_scale_power":
                self.set("fp16.initial_scale_power", "engine.initial_loss_scale",
                         float(2 ** _number("fp16.initial_scale_power", v, integer=True, minimum=0)))
            elif k == "loss_scale_window":
                self.set("fp16.loss_scale_window", "engine.loss_scale_window",
                         _number("fp16.loss_scale_window", v, integer=True, minimum=1))
            elif k == "min_loss_scale":
                self.set("fp16.min_loss_scale", "engine.min_loss_scale", _number("fp16.min_loss_scale", v, above=0))
            elif k == "hysteresis":
                h = _number("fp16.hysteresis", v, integer=True, minimum=1)
                self.ignore("fp16.hysteresis", "1, as the engine: the scale halves at every overflow" if h == 1 else
                            f"the engine's scale halves at every overflow (hysteresis 1); DeepSpeed's {h} lets "
                            f"{h - 1} overflow(s) pass first")
            elif k == "consecutive_hysteresis":
                self.ignore("fp16.consecutive_hysteresis", "the engine has no hysteresis (it halves at every overflow)")

    # -- optimizer, schedule, clipping
    def optimizer(self, b: dict) -> None:
        _block("optimizer", b, ("type", "params"))
        t = b.get("type")
        if not (isinstance(t, str) and t.lower() in ("adam", "adamw")):
            raise ConfigError(f"optimizer.type={t!r} is not available: the engine's optimizer is AdamW (decoupled "
                              "weight decay, torch.optim.AdamW); use \"AdamW\" or \"Adam\", or leave the block out")
        p = _block("optimizer.params", b.get("params", {}),
                   ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "fused", "foreach",
                    "capturable", "amsgrad", "bias_correction"))
        self.ignore("optimizer.type", "AdamW, as the engine's" if t.lower() == "adamw" else
                    "Adam with adam_w_mode (DeepSpeed's default) is AdamW, as the engine's")
        if t.lower() == "adam" and "adam_w_mode" in p and not _flag("optimizer.params.adam_w_mode", p["adam_w_mode"]):
            wd = p.get("weight_decay", 0)
            if _is_auto(wd) or wd != 0:
                raise ConfigError("optimizer.params.adam_w_mode=false (Adam with L2 weight decay) is not available: "
                                  "the engine's AdamW decays weights decoupled; set adam_w_mode true, or weight_decay 0")
            self.ignore("optimizer.params.adam_w_mode", "false, but weight_decay is 0: Adam and AdamW are the same")
        elif "adam_w_mode" in p:
            self.ignore("optimizer.params.adam_w_mode", "AdamW, as the engine's")
        for k, v in p.items():
            src = f"optimizer.params.{k}"
            if k == "adam_w_mode":
                continue
            if _is_auto(v):
                self.auto(src)
            elif k == "lr":
                self.set_optim(src, "lr", _number(src, v, above=0))
            elif k == "betas":
                if not (isinstance(v, list) and len(v) == 2):
                    raise ConfigError(f"{src} must be two numbers [beta1, beta2], got {v!r}")
                self.set_optim(src, "betas", [_number(src, x, minimum=0) for x in v])
            elif k == "eps":
                self.set_optim(src, "eps", _number(src, v, above=0))
            elif k == "weight_decay":
                self.set_optim(src, "weight_decay", _number(src, v, minimum=0))
            elif k in ("amsgrad", "bias_correction"):
                if _flag(src, v) != (k == "bias_correction"):
                    raise ConfigError(f"{src}={str(v).lower()} is not available: the engine's AdamW has "
                                      "bias correction and no AMSGrad; remove the key")
                self.ignore(src, "as the engine's AdamW")
            else:
                self.ignore(src, "an implementation choice: the engine runs torch.optim.AdamW")

    def scheduler(self, b: dict, optimizer: dict | None) -> None:
        _block("scheduler", b, ("type", "params"))
        t = b.get("type")
        if t not in SCHEDULERS:
            raise ConfigError(f"scheduler.type={t!r} is not available: the engine's schedules are a linear warmup "
                              "then constant, linear or cosine decay; use WarmupLR, WarmupDecayLR or WarmupCosineLR "
                              "(or train.scheduler=constant|linear|cosine)")
        known = {"warmup_num_steps", "warmup_type", "last_batch_iteration"}
        known |= {"warmup_min_ratio", "cos_min_ratio", "total_num_steps"} if t == "WarmupCosineLR" else {
            "warmup_min_lr", "warmup_max_lr"} | ({"total_num_steps"} if t == "WarmupDecayLR" else set())
        p = _block("scheduler.params", b.get("params", {}), known)
        self.set_optim(f"scheduler.type={t}", "scheduler", SCHEDULERS[t])
        pre = "scheduler.params."
        get = {k: v for k, v in p.items() if not _is_auto(v)}
        for k in p:
            if k not in get:
                self.auto(pre + k)
        warmup = get.get("warmup_num_steps")
        if warmup is not None:
            self.set_optim(pre + "warmup_num_steps", "warmup_steps", _number(pre + "warmup_num_steps", warmup,
                                                                                integer=True, minimum=0))
        if warmup != 0 and get.get("warmup_type", "log") != "linear":
            given = get.get("warmup_type")
            self.ignore(pre + "warmup_type", f"{given or 'absent: DeepSpeed warms up by log by default'}; the "
                        "engine's warmup is linear, (s + 1) / warmup_steps of the peak")
        elif "warmup_type" in get:
            self.ignore(pre + "warmup_type", "linear, as the engine's warmup")
        if "last_batch_iteration" in p:
            self.ignore(pre + "last_batch_iteration", "a resume restores the schedule's position from the checkpoint")
        if "total_num_steps" in get:
            n = _number(pre + "total_num_steps", get["total_num_steps"], integer=True, minimum=1)
            if self.t.max_steps:  # the engine's schedule spans the run: a run of total_num_steps steps
                self.set(pre + "total_num_steps", self.t.max_steps, n)
            else:
                self.ignore(pre + "total_num_steps", "the schedule spans the run's optimizer updates "
                            "(train.max_steps x ppo.ppo_epochs x mini-batches per step)")
        if t == "WarmupCosineLR":
            ratio = _number(pre + "cos_min_ratio", get.get("cos_min_ratio", 1e-4), minimum=0)
            self.set_optim(pre + "cos_min_ratio" + ("" if "cos_min_ratio" in get else " (DeepSpeed's default 1e-4)"),
                           "min_lr_ratio", ratio)
            wmin = get.get("warmup_min_ratio")
            if wmin is not None:
                self.ignore(pre + "warmup_min_ratio", "0: the engine's warmup also starts from 0" if
                            _number(pre + "warmup_min_ratio", wmin, minimum=0) == 0 else
                            "the engine's warmup starts from 0, not from warmup_min_ratio of the peak")
            return
        peak = get.get("warmup_max_lr")
        if peak is not None:  # DeepSpeed's WarmupLR sets the lr itself: warmup_max_lr is the peak
            self.set_optim(pre + "warmup_max_lr", "lr", _number(pre + "warmup_max_lr", peak, above=0))
            if optimizer and not _is_auto(optimizer.get("params", {}).get("lr", AUTO)):
                self.ignore("optimizer.params.lr", "scheduler.params.warmup_max_lr sets the peak lr (as in DeepSpeed)")
        low = _number(pre + "warmup_min_lr", get.get("warmup_min_lr", 0), minimum=0)
        if t == "WarmupDecayLR":  # decays to warmup_min_lr (0 by default): min_lr_ratio = min / peak
            if low > 0 and peak is None:
                raise ConfigError(f"{pre}warmup_min_lr={low:g} needs {pre}warmup_max_lr as a number: the decay ends at "
                                  "warmup_min_lr / warmup_max_lr of the peak (train.min_lr_ratio)")
            ratio = low / float(peak) if low > 0 else 0.0
            self.set_optim(pre + "warmup_min_lr" + ("" if "warmup_min_lr" in get else " (default 0)"),
                           "min_lr_ratio", ratio)
        if "warmup_min_lr" in get and (low > 0 or t == "WarmupLR"):
            self.ignore(pre + "warmup_min_lr", "0: the engine's warmup also starts from 0" if low == 0 else
                        "the engine's warmup starts from 0, not from warmup_min_lr")

    # -- ZeRO
    def zero(self, b: dict) -> None:
        known = ("stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_params",
                 "ignore_unused_parameters", *ZERO_INTERNALS, *ZERO_SAVE, *ZERO_PLUS)
        _block("zero_optimization", b, known)
        pre = "zero_optimization."
        stage = b.get("stage")
        if stage is not None and not _is_auto(stage):
            stage = _number(pre + "stage", stage, integer=True, minimum=0)
            if stage > 3:
                raise ConfigError(f"{pre}stage must be 0, 1, 2 or 3, got {stage}")
            self.set(pre + "stage", "engine.stage", stage)
        elif stage is not None:
            self.auto(pre + "stage")
        offload = []  # the DeepSpeed keys that ask for CPU offload
        for k in ("offload_optimizer", "offload_param"):
            if k not in b:
                continue
            o = _block(pre + k, b[k], OFFLOAD_KEYS)
            device = o.get("device", "none")
            if device == "nvme":
                raise ConfigError(f"{pre}{k}.device=nvme (ZeRO-Infinity) is not available: use \"device\": \"cpu\" "
                                  "(engine.offload=true: FSDP2 CPUOffloadPolicy)")
            if device not in ("cpu", "none", None):
                raise ConfigError(f"{pre}{k}.device must be cpu, nvme or none, got {device!r}")
            if device == "cpu" and k == "offload_param" and isinstance(stage, int) and stage < 3:
                self.ignore(pre + k, f"DeepSpeed offloads parameters only at stage 3 (stage here: {stage})")
            elif device == "cpu":
                offload.append(f"{pre}{k}.device=cpu")
            else:
                self.ignore(pre + k, "device none: no offload")
            for sub in o:
                if sub == "ratio" and device == "cpu" and _number(f"{pre}{k}.ratio", o[sub], minimum=0) < 1:
                    self.ignore(f"{pre}{k}.ratio", "the engine offloads all of the optimizer step, not a share")
                elif sub != "device":
                    self.ignore(f"{pre}{k}.{sub}", "offload tuning (CPUOffloadPolicy pins its CPU memory)")
        for k in ("cpu_offload", "cpu_offload_params"):  # DeepSpeed's deprecated flags
            if k in b and _flag(pre + k, b[k]):
                offload.append(f"{pre}{k}=true")
            elif k in b:
                self.ignore(pre + k, "false: no offload")
        if offload:
            if isinstance(stage, int) and stage < 2:
                raise ConfigError(f"{offload[0]} with {pre}stage={stage} is not available: the engine's CPU offload "
                                  "(FSDP2 CPUOffloadPolicy) needs ZeRO stage 2 or 3; set \"stage\": 2")
            self.set(" and ".join(offload) + " (parameters, gradients and the optimizer step on the CPU)",
                     "engine.offload", True)
        for k, off in ZERO_PLUS.items():
            if k in b and b[k] != off:
                raise ConfigError(f"{pre}{k}={json.dumps(b[k])} (ZeRO++/MiCS) is not available: the engine's ZeRO "
                                  "communicates full-precision shards over all ranks; remove the key")
            if k in b:
                self.ignore(pre + k, "off (ZeRO++/MiCS)")
        for k in b:
            if k in ZERO_INTERNALS:
                self.ignore(pre + k, INTERNALS)
            elif k in ZERO_SAVE:
                self.ignore(pre + k, "the export always writes full Hugging Face weights (model.save_dtype)")
            elif k == "ignore_unused_parameters":
                self.ignore(pre + k, "FSDP2 (stage 2/3) needs no flag; DDP (stage 0/1): engine.find_unused_parameters")

    # -- the rest
    def activation_checkpointing(self, b: dict) -> None:
        pre = "activation_checkpointing."
        _block("activation_checkpointing", b, ("partition_activations", "cpu_checkpointing",
                                               "contiguous_memory_optimization", "number_checkpoints",
                                               "synchronize_checkpoint_boundary", "profile"))
        if "cpu_checkpointing" in b and _flag(pre + "cpu_checkpointing", b["cpu_checkpointing"]):
            raise ConfigError(f"{pre}cpu_checkpointing=true is not available: the engine's checkpoints stay on the "
                              "device (each transformer block recomputed in backward); remove the key")
        self.set("activation_checkpointing (the block; the engine checkpoints every transformer block)",
                 "engine.activation_checkpointing", True)
        for k in b:
            if k != "cpu_checkpointing":
                self.ignore(pre + k, "tunes DeepSpeed's checkpointing API (partitioning needs model parallelism)")
            else:
                self.ignore(pre + k, "false, as the engine")

    def wandb(self, b: dict) -> None:
        _block("wandb", b, ("enabled", "group", "team", "project"))
        if not self.monitor_on("wandb", b):
            return
        self.set("wandb.enabled", "logger.wandb", True)
        for k, ours in (("project", "logger.project"), ("team", "logger.entity")):
            if k in b and not _is_auto(b[k]):
                if not isinstance(b[k], str):
                    raise ConfigError(f"wandb.{k} must be a string, got {b[k]!r}")
                self.set(f"wandb.{k}", ours, b[k])
        if "group" in b:
            self.ignore("wandb.group", "the logger has no run groups (logger.name names the run)")

    def monitor(self, key: str, b: dict, ours: str) -> None:
        """DeepSpeed's tensorboard / csv_monitor block: {enabled, output_path, job_name} -> logger.<name>=true and
        its directory output_path/job_name (DeepSpeed's layout; either alone is used as it is)."""
        _block(key, b, ("enabled", "output_path", "job_name"))
        if not self.monitor_on(key, b):
            return
        name = ours.split(".")[1]
        self.set(f"{key}.enabled", ours, True)
        given = [k for k in ("output_path", "job_name") if k in b and not _is_auto(b[k])]
        for k in given:
            if not isinstance(b[k], str) or not b[k]:
                raise ConfigError(f"{key}.{k} must be a non-empty string, got {b[k]!r}")
        if given:
            self.set(" + ".join(f"{key}.{k}" for k in given), f"logger.{name}_dir", os.path.join(*(b[k] for k in given)))
        for k in ("output_path", "job_name"):
            if k in b and k not in given:
                self.auto(f"{key}.{k}")

    def monitor_on(self, key: str, b: dict) -> bool:
        """Whether a monitor block is on; when it is not (or this app has no logger) its keys are ignored."""
        if self.t.logger and _enabled(key, b) is True:
            return True
        for k in b:
            self.ignore(f"{key}.{k}", f"the {key} monitor is off ({key}.enabled is not true)" if self.t.logger else
                        f"{self.t.app} has no logger")
        return False

    def hybrid_engine(self, b: dict) -> None:
        pre = "hybrid_engine."
        _block("hybrid_engine", b, ("enabled", "max_out_tokens", "inference_tp_size", "release_inference_cache",
                                    "pin_parameters", "tp_gather_partition_size"))
        if _enabled("hybrid_engine", b) is not True:
            for k in b:
                self.ignore(pre + k, "the hybrid engine block is off; ours is always on (TrainEngine.generation())")
            return
        tp = b.get("inference_tp_size", 1)
        if not _is_auto(tp) and _number(pre + "inference_tp_size", tp, integer=True, minimum=1) > 1:
            raise ConfigError(f"{pre}inference_tp_size={tp} is not available: generation runs on each rank's full "
                              "gathered model (no tensor parallelism); remove the key")
        for k, v in b.items():
            if k == "release_inference_cache" and not _is_auto(v):
                self.set(pre + k, "engine.release_inference_cache", _flag(pre + k, v))
            elif k == "enabled":
                self.ignore(pre + k, "the engine's hybrid engine is always on (TrainEngine.generation())")
            elif k == "max_out_tokens":
                self.ignore(pre + k, "the KV cache is sized from the prompt length + rollout.max_new_tokens")
            else:
                self.ignore(pre + k, "DeepSpeed's inference-engine tuning")

    def run(self, ds: dict) -> Mapping:
        unknown = [k for k in ds if k not in HANDLED and k not in IGNORED and k not in UNSUPPORTED]
        if unknown:
            raise ConfigError(f"{unknown[0]} is not a DeepSpeed key this mapping knows (docs/deepspeed.md lists "
                              "them); remove it from the file")
        self.batch(ds)
        self.precision(ds)
        for key, v in ds.items():
            if key in IGNORED:
                self.ignore(key, IGNORED[key])
            elif key in UNSUPPORTED:
                on = v.get("enabled", True) if isinstance(v, dict) else v not in (None, False, 0, 1)
                if on and not _is_auto(on):
                    raise ConfigError(f"{key}: {UNSUPPORTED[key]}")
                self.ignore(key, "off")
            elif key in ("optimizer", "scheduler", "gradient_clipping") and not self.t.optim:
                self.trains_nothing(key)
            elif key == "fp16":
                self.fp16(v)
            elif key == "optimizer":
                self.optimizer(v)
            elif key == "scheduler":
                self.scheduler(v, ds.get("optimizer"))
            elif key == "gradient_clipping":
                if _is_auto(v):
                    self.auto(key)
                else:
                    self.set_optim(key, "grad_clip", _number(key, v, minimum=0))
            elif key == "zero_optimization":
                self.zero(v)
            elif key == "activation_checkpointing":
                self.activation_checkpointing(v)
            elif key == "steps_per_print":
                if self.t.log_every is None:
                    self.trains_nothing(key)
                else:
                    self.set(key, self.t.log_every, _number(key, v, integer=True, minimum=1))
            elif key == "wandb":
                self.wandb(v)
            elif key == "tensorboard":
                self.monitor(key, v, "logger.tensorboard")
            elif key == "csv_monitor":
                self.monitor(key, v, "logger.csv")
            elif key == "hybrid_engine":
                self.hybrid_engine(v)
        return self.m


def map_ds_config(ds: dict, world_size: int, targets: Targets) -> Mapping:
    """A parsed DeepSpeed config -> our overrides and the keys ignored (module docstring: the rules).
    Raises ConfigError naming the DeepSpeed key for an unknown key, a feature we do not have, a value
    of the wrong type or an inconsistent batch-size triple."""
    if not isinstance(ds, dict):
        raise ConfigError(f"a ds_config must be a JSON object, got {type(ds).__name__}")
    return _Mapper(targets, world_size).run(ds)


# ----------------------------------------------------------------------------- the command line


@dataclass
class Report:
    """What `ds_overrides` applied, for the run's log (`log_report`)."""

    path: str
    world_size: int
    mapping: Mapping
    overruled: list[str]  # our keys the command line sets itself (the file's value not applied)


def load_ds_config(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"engine.ds_config={path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"engine.ds_config={path}: cannot be read ({e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"engine.ds_config={path} is not valid JSON: {e}") from None


def hydra_value(v: Any) -> str:
    """`v` written as a Hydra override value (strings quoted when they need it)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    s = str(v)
    if s and all(c.isalnum() or c in "_-./" for c in s) and s.lower() not in ("null", "true", "false"):
        return s
    # Hydra's quoted strings: a quote is escaped, and backslashes only where they precede a quote or the end
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", s)
    return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body) + "'"


def _flat_keys(node: Any, prefix: str) -> list[str]:
    if isinstance(node, dict) and node:
        return [k for name, sub in node.items() for k in _flat_keys(sub, f"{prefix}{name}.")]
    return [prefix[:-1]]


def command_line_keys(parsed: list, conf_dir: str) -> list[str]:
    """The dotted keys the command line sets: `key=value`, `~key`, and every key that a config-group
    option chosen there (`engine=zero3`) sets in its YAML."""
    import yaml

    keys = []
    for o in parsed:
        name = o.key_or_group
        option = os.path.join(conf_dir, name, f"{o.value()}.yaml") if isinstance(o.value(), str) else ""
        if os.path.isdir(os.path.join(conf_dir, name)) and os.path.isfile(option):
            with open(option) as f:
                text = f.read()
            glob = "# @package _global_" in text
            content = yaml.safe_load(text) or {}
            keys += [k for k in _flat_keys(content, "" if glob else f"{name}.") if k]
        else:
            keys.append(name.lstrip("+~"))
    return keys


def _set_by(key: str, user: list[str]) -> bool:
    return any(key == u or key.startswith(u + ".") or u.startswith(key + ".") for u in user)


def ds_overrides(overrides: list[str], schema: type, conf_dir: str, app: str) -> tuple[list[str], Report | None]:
    """With `engine.ds_config=PATH` among the command line's `overrides`: the Hydra overrides that
    put the file's settings into the config (to go before the user's), leaving out the keys the
    command line sets itself; else ([], None). World size: WORLD_SIZE (torchrun) or 1."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    found = [o for o in parsed if o.key_or_group.lstrip("+") == "engine.ds_config" and not o.is_delete()]
    if not found or found[-1].value() in (None, ""):
        return [], None
    if found[-1].is_sweep_override():
        raise ConfigError("engine.ds_config takes one file per run, not a sweep")
    path = str(found[-1].value())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        mapping = map_ds_config(load_ds_config(path), world, targets_for(schema, f"python -m {app}"))
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith("engine.ds_config=") else f"engine.ds_config={path}: {msg}") from None
    user = command_line_keys(parsed, conf_dir)
    overruled = [k for k in mapping.overrides if _set_by(k, user)]
    args = [f"{k}={hydra_value(v)}" for k, v in mapping.overrides.items() if k not in overruled]
    return args, Report(path, world, mapping, overruled)


def log_report(report: Report, log: logging.Logger) -> None:
    """Two log records: every key the file set (DeepSpeed key -> ours = value, and where the command
    line won), then every DeepSpeed key that set nothing, with the reason."""
    m = report.mapping
    lines = [f"engine.ds_config={report.path} (DeepSpeed keys -> ours; world size {report.world_size}):"]
    for key, value in m.overrides.items():
        won = "  [the command line's value wins]" if key in report.overruled else ""
        lines.append(f"  {m.sources[key]} -> {key}={hydra_value(value)}{won}")
    log.info("\n".join(lines))
    if m.ignored:
        log.info("\n".join([f"engine.ds_config={report.path}: DeepSpeed keys that set nothing here:"]
                           + [f"  {key}: {why}" for key, why in m.ignored]))
