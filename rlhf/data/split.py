"""`data.data_split`: one dataset shared between the three stages without overlap (DeepSpeed-Chat).

"2,4,4" gives weights for stage 0 (SFT), 1 (reward) and 2 (PPO prompts), normalised to sum to 1.
The rows are permuted by `numpy.random.RandomState(seed).permutation(n)` and the permutation is
cut into contiguous chunks at `round(cumsum(proportions) * n)` (round half up), so the chunks are
disjoint, cover every row, are each within one row of their share, and are the same in every
stage's process given the same n and seed. Indices come back in permuted order.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

STAGES = ("sft", "reward", "ppo")
T = TypeVar("T")


def parse_data_split(data_split: str | Sequence[float]) -> tuple[float, float, float]:
    """"2,4,4" or [2, 4, 4] -> normalised proportions; ValueError naming data.data_split."""
    try:
        parts = data_split.split(",") if isinstance(data_split, str) else list(data_split)
        weights = [float(p) for p in parts]
    except (TypeError, ValueError):
        msg = f"data.data_split must be 3 comma-separated numbers like '2,4,4', got {data_split!r}"
        raise ValueError(msg) from None
    if len(weights) != 3:
        raise ValueError(f"data.data_split needs 3 weights (sft, reward, ppo), got {len(weights)}: {data_split!r}")
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"data.data_split weights must be finite and >= 0, got {data_split!r}")
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"data.data_split weights must not all be zero, got {data_split!r}")
    return tuple(w / total for w in weights)  # type: ignore[return-value]


def split_indices(n: int, data_split: str | Sequence[float], stage: int, seed: int) -> list[int]:
    """Indices into range(n) that belong to `stage` (0 = SFT, 1 = reward, 2 = PPO)."""
    if stage not in (0, 1, 2):
        raise ValueError(f"stage must be 0 (sft), 1 (reward) or 2 (ppo), got {stage!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    props = parse_data_split(data_split)
    perm = np.random.RandomState(seed).permutation(n)
    bounds = [0]
    cum = 0.0
    for p in props:
        cum += p
        bounds.append(min(n, math.floor(cum * n + 0.5)))
    bounds[-1] = n  # float error in cumsum must not lose the last row
    return perm[bounds[stage] : bounds[stage + 1]].tolist()


def take_split(rows: Sequence[T], data_split: str | Sequence[float], stage: int, seed: int) -> list[T]:
    """The rows of `stage`: `[rows[i] for i in split_indices(len(rows), ...)]`."""
    return [rows[i] for i in split_indices(len(rows), data_split, stage, seed)]
