"""Tokenization of canonical examples, the over-long rule, and the batch collators.

Prompt and response are tokenized separately (no special tokens added by the tokenizer) and then
joined, so the prompt's ids are exactly what the policy is given at generation time:

    sequence = [bos] + prompt_ids + response_ids + [eos]
    labels   = -100 ... -100        + response_ids + [eos]     (SFT loss on the response only)

A conversation (ChatExample: {messages} and ShareGPT rows) is the template's own rendering instead,
tokenized whole, with the loss on every assistant turn including the end-of-turn tokens the template
writes, and nothing appended (rlhf/data/chat.py):

    sequence = [bos] + ids(template(messages))
    labels   = -100 on bos and on every token outside the assistant turns
               (data.assistant_only_loss=false: on bos only, as a {text} row)

and the over-long rule below reads its "prompt part" as the tokens before the first trained one and
its "response" as everything from there (no eos to cut first: the rendering's own end goes first).

`bos` is added only with `add_bos=True` and when the tokenizer has one (and not twice when the
prompt text, e.g. from a chat template, already starts with it); `eos` is always added.

The over-long rule (`max_prompt_len` counts the bos; `max_len` the whole sequence):
  1. prompt part longer than max_prompt_len: "truncate" cuts the prompt from the LEFT (bos is kept
     and so is the end of the prompt, nearest the response); "drop" drops the row.
  2. then, if [prompt part] + response + [eos] exceeds max_len: "truncate" cuts it on the right
     (the eos goes first, so a cut sequence has no eos — an honest truncation, the model is not
     taught to stop there); "drop" drops the row. So "drop" never keeps a cut row.
  3. a row left with no response token (the prompt part fills max_len) is dropped.
Pairs apply this to chosen and rejected with the same prompt part, and are dropped when either
side ends empty, when chosen == rejected as text, or when both sides are identical after the cut
(counted as `identical`; a reward model learns nothing from them). Every function returns
(rows, stats) with counts `rows`, `kept`, `prompt_truncated`, `response_truncated`, `dropped`
(truncation counts are over kept rows; kept + dropped = rows) and logs one line when anything was
cut or dropped.

Unpaired rows (KTO) follow the SFT rule row by row; `mismatched_rows` then gives each kept row the
sequence KTO's KL estimate reads: its own prompt part followed by another row's response (+ eos), cut
on the right to max_len when longer (whatever data.overlong says: it is scored, never trained on).

Collators: SFT and pairs are right-padded (pairs as one [2B, L] batch, the B chosen rows first,
then the B rejected rows); prompts are left-padded so generation continues from the last column.
Pairs whose two rows run their prompt once (data.shared_prompts, `collate_shared_pairs`) are laid out as
the RL stage's rollouts: the prompt part left-padded to the batch's longest, the response right-padded.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from rlhf.data.chat import chat_tokens
from rlhf.data.records import ChatExample, PairExample, PromptExample, SFTExample, UnpairedExample

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
OVERLONG = ("truncate", "drop")


# --------------------------------------------------------------------------- the over-long rule


def _check(tokenizer: Any, max_len: int | None, max_prompt_len: int, overlong: str) -> None:
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {OVERLONG}, got {overlong!r}")
    if not isinstance(max_prompt_len, int) or max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be an int >= 1, got {max_prompt_len!r}")
    if max_len is not None:
        if not isinstance(max_len, int) or max_len < max_prompt_len:
            raise ValueError(f"max_len must be an int >= max_prompt_len ({max_prompt_len}), got {max_len!r}")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token; it is needed to end each response")


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _bos(tokenizer: Any, add_bos: bool) -> int | None:
    return tokenizer.bos_token_id if add_bos else None


def _prompt_part(ids: list[int], bos: int | None, max_prompt_len: int, overlong: str) -> tuple[list[int], bool] | None:
    """[bos] + prompt ids within max_prompt_len, cut from the left; None = drop. Returns (ids, was_cut)."""
    head: list[int] = []
    if bos is not None:
        head = [bos]
        if ids and ids[0] == bos:  # the text already carries it (chat templates often do)
            ids = ids[1:]
    room = max_prompt_len - len(head)
    if len(ids) <= room:
        return head + ids, False
    if overlong == "drop":
        return None
    return head + ids[len(ids) - room :], True


def _target(resp_ids: list[int], eos: int, room: int, overlong: str) -> tuple[list[int], bool] | None:
    """response ids + [eos] within `room`, cut on the right; None = drop (would be cut, or empty)."""
    target = resp_ids + [eos]
    if len(target) <= room:
        return target, False
    if overlong == "drop" or room <= 0:
        return None
    return target[:room], True


def _log(fn: str, stats: dict[str, int], max_len: int | None, max_prompt_len: int, overlong: str) -> None:
    if stats["kept"] == stats["rows"] and not stats["prompt_truncated"] and not stats.get("response_truncated"):
        return
    extra = "".join(f", {k}={v}" for k, v in stats.items() if k not in ("rows", "kept"))
    logger.warning(
        "%s: %d rows -> %d kept%s (max_len=%s, max_prompt_len=%d, overlong=%s)",
        fn, stats["rows"], stats["kept"], extra, max_len, max_prompt_len, overlong,
    )


# --------------------------------------------------------------------------- tokenizers


def tokenize_sft(
    examples: Sequence[SFTExample | ChatExample],
    tokenizer: Any,
    max_len: int,
    max_prompt_len: int,
    overlong: str = "truncate",
    add_bos: bool = True,
    assistant_only_loss: bool = True,
) -> tuple[list[dict[str, list[int]]], dict[str, int]]:
    """SFT examples -> [{input_ids, labels}] with labels -100 on bos + prompt, and stats. Conversations
    (ChatExample) are trained on every assistant turn, or on every token with assistant_only_loss=False."""
    _check(tokenizer, max_len, max_prompt_len, overlong)
    bos, eos = _bos(tokenizer, add_bos), tokenizer.eos_token_id
    plain = [e for e in examples if not isinstance(e, ChatExample)]
    prompts = _encode(tokenizer, [e.prompt for e in plain])
    responses = _encode(tokenizer, [e.response for e in plain])
    chats = iter(chat_tokens(tokenizer, [e for e in examples if isinstance(e, ChatExample)], assistant_only_loss))
    pairs = iter(zip(prompts, responses))
    stats = dict(rows=len(examples), kept=0, prompt_truncated=0, response_truncated=0, dropped=0)
    out = []
    for ex in examples:
        if isinstance(ex, ChatExample):
            made = _chat_feature(*next(chats), bos, max_len, max_prompt_len, overlong)
        else:
            p_ids, r_ids = next(pairs)
            made = None
            prompt = _prompt_part(p_ids, bos, max_prompt_len, overlong)
            target = None if prompt is None else _target(r_ids, eos, max_len - len(prompt[0]), overlong)
            if target is not None:
                (p, p_cut), (t, t_cut) = prompt, target
                made = {"input_ids": p + t, "labels": [IGNORE_INDEX] * len(p) + t}, p_cut, t_cut
        if made is None:
            stats["dropped"] += 1
            continue
        feature, p_cut, t_cut = made
        stats["kept"] += 1
        stats["prompt_truncated"] += p_cut
        stats["response_truncated"] += t_cut
        out.append(feature)
    _log("tokenize_sft", stats, max_len, max_prompt_len, overlong)
    return out, stats


def _chat_feature(ids: list[int], mask: list[bool], bos: int | None, max_len: int, max_prompt_len: int,
                  overlong: str) -> tuple[dict[str, list[int]], bool, bool] | None:
    """A conversation's (ids, mask) under the over-long rule: the tokens before the first trained one are
    the prompt part (cut from the left), the rest is cut on the right; None = drop."""
    if bos is not None and ids and ids[0] == bos:  # the template writes it: added once, by _prompt_part
        ids, mask = ids[1:], mask[1:]
    first = next((i for i, m in enumerate(mask) if m), None)
    if first is None:  # nothing to train on
        return None
    prompt = _prompt_part(ids[:first], bos, max_prompt_len, overlong)
    if prompt is None:
        return None
    (p, p_cut), rest, rest_mask = prompt, ids[first:], mask[first:]
    room = max_len - len(p)
    t_cut = len(rest) > room
    if t_cut:
        if overlong == "drop" or room <= 0:
            return None
        rest, rest_mask = rest[:room], rest_mask[:room]
    labels = [IGNORE_INDEX] * len(p) + [t if m else IGNORE_INDEX for t, m in zip(rest, rest_mask)]
    return {"input_ids": p + rest, "labels": labels}, p_cut, t_cut


def tokenize_pairs(
    examples: Sequence[PairExample],
    tokenizer: Any,
    max_len: int,
    max_prompt_len: int,
    overlong: str = "truncate",
    add_bos: bool = True,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Pairs -> [{chosen_ids, rejected_ids, prompt_len, index}] (each side [bos]+prompt+response+[eos];
    index = position in `examples`), and stats."""
    _check(tokenizer, max_len, max_prompt_len, overlong)
    bos, eos = _bos(tokenizer, add_bos), tokenizer.eos_token_id
    prompts = _encode(tokenizer, [e.prompt for e in examples])
    chosen = _encode(tokenizer, [e.chosen for e in examples])
    rejected = _encode(tokenizer, [e.rejected for e in examples])
    stats = dict(rows=len(examples), kept=0, prompt_truncated=0, response_truncated=0, dropped=0, identical=0)
    out = []
    for i, (ex, p_ids, c_ids, r_ids) in enumerate(zip(examples, prompts, chosen, rejected)):
        if ex.chosen == ex.rejected:
            stats["identical"] += 1
            stats["dropped"] += 1
            continue
        prompt = _prompt_part(p_ids, bos, max_prompt_len, overlong)
        c = r = None
        if prompt is not None:
            room = max_len - len(prompt[0])
            c, r = _target(c_ids, eos, room, overlong), _target(r_ids, eos, room, overlong)
        if c is None or r is None:
            stats["dropped"] += 1
            continue
        if c[0] == r[0]:  # the cut removed every difference
            stats["identical"] += 1
            stats["dropped"] += 1
            continue
        p = prompt[0]
        stats["kept"] += 1
        stats["prompt_truncated"] += prompt[1]
        stats["response_truncated"] += c[1] or r[1]
        out.append({"chosen_ids": p + c[0], "rejected_ids": p + r[0], "prompt_len": len(p), "index": i})
    _log("tokenize_pairs", stats, max_len, max_prompt_len, overlong)
    return out, stats


def tokenize_unpaired(
    examples: Sequence[UnpairedExample],
    tokenizer: Any,
    max_len: int,
    max_prompt_len: int,
    overlong: str = "truncate",
    add_bos: bool = True,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Labelled rows -> [{input_ids, prompt_len, label, index}] ([bos]+prompt+response+[eos] under the
    over-long rule; index = position in `examples`), and stats (+ desirable/undesirable: kept rows of each)."""
    _check(tokenizer, max_len, max_prompt_len, overlong)
    bos, eos = _bos(tokenizer, add_bos), tokenizer.eos_token_id
    prompts = _encode(tokenizer, [e.prompt for e in examples])
    responses = _encode(tokenizer, [e.response for e in examples])
    stats = dict(rows=len(examples), kept=0, prompt_truncated=0, response_truncated=0, dropped=0, desirable=0,
                 undesirable=0)
    out = []
    for i, (ex, p_ids, r_ids) in enumerate(zip(examples, prompts, responses)):
        prompt = _prompt_part(p_ids, bos, max_prompt_len, overlong)
        target = None if prompt is None else _target(r_ids, eos, max_len - len(prompt[0]), overlong)
        if target is None:
            stats["dropped"] += 1
            continue
        (p, p_cut), (t, t_cut) = prompt, target
        stats["kept"] += 1
        stats["prompt_truncated"] += p_cut
        stats["response_truncated"] += t_cut
        stats["desirable" if ex.label else "undesirable"] += 1
        out.append({"input_ids": p + t, "prompt_len": len(p), "label": ex.label, "index": i})
    _log("tokenize_unpaired", stats, max_len, max_prompt_len, overlong)
    return out, stats


def mismatched_rows(features: list[dict[str, Any]], max_len: int, seed: int) -> list[dict[str, Any]]:
    """KTO's mismatched pairs (x_i, y_j): each feature gains `kl_ids`, its own prompt part followed by
    the response (+ eos) of another row, cut on the right to `max_len`, and `kl_partner` (j).

    Partners are fixed per row, as TRL's KTOTrainer fixes its KL completions when it prepares the
    dataset: in a permutation seeded by `seed`, a row takes the response of the next row whose prompt
    differs from its own (the rows of a split pair share a prompt: theirs would not be a mismatch),
    cyclically; only when every row has the same prompt does a row take the next row's anyway.
    Needs at least two rows."""
    n = len(features)
    if n < 2:
        raise ValueError(f"KTO pairs each prompt with another row's response to estimate the KL: it needs at "
                         f"least 2 rows, got {n}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    prompt = [tuple(f["input_ids"][: f["prompt_len"]]) for f in features]
    for k, i in enumerate(order):
        j = next((order[(k + s) % n] for s in range(1, n) if prompt[order[(k + s) % n]] != prompt[i]),
                 order[(k + 1) % n])
        own, other = features[i], features[j]
        kl = own["input_ids"][: own["prompt_len"]] + other["input_ids"][other["prompt_len"] :]
        own["kl_ids"], own["kl_partner"] = kl[:max_len], j
    return features


def tokenize_prompts(
    examples: Sequence[PromptExample],
    tokenizer: Any,
    max_prompt_len: int,
    overlong: str = "truncate",
    add_bos: bool = True,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Prompts -> [{input_ids, prompt (text), answer, meta}] ([bos]+prompt, cut from the left), and stats."""
    _check(tokenizer, None, max_prompt_len, overlong)
    bos = _bos(tokenizer, add_bos)
    stats = dict(rows=len(examples), kept=0, prompt_truncated=0, dropped=0)
    out = []
    for ex, p_ids in zip(examples, _encode(tokenizer, [e.prompt for e in examples])):
        prompt = _prompt_part(p_ids, bos, max_prompt_len, overlong)
        if prompt is None or not prompt[0]:  # nothing to generate from
            stats["dropped"] += 1
            continue
        stats["kept"] += 1
        stats["prompt_truncated"] += prompt[1]
        out.append({"input_ids": prompt[0], "prompt": ex.prompt, "answer": ex.answer, "meta": ex.meta})
    _log("tokenize_prompts", stats, None, max_prompt_len, overlong)
    return out, stats


# --------------------------------------------------------------------------- collators


def _pad(seqs: Sequence[Sequence[int]], value: int, left: bool = False,
         width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of shape (len(seqs), max length or `width`), padded on the right (or left) with `value`."""
    longest = max((len(s) for s in seqs), default=0)
    if width is not None and width < longest:
        raise ValueError(f"a row of {longest} tokens does not fit the fixed width {width}")
    width = longest if width is None else width
    ids = torch.full((len(seqs), width), value, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        span = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, span] = torch.as_tensor(s, dtype=torch.long)
        mask[i, span] = 1
    return ids, mask


def collate_sft(batch: Sequence[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """-> input_ids, attention_mask, labels: (B, L) right-padded; labels -100 on pads."""
    input_ids, attention_mask = _pad([b["input_ids"] for b in batch], pad_id)
    labels, _ = _pad([b["labels"] for b in batch], IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def collate_pairs(batch: Sequence[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """-> input_ids, attention_mask: (2B, L) right-padded; rows [:B] chosen, [B:] rejected."""
    seqs = [b["chosen_ids"] for b in batch] + [b["rejected_ids"] for b in batch]
    input_ids, attention_mask = _pad(seqs, pad_id)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def collate_shared_pairs(batch: Sequence[dict[str, Any]], pad_id: int, *, labels: bool = False) -> dict[str, Any]:
    """`collate_pairs`' 2B rows (chosen first) with each row's prompt part (its first `prompt_len` tokens, bos
    included) LEFT-padded to P, the batch's longest, and its response right-padded to R: input_ids,
    attention_mask, position_ids (0, 1, ... over the real tokens) [2B, P + R], "prompt_len" P and
    "shared_prompts" True. A pair's two rows hold the same first P columns, so a role given prompt_len runs
    that prompt once and both responses on its KV cache (rlhf/modeling/roles.py shared_prompt_forward).
    `labels`: + labels [2B, P + R], the response tokens (IGNORE_INDEX on the prompt part and padding)."""
    rows = [*batch, *batch]
    seqs = [b["chosen_ids"] for b in batch] + [b["rejected_ids"] for b in batch]
    p_ids, p_mask = _pad([s[: r["prompt_len"]] for r, s in zip(rows, seqs)], pad_id, left=True)
    r_ids, r_mask = _pad([s[r["prompt_len"] :] for r, s in zip(rows, seqs)], pad_id)
    mask = torch.cat([p_mask, r_mask], 1)
    out = {"input_ids": torch.cat([p_ids, r_ids], 1), "attention_mask": mask,
           "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "prompt_len": p_ids.shape[1], "shared_prompts": True}
    if labels:
        out["labels"] = torch.cat([torch.full_like(p_ids, IGNORE_INDEX), r_ids.masked_fill(r_mask == 0, IGNORE_INDEX)], 1)
    return out


def collate_prompts(batch: Sequence[dict[str, Any]], pad_id: int, width: int | None = None) -> dict[str, torch.Tensor]:
    """-> input_ids, attention_mask: (B, P) LEFT-padded, so every prompt ends at the last column; P = the
    longest prompt, or `width` (a fixed width, e.g. for batch-invariant generation: engine.deterministic)."""
    input_ids, attention_mask = _pad([b["input_ids"] for b in batch], pad_id, left=True, width=width)
    return {"input_ids": input_ids, "attention_mask": attention_mask}
