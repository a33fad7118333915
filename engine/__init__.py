"""Distributed training runtime: ZeRO stages on DDP / FSDP2, checkpoints, memory accounting.

Knows nothing about RLHF. Entry points:
    info = init_distributed()
    engine = TrainEngine(model, engine_cfg, optim_cfg, total_steps=N, info=info)
    out = engine.train_step(micro_batches, loss_fn)
    frozen = FrozenEngine(model, engine_cfg, info)
"""
from .checkpoint import atomic_directory, latest_checkpoint, list_checkpoints, prune_checkpoints
from .config import TORCH_DTYPES, EngineConfig, OptimConfig, validate_engine_config
from .distributed import DistInfo, exit_process, init_distributed, shutdown_distributed
from .loss_scale import DynamicLossScaler
from .memory import format_memory_report
from .optim import validate_optim_config
from .parallelize import ModuleView, hf_base_model, inner_module, parallelize
from .train_engine import FrozenEngine, TrainEngine

__all__ = [
    "DistInfo",
    "DynamicLossScaler",
    "EngineConfig",
    "FrozenEngine",
    "ModuleView",
    "OptimConfig",
    "TORCH_DTYPES",
    "TrainEngine",
    "atomic_directory",
    "exit_process",
    "format_memory_report",
    "hf_base_model",
    "init_distributed",
    "inner_module",
    "latest_checkpoint",
    "list_checkpoints",
    "parallelize",
    "prune_checkpoints",
    "shutdown_distributed",
    "validate_engine_config",
    "validate_optim_config",
]
