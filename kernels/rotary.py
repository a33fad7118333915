"""Rotary position embedding on q and k, transformers' Llama convention (rotate_half).

    q [B, Hq, T, D], k [B, Hk, T, D], cos/sin [B, T, D] (or [T, D], or batch 1: broadcast)
    out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
i.e. per half:  out1 = x1*cos1 - x2*sin1,  out2 = x2*cos2 + x1*sin2.
Backward is the transposed map:  dx1 = g1*cos1 + g2*sin2,  dx2 = g2*cos2 - g1*sin1
(no gradient for cos/sin: they come from a buffer). cos halves need not be equal.

The kernel computes in fp32 (fp64 for fp64 inputs) and rounds once; transformers rounds after each bf16 op, so bf16 results
differ from the reference by a few bf16 ulps. Outputs are contiguous in q's/k's dtype. q and k may be
strided views (e.g. `proj(x).view(B, T, H, D).transpose(1, 2)`) as long as the last dim is contiguous.
"""
import torch

from .dispatch import guarded, jit, next_pow2, resolve_impl, tl


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _bcast(cos, B, T):
    """cos [T, D] / [1, T, D] / [B, T, D] -> [B, T, D] view (stride 0 over a broadcast batch)."""
    cos = cos if cos.dim() == 3 else cos.unsqueeze(0)
    return cos.expand(B, T, cos.shape[-1])


def apply_rotary_reference(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb with unsqueeze_dim=1."""
    cos = _bcast(cos, q.shape[0], q.shape[2]).unsqueeze(1)
    sin = _bcast(sin, q.shape[0], q.shape[2]).unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, y_ptr,  # x [B, NH, T, D] strided, cos/sin [B, T, D] strided, y contiguous
    T, NH, HALF, sx_b, sx_h, sx_t, sc_b, sc_t, ss_b, ss_t,
    BACKWARD: tl.constexpr, ACC: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # one (batch, position): all heads share its cos/sin row
    b = pid // T
    t = pid % T
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    ok = (heads[:, None] < NH) & d_ok[None, :]
    c1 = tl.load(cos_ptr + b * sc_b + t * sc_t + d, mask=d_ok, other=0.0).to(ACC)[None, :]
    c2 = tl.load(cos_ptr + b * sc_b + t * sc_t + HALF + d, mask=d_ok, other=0.0).to(ACC)[None, :]
    s1 = tl.load(sin_ptr + b * ss_b + t * ss_t + d, mask=d_ok, other=0.0).to(ACC)[None, :]
    s2 = tl.load(sin_ptr + b * ss_b + t * ss_t + HALF + d, mask=d_ok, other=0.0).to(ACC)[None, :]
    src = x_ptr + b * sx_b + t * sx_t + heads[:, None] * sx_h + d[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(ACC)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(ACC)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    dst = y_ptr + ((b * NH + heads[:, None]) * T + t) * (2 * HALF) + d[None, :]
    tl.store(dst, y1.to(y_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, y2.to(y_ptr.dtype.element_ty), mask=ok)


def _rope(x, cos, sin, backward):
    """x [B, NH, T, D] -> contiguous rotated copy."""
    B, NH, T, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(B, NH, T, D, dtype=x.dtype, device=x.device)
    BLOCK_H, BLOCK_D = next_pow2(NH), next_pow2(D // 2)
    _rope_kernel[(B * T,)](
        x, cos, sin, y, T, NH, D // 2, x.stride(0), x.stride(1), x.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        BACKWARD=backward, ACC=tl.float64 if x.dtype == torch.float64 else tl.float32,
        BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, num_warps=4 if BLOCK_H * BLOCK_D <= 4096 else 8)
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        B, T = q.shape[0], q.shape[2]
        cos, sin = _bcast(cos, B, T), _bcast(sin, B, T)
        cos = cos if cos.stride(-1) == 1 else cos.contiguous()
        sin = sin if sin.stride(-1) == 1 else sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rope(q, cos, sin, False), _rope(k, cos, sin, False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        return _rope(dq, cos, sin, True), _rope(dk, cos, sin, True), None, None


def apply_rotary(q, k, cos, sin, impl="auto"):
    """Rotary embedding on q [B, Hq, T, D] and k [B, Hk, T, D] with cos/sin [B, T, D] (or [T, D]).
    Returns (q_embed, k_embed). Differentiable w.r.t. q and k. impl: "auto" | "triton" | "reference"."""
    if q.shape[-1] % 2:
        raise ValueError(f"head dim must be even, got {q.shape[-1]}")
    auto, impl = impl == "auto", resolve_impl(impl, "reference", q, k)
    if impl == "reference":
        return apply_rotary_reference(q, k, cos, sin)
    if impl != "triton":
        raise ValueError(f"impl must be auto|triton|reference, got {impl!r}")
    if not auto:
        return _Rotary.apply(q, k, cos, sin)
    first = [t[:1] if t.dim() == 3 else t for t in (cos, sin)]  # the probe: batch row 0
    return guarded("apply_rotary", _Rotary.apply, apply_rotary_reference, (q, k, cos, sin), (q[:1], k[:1], *first),
                   q.dtype, ("q", "k"))
