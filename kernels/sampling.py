"""Sampling from logits with temperature, top-k and top-p, without host syncs.

    logits [B, V] (any float dtype) -> tokens [B] int64, logprobs [B] fp32

Meaning (`sample_reference` defines it):
- z = logits.float() / temperature; temperature == 0 means greedy: argmax of the logits (first
  index on ties), no noise used.
- top-k (k > 0): keep z >= the k-th largest z (ties at the threshold kept, as transformers'
  TopKLogitsWarper).
- top-p (0 < p < 1), applied after top-k on the renormalised kept set, as TopPLogitsWarper: keep a
  token iff the probability mass of the tokens strictly above it is < p, i.e. the smallest set of
  most likely tokens whose mass reaches p, always >= 1 token. transformers breaks ties at the
  threshold by sort order; here all tied tokens are kept.
- The draw is Gumbel-max with uniform noise u [B, V] in [0, 1) (clamped to >= 2**-126):
  token = argmax over kept tokens of z - log(-log u), an exact sample of softmax(z) restricted to the
  kept set. `noise` is taken as given, else drawn with `torch.rand(..., generator=generator)`, so a
  seeded generator makes sampling reproducible and the same noise gives the same token in every
  implementation (up to float rounding at near-ties).
- logprobs: the log-prob of the token under the distribution it was drawn from: softmax(z)
  restricted to the kept set and renormalised, i.e. z[token] - logsumexp(z over kept tokens) (with
  top-k and top-p off: log softmax(z)[token], the temperature-scaled distribution; temperature 0:
  log softmax(logits)[token], T = 1, unfiltered). The RL step compares it with the trainer's
  log_softmax(logits / T) (rlhf/rl/metrics.py `gen_logprob_gap`).

Triton: one program per row, passes over the vocabulary in BLOCK_V chunks. The top-k and top-p
thresholds are found by bisection instead of a sort: floats are mapped to int32 keys with the same
order, and 32 halvings of the key range pin the exact threshold (top-k: the largest key with
count(z >= key) >= k; top-p: the largest key with mass(z >= key) >= p * mass(kept by top-k)). Each
halving re-reads the row (up to 66 passes with both filters on); a decode batch's logits should stay
in L2, but this is not timed yet — a radix select (4 passes of 8-bit histograms) is the next step
if it shows up in the decode step.
"""
import torch

from .dispatch import guarded, jit, next_pow2, resolve_impl, tl


_TINY = torch.finfo(torch.float32).tiny  # 1.1754944e-38, also hard-coded in the kernel


def _greedy(temperature):
    return temperature is None or float(temperature) == 0.0


def keep_mask_reference(z, top_k=0, top_p=1.0):
    """Tokens that survive top-k then top-p on scaled logits z [B, V] (sort-based) -> bool [B, V]."""
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        keep &= z >= kth
    if top_p < 1.0:
        zs, _ = z.masked_fill(~keep, float("-inf")).sort(dim=-1, descending=True)
        ps = zs.softmax(-1)
        above = ps.cumsum(-1) - ps  # mass strictly before each sorted position
        n_keep = (above < top_p).sum(-1, keepdim=True).clamp_min(1)
        threshold = zs.gather(1, n_keep - 1)  # smallest kept value; ties with it are kept too
        keep &= z >= threshold
    return keep


def sample_reference(logits, temperature=1.0, top_k=0, top_p=1.0, noise=None, generator=None):
    """Sort-based PyTorch reference. Returns (tokens [B] int64, logprobs [B] fp32)."""
    B, V = logits.shape
    if _greedy(temperature):
        tokens = logits.argmax(-1)
        return tokens, logits.float().log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    z = logits.float() / float(temperature)
    keep = keep_mask_reference(z, top_k, top_p)
    if noise is None:
        noise = torch.rand(B, V, generator=generator, device=logits.device)
    gumbel = -torch.log(-torch.log(noise.float().clamp_min(_TINY)))  # u = 0 must not veto a token
    kept = torch.where(keep, z, float("-inf"))
    tokens = (kept + gumbel).argmax(-1)
    return tokens, kept.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)  # the filtered, renormalised p


@jit
def _order_key(z):
    """fp32 -> int32 whose integer order is the float order (for bisection on thresholds)."""
    bits = z.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@jit
def _scaled_tile(zrow, cols, V, temp):
    """(z / temp as fp32, in-bounds mask) for one block of a row; IEEE division as the reference."""
    ok = cols < V
    return tl.div_rn(tl.load(zrow + cols, mask=ok, other=0.0).to(tl.float32), temp), ok


@jit
def _sample_kernel(
    z_ptr, u_ptr, tok_ptr, lp_ptr,  # logits [B, V], noise [B, V], tokens [B], logprobs [B]
    V, stride_z, stride_u, temp, top_k, top_p,
    GREEDY: tl.constexpr, TOP_K: tl.constexpr, TOP_P: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    zrow = z_ptr + row * stride_z
    offs = tl.arange(0, BLOCK_V)
    # pass 1: max, sum exp (online), min key
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    kmin = tl.full((), 2147483647, tl.int32)
    kmax = tl.full((), -2147483647 - 1, tl.int32)
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.zeros((), tl.int32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        ok = cols < V
        z = tl.load(zrow + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if GREEDY:  # argmax of the raw logits; strict > keeps the first index across blocks
            bv, bi = tl.max(z, 0, return_indices=True)  # first index on ties
            take = bv > best
            best_i = tl.where(take, v0 + bi, best_i)
            best = tl.where(take, bv, best)
        else:
            z = tl.div_rn(z, temp)  # IEEE division, as the reference does, so keys match bit for bit
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
        if TOP_K or TOP_P:
            key = _order_key(z)
            kmin = tl.minimum(kmin, tl.min(tl.where(ok, key, 2147483647), 0))
            kmax = tl.maximum(kmax, tl.max(tl.where(ok, key, -2147483647 - 1), 0))
    lse = m + tl.log(s)
    if GREEDY:
        tok = best_i
    else:
        lo = kmin.to(tl.int64)  # invariant: the predicate holds at lo, fails at hi
        if TOP_K:
            hi = kmax.to(tl.int64) + 1
            for _ in range(32):  # hi - lo <= 2**32
                mid = lo + (hi - lo) // 2
                cnt = tl.zeros((), tl.int32)
                for v0 in range(0, V, BLOCK_V):
                    z, ok = _scaled_tile(zrow, v0 + offs, V, temp)
                    key = _order_key(z)
                    cnt += tl.sum(tl.where(ok & (key >= mid), 1, 0), 0)
                big = cnt >= top_k
                lo = tl.where(big, mid, lo)
                hi = tl.where(big, hi, mid)
        if TOP_P:
            # mass (relative to exp(-m)) of the top-k set, then of z >= mid; lo starts at the top-k cut
            kept = tl.zeros((), tl.float32)
            for v0 in range(0, V, BLOCK_V):
                z, ok = _scaled_tile(zrow, v0 + offs, V, temp)
                key = _order_key(z)
                kept += tl.sum(tl.where(ok & (key >= lo), tl.exp(z - m), 0.0), 0)
            need = top_p * kept
            hi = kmax.to(tl.int64) + 1
            for _ in range(32):
                mid = lo + (hi - lo) // 2
                mass = tl.zeros((), tl.float32)
                for v0 in range(0, V, BLOCK_V):
                    z, ok = _scaled_tile(zrow, v0 + offs, V, temp)
                    key = _order_key(z)
                    mass += tl.sum(tl.where(ok & (key >= mid), tl.exp(z - m), 0.0), 0)
                big = mass >= need
                lo = tl.where(big, mid, lo)
                hi = tl.where(big, hi, mid)
        # final pass: Gumbel-max over kept tokens, and their mass (the renormaliser of the log-prob)
        best = tl.full((), float("-inf"), tl.float32)
        best_i = tl.zeros((), tl.int32)
        kept_mass = tl.zeros((), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + offs
            ok = cols < V
            z = tl.div_rn(tl.load(zrow + cols, mask=ok, other=0.0).to(tl.float32), temp)
            u = tl.maximum(tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.5).to(tl.float32), 1.1754944e-38)
            score = z - tl.log(-tl.log(u))
            keep = ok
            if TOP_K or TOP_P:
                keep = keep & (_order_key(z) >= lo)
            kept_mass += tl.sum(tl.where(keep, tl.exp(z - m), 0.0), 0)
            score = tl.where(keep, score, float("-inf"))
            bv, bi = tl.max(score, 0, return_indices=True)  # first index on ties
            take = bv > best
            best_i = tl.where(take, v0 + bi, best_i)
            best = tl.where(take, bv, best)
        tok = best_i
        if TOP_K or TOP_P:
            lse = m + tl.log(kept_mass)  # log-prob under the kept set, renormalised
    z_tok = tl.load(zrow + tok).to(tl.float32)
    if not GREEDY:
        z_tok = tl.div_rn(z_tok, temp)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(lp_ptr + row, z_tok - lse)


def _sample_triton(logits, temperature, top_k, top_p, noise):
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    greedy = _greedy(temperature)
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    noise = noise if noise is not None else logits  # unused when greedy
    if noise.stride(-1) != 1:
        noise = noise.contiguous()
    # interpreter: its cost is per op, not per element, but tests still want several blocks
    BLOCK_V = min(4096, next_pow2(V)) if logits.is_cuda else min(128, next_pow2(V))
    _sample_kernel[(B,)](
        logits, noise, tokens, logprobs, V, logits.stride(0), noise.stride(0),
        1.0 if greedy else float(temperature), int(top_k), float(top_p),
        GREEDY=greedy, TOP_K=(not greedy) and 0 < top_k < V, TOP_P=(not greedy) and top_p < 1.0,
        BLOCK_V=BLOCK_V, num_warps=8 if BLOCK_V >= 2048 else 4)
    return tokens, logprobs


def sample(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None, noise=None, impl="auto"):
    """Draw one token per row of logits [B, V]. temperature 0 (or None) = greedy; top_k 0 = off;
    top_p 1.0 = off. noise: uniform [B, V] in (0, 1) (drawn from `generator` when None).
    Returns (tokens [B] int64, logprobs [B] fp32 under the distribution drawn from: softmax(logits /
    temperature) over the tokens top-k/top-p keep, renormalised; greedy: softmax(logits)).
    All arguments but the tensors are Python numbers, so nothing waits on the device.
    impl: "auto" | "triton" | "reference"."""
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not _greedy(temperature) and noise is None:
        noise = torch.rand(logits.shape, generator=generator, device=logits.device)
    auto, impl = impl == "auto", resolve_impl(impl, "reference", logits)
    if impl == "reference":
        return sample_reference(logits, temperature, top_k, top_p, noise)
    if impl != "triton":
        raise ValueError(f"impl must be auto|triton|reference, got {impl!r}")
    if not auto:
        return _sample_triton(logits, temperature, top_k, top_p, noise)
    # the same noise on both paths: tokens must be equal, not just equally distributed
    return guarded("sample", lambda z, u: _sample_triton(z, temperature, top_k, top_p, u),
                   lambda z, u: sample_reference(z, temperature, top_k, top_p, u), (logits, noise),
                   (logits[:4], None if noise is None else noise[:4]), logits.dtype, ("tokens", "log-probs"))
