"""Log-probs of target tokens and entropy straight from hidden states and the LM head.

    z = (h @ W.T + b) / T                               # [N, V], never held whole
    logp[n]    = z[n, t_n] - logsumexp(z[n])
    entropy[n] = logsumexp(z[n]) - sum_v softmax(z[n])_v * z[n, v]
Rows whose target is `ignore_index` give logp = entropy = 0 and no gradient.

Backward, with upstream grads g_lp, g_ent, p = softmax(z) and Ez = sum_v p_v z_v:
    dz = g_lp * (onehot(t) - p) + g_ent * p * (Ez - z);   dlogits = dz / T
    dh = dlogits @ W,   dW = dlogits.T @ h,   db = dlogits.sum(0)
so the forward saves only lse and Ez per row ([N] each) and the backward recomputes logits.

Implementations, one meaning (`logprobs_entropy_reference` defines it):
- "reference": logits in the input dtype (as `lm_head(h).float()` in transformers), log_softmax,
  gather. Holds [N, V] fp32 logits plus autograd's copies.
- "chunked": the same PyTorch math over row chunks of `chunk_size`, logits recomputed in backward;
  holds a few [chunk, V] fp32 buffers. The CPU path (and the path with Triton disabled) when N*V is
  large.
- "triton": forward is one fused kernel: a program owns BLOCK_N rows and a slice of the
  vocabulary, builds [BLOCK_N, BLOCK_V] logit tiles with tl.dot in fp32, and keeps an online max,
  sum of exp and sum of exp*z (online entropy); slices are merged in PyTorch ([N, n_split] floats).
  No logits exist in memory. Backward, per row chunk: a kernel recomputes the logit tile and writes
  dlogits ([chunk, V], input dtype), then cuBLAS gives dh and accumulates dW (addmm_ in W's
  dtype: one rounding per chunk, as Liger's fused linear cross-entropy does). (A fully fused
  backward would need atomic adds into dW from every row block; we keep the two large matmuls on
  cuBLAS instead.) Logits are accumulated in fp32 and never rounded to bf16, so on bf16 inputs this
  path is closer to the exact value than the reference is. Tile sizes come from compiling for
  sm_90 (see `_tiles`), not from timings: untuned.
"""
import functools

import torch
import torch.nn.functional as F

from .dispatch import cdiv, guarded, jit, resolve_impl, tl

IGNORE_INDEX = -100
_CHUNK_BYTES = 256 << 20  # per [chunk, V] buffer: chunked path (fp32) and Triton dlogits (input dtype)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- reference


def logprobs_entropy_reference(hidden, weight, targets, bias=None, temperature=1.0,
                               compute_entropy=True, ignore_index=IGNORE_INDEX):
    """Plain PyTorch; defines the meaning. hidden [..., H], weight [V, H], bias [V] or None,
    targets [...] int -> (logp [...], entropy [...] or None), fp32 (fp64 for fp64 inputs)."""
    z = F.linear(hidden, weight, bias).to(_acc_dtype(hidden)) / temperature
    logp_all = z.log_softmax(-1)
    valid = targets != ignore_index
    logp = logp_all.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(valid, logp, 0.0)
    if not compute_entropy:
        return logp, None
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, torch.where(valid, ent, 0.0)


# ----------------------------------------------------------------------------- chunked PyTorch


def _logits(h, weight, bias, temperature):
    # Same rounding as the reference: matmul in the input dtype, then fp32.
    return F.linear(h, weight, bias).to(_acc_dtype(h)) / temperature


def _chunked_forward(h, weight, bias, targets, temperature, entropy, ignore_index, chunk):
    """h [N, H] -> logp, ent, lse, Ez (each [N], acc dtype); one [chunk, V] logits at a time."""
    N = h.shape[0]
    acc = _acc_dtype(h)
    lse, ez, zt = (torch.zeros(N, dtype=acc, device=h.device) for _ in range(3))
    for r0 in range(0, N, chunk):
        sl = slice(r0, r0 + chunk)
        z = _logits(h[sl], weight, bias, temperature)  # [c, V]
        lse[sl] = z.logsumexp(-1)
        zt[sl] = z.gather(1, targets[sl].clamp_min(0)[:, None]).squeeze(1)
        if entropy:
            ez[sl] = (torch.softmax(z, -1) * z).sum(-1)
    return _finish(lse, ez, zt, targets, entropy, ignore_index)


def _finish(lse, ez, zt, targets, entropy, ignore_index):
    valid = targets != ignore_index
    logp = torch.where(valid, zt - lse, 0.0)
    ent = torch.where(valid, lse - ez, 0.0) if entropy else None
    return logp, ent, lse, ez


def _dlogits_torch(h, weight, bias, targets, lse, ez, g_lp, g_ent, temperature):
    """dL/dlogits for one row chunk, [c, V] in h's dtype (g_* already zero on ignored rows)."""
    z = _logits(h, weight, bias, temperature)
    p = torch.exp(z - lse[:, None])
    dz = p * -g_lp[:, None]
    dz.scatter_add_(1, targets.clamp_min(0)[:, None], g_lp[:, None])
    if g_ent is not None:
        dz += g_ent[:, None] * p * (ez[:, None] - z)
    return (dz / temperature).to(h.dtype)


# ----------------------------------------------------------------------------- Triton


@jit
def _fwd_kernel(
    h_ptr, w_ptr, b_ptr, t_ptr,  # [N, H], [V, H], [V], [N]
    m_ptr, s_ptr, a_ptr, zt_ptr,  # partial max / sum exp / sum exp*z: [N, n_split]; target logit [N]
    N, V, H, stride_h, stride_w, v_per_split, n_split, inv_temp, ignore_index,
    HAS_BIAS: tl.constexpr, ENTROPY: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid_n = tl.program_id(0)  # axis 0 varies fastest: programs running together share a W slice in L2
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h  # int64: V * H can pass 2**31
    tgt = tl.load(t_ptr + rows, mask=row_ok, other=ignore_index)
    m = tl.full((BLOCK_N,), float("-inf"), ACC)
    s = tl.zeros((BLOCK_N,), ACC)
    a = tl.zeros((BLOCK_N,), ACC)
    zt = tl.zeros((BLOCK_N,), ACC)
    v_start = pid_s * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)  # every split holds >= 1 column, so m stays finite
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        acc = tl.zeros((BLOCK_N, BLOCK_V), ACC)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            hb = tl.load(h_rows + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < H), other=0.0)
            wb = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :],
                         mask=col_ok[:, None] & (ks[None, :] < H), other=0.0)
            acc = tl.dot(hb, tl.trans(wb), acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(ACC)[None, :]
        z = tl.where(col_ok[None, :], acc * inv_temp, float("-inf"))
        # online logsumexp (and sum p*z for the entropy), rescaled to the new running max
        m_new = tl.maximum(m, tl.max(z, 1))
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new[:, None])  # 0 on padded columns
        s = s * scale + tl.sum(e, 1)
        if ENTROPY:
            a = a * scale + tl.sum(e * tl.where(col_ok[None, :], z, 0.0), 1)
        m = m_new
        zt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), 1)
    part = rows * n_split + pid_s
    tl.store(m_ptr + part, m, mask=row_ok)
    tl.store(s_ptr + part, s, mask=row_ok)
    if ENTROPY:
        tl.store(a_ptr + part, a, mask=row_ok)
    # exactly one split holds each (non-ignored) target
    tl.store(zt_ptr + rows, zt, mask=row_ok & (tgt >= v_start) & (tgt < v_end))


@jit
def _dlogits_kernel(
    h_ptr, w_ptr, b_ptr, t_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, dz_ptr,  # dz: [N, V]
    N, V, H, stride_h, stride_w, stride_dz, inv_temp,
    HAS_BIAS: tl.constexpr, ENTROPY: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    col_ok = cols < V
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_N, BLOCK_V), ACC)
    for k0 in range(0, H, BLOCK_H):  # same tile as the forward
        ks = k0 + tl.arange(0, BLOCK_H)
        hb = tl.load(h_rows + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < H), other=0.0)
        wb = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks[None, :] < H), other=0.0)
        acc = tl.dot(hb, tl.trans(wb), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(ACC)[None, :]
    z = acc * inv_temp
    tgt = tl.load(t_ptr + rows, mask=row_ok, other=-1)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g_lp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)  # zero on ignored rows
    p = tl.exp(z - lse[:, None])
    dz = g_lp[:, None] * (tl.where(cols[None, :] == tgt[:, None], 1.0, 0.0) - p)
    if ENTROPY:
        ez = tl.load(ez_ptr + rows, mask=row_ok, other=0.0)
        g_ent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
        dz += g_ent[:, None] * p * (ez[:, None] - z)
    dz = dz * inv_temp
    tl.store(dz_ptr + rows.to(tl.int64)[:, None] * stride_dz + cols[None, :], dz.to(dz_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _tiles(x: torch.Tensor):
    """(BLOCK_N, BLOCK_V, BLOCK_H, num_warps, num_stages) for a launch.

    Chosen from an sm_90 compile (ptxas -v, H divisible by 16 so the K loop is pipelined through
    shared memory): bf16 128x128x64 uses 255 registers with no spills and 96 KiB of shared memory;
    fp32 (FMA path, "ieee") spills at 128 rows, so 64. Not yet timed on a GPU.
    """
    if x.is_cuda:
        return (128, 128, 64, 8, 3) if x.element_size() <= 2 else (64, 128, 32, 8, 3)
    return 16, 32, 16, 1, 1  # interpreter: small tiles so small test shapes span several tiles


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _kernel_consts(h):
    acc = tl.float64 if h.dtype == torch.float64 else tl.float32
    # fp32 inputs: full-precision dot (tl.dot would use TF32, unlike torch's default fp32 matmul)
    prec = "ieee" if h.dtype in (torch.float32, torch.float64) else None
    return acc, prec


def _triton_forward(h, weight, bias, targets, temperature, entropy, ignore_index, chunk, n_split=None):
    N, H = h.shape
    V = weight.shape[0]
    BN, BV, BH, warps, stages = _tiles(h)
    n_row_blocks = cdiv(N, BN)
    n_vblocks = cdiv(V, BV)
    if n_split is None:  # enough programs to fill the GPU; a few in the interpreter
        target = 2 * _sm_count(h.device.index or 0) if h.is_cuda else 4
        n_split = min(n_vblocks, max(1, cdiv(target, n_row_blocks)))
    v_per_split = cdiv(n_vblocks, n_split) * BV
    n_split = cdiv(V, v_per_split)
    acc = _acc_dtype(h)
    m, s, a = (torch.empty(N, n_split, dtype=acc, device=h.device) for _ in range(3))
    zt = torch.zeros(N, dtype=acc, device=h.device)
    ACC, PREC = _kernel_consts(h)
    _fwd_kernel[(n_row_blocks, n_split)](
        h, weight, bias if bias is not None else h, targets, m, s, a, zt,
        N, V, H, h.stride(0), weight.stride(0), v_per_split, n_split, 1.0 / temperature, ignore_index,
        HAS_BIAS=bias is not None, ENTROPY=entropy, ACC=ACC, PRECISION=PREC,
        BLOCK_N=BN, BLOCK_V=BV, BLOCK_H=BH, num_warps=warps, num_stages=stages)
    # merge the vocabulary slices: rescale each slice's sums to the global max
    m_max = m.amax(1, keepdim=True)
    r = torch.exp(m - m_max)
    s_tot = (s * r).sum(1)
    lse = m_max.squeeze(1) + s_tot.log()
    ez = (a * r).sum(1) / s_tot if entropy else torch.zeros_like(lse)
    return _finish(lse, ez, zt, targets, entropy, ignore_index)


def _dlogits_triton(h, weight, bias, targets, lse, ez, g_lp, g_ent, temperature):
    N, H = h.shape
    V = weight.shape[0]
    BN, BV, BH, warps, stages = _tiles(h)
    dz = torch.empty(N, V, dtype=h.dtype, device=h.device)
    ACC, PREC = _kernel_consts(h)
    _dlogits_kernel[(cdiv(N, BN), cdiv(V, BV))](
        h, weight, bias if bias is not None else h, targets, lse, ez, g_lp,
        g_ent if g_ent is not None else g_lp, dz,
        N, V, H, h.stride(0), weight.stride(0), dz.stride(0), 1.0 / temperature,
        HAS_BIAS=bias is not None, ENTROPY=g_ent is not None, ACC=ACC, PRECISION=PREC,
        BLOCK_N=BN, BLOCK_V=BV, BLOCK_H=BH, num_warps=warps, num_stages=stages)
    return dz


# ----------------------------------------------------------------------------- autograd


class _LogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, entropy, ignore_index, impl, chunk):
        fwd = _triton_forward if impl == "triton" else _chunked_forward
        logp, ent, lse, ez = fwd(hidden, weight, bias, targets, temperature, entropy, ignore_index, chunk)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ez)
        ctx.args = temperature, entropy, ignore_index, impl, chunk
        if ent is None:  # keep the output arity fixed; the wrapper drops it
            ent = torch.zeros_like(logp)
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets, lse, ez = ctx.saved_tensors
        temperature, entropy, ignore_index, impl, chunk = ctx.args
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        valid = targets != ignore_index
        g_lp = torch.where(valid, g_lp, 0.0).to(lse.dtype).contiguous()
        g_ent = torch.where(valid, g_ent, 0.0).to(lse.dtype).contiguous() if entropy else None
        dlogits = _dlogits_triton if impl == "triton" else _dlogits_torch
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros_like(weight) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=lse.dtype, device=weight.device) if need_b else None
        for r0 in range(0, hidden.shape[0], chunk):
            sl = slice(r0, r0 + chunk)
            dz = dlogits(hidden[sl], weight, bias, targets[sl], lse[sl], ez[sl], g_lp[sl],
                         g_ent[sl] if entropy else None, temperature)  # [c, V]
            if need_h:
                torch.mm(dz, weight, out=dh[sl])
            if need_w:
                dw.addmm_(dz.t(), hidden[sl])
            if need_b:
                db += dz.sum(0, dtype=db.dtype)
            del dz  # free before the next chunk's buffer is allocated
        return dh, dw, db.to(bias.dtype) if need_b else None, None, None, None, None, None, None


def fused_logprobs_entropy(hidden, weight, targets, bias=None, temperature=1.0, compute_entropy=True,
                           ignore_index=IGNORE_INDEX, impl="auto", chunk_size=None):
    """Log-prob of `targets` and entropy of softmax((hidden @ weight.T + bias) / temperature).

    hidden [N, H] or [B, T, H]; weight [V, H] (same dtype); bias [V] or None; targets [N] or
    [B, T] int (ignore_index -> 0 and no gradient). Returns (logp, entropy or None), shaped like
    targets, fp32 (fp64 for fp64 inputs). Differentiable w.r.t. hidden, weight and bias through
    both outputs.
    impl: "auto" (Triton on CUDA, else "chunked" when the [N, V] fp32 logits exceed 256 MiB, else
    "reference"), "triton", "chunked" or "reference". chunk_size: rows per chunk (default from a
    256 MiB budget per [chunk, V] buffer). Targets outside [0, V) other than ignore_index are not
    checked on the Triton path (that would need a host sync).
    """
    shape = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    N, V = h.shape[0], weight.shape[0]
    fallback = "chunked" if N * V * 4 > _CHUNK_BYTES else "reference"
    auto = impl == "auto"
    impl = resolve_impl(impl, fallback, h, weight) if N > 0 else "reference"  # no empty launches
    if impl == "reference":
        logp, ent = logprobs_entropy_reference(h, weight, t, bias, temperature, compute_entropy, ignore_index)
    elif impl in ("triton", "chunked"):
        if h.dtype != weight.dtype:
            raise TypeError(f"hidden {h.dtype} and weight {weight.dtype} must have the same dtype")
        h = h if h.stride(-1) == 1 else h.contiguous()
        w = weight if weight.stride(-1) == 1 else weight.contiguous()

        def run(h, t, impl=impl):
            itemsize = 4 if impl == "chunked" else h.element_size()
            chunk = chunk_size or max(1, _CHUNK_BYTES // (V * itemsize))
            logp, ent = _LogprobsEntropy.apply(h, w, bias, t.contiguous(), float(temperature),
                                               compute_entropy, ignore_index, impl, min(chunk, max(h.shape[0], 1)))
            return logp, ent if compute_entropy else None

        if auto and impl == "triton":
            # the first Triton call is checked on 4 rows; a fallback takes the chunked PyTorch path (the
            # reference's results without its [N, V] logits)
            logp, ent = guarded("fused_logprobs_entropy", run, lambda h, t: run(h, t, "chunked"), (h, t),
                                (h[:4], t[:4]), h.dtype, ("log-probs", "entropy"))
        else:
            logp, ent = run(h, t)
    else:
        raise ValueError(f"impl must be auto|triton|chunked|reference, got {impl!r}")
    if len(shape) != 1:
        logp, ent = logp.view(shape), None if ent is None else ent.view(shape)
    return logp, ent
