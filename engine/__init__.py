"""Distributed training runtime: ZeRO stages on DDP / FSDP2, checkpoints, memory accounting.

Knows nothing about RLHF. Entry points:
    info = init_distributed()
    engine = TrainEngine(model, engine_cfg, optim_cfg, total_steps=N, info=info)
    out = engine.train_step(micro_batches, loss_fn)
    frozen = FrozenEngine(model, engine_cfg, info)
"""
import importlib

# Loaded on first use (PEP 562), so `engine.config` alone imports no torch (see its NOTE).
_WHERE = {
    "atomic_directory": "checkpoint", "atomic_directories": "checkpoint", "latest_checkpoint": "checkpoint",
    "list_checkpoints": "checkpoint", "prune_checkpoints": "checkpoint",
    "EngineConfig": "config", "OptimConfig": "config", "validate_engine_config": "config",
    "set_deterministic": "determinism",
    "DistInfo": "distributed", "exit_process": "distributed", "init_distributed": "distributed",
    "shutdown_distributed": "distributed",
    "DynamicLossScaler": "loss_scale", "format_memory_report": "memory", "validate_optim_config": "optim",
    "TORCH_DTYPES": "parallelize", "ModuleView": "parallelize", "hf_base_model": "parallelize",
    "inner_module": "parallelize", "parallelize": "parallelize", "compile_seconds": "parallelize",
    "FrozenEngine": "train_engine", "TrainEngine": "train_engine",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


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
    "atomic_directories",
    "compile_seconds",
    "exit_process",
    "format_memory_report",
    "hf_base_model",
    "init_distributed",
    "inner_module",
    "latest_checkpoint",
    "list_checkpoints",
    "parallelize",
    "prune_checkpoints",
    "set_deterministic",
    "shutdown_distributed",
    "validate_engine_config",
    "validate_optim_config",
]
