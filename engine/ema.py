"""An exponential moving average of a (possibly sharded) model's trainable parameters.

Each rank keeps the average of its own shards (the local part of each DTensor), so the EMA costs
one extra copy of the trainable state per rank, sharded like the parameters themselves:
    ema = decay * ema + (1 - decay) * param          after every optimizer step
`swapped_in()` puts the averages into the live parameters for the duration (e.g. to export them
with the engine's consolidating `full_state_dict`), then restores the trained values.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .loss_scale import local_tensor


class ParamEMA:
    def __init__(self, module: nn.Module, decay: float):
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self._params = [p for p in module.parameters() if p.requires_grad]
        self.shadow = [local_tensor(p).detach().clone() for p in self._params]

    @torch.no_grad()
    def update(self) -> None:
        live = [local_tensor(p).detach() for p in self._params]
        torch._foreach_lerp_(self.shadow, live, 1.0 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self):
        with torch.no_grad():
            backup = [local_tensor(p).detach().clone() for p in self._params]
            for p, s in zip(self._params, self.shadow):
                local_tensor(p).copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(self._params, backup):
                    local_tensor(p).copy_(b)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": [s.cpu() for s in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["shadow"]) != len(self.shadow) or any(
            a.shape != b.shape for a, b in zip(state["shadow"], self.shadow)
        ):
            raise ValueError("EMA state does not match this model's (sharded) trainable parameters")
        for s, v in zip(self.shadow, state["shadow"]):
            s.copy_(v)
