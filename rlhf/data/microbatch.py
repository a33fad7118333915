"""Token-budget micro-batches (rollout.micro_batch_tokens): rows grouped by the tokens a forward computes,
not by a row count, and each micro-batch trimmed to its own width.

    bins = token_budget_bins(prompt_lens, response_lens, budget, groups=g, min_bins=k)  # [[row, ...], ...]
    mb = trim_columns(batch, prompt_len, idx)        # the rows of one bin at their own width

A micro-batch's cost is what its forward computes: rows x (longest real prompt + longest response
extent) of its rows when padded (the trimmed width, `trim_columns`), or the sum of its rows' real tokens
when packed (rlhf/modeling/forward.py Repacked). Rows are placed longest first (first-fit decreasing),
so a micro-batch holds rows of similar length and pads little; a unit (a row, or a prompt's group of rows
with rollout.shared_prompt_forward) whose own cost exceeds the budget runs alone (`over_budget` counts
them). FSDP's forwards are collective, so every rank must run as many micro-batches: `min_bins` (the
all-reduced max of the ranks' counts) splits the costliest micro-batches in two until there are that many.

Layout (P = prompt width, T = response width), as rlhf/rl/rollout.py: [B, P+T] tensors hold the
left-padded prompt then the right-padded response; [B, T] tensors are response-aligned.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def bin_cost(prompt_lens: Sequence[int], response_lens: Sequence[int], rows: Sequence[int], packed: bool = False) -> int:
    """The tokens one forward of `rows` computes: their real tokens packed, else rows x trimmed width."""
    if not rows:
        return 0
    if packed:
        return sum(prompt_lens[i] + response_lens[i] for i in rows)
    return len(rows) * (max(prompt_lens[i] for i in rows) + max(response_lens[i] for i in rows))


def token_budget_bins(prompt_lens: Sequence[int], response_lens: Sequence[int], budget: int, *,
                      groups: Sequence[int] | None = None, min_bins: int = 1,
                      packed: bool = False) -> list[list[int]]:
    """Row indices split into micro-batches of at most `budget` computed tokens each (`bin_cost`).

    prompt_lens, response_lens: [B] each row's real prompt tokens and response extent (the columns up to its
    last attended response token: a multi-turn observation inside the response counts). `groups` [B] (None:
    every row its own unit): rows with the same id stay in one micro-batch (a prompt's samples, so a shared
    prompt runs once). Units are placed longest first into the first micro-batch where they fit (first-fit
    decreasing: similar lengths together); a unit over the budget alone gets a micro-batch of its own. Then,
    while there are fewer than `min_bins`, the costliest micro-batch of more than one unit is split into its
    longer and shorter halves (a part never costs more than the whole); when every micro-batch is one unit
    and more are asked for (another rank's rows come from more groups), the largest group's rows go apart.
    Returns the micro-batches (each row exactly once, a unit's rows together unless so split, in their
    original order within a micro-batch); ValueError when `min_bins` exceeds the number of rows."""
    B = len(prompt_lens)
    if len(response_lens) != B or (groups is not None and len(groups) != B):
        raise ValueError(f"prompt_lens, response_lens and groups must have one entry per row, got "
                         f"{len(prompt_lens)}, {len(response_lens)}, {None if groups is None else len(groups)}")
    if budget < 1:
        raise ValueError(f"a token budget must be >= 1, got {budget}")
    if B == 0:
        return []
    units: dict[int, list[int]] = {}
    for i in range(B):
        units.setdefault(i if groups is None else int(groups[i]), []).append(i)
    if min_bins > B:
        raise ValueError(f"cannot make {min_bins} micro-batches of {B} rows")

    def length(u: list[int]) -> tuple[int, int]:
        return max(prompt_lens[i] + response_lens[i] for i in u), max(prompt_lens[i] for i in u)

    order = sorted(units.values(), key=length, reverse=True)  # longest first; stable for equal lengths
    bins: list[list[list[int]]] = []  # each bin: its units
    for u in order:
        for b in bins:
            if bin_cost(prompt_lens, response_lens, [i for v in (*b, u) for i in v], packed) <= budget:
                b.append(u)
                break
        else:
            bins.append([u])
    while len(bins) < min_bins:
        if all(len(b) == 1 for b in bins):  # more micro-batches asked than units: the largest group's rows go apart
            k = max(range(len(bins)), key=lambda j: len(bins[j][0]))
            bins[k] = sorted(([i] for i in bins[k][0]), key=length, reverse=True)  # each row a unit of its own
            continue
        costs = [bin_cost(prompt_lens, response_lens, [i for u in b for i in u], packed) if len(b) > 1 else -1
                 for b in bins]
        k = max(range(len(bins)), key=costs.__getitem__)
        b = bins.pop(k)
        half = len(b) // 2
        bins[k:k] = [b[:half], b[half:]]
    return [sorted(i for u in b for i in u) for b in bins]


def row_extents(attention_mask: torch.Tensor, prompt_len: int) -> tuple[list[int], list[int]]:
    """([B] real prompt tokens, [B] response extent) of a rollout batch [B, P+T]: the prompt's attended
    columns, and the columns up to the last attended response one (by the attention mask, not the
    response mask: a multi-turn observation is attended but out of the response mask)."""
    m = attention_mask.bool()
    P, T = prompt_len, m.shape[1] - prompt_len
    prompt = m[:, :P].sum(1)
    cols = torch.arange(1, T + 1, device=m.device)
    extent = torch.where(m[:, P:], cols, 0).amax(1) if T else torch.zeros_like(prompt)
    return prompt.tolist(), extent.tolist()


def trim_columns(batch: dict, prompt_len: int, rows: Sequence[int] | None = None) -> dict:
    """`batch` (rows `rows` of it, None: all) cut to its own width: the prompt columns no row attends
    (left padding common to every row) and the response columns past the last attended one are dropped.
    Every tensor field [B, P+T] or [B, T] is cut (others: rows selected, or kept as they are);
    `prompt_len` becomes the new P. At least one response column is kept. A forward of the result
    computes what the full-width forward computes on the real tokens (causal attention, positions from the
    mask): pad its [b, T'] outputs back with `pad_response`."""
    mask = batch["attention_mask"]
    idx = None if rows is None else torch.as_tensor(list(rows), dtype=torch.long, device=mask.device)
    m = mask if idx is None else mask[idx]
    P, L = prompt_len, mask.shape[1]
    T = L - P
    real = m.bool()
    left = int(real[:, :P].any(0).long().argmax()) if bool(real[:, :P].any()) else P
    attended = real[:, P:].any(0).nonzero()
    width = max(int(attended.max()) + 1 if attended.numel() else 0, 1)
    out = {}
    for k, v in batch.items():
        if not torch.is_tensor(v):
            out[k] = v
            continue
        if idx is not None and v.dim() >= 1 and v.shape[0] == mask.shape[0]:
            v = v[idx]
        if v.dim() >= 2 and v.shape[1] == L:
            v = v[:, left : P + width]
        elif v.dim() >= 2 and v.shape[1] == T:
            v = v[:, :width]
        out[k] = v
    out["prompt_len"] = P - left
    return out


def pad_response(x: torch.Tensor, width: int) -> torch.Tensor:
    """[b, T'] -> [b, width]: a trimmed micro-batch's response-aligned output padded back with 0."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))
