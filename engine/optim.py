"""AdamW with weight-decay groups, and the warmup + decay learning-rate schedules.

Decay rule (as DeepSpeed-Chat / nanoGPT): matrices decay; biases, norm weights and every other 1-d
parameter do not. Only trainable parameters (requires_grad) enter the optimizer, so a LoRA model
optimizes its adapters only.

Schedule, as a factor on `optim.lr` for the s-th optimizer step (s = 0, 1, ...; W = warmup_steps,
T = total_steps, r = min_lr_ratio):
    s < W:   (s + 1) / W                                  linear warmup, never 0
    s >= W:  p = min(1, (s - W) / max(1, T - W - 1))     progress, 0 on the first decay step, 1 on the last
             constant: 1;  linear: 1 - (1 - r) p;  cosine: r + (1 - r) (1 + cos(pi p)) / 2
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .config import OptimConfig
from .distributed import group

SCHEDULERS = ("constant", "linear", "cosine")


def validate_optim_config(cfg: OptimConfig, total_steps: int) -> None:
    """Raise ValueError naming the offending key (`optim.<field>`)."""
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise ValueError(f"optim.lr must be a finite number > 0, got {cfg.lr}")
    if not (cfg.eps > 0 and math.isfinite(cfg.eps)):
        raise ValueError(f"optim.eps must be a finite number > 0, got {cfg.eps}")
    if cfg.weight_decay < 0:
        raise ValueError(f"optim.weight_decay must be >= 0, got {cfg.weight_decay}")
    if len(cfg.betas) != 2 or not all(0 <= b < 1 for b in cfg.betas):
        raise ValueError(f"optim.betas must be two numbers in [0, 1), got {cfg.betas}")
    if cfg.scheduler not in SCHEDULERS:
        raise ValueError(f"optim.scheduler must be one of {SCHEDULERS}, got {cfg.scheduler!r}")
    if cfg.warmup_steps < 0:
        raise ValueError(f"optim.warmup_steps must be >= 0, got {cfg.warmup_steps}")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if cfg.grad_clip < 0:
        raise ValueError(f"optim.grad_clip must be >= 0 (0 disables clipping), got {cfg.grad_clip}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")


def is_decayed(name: str, param: torch.Tensor) -> bool:
    """Weight decay applies to matrices (linear, embedding weights), not to biases or norm weights."""
    return param.ndim >= 2 and not name.endswith("bias") and "norm" not in name.lower()


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups over the trainable parameters: {"decay"} and {"no_decay"} (empty ones dropped)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if is_decayed(name, p) else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "group": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "group": "no_decay"},
    ]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("the model has no trainable parameters (requires_grad) to optimize")
    return groups


def build_optimizer(model: nn.Module, cfg: OptimConfig, *, zero1: bool = False) -> torch.optim.Optimizer:
    """AdamW over `param_groups`; `zero1` shards its state over ranks (ZeroRedundancyOptimizer, stage 1)."""
    groups = param_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, process_group=group(), **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


@dataclass
class LRSchedule:
    """The factor on the base lr at optimizer step s (a callable object so LambdaLR can state_dict it)."""

    scheduler: str
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float

    def __call__(self, s: int) -> float:
        w, t, r = self.warmup_steps, self.total_steps, self.min_lr_ratio
        if s < w:
            return (s + 1) / w
        if self.scheduler == "constant":
            return 1.0
        p = min(1.0, (s - w) / max(1, t - w - 1))
        if self.scheduler == "linear":
            return 1.0 - (1.0 - r) * p
        return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * p))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    schedule = LRSchedule(cfg.scheduler, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
