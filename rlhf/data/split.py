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

from rlhf.config.validate import parse_data_split

T = TypeVar("T")


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
