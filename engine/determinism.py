"""`engine.deterministic=true`: runs that repeat bit for bit on the same machine and world size.

    set_deterministic(True)    # once per process, before the models are built (the stage apps: Run.open)

What it sets, process-wide: `torch.use_deterministic_algorithms(True)` (an op without a deterministic
implementation raises instead of varying), cuDNN's deterministic algorithms without autotuning, and on
CUDA `CUBLAS_WORKSPACE_CONFIG=:4096:8` (cuBLAS' deterministic workspace; read when a handle is created,
so it is set before any matmul when called first). What the rest of the engine already fixes: the order
of micro-batches (the caller's list, in order), the reductions (gloo and NCCL all-reduce / reduce-scatter
sum in a fixed ring or tree order for a given world size; DDP's buckets each reduce independently), and
the seeds (the stage apps seed torch, numpy and random identically on every rank). Generation gets
per-row sampling streams and batch-invariant numerics from `generation.BatchInvariantGenerator`
(`TrainEngine.generation()` wraps its generator in it).
"""
from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"


def set_deterministic(enabled: bool) -> None:
    """Turn deterministic algorithms on (process-wide) when `enabled`; a no-op otherwise (a run without
    `engine.deterministic` keeps PyTorch's defaults, whatever an earlier caller in the process set)."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
