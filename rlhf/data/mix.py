"""`data.path=[a.jsonl,b.jsonl] data.weights=[0.7,0.3]`: a deterministic mixture of several sources
(OpenRLHF's `--dataset a,b --dataset_probs 0.7,0.3`).

    picks = mix_indices(sizes=[1000, 200], weights=[0.7, 0.3], total=None, seed=1234)

`total` (data.mix_size; None = the sum of the sources' sizes) is shared out by the normalised
weights: source i gives k_i = round(w_i x total) rows (round half up; the k_i may then sum to a row
more or less than total). Its rows are those of `numpy.random.RandomState(seed + i).permutation(n_i)`:
the first k_i when k_i <= n_i (drawn without replacement), else every row k_i // n_i times and the
permutation's first k_i % n_i once more (drawn with repetition; `mix_rows` logs it). Weights None:
every row of every source once, in order (a plain concatenation). The mixture is a pure function of
(sizes, weights, total, seed): the same on every rank and after a resume.

Held-out rows are carved from each source before mixing (rlhf/data/stage.py), so the mixture's
repetitions never carry a held-out row into training.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from rlhf.core.errors import ConfigError

logger = logging.getLogger(__name__)
T = TypeVar("T")


def mix_indices(sizes: Sequence[int], weights: Sequence[float] | None, total: int | None, seed: int,
                names: Sequence[str] | None = None) -> list[list[int]]:
    """Per source, the indices of its rows in the mixture (see the module docstring); `names` name the
    sources in errors."""
    if weights is None:
        if total is None:
            return [list(range(n)) for n in sizes]
        weights = [n / max(1, sum(sizes)) for n in sizes]
    total = sum(sizes) if total is None else total
    out = []
    for i, (n, w) in enumerate(zip(sizes, weights)):
        k = math.floor(w * total + 0.5)
        if k and not n:
            name = repr(names[i]) if names else str(i)
            raise ConfigError(f"data.path source {name} has no training rows (after data_split/eval_size) "
                              f"to draw its {k} from (data.weights)")
        perm = np.random.RandomState(seed + i).permutation(n).tolist() if k else []
        full, rest = divmod(k, n) if n else (0, 0)
        out.append(perm[:k] if k <= n else sorted(perm) * full + perm[:rest])
    return out


def mix_rows(sources: Sequence[Sequence[T]], names: Sequence[str], weights: Sequence[float] | None,
             total: int | None, seed: int) -> list[T]:
    """The mixture of `sources` (rows per source, in order), and one log line counting each source's rows."""
    picks = mix_indices([len(s) for s in sources], weights, total, seed, names)
    parts = []
    for name, rows, idx in zip(names, sources, picks):
        repeated = ""
        if len(idx) > len(rows):  # drawn with repetition
            full, rest = divmod(len(idx), len(rows))
            repeated = f", repeated: each row {full} times" if not rest else \
                f", repeated: each row {full} or {full + 1} times"
        parts.append(f"{name}: {len(idx)} of its {len(rows)} rows{repeated}")
    how = "data.weights=[" + ", ".join(f"{w:.3g}" for w in weights) + "]" if weights is not None else "their sizes"
    mixed = [rows[i] for rows, idx in zip(sources, picks) for i in idx]
    logger.info("data.path: %d sources mixed by %s into %d training rows (%s)", len(sources), how, len(mixed),
                "; ".join(parts))
    return mixed
