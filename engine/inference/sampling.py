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

Per-row random streams (`engine.deterministic`): with `row_seeds` [B] the noise of row b at response
token t is `row_noise(row_seeds, t, V)[b]`, a counter-based hash of (row_seeds[b], t, vocabulary index)
in int64 tensor ops: no generator state, the same bits on every device and inside a CUDA graph, and a
row's draw does not depend on the other rows of its batch, its position there, or how many there are.
`stream_seed(*ints)` derives such a seed from integers (a run seed, a step, a prompt index, ...).
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


_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1


def stream_seed(*keys: int) -> int:
    """A seed in [0, 2**63) from non-negative integers (splitmix64 over them, in Python ints): e.g. the
    per-row seed of a sampled response from (run seed, step, prompt index, sample index)."""
    h = 0x243F6A8885A308D3
    for k in keys:
        h = (h ^ (int(k) & _M64)) + 0x9E3779B97F4A7C15 & _M64
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & _M64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _M64
        h ^= h >> 31
    return h >> 1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) and a 32-bit constant c, without int64 overflow
    (signed overflow is undefined in the C++ kernels): x is split in 16-bit halves."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser (a bijection with full avalanche) on int64 tensors in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def row_noise(row_seeds: torch.Tensor, step: torch.Tensor | int, vocab_size: int) -> torch.Tensor:
    """Uniform noise [B, V] in [0, 1) for response token `step` of rows seeded `row_seeds` [B] (int64 >= 0).

    Counter-based: u[b, v] = hash(row_seeds[b], step, v) >> 8, times 2**-24 (24 bits: exact in fp32, and
    below 1 so that Gumbel noise stays finite). The row key mixes the seed's two 32-bit halves and the
    step; each vocabulary index (times an odd constant) is XORed with it and hashed (a MurmurHash3
    finaliser: for a given row and step, a bijection of the index, so no two tokens draw alike). Integer ops
    only: the same bits on CPU and CUDA, for any batch; `step` may be a device tensor (a CUDA graph
    advances it in place).
    """
    seeds = row_seeds.to(torch.long)
    step = torch.as_tensor(step, dtype=torch.long, device=seeds.device)
    key = _fmix32(((seeds >> 32) & _M32) ^ 0x243F6A88)
    key = _fmix32(key ^ (seeds & _M32))
    key = _fmix32(key ^ _mul32(step & _M32, 0x9E3779B9))[:, None]  # [B, 1]
    cols = _mul32(torch.arange(vocab_size, device=seeds.device), 0x85EBCA77)[None]  # [1, V]
    x = _fmix32(key ^ cols)
    return (x >> 8).to(torch.float32) * 2.0**-24


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
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B] int64, logprobs [B] fp32), through kernels.sample (one fused
    Triton pass on CUDA, its sort-based reference elsewhere). No host sync. `noise` [B, V]: the
    uniform draws to use (`row_noise`), else drawn from `generator` (or the global RNG)."""
    if params.greedy:
        return kernels.sample(logits, temperature=0.0)
    return kernels.sample(logits, params.temperature, params.top_k, params.top_p, generator=generator, noise=noise)
