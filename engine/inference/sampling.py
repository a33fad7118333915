"""Token sampling on a batch of logits, without host syncs (so a CUDA graph can hold it).

Order and semantics are transformers' warpers: temperature, then top-k (keep every token whose
logit is >= the k-th largest, ties included), then top-p (drop the low tokens whose cumulative
probability stays <= 1 - top_p, always keeping the most likely). `greedy` is argmax and ignores the
three settings. The draw is exponential-race sampling, `argmax(p / E)` with E ~ Exp(1), which picks
token i with probability p_i and needs no `torch.multinomial` (whose CUDA version syncs).

The log-prob returned for a chosen token is `log_softmax(logits / temperature)` at that token: the
temperature-scaled distribution *before* top-k/top-p truncation (greedy: temperature 1). It is a
by-product, not the PPO "old" log-prob, which scoring recomputes under the training forward.

TODO(kernels): kernels.sampling fuses scale, filter and draw without the full-vocab sort.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    greedy: bool = False

    def __post_init__(self):
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling (got {self.temperature}); use greedy=True")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (got {self.top_k})")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")


def filter_logits(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """scores [B, V] with the tokens top-k / top-p remove set to -inf (transformers' warpers)."""
    if top_k > 0:
        kth = torch.topk(scores, min(top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[..., -1:] = False  # keep at least the most likely token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B] int64, logprobs [B] fp32). No host sync."""
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / params.temperature
    probs = filter_logits(scaled, params.top_k, params.top_p).softmax(dim=-1)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator).clamp_min_(1e-30)
    tokens = (probs / race).argmax(dim=-1)
    return tokens, torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
