"""Padding-free micro-batches: the rows of a micro-batch packed end to end into a few long rows.

    packs = pack_bins([len(r) for r in rows], pack_length)   # first-fit decreasing: [[row, ...], ...]
    batch = pack_sft(feats, pad_id, pack_length)              # input_ids/labels/position_ids [P, T]
    batch = pack_pairs(feats, pad_id, pack_length)            # + row_pack/row_end [2B]: where each score is

A packed batch has `attention_mask=None` and `position_ids` that restart at 0 on every row.
transformers (masking_utils, >= 4.53) then finds the row boundaries from the position ids and
builds a block-diagonal causal mask for sdpa/eager (flash-attention uses them as varlen offsets),
so no token attends across rows and every row sees exactly the positions it has alone: a packed
forward equals the padded one (tests/test_packing.py). The tail of a pack that is not full is one
more "row" of pad tokens with its own positions: it attends only to itself and nothing reads it.

Layout: `pack_length=0` puts the whole micro-batch in one row [1, sum(len)] (what flash-attention
varlen wants); `pack_length=L` fills rows of at most L tokens ([P, T], P <= B, T <= L the fullest
pack's length, so never more slots than the padded [B, longest row]). On CPU, sdpa
materialises the block-diagonal mask densely and computes every block of it, so one long row costs
(sum len)^2 attention; rows of max_len cost P x max_len^2, below the padded B x max_len^2.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlhf.data.tokenize import IGNORE_INDEX, collate_pairs, collate_shared_pairs


def pack_length_of(data_cfg: Any) -> int:
    """`data.pack_length` resolved: null -> data.max_len."""
    return data_cfg.max_len if data_cfg.pack_length is None else data_cfg.pack_length


def widest_row(data_cfg: Any, pack_len: int | None) -> int | None:
    """Tokens of the widest row a stage's forward takes: data.max_len unpacked, else the pack's width;
    None where it is not known ahead (data.pack_length=0: one pack of all rows)."""
    return data_cfg.max_len if pack_len is None else (pack_len or None)


def pack_bins(lengths: Sequence[int], pack_length: int) -> list[list[int]]:
    """Row indices grouped into packs of at most `pack_length` tokens (0 = one pack of all rows).

    First-fit decreasing finds how many packs are needed (K); then the rows, longest first, go to the
    least-filled of K packs, which evens the packs out, and is kept when its fullest pack is no longer
    than first-fit's and fits: packs are as long as the fullest one, so that is the padding left
    (25M-parameter bench, 8 rows of 16-1024 tokens per micro-batch: FFD alone left 32% padding)."""
    if pack_length <= 0:
        return [list(range(len(lengths)))]
    if lengths and max(lengths) > pack_length:
        raise ValueError(f"a row of {max(lengths)} tokens does not fit a pack of {pack_length}")
    ffd = _first_fit_decreasing(lengths, pack_length)
    even: list[list[int]] = [[] for _ in ffd]
    load = [0] * len(ffd)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = min(range(len(even)), key=lambda b: load[b])
        even[b].append(i)
        load[b] += lengths[i]
    fullest = max((sum(lengths[i] for i in b) for b in ffd), default=0)
    return even if max(load, default=0) <= min(fullest, pack_length) else ffd


def _first_fit_decreasing(lengths: Sequence[int], pack_length: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(pack_length - lengths[i])
    return bins


def packing_saves(lengths: Sequence[int], pack_length: int) -> bool:
    """Whether packing rows of `lengths` computes fewer token slots than padding them to the longest.
    `data.packing=auto` packs only then: rows of the default data (37-50 tokens, max_len 64) rarely
    share a pack, and a micro-batch that packs no tighter stays padded, as before packing existed."""
    bins = pack_bins(lengths, pack_length)
    return len(bins) * max(sum(lengths[i] for i in b) for b in bins) < len(lengths) * max(lengths)


def packs(lengths: Sequence[int], pack_length: int | None, only_if_saves: bool) -> bool:
    """Whether a micro-batch of rows of `lengths` is packed: packing is on (`pack_length` not None)
    and, with `only_if_saves` (data.packing=auto), it computes fewer token slots than padding."""
    return pack_length is not None and (not only_if_saves or packing_saves(lengths, pack_length))


def pack_rows(rows: Sequence[Sequence[int]], pad_id: int, pack_length: int,
              labels: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
    bins = pack_bins([len(r) for r in rows], pack_length)
    # NOTE: packs are as long as the fullest one, not pack_length: rows of the default data (37-50
    # tokens, max_len 64) rarely share a 64-token pack, and [B, 64] packs held 33% padding where the
    # padded [B, 50] batch held 11% (scripts/bench_train.py).
    T = max(sum(len(rows[i]) for i in b) for b in bins)
    P = len(bins)
    input_ids = torch.full((P, T), pad_id, dtype=torch.long)
    position_ids = torch.zeros((P, T), dtype=torch.long)
    label_t = torch.full((P, T), IGNORE_INDEX, dtype=torch.long)
    row_id = torch.full((P, T), -1, dtype=torch.long)  # which row each token is (-1: the pad tail)
    row_pack = torch.empty(len(rows), dtype=torch.long)
    row_end = torch.empty(len(rows), dtype=torch.long)
    for p, members in enumerate(bins):
        at = 0
        for i in members:
            n = len(rows[i])
            input_ids[p, at : at + n] = torch.tensor(rows[i])
            position_ids[p, at : at + n] = torch.arange(n)
            row_id[p, at : at + n] = i
            if labels is not None:
                label_t[p, at : at + n] = torch.tensor(labels[i])
                # NOTE: a row's first token is never a target (the padded path predicts from column 1
                # on); here the previous row's last token would "predict" it.
                label_t[p, at] = IGNORE_INDEX
            row_pack[i], row_end[i] = p, at + n - 1
            at += n
        position_ids[p, at:] = torch.arange(T - at)  # the pad tail: a row of its own
    out = {"input_ids": input_ids, "attention_mask": None, "position_ids": position_ids,
           "row_pack": row_pack, "row_end": row_end, "row_id": row_id, "num_tokens": sum(len(r) for r in rows)}
    if labels is not None:
        out["labels"] = label_t
    return out


def pack_sft(batch: Sequence[dict[str, list[int]]], pad_id: int, pack_length: int) -> dict[str, Any]:
    """`collate_sft`'s rows packed: input_ids, labels, position_ids [P, T] (labels -100 on every row's
    first token and on the pad tail), attention_mask None, row_pack/row_end [B], num_tokens."""
    return pack_rows([b["input_ids"] for b in batch], pad_id, pack_length, [b["labels"] for b in batch])


def pack_pairs(batch: Sequence[dict[str, Any]], pad_id: int, pack_length: int, *, labels: bool = False) -> dict[str, Any]:
    """`collate_pairs`' 2B rows (chosen first) packed; row_pack/row_end [2B] locate each row's last
    token, where its score is read (`packed_scores`). `labels`: + labels [P, T], the response tokens
    (IGNORE_INDEX on bos + prompt, as DPO's `pair_batch`)."""
    rows = [b["chosen_ids"] for b in batch] + [b["rejected_ids"] for b in batch]
    lab = None
    if labels:
        lab = [[IGNORE_INDEX] * f["prompt_len"] + r[f["prompt_len"] :] for f, r in zip([*batch, *batch], rows)]
    return pack_rows(rows, pad_id, pack_length, lab)


def packed_scores(values: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    """values [P, T] of a packed batch -> [rows]: each row's value at its last token, in row order."""
    return values[batch["row_pack"].to(values.device), batch["row_end"].to(values.device)]


def packed_row_sums(values: torch.Tensor, mask: torch.Tensor, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-target values [P, T-1] of a packed batch (target t = token t+1) and a mask [P, T-1] ->
    (the sum over each row's masked targets [rows] float32, their count [rows] float32), in row order:
    `dpo_math.sequence_logps` of the padded batch."""
    row = batch["row_id"][:, 1:].to(values.device)
    keep = mask.bool() & (row >= 0)
    n = batch["row_pack"].shape[0]
    sums = torch.zeros(n, dtype=torch.float32, device=values.device).index_add(0, row[keep], values[keep].float())
    counts = torch.zeros(n, dtype=torch.float32, device=values.device).index_add(
        0, row[keep], torch.ones_like(row[keep], dtype=torch.float32))
    return sums, counts


def is_packed(batch: dict[str, Any]) -> bool:
    return batch.get("attention_mask") is None and "position_ids" in batch


def batch_tokens(batch: dict[str, Any]) -> int:
    """Real (non-pad) tokens of a padded or packed batch."""
    return int(batch["num_tokens"]) if is_packed(batch) else int(batch["attention_mask"].sum())


def padded_tokens(batch: dict[str, Any]) -> int:
    """Token slots the forward computes (real + pad)."""
    return batch["input_ids"].numel()


# Families whose model code does not hand position_ids to transformers' mask builder, so a packed row
# would attend across its rows: they get the block-diagonal mask explicitly (`block_causal_mask`).
EXPLICIT_MASK_MODEL_TYPES = ("opt",)


def block_causal_mask(position_ids: torch.Tensor, attn_implementation: str) -> torch.Tensor:
    """position_ids [P, T] of packed rows -> a 4D mask [P, 1, T, T] that lets token i see token j
    only when j <= i in the same row (a row starts where the position does not follow the previous
    one, as transformers' `find_packed_sequence_indices`): bool for sdpa, additive float32 for eager.
    Dense: T^2 bytes per pack (1 MiB at T=1024)."""
    first = position_ids[:, :1] - 1
    seq = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)  # [P, T] row index per token
    T = position_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (seq[:, :, None] == seq[:, None, :]) & causal  # [P, T, T]
    if attn_implementation == "eager":
        return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(torch.float32).min)[:, None]
    return allowed[:, None]


def pair_layout(rows: Sequence[dict], pack_length: int | None, only_if_saves: bool, shared: bool | None) -> str:
    """How a micro-batch of pairs is laid out: "packed" (`pack_length` not None; with `only_if_saves`,
    data.packing=auto, only where it computes fewer token slots than padding), "shared" (each pair's prompt
    run once, `collate_shared_pairs`; `shared` True: always, None: data.shared_prompts=auto) or "padded".
    With both automatic, the layout that computes the fewest token slots: the shipped pairs (prompts ~65% of
    a row, lengths close) run shared, a long-tailed mix packs (its padding is most of a padded batch)."""
    if shared is True:
        return "shared"
    lengths = [len(r["chosen_ids"]) for r in rows] + [len(r["rejected_ids"]) for r in rows]
    slots = {"padded": len(lengths) * max(lengths)}
    if pack_length is not None:
        if not only_if_saves:
            return "packed"
        bins = pack_bins(lengths, pack_length)
        slots["packed"] = len(bins) * max(sum(lengths[i] for i in b) for b in bins)
    if shared is None:
        P = max(r["prompt_len"] for r in rows)
        R = max(len(r[k]) - r["prompt_len"] for r in rows for k in ("chosen_ids", "rejected_ids"))
        slots["shared"] = len(rows) * P + len(lengths) * R
    return min(slots, key=lambda k: (slots[k], k != "padded"))  # a tie stays padded


def pair_collate(pad_id: int, pack_length: int | None, only_if_saves: bool = False, *, shared: bool | None = False):
    """rows -> collate_pairs' padded batch, packed (`pack_length` not None) or shared-prompt one
    (`shared`, data.shared_prompts resolved): `pair_layout` chooses per micro-batch."""
    def collate(rows: list[dict]) -> dict:
        layout = pair_layout(rows, pack_length, only_if_saves, shared)
        if layout == "shared":
            return collate_shared_pairs(rows, pad_id)
        if layout == "packed":
            return pack_pairs(rows, pad_id, pack_length)
        return collate_pairs(rows, pad_id)

    return collate
