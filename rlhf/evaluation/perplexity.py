"""Held-out perplexity of a policy on SFT rows, token-weighted over every rank's rows."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from engine.distributed import all_reduce_sum
from rlhf.data import collate_sft
from rlhf.data.tokenize import IGNORE_INDEX


@torch.no_grad()
def perplexity(
    model: torch.nn.Module,
    features: Sequence[dict[str, list[int]]],
    pad_id: int,
    batch_size: int,
    *,
    rank: int,
    world: int,
    device: torch.device,
) -> dict[str, float]:
    """Token-weighted loss and perplexity of a `Policy` role on SFT features (labels -100 outside responses)."""
    mine = list(features[rank::world])
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    for i in range(0, len(mine), batch_size):
        b = collate_sft(mine[i : i + batch_size], pad_id)
        labels = b["labels"][:, 1:].to(device)
        acc[0] += model(b["input_ids"].to(device), b["attention_mask"].to(device), targets=labels,
                        reduction="sum").double()
        acc[1] += (labels != IGNORE_INDEX).sum()
    model.train(was_training)
    all_reduce_sum(acc)
    loss = (acc[0] / acc[1]).item() if acc[1] > 0 else float("nan")
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 50 else float("inf")}
