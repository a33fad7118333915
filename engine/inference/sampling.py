"""Token sampling on a batch of logits, without host syncs (so a CUDA graph can hold it).

`SamplingParams` states the sampling convention, once, for every sampler in the project. `sample`
follows transformers' warpers for top-k (keep every token whose logit is >= the k-th largest, ties
included) and top-p (drop the low tokens whose cumulative probability stays <= 1 - top_p, always
keeping the most likely; kernels.sample keeps every token tied at the top-p threshold, where
transformers, and `filter_logits` here, break the tie by sort order). The draw is kernels.sample's
Gumbel-max over uniform noise, which picks token i with probability p_i and needs no
`torch.multinomial` (whose CUDA version syncs); on CUDA one Triton pass scales, filters and draws
without the full-vocabulary sort.

The log-prob returned for a chosen token is the sampler's (the distribution it was drawn from), not
the PPO "old" log-prob, which scoring recomputes under the training forward; the RL step reports
their gap (`gen_logprob_gap`, `gen_kl`) and can correct for it (`ppo.is_correction`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

import kernels


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How responses are drawn: the one settings object of both generation paths (`transformers`
    `generate` in engine/generation.py, and this package). The convention every sampler follows
    (`sample` here, the HF path, kernels.sampling):

    - greedy=True: argmax of the logits; temperature, top_k and top_p are ignored. kernels.sampling
      takes plain arguments and spells greedy as temperature=0.
    - otherwise, in transformers' order: logits / temperature (> 0), then top-k, then top-p.
      top_k=0 is off (as is top_k >= vocab size); top_p=1.0 is off.
    - The log-prob reported for a drawn token is under the distribution it was drawn from:
      softmax(logits / temperature) over the tokens top-k/top-p keep, renormalised (with both off:
      log_softmax(logits / temperature); greedy: log_softmax(logits), temperature 1, unfiltered).
    - max_new_tokens caps the response length. engine.generation requires it;
      `engine.inference.generate` takes the length as an argument and does not read this field.
    """

    max_new_tokens: int | None = None
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self):
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling (got {self.temperature}); use greedy=True")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (got {self.top_k})")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")

    def draw_settings(self) -> SamplingParams:
        """Only what one draw reads: no length, and for greedy none of the settings it ignores. The
        decode-graph key, so one captured step serves every length and every greedy request."""
        return SamplingParams(greedy=True) if self.greedy else replace(self, max_new_tokens=None)


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
    """logits [B, V] -> (tokens [B] int64, logprobs [B] fp32), through kernels.sample (one fused
    Triton pass on CUDA, its sort-based reference elsewhere). No host sync."""
    if params.greedy:
        return kernels.sample(logits, temperature=0.0)
    return kernels.sample(logits, params.temperature, params.top_k, params.top_p, generator=generator)
