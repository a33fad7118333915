"""Reward-model math as pure functions over tensors and masks (no model, no config, no I/O).

The score of a sequence is the value at its last real token: the last position where the
attention mask is 1. This holds for right padding, left padding, no padding, and models with a
leading pad/BOS, with no model-specific offsets (DeepSpeed-Chat's `num_padding_at_beginning`).

Pairwise loss (Bradley-Terry, as InstructGPT / DeepSpeed-Chat), per pair i:
    loss_i = -log sigmoid(r_chosen_i - r_rejected_i - margin) + score_reg * (r_chosen_i^2 + r_rejected_i^2) / 2
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] 0/1 mask -> [B] long: the column of each row's last 1. ValueError on an all-zero row."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [B, T], got shape {list(attention_mask.shape)}")
    mask = attention_mask.bool()
    if not mask.any(dim=1).all():
        raise ValueError("a row of the attention mask has no real token to score")
    T = mask.shape[1]
    return T - 1 - mask.flip(1).long().argmax(dim=1)


def sequence_scores(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """values [B, T] (per-token), attention_mask [B, T] -> [B]: the value at the last real token."""
    idx = last_token_index(attention_mask).to(values.device)
    return values.gather(1, idx[:, None]).squeeze(1)


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: float = 0.0, score_reg: float = 0.0) -> torch.Tensor:
    """[B], [B] scores -> [B] per-pair losses (sum or mean them as the caller needs)."""
    if chosen.shape != rejected.shape:
        raise ValueError(f"chosen {list(chosen.shape)} and rejected {list(rejected.shape)} scores differ in shape")
    c, r = chosen.float(), rejected.float()
    loss = -F.logsigmoid(c - r - margin)
    if score_reg:
        loss = loss + score_reg * (c.square() + r.square()) / 2
    return loss


def pair_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Fraction of pairs scored chosen > rejected (ties count as wrong)."""
    return (chosen > rejected).float().mean()


def auc(scores: list[float], labels: list[float]) -> float | None:
    """Area under the ROC curve: P(score of a random positive > score of a random negative), ties
    half. None when one class is missing."""
    pos = [s for s, y in zip(scores, labels) if y > 0.5]
    neg = [s for s, y in zip(scores, labels) if y <= 0.5]
    if not pos or not neg:
        return None
    s = torch.tensor(pos, dtype=torch.float64)[:, None]
    n = torch.tensor(neg, dtype=torch.float64)[None, :]
    return ((s > n).double().sum() + 0.5 * (s == n).double().sum()).item() / (len(pos) * len(neg))
