"""Dynamic loss scaling for fp16 that works on sharded (DTensor) gradients.

torch.amp.GradScaler assumes whole local gradients; under FSDP2 each rank holds a shard, so an inf in
rank 1's shard must also skip rank 0's step. The overflow flag is the global gradient norm (local sums
of squares all-reduced), which is inf/nan on every rank exactly when some element anywhere is (or when
the squares overflow fp32, ~1.8e19, which is worth a skip too); the same number feeds clipping.
Policy (DeepSpeed's): on overflow halve the scale (not below min_scale) and skip the step; after
`window` consecutive clean steps double it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .distributed import group


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The locally held part of `t`: the shard of a DTensor, `t` itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def global_grad_norm(grads: list[torch.Tensor], *, sharded: bool) -> float:
    """L2 norm of all gradients together, identical on every rank; inf/nan if any element is.

    This is also the all-reduced overflow flag of the scaler: one reduction serves both. `sharded`
    (FSDP2): each rank holds a shard, so local sums of squares are all-reduced; replicated (DDP,
    ZeRO-1) gradients are already identical on every rank and need no collective.
    """
    local = [local_tensor(g) for g in grads]
    device = local[0].device if local else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in local:
        sq += g.detach().float().pow(2).sum().to(device)
    if sharded and dist.is_initialized() and dist.get_world_size(group()) > 1:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group())
    return sq.sqrt().item()


def scale_grads_(grads: list[torch.Tensor], factor: float) -> None:
    """grads *= factor in place, on the local shards (works for DTensor and plain gradients)."""
    if factor != 1.0:
        for g in grads:
            local_tensor(g).mul_(factor)


class DynamicLossScaler:
    """Scale the loss up before backward, unscale the gradients, skip steps that overflowed.

    Disabled (`enabled=False`, scale 1, never adjusts) for fp32 and bf16.
    """

    def __init__(self, *, enabled: bool, init_scale: float = 2.0**16, window: int = 1000, min_scale: float = 1.0):
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.window = window
        self.min_scale = min_scale
        self.clean_steps = 0  # consecutive steps without overflow since the last change of scale
        self.overflows = 0  # total skipped steps

    def update(self, overflow: bool) -> None:
        """Call once per optimizer step with that step's (all-reduced) overflow flag."""
        if not self.enabled:
            return
        if overflow:
            self.overflows += 1
            self.scale = max(self.scale / 2.0, self.min_scale)
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.window:
                self.scale *= 2.0
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.overflows = int(state["overflows"])
