"""`engine.ds_config=PATH`: DeepSpeed configs (from DeepSpeed's documentation, DeepSpeedExamples, the
Hugging Face integration and DeepSpeed-Chat) mapped onto the stage configs, the batch-size rule,
"auto", errors naming the key, and the command line winning over the file."""
from __future__ import annotations

import json
import math
import re

import pytest
import yaml

from conftest import ROOT, SMALL_MODEL, metrics, run_stage
from engine.config import EngineConfig
from rlhf.config import EvaluateConfig, PPOConfig, RewardConfig, SFTConfig
from rlhf.config.ds_config import (
    STATIC_LOSS_SCALE_WINDOW,
    ConfigError,
    command_line_keys,
    ds_overrides,
    hydra_value,
    map_ds_config,
    targets_for,
)

SFT, PPO, EVAL = targets_for(SFTConfig), targets_for(PPOConfig), targets_for(EvaluateConfig, "python -m rlhf.evaluate")
CONF = str(ROOT / "conf")


def mapped(ds: dict, targets=SFT, world: int = 1) -> dict:
    m = map_ds_config(ds, world, targets)
    assert_every_key_named(ds, m)
    return m.overrides


def ignored(ds: dict, targets=SFT, world: int = 1) -> dict[str, str]:
    return dict(map_ds_config(ds, world, targets).ignored)


def leaves(ds: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in ds.items():
        out += leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [prefix + k]
    return out


def assert_every_key_named(ds: dict, m) -> None:
    """Every DeepSpeed key of the file is either the source of a value set or listed as ignored."""
    named = list(m.sources.values()) + [k for k, _ in m.ignored]
    for path in leaves(ds):
        parts = path.split(".")
        prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        assert any(re.search(rf"(?<![\w.]){re.escape(p)}(?![\w])", text) for p in prefixes for text in named), path


# ----------------------------------------------------------------------------- ZeRO blocks


# DeepSpeed's ZeRO tutorial (docs/_tutorials/zero.md) and config-json.md blocks, with the keys each sets here
ZERO_CASES = {
    "zero1": ({"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}}, {"engine.stage": 1}),
    "zero2": ({"zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True,
                                     "reduce_scatter": True, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}},
              {"engine.stage": 2}),
    "zero2_offload": ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                             "allgather_partitions": True, "allgather_bucket_size": 2e8,
                                             "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                                             "contiguous_gradients": True}},
                      {"engine.stage": 2, "engine.offload": True}),
    "zero3_offload": ({"zero_optimization": {
        "stage": 3, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 1e7, "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7,
        "sub_group_size": 1e9, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
        "stage3_gather_16bit_weights_on_model_save": True}},
        {"engine.stage": 3, "engine.offload": True}),
    # the deprecated flag (DeepSpeedExamples cifar/ds_config.json, without its fp16 master weights)
    "zero2_cpu_offload_flag": ({"zero_optimization": {"stage": 2, "cpu_offload": True}},
                               {"engine.stage": 2, "engine.offload": True}),
    # DeepSpeed offloads parameters only at stage 3 (offload_param below it does nothing there either)
    "zero2_offload_param": ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
                            {"engine.stage": 2}),
    "zero0": ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "none"}}}, {"engine.stage": 0}),
}


@pytest.mark.parametrize("case", list(ZERO_CASES))
def test_zero_blocks_map_to_the_engine_stage_and_offload(case):
    ds, expected = ZERO_CASES[case]
    assert mapped(ds) == expected
    why = ignored(ds)
    for k in ("overlap_comm", "reduce_bucket_size", "stage3_max_live_parameters", "sub_group_size"):
        if k in ds["zero_optimization"]:
            assert "DeepSpeed's own bucketing" in why[f"zero_optimization.{k}"]
    if "stage3_gather_16bit_weights_on_model_save" in ds["zero_optimization"]:
        assert "full Hugging Face weights" in why["zero_optimization.stage3_gather_16bit_weights_on_model_save"]


@pytest.mark.parametrize("ds, key, instead", [
    # ZeRO-Infinity (DeepSpeedExamples Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_infinity_config.json)
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme_data"}}},
     "zero_optimization.offload_param.device=nvme", '"device": "cpu"'),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer.device=cpu with zero_optimization.stage=1", '"stage": 2'),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
     "zero_optimization.zero_quantized_weights=true", "remove the key"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}},
     "zero_optimization.zero_hpz_partition_size=8", "remove the key"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage must be 0, 1, 2 or 3", "got 4"),
    ({"zero_optimization": {"stage": 3, "stage3_param_persitance_threshold": 1e5}},  # misspelt, as in that example
     "zero_optimization.stage3_param_persitance_threshold is not a DeepSpeed key", "remove it"),
])
def test_zero_features_we_do_not_have_name_the_key(ds, key, instead):
    with pytest.raises(ConfigError) as e:
        map_ds_config(ds, 1, SFT)
    assert key in str(e.value) and instead in str(e.value)


# ----------------------------------------------------------------------------- precision


FP16_DOCS = {"enabled": True, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16,
             "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1}


def test_fp16_block_from_the_docs_is_dynamic_loss_scaling():
    assert mapped({"fp16": FP16_DOCS}) == {"engine.precision": "fp16", "engine.initial_loss_scale": 65536.0,
                                           "engine.loss_scale_window": 1000, "engine.min_loss_scale": 1.0}
    why = ignored({"fp16": FP16_DOCS})
    assert "halves at every overflow" in why["fp16.hysteresis"] and "1 overflow(s) pass first" in why["fp16.hysteresis"]
    assert why["fp16.loss_scale"] == "0 = dynamic loss scaling, which the engine does"
    # DeepSpeed-Chat's actor block: only the window differs from DeepSpeed's defaults
    assert mapped({"fp16": {"enabled": True, "loss_scale_window": 100}}) == {
        "engine.precision": "fp16", "engine.loss_scale_window": 100}
    assert ignored({"fp16": {**FP16_DOCS, "hysteresis": 1}})["fp16.hysteresis"].startswith("1, as the engine")


def test_a_static_loss_scale_pins_the_dynamic_scaler():
    # DeepSpeedExamples' ZeRO-Infinity block: "loss_scale": 1024 (static)
    ds = {"fp16": {"enabled": True, "loss_scale": 1024, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}}
    assert mapped(ds) == {"engine.precision": "fp16", "engine.initial_loss_scale": 1024.0,
                          "engine.min_loss_scale": 1024.0, "engine.loss_scale_window": STATIC_LOSS_SCALE_WINDOW}
    assert ignored(ds)["fp16.loss_scale_window"] == "fp16.loss_scale=1024 is a static scale"
    # the engine's scaler with these settings never moves, and still skips an overflowing step
    from engine.loss_scale import DynamicLossScaler

    s = DynamicLossScaler(enabled=True, init_scale=1024.0, window=STATIC_LOSS_SCALE_WINDOW, min_scale=1024.0)
    for overflow in (True, False, False, True):
        s.update(overflow)
    assert s.scale == 1024.0 and s.overflows == 2


@pytest.mark.parametrize("ds, precision", [
    ({"bf16": {"enabled": True}}, "bf16"),
    ({"bfloat16": {"enabled": True}}, "bf16"),  # DeepSpeed's older name
    ({"fp16": {"enabled": False}, "bf16": {"enabled": True}}, "bf16"),
    ({"fp16": {"enabled": False}}, "fp32"),  # mixed precision off: DeepSpeed trains in fp32
    ({"fp16": {"enabled": False}, "bf16": {"enabled": False}}, "fp32"),
    ({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}, None),  # HF: ours (auto: bf16 on CUDA)
    ({"fp16": {"enabled": False}, "bf16": {"enabled": "auto"}}, None),
    ({"zero_optimization": {"stage": 2}}, None),  # no precision block: ours
])
def test_precision_from_the_fp16_and_bf16_blocks(ds, precision):
    assert mapped(ds).get("engine.precision") == precision


def test_precision_errors_and_fp16_keys_when_fp16_is_off():
    with pytest.raises(ConfigError, match="fp16.enabled and bf16.enabled cannot both be true"):
        map_ds_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, 1, SFT)
    # DeepSpeedExamples cifar/ds_config.json asks for fp16 master weights
    with pytest.raises(ConfigError, match="fp16.fp16_master_weights_and_grads=true is not available"):
        map_ds_config({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, 1, SFT)
    with pytest.raises(ConfigError, match=r"fp16.initial_scale_power must be an integer >= 0 .*got 'big'"):
        map_ds_config({"fp16": {"enabled": True, "initial_scale_power": "big"}}, 1, SFT)
    off = {"fp16": {**FP16_DOCS, "enabled": False}}
    assert mapped(off) == {"engine.precision": "fp32"}
    assert ignored(off)["fp16.loss_scale_window"] == "fp16 is off (fp16.enabled=false)"


# ----------------------------------------------------------------------------- batch sizes


@pytest.mark.parametrize("given, world, expected", [
    # (train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps), world -> (global, micro)
    ((32, 4, 4), 2, (32, 4)),
    ((32, 4, None), 2, (32, 4)),  # accumulation derived: 32 / (4 x 2) = 4
    ((32, None, 4), 2, (32, 4)),  # micro derived: 32 / (4 x 2) = 4
    ((None, 4, 4), 2, (32, 4)),
    ((16, None, None), 1, (16, 16)),  # DeepSpeedExamples Megatron zero2: no accumulation
    ((16, None, None), 4, (16, 4)),
    ((None, 4, None), 2, (8, 4)),
    ((None, 4, 1), 1, (4, 4)),  # DeepSpeedExamples ZeRO-Infinity example
    ((32, 4, 4), 1, "train_batch_size (32) must equal train_micro_batch_size_per_gpu (4) x gradient_accumulation_steps "
                    "(4) x world size 1 (WORLD_SIZE) = 16"),
    ((30, 4, None), 2, "train_batch_size (30) must be a multiple of train_micro_batch_size_per_gpu (4) x world size 2"),
    ((30, None, 4), 1, "train_batch_size (30) must be a multiple of gradient_accumulation_steps (4)"),
    ((15, None, None), 2, "train_batch_size (15) must be a multiple of the world size 2"),
    ((None, None, 4), 1, "gradient_accumulation_steps alone does not fix the batch"),
    ((0, 4, None), 1, "train_batch_size must be an integer >= 1"),
])
def test_batch_triple_follows_deepspeeds_rule(given, world, expected):
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    ds = {k: v for k, v in zip(names, given) if v is not None}
    if isinstance(expected, str):
        with pytest.raises(ConfigError) as e:
            map_ds_config(ds, world, SFT)
        assert expected in str(e.value)
        return
    total, micro = expected
    assert mapped(ds, world=world) == {"train.global_batch_size": total, "train.micro_batch_size": micro}
    # and the stage's own check agrees: accumulation = global / (micro x world)
    from rlhf.config import TrainConfig
    from rlhf.config.validate import validate_train

    accum = validate_train(TrainConfig(global_batch_size=total, micro_batch_size=micro), world)
    assert total == micro * accum * world
    if given[2] is not None:
        assert accum == given[2]


def test_batch_sizes_of_ppo_are_the_rollout_mini_and_micro_batches():
    assert mapped({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, PPO, world=2) == {
        "rollout.mini_batch_size": 16, "rollout.micro_batch_size": 4}
    # the evaluation app trains nothing: the batch keys set nothing there
    why = ignored({"train_batch_size": 16, "optimizer": {"type": "Lamb"}}, EVAL)
    assert why == {"train_batch_size": "python -m rlhf.evaluate trains nothing",
                   "optimizer": "python -m rlhf.evaluate trains nothing"}


# ----------------------------------------------------------------------------- optimizer, scheduler, clipping


# DeepSpeedExamples cifar/ds_config.json (optimizer, scheduler, clipping as published)
CIFAR = {
    "train_batch_size": 4, "steps_per_print": 2000,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}},
    "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
}


def test_cifar_example_optimizer_schedule_clipping_and_logging():
    assert mapped(CIFAR) == {
        "train.global_batch_size": 4, "train.micro_batch_size": 4, "train.lr": 0.001, "train.betas": [0.8, 0.999],
        "train.eps": 1e-8, "train.weight_decay": 3e-7, "train.scheduler": "constant", "train.warmup_steps": 1000,
        "train.grad_clip": 1.0, "train.log_every": 2000,
    }
    why = ignored(CIFAR)
    assert "the engine's warmup is linear" in why["scheduler.params.warmup_type"]  # DeepSpeed's default is log
    assert why["optimizer.params.lr"].startswith("scheduler.params.warmup_max_lr sets the peak lr")


def test_ppo_optimizer_keys_go_to_the_actor_and_the_critic():
    got = mapped({"optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.1}}, "gradient_clipping": 0.5},
                 PPO)
    assert got == {f"{g}.{k}": v for g in ("actor", "critic") for k, v in
                   (("lr", 1e-5), ("weight_decay", 0.1), ("grad_clip", 0.5))}


@pytest.mark.parametrize("ds, message", [
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer.type='Lamb' is not available"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 400}}},
     "optimizer.type='OneBitAdam' is not available"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.01}}},
     "optimizer.params.adam_w_mode=false (Adam with L2 weight decay) is not available"),
    ({"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad=true is not available"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, "optimizer.params.betas must be two numbers"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4}}}, "scheduler.type='OneCycle' is not available"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-5}}},
     "scheduler.params.warmup_min_lr=1e-05 needs scheduler.params.warmup_max_lr as a number"),
    ({"scheduler": {"type": "WarmupLR", "params": {"cos_min_ratio": 0.1}}},
     "scheduler.params.cos_min_ratio is not a DeepSpeed key"),
    ({"gradient_clipping": -1}, "gradient_clipping must be a number >= 0"),
])
def test_optimizer_and_scheduler_errors_name_the_key(ds, message):
    with pytest.raises(ConfigError) as e:
        map_ds_config(ds, 1, SFT)
    assert message in str(e.value)


def test_adam_without_decoupled_decay_is_fine_when_weight_decay_is_zero():
    ds = {"optimizer": {"type": "Adam", "params": {"lr": 2e-4, "adam_w_mode": False, "weight_decay": 0}}}
    assert mapped(ds) == {"train.lr": 2e-4, "train.weight_decay": 0.0}


def deepspeed_lr(kind: str, p: dict, s: int, base_lr: float = 1.0) -> float:
    """DeepSpeed's runtime/lr_schedules.py at step s (warmup_type linear), written from its source."""
    w = max(2, p["warmup_num_steps"]) if kind != "WarmupCosineLR" else p["warmup_num_steps"]
    if kind == "WarmupCosineLR":
        if s < w:
            return base_lr * s / w
        ratio = (1 + math.cos(math.pi * (s - w + 1) / (p["total_num_steps"] - w))) / 2
        return base_lr * max(0.0, p["cos_min_ratio"] + (1 - p["cos_min_ratio"]) * ratio)
    lo, hi = p["warmup_min_lr"], p["warmup_max_lr"]
    gamma = s / w if s < w else max(0.0, (p["total_num_steps"] - s) / max(1.0, p["total_num_steps"] - w))
    return lo + (hi - lo) * gamma


@pytest.mark.parametrize("kind, params", [
    ("WarmupDecayLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-4, "warmup_num_steps": 10, "total_num_steps": 100}),
    ("WarmupDecayLR", {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 5, "total_num_steps": 60}),
    ("WarmupCosineLR", {"warmup_num_steps": 10, "total_num_steps": 100, "cos_min_ratio": 0.05}),
])
def test_decaying_schedules_follow_deepspeeds_within_one_step(kind, params):
    """The engine's schedule built from the mapped keys, against DeepSpeed's formula: after warmup
    they differ by at most one step of decay and end on the same floor; both warm up linearly to the
    same peak."""
    from engine.optim import LRSchedule

    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 2e-4}},
          "scheduler": {"type": kind, "params": {**params, "warmup_type": "linear"}}}
    got = mapped(ds)
    base = got["train.lr"]
    sched = LRSchedule(got["train.scheduler"], got["train.warmup_steps"], got["train.max_steps"],
                       got["train.min_lr_ratio"])
    w, total = params["warmup_num_steps"], params["total_num_steps"]
    assert got["train.max_steps"] == total and got["train.warmup_steps"] == w
    step = base / (total - w)  # one step of decay (linear); the cosine's steepest is pi/2 of it
    for s in range(w, total):
        assert abs(base * sched(s) - deepspeed_lr(kind, params, s, base)) <= step * (1 + 1e-9), s
    # the floor: DeepSpeed's linear decay reaches it one step after the run's last, its cosine on the last
    floor_at = total if kind == "WarmupDecayLR" else total - 1
    assert math.isclose(base * sched(total - 1), deepspeed_lr(kind, params, floor_at, base), rel_tol=1e-9)
    # the peak: ours at the warmup's last step, DeepSpeed's within one step of it
    assert base * sched(w - 1) == base and base - max(deepspeed_lr(kind, params, s, base) for s in range(total)) <= step


def test_scheduler_end_points_and_the_ppo_run_length():
    # WarmupDecayLR decays to warmup_min_lr (default 0), WarmupCosineLR to cos_min_ratio (default 1e-4)
    assert mapped({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}})["train.min_lr_ratio"] == 0
    assert mapped({"scheduler": {"type": "WarmupCosineLR", "params": {}}})["train.min_lr_ratio"] == 1e-4
    # PPO's schedule spans its optimizer updates, not train.max_steps (PPO steps): total_num_steps sets nothing
    ds = {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 500, "warmup_num_steps": 5}}}
    got = mapped(ds, PPO)
    assert "train.max_steps" not in got and got["actor.warmup_steps"] == got["critic.warmup_steps"] == 5
    assert "ppo.ppo_epochs" in ignored(ds, PPO)["scheduler.params.total_num_steps"]


# ----------------------------------------------------------------------------- "auto", whole published configs


# The Hugging Face integration's ZeRO-3 template (every value it fills in is "auto")
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                          "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def test_hf_auto_values_keep_ours():
    assert mapped(HF_ZERO3) == {
        "engine.stage": 3, "engine.offload": True, "engine.initial_loss_scale": 65536.0,
        "engine.loss_scale_window": 1000, "engine.min_loss_scale": 1.0, "train.scheduler": "constant",
        "train.log_every": 2000,
    }
    why = ignored(HF_ZERO3)
    for key in ("fp16.enabled", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas",
                "scheduler.params.warmup_num_steps", "train_batch_size", "gradient_clipping"):
        assert why[key] == "auto: our value is kept", key


# DeepSpeed-Chat's actor config (get_train_ds_config: ZeRO-3, fp16, hybrid engine, TensorBoard)
DS_CHAT = {
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
    "zero_optimization": {"stage": 3, "overlap_comm": True, "offload_param": {"device": "none"},
                          "offload_optimizer": {"device": "none"}, "stage3_param_persistence_threshold": 1e4,
                          "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                          "memory_efficient_linear": False},
    "fp16": {"enabled": True, "loss_scale_window": 100}, "gradient_clipping": 1.0, "prescale_gradients": False,
    "wall_clock_breakdown": False,
    "hybrid_engine": {"enabled": True, "max_out_tokens": 512, "inference_tp_size": 1, "release_inference_cache": True,
                      "pin_parameters": True, "tp_gather_partition_size": 8},
    "tensorboard": {"enabled": False, "output_path": "step3_tensorboard/ds_tensorboard_logs/",
                    "job_name": "step3_actor_tensorboard"},
}


def test_deepspeed_chat_actor_config_on_ppo():
    assert mapped(DS_CHAT, PPO, world=2) == {
        "rollout.mini_batch_size": 32, "rollout.micro_batch_size": 4, "engine.precision": "fp16",
        "train.log_every": 10, "engine.stage": 3, "engine.loss_scale_window": 100, "actor.grad_clip": 1.0,
        "critic.grad_clip": 1.0, "engine.release_inference_cache": True,
    }
    why = ignored(DS_CHAT, PPO)
    assert why["hybrid_engine.max_out_tokens"].startswith("the KV cache is sized")
    assert why["zero_optimization.offload_param"] == "device none: no offload"
    with pytest.raises(ConfigError, match="hybrid_engine.inference_tp_size=2 is not available"):
        map_ds_config({"hybrid_engine": {**DS_CHAT["hybrid_engine"], "inference_tp_size": 2}}, 1, PPO)


def test_activation_checkpointing_wandb_and_logging():
    # DeepSpeedExamples Megatron-LM/scripts/ds_zero2_config.json's block
    ds = {"activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": False},
          "wandb": {"enabled": True, "group": "g", "team": "my team", "project": "rlhf-ds"}}
    assert mapped(ds) == {"engine.activation_checkpointing": True, "logger.wandb": True,
                          "logger.project": "rlhf-ds", "logger.entity": "my team"}
    assert "no run groups" in ignored(ds)["wandb.group"]
    assert mapped({"wandb": {"enabled": False, "project": "p"}}) == {}
    with pytest.raises(ConfigError, match="activation_checkpointing.cpu_checkpointing=true is not available"):
        map_ds_config({"activation_checkpointing": {"cpu_checkpointing": True}}, 1, SFT)


def test_tensorboard_and_csv_monitor_blocks():
    # DeepSpeed's monitor blocks (docs config-json "Monitoring Module"): output_path/job_name is where it writes
    ds = {"tensorboard": {"enabled": True, "output_path": "logs/ds_logs/", "job_name": "train_bert"},
          "csv_monitor": {"enabled": True, "output_path": "csv", "job_name": "auto"}}
    assert mapped(ds) == {"logger.tensorboard": True, "logger.tensorboard_dir": "logs/ds_logs/train_bert",
                          "logger.csv": True, "logger.csv_dir": "csv"}
    assert ignored(ds)["csv_monitor.job_name"] == "auto: our value is kept"
    off = {"tensorboard": {"enabled": False, "output_path": "x"}, "csv_monitor": {"job_name": "j"}}
    assert mapped(off) == {}
    assert ignored(off) == {"tensorboard.enabled": "the tensorboard monitor is off (tensorboard.enabled is not true)",
                            "tensorboard.output_path": "the tensorboard monitor is off (tensorboard.enabled is not true)",
                            "csv_monitor.job_name": "the csv_monitor monitor is off (csv_monitor.enabled is not true)"}
    with pytest.raises(ConfigError, match="tensorboard.job_name must be a non-empty string, got 3"):
        map_ds_config({"tensorboard": {"enabled": True, "job_name": 3}}, 1, SFT)
    with pytest.raises(ConfigError, match="tensorboard.flush_secs is not a DeepSpeed key this mapping knows"):
        map_ds_config({"tensorboard": {"enabled": True, "flush_secs": 3}}, 1, SFT)


@pytest.mark.parametrize("ds, message", [
    ({"pipeline": {"stages": "auto"}}, "pipeline: pipeline parallelism is not available: ZeRO stage 3"),
    ({"moe": {"enabled": True}}, "moe: DeepSpeed's mixture-of-experts layers are not available"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel: tensor parallelism is not available"),
    ({"sequence_parallel_size": 2}, "sequence_parallel_size: sequence parallelism is not available"),
    ({"amp": {"enabled": True, "opt_level": "O1"}}, "amp: Apex AMP is not available: use the bf16 or fp16 block"),
    ({"elasticity": {"enabled": True, "max_train_batch_size": 2000}}, "elasticity: elastic training is not available"),
    ({"compression_training": {"layer_reduction": {"enabled": True}}}, "compression_training: DeepSpeed Compression"),
    ({"compile": {"deepcompile": True}}, "(engine.compile=true torch.compiles each transformer block instead"),
    ({"gradient_clippng": 1.0}, "gradient_clippng is not a DeepSpeed key this mapping knows"),
    ({"fp16": {"enabled": True, "loss_scale_windw": 10}}, "fp16.loss_scale_windw is not a DeepSpeed key"),
])
def test_features_we_do_not_have_and_unknown_keys_name_the_key(ds, message):
    with pytest.raises(ConfigError) as e:
        map_ds_config(ds, 1, SFT)
    assert message in str(e.value)


def test_features_switched_off_are_listed_not_refused():
    ds = {"elasticity": {"enabled": False}, "sequence_parallel_size": 1, "autotuning": {"enabled": False},
          "comet": {"enabled": True}, "aio": {"block_size": 1048576}}
    assert mapped(ds) == {}
    why = ignored(ds)
    assert why["elasticity"] == why["sequence_parallel_size"] == "off"
    assert "not Comet" in why["comet"] and "NVMe" in why["aio"]


# ----------------------------------------------------------------------------- the command line


def test_targets_follow_each_stage_schema():
    assert (SFT.optim, SFT.batch, SFT.max_steps) == (("train",), ("train.global_batch_size", "train.micro_batch_size"),
                                                     "train.max_steps")
    assert targets_for(RewardConfig) == SFT
    assert (PPO.optim, PPO.batch, PPO.max_steps, PPO.log_every) == (
        ("actor", "critic"), ("rollout.mini_batch_size", "rollout.micro_batch_size"), None, "train.log_every")
    assert (EVAL.optim, EVAL.batch, EVAL.log_every, EVAL.logger) == ((), None, None, True)


@pytest.mark.parametrize("value", ["fp16", "my proj", "it's", "a\\b", "a\\", "x\\'y", "true", "null", "", 3e-05,
                                   1e-08, 65536.0, 2**31 - 1, True, [0.9, 0.999], None])
def test_hydra_value_parses_back_to_the_same_value(value):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (o,) = OverridesParser.create().parse_overrides([f"x={hydra_value(value)}"])
    assert o.value() == value and type(o.value()) is type(value)


def test_command_line_keys_include_group_options():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(["engine=zero3_offload", "algorithm=grpo", "train.lr=1",
                                                       "~train.betas"])
    keys = command_line_keys(parsed, CONF)
    assert {"engine.stage", "engine.offload", "rollout.prompts_per_step", "ppo.kl_coef", "train.lr",
            "train.betas"} <= set(keys)
    assert "engine.precision" not in keys


def test_ds_overrides_leave_out_what_the_command_line_sets(tmp_path, monkeypatch):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 64, "zero_optimization": {"stage": 2},
                                "optimizer": {"type": "AdamW", "params": {"lr": 3e-5}}, "bf16": {"enabled": True}}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    args, report = ds_overrides([f"engine.ds_config={path}", "engine=zero3", "train.lr=1e-4"], SFTConfig, CONF, "rlhf.sft")
    assert args == ["train.global_batch_size=64", "train.micro_batch_size=32", "engine.precision=bf16"]
    assert report.overruled == ["engine.stage", "train.lr"] and report.world_size == 2
    assert ds_overrides(["train.lr=1"], SFTConfig, CONF, "rlhf.sft") == ([], None)
    with pytest.raises(ConfigError, match=r"engine.ds_config=.*missing.json: no such file"):
        ds_overrides([f"engine.ds_config={tmp_path / 'missing.json'}"], SFTConfig, CONF, "rlhf.sft")


def test_a_ds_config_set_outside_the_command_line_is_an_error():
    from rlhf.run.app import _check_ds_config_applied

    with pytest.raises(ConfigError, match="engine.ds_config=x.json is read from the command line only"):
        _check_ds_config_applied(SFTConfig(engine=EngineConfig(ds_config="x.json")), None)


def write(tmp_path, ds: dict | str) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(ds if isinstance(ds, str) else json.dumps(ds))
    return str(path)


def test_cfg_job_shows_the_file_under_the_command_line(tmp_path):
    ds = {**CIFAR, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
          "bf16": {"enabled": True}}
    proc = run_stage("sft", f"engine.ds_config={write(tmp_path, ds)}", "train.warmup_steps=7", "engine=zero3",
                     "--cfg", "job")
    job = yaml.safe_load(proc.stdout)
    e = job["engine"]
    assert (e["stage"], e["offload"], e["precision"]) == (3, True, "bf16")  # engine=zero3 wins over the file's 2
    t = job["train"]
    assert (t["lr"], t["betas"], t["weight_decay"], t["scheduler"], t["grad_clip"], t["log_every"]) == (
        0.001, [0.8, 0.999], 3e-7, "constant", 1.0, 2000)
    assert (t["global_batch_size"], t["micro_batch_size"], t["warmup_steps"]) == (4, 4, 7)  # the command line's 7


@pytest.mark.parametrize("ds, message", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4},
     "train_batch_size (32) must equal train_micro_batch_size_per_gpu (4) x gradient_accumulation_steps (4) x world"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "zero_optimization.offload_param.device=nvme (ZeRO-Infinity) is not available"),
    ('{"fp16": {"enabled": true,}}', "is not valid JSON"),
])
def test_bad_files_exit_2_naming_the_key(tmp_path, ds, message):
    proc = run_stage("sft", f"output_dir={tmp_path / 'out'}", f"engine.ds_config={write(tmp_path, ds)}", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("error (configuration/data): engine.ds_config=") and message in line, line
    assert not (tmp_path / "out").exists()


def test_a_run_logs_the_mapping_and_trains_with_the_files_schedule(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "steps_per_print": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.9, 0.99]}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 2,
                                                       "warmup_type": "linear"}},
          "zero_optimization": {"stage": 1, "overlap_comm": True}}
    out = tmp_path / "out"
    proc = run_stage("sft", f"output_dir={out}", f"engine.ds_config={write(tmp_path, ds)}", *SMALL_MODEL,
                     "train.max_steps=3", "train.save_every=0", "train.eval_every=0", "data.num_eval_prompts=4")
    log = proc.stdout + proc.stderr
    assert "scheduler.params.warmup_max_lr -> train.lr=0.01" in log
    assert "train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size -> train.global_batch_size=16" in log
    assert re.search(r"zero_optimization.overlap_comm: tunes DeepSpeed's own bucketing", log)
    saved = (out / "config.yaml").read_text()
    assert "global_batch_size: 16" in saved and "micro_batch_size: 8" in saved and "stage: 1" in saved
    lrs = [r["lr"] for r in metrics(out, "train")]
    assert lrs == pytest.approx([0.005, 0.01, 0.01])  # linear warmup over 2 steps to warmup_max_lr, then constant
