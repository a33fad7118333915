"""A stage's data: rows from `data.path` (its `data_split` share; a list of sources: their mixture by
`data.weights`, rlhf/data/mix.py), a held-out part, and the deterministic order in which optimizer
steps read them.

    train_rows, eval_rows = stage_rows(cfg.data, stage=0)      # 0 sft, 1 reward, 2 ppo
    held_out_source(cfg.data)  # "data.path=/x/pairs.jsonl (eval_size=0.05, split_seed=1234)" or "data.eval_path=..."
    order = StepOrder(len(features), global_batch=32, seed=1234)
    order.steps_per_epoch; order.rank_rows(step, rank, world, accum) -> accum lists of indices
    data = stage_data(cfg.data, cfg.train, cfg.seed, tok, 1, "reward")  # tokenized; SFT, reward, DPO

The order is a pure function of (step, seed): epoch e = step // steps_per_epoch reads the rows in
`torch.randperm(n, generator=seed + e)` order, global batch after global batch (the last partial
batch of an epoch is left out); each rank takes a contiguous 1/world slice of the global batch and
cuts it into `accum` micro-batches. Resuming at step s therefore needs nothing but s.

The held-out rows are `data.eval_path`'s, else `data.eval_size` of the stage's rows (a fraction, or a
number of rows) taken by `torch.randperm(n, generator=data.split_seed)`: the same rows on every rank,
on resume, and in `rlhf.evaluate` (the stages also write them to output_dir/eval_rows.jsonl).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.config import DataConfig, TrainConfig
from rlhf.config.validate import STAGES, data_sources, mix_weights
from rlhf.core.errors import ConfigError
from rlhf.data.mix import mix_rows
from rlhf.data.records import Row, parse_pairs, parse_sft, parse_unpaired
from rlhf.data.sources import load_rows
from rlhf.data.split import take_split
from rlhf.data.tokenize import mismatched_rows, tokenize_pairs, tokenize_sft, tokenize_unpaired

logger = logging.getLogger(__name__)


def eval_size(d: DataConfig) -> tuple[str, float]:
    """(key, value) of the hold-out size: data.eval_fraction where set (its former name), else data.eval_size."""
    return ("eval_fraction", d.eval_fraction) if d.eval_fraction is not None else ("eval_size", d.eval_size)


def held_out_count(size: float, n: int) -> int:
    """Rows held out of `n`: a fraction (< 1) of them, rounded, or a number of rows (>= 1)."""
    return round(size * n) if size < 1 else int(size)


def _source_rows(d: DataConfig, path: str, stage: int, carve: bool, named: bool) -> tuple[list[Row], list[Row], int]:
    """One source's (train rows, held-out rows, rows read): its data_split share, then (`carve`) its
    eval_size taken out by a permutation seeded with data.split_seed."""
    rows = load_rows(path, d.split, d.cache_dir, key="data.path")
    total = len(rows)
    if d.data_split is not None:
        rows = take_split(rows, d.data_split, stage, d.split_seed)
        logger.info("data.data_split=%s: %s stage takes %d of %d rows%s", d.data_split, STAGES[stage], len(rows), total,
                    f" of {path}" if named else "")
    if not carve:
        return rows, [], total
    key, size = eval_size(d)
    n_eval = held_out_count(size, len(rows))
    if n_eval >= len(rows) > 0:
        raise ConfigError(f"data.{key}={size:g} holds out {n_eval} of the {len(rows)} rows of data.path={path!r}, "
                          "leaving none to train on: hold out fewer, or name data.eval_path")
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(d.split_seed)).tolist()
    held = set(perm[:n_eval])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held], total


def stage_rows(d: DataConfig, stage: int, *, hold_out: bool = True) -> tuple[list[Row], list[Row]]:
    """(train rows, held-out rows) of `d.path` for `stage`: the held-out rows are eval_path's, else
    eval_size of the stage's rows taken out (see the module docstring); `hold_out=False`: none at all.
    A list of sources (data.path=[a,b]): each source's share and held-out part are taken first, then its
    training rows are mixed by data.weights (rlhf/data/mix.py); the held-out rows are every source's."""
    paths, weights = data_sources(d.path), mix_weights(d)
    mixing = len(paths) > 1 or weights is not None or d.mix_size is not None
    parts = [_source_rows(d, p, stage, hold_out and not d.eval_path, mixing) for p in paths]
    if mixing:
        for p, (train, held, _) in zip(paths, parts):
            for r in train + held:
                r.dataset = p  # each source's shape is detected on its own (rlhf/data/records.py)
        rows = mix_rows([train for train, _, _ in parts], paths, weights, d.mix_size, d.split_seed)
    else:
        rows = parts[0][0]
    eval_rows = [r for _, held, _ in parts for r in held]
    if hold_out and d.eval_path:
        eval_rows = load_rows(d.eval_path, d.eval_split, d.cache_dir, key="data.eval_path")
    if not rows:
        total = sum(n for _, _, n in parts)
        key, _ = eval_size(d)
        raise ConfigError(f"data.path={d.path!r}: no training rows left (of {total}) after data_split/{key}")
    return rows, eval_rows


def held_out_source(d: DataConfig, stage: int | None = None) -> str | None:
    """Where `stage_rows`' held-out rows come from, as the log and summary.json's `eval_source` name it:
    "data.eval_path=<path>", or "data.path=<path> (eval_size=0.05, split_seed=1234[, data_split=..., <stage>
    share])"; None when nothing is held out."""
    if d.eval_path:
        return f"data.eval_path={d.eval_path}" + (f" (split {d.eval_split})" if not os.path.isfile(d.eval_path) else "")
    key, size = eval_size(d)
    if not size or not d.path:
        return None
    share = f", data_split={d.data_split}: the {STAGES[stage]} share" if d.data_split is not None and stage is not None else ""
    return f"data.path={d.path} ({key}={size:g}, split_seed={d.split_seed}{share})"


class StepOrder:
    """Which rows each optimizer step reads, on each rank (see the module docstring)."""

    def __init__(self, n: int, global_batch: int, seed: int, key: str = "train.global_batch_size"):
        if n < global_batch:
            raise ConfigError(f"{key}={global_batch} exceeds the {n} training rows (after the over-long rule)")
        self.n, self.global_batch, self.seed = n, global_batch, seed
        self.steps_per_epoch = n // global_batch
        self._perm_epoch, self._perm = -1, None

    def global_rows(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n, generator=g).tolist(), epoch
        return self._perm[k * self.global_batch : (k + 1) * self.global_batch]

    def rank_rows(self, step: int, rank: int, world: int, accum: int) -> list[list[int]]:
        rows = self.global_rows(step)
        per_rank = self.global_batch // world
        mine = rows[rank * per_rank : (rank + 1) * per_rank]
        m = per_rank // accum
        return [mine[i * m : (i + 1) * m] for i in range(accum)]


@dataclass
class StageData:
    """A row-trained stage's data (`stage_data`): features as rlhf/data/tokenize.py makes them."""

    train: list[dict]
    eval: list[dict]
    eval_examples: list  # the held-out examples before tokenizing (a feature's "index" points here)
    order: StepOrder
    total: int  # optimizer steps: train.max_steps, else train.epochs x steps per epoch
    eval_rows: list[Row]  # the held-out rows as read (what output_dir/eval_rows.jsonl holds)
    eval_source: str | None  # where they come from (`held_out_source`)
    unit: str  # "rows" (SFT, KTO's labelled rows) or "pairs"
    stats: dict[str, int] | None = None  # the training rows' counts from the tokenizer (over-long rule, kinds)


def stage_data(d: DataConfig, t: TrainConfig, seed: int, tok: Any, stage: int, name: str, *,
               unpaired: bool = False) -> StageData:
    """`stage_rows` parsed and tokenized as demonstrations (stage 0: SFT) or preference pairs (1: reward,
    DPO) under the over-long rule, and the order the run's `total` steps read them in; one log line
    (`name` starts it) with the counts. `unpaired` (KTO, stage 1): labelled rows instead of pairs (pairs
    split into a desirable and an undesirable row), each with its mismatched KL row (`mismatched_rows`,
    seeded with data.split_seed)."""
    parse, tokenize, unit = (parse_sft, tokenize_sft, "rows") if stage == 0 else (parse_pairs, tokenize_pairs, "pairs")
    if unpaired:
        parse, tokenize, unit = parse_unpaired, tokenize_unpaired, "rows"
    train_rows, eval_rows = stage_rows(d, stage)
    rule = (tok, d.max_len, d.max_prompt_len, d.overlong, d.add_bos)
    if stage == 0:  # conversations: every assistant turn, or the whole transcript
        rule = (*rule, d.assistant_only_loss)
    train, stats = tokenize(parse(train_rows, tok), *rule)
    eval_examples = parse(eval_rows, tok)
    held_out, _ = tokenize(eval_examples, *rule)
    if unpaired:
        for feats, what in ((train, "training"), (held_out, "held-out")):
            if len(feats) == 1:
                raise ConfigError(f"data.path={d.path!r}: one {what} row is left after the over-long rule; KTO pairs "
                                  "each prompt with another row's response to estimate its reference point: give it two or more")
            if feats:
                mismatched_rows(feats, d.max_len, d.split_seed)
    order = StepOrder(len(train), t.global_batch_size, seed)
    total = t.max_steps or t.epochs * order.steps_per_epoch
    logger.info("%s data: %d train %s (%s), %d held-out %s; %d steps of %d %s (%d per epoch)", name,
                len(train), unit, stats, len(held_out), unit, total, t.global_batch_size, unit, order.steps_per_epoch)
    return StageData(train, held_out, eval_examples, order, total, eval_rows, held_out_source(d, stage), unit, stats)


def held_out_line(n: int, unit: str, source: str | None) -> str:
    """The log line naming a stage's held-out set: "held-out: 37 pairs from data.path=... (eval_size=...)"."""
    if source is None:
        return "held-out: none (no data.eval_path, and nothing held out of data.path)"
    return f"held-out: {n} {unit} from {source}"
