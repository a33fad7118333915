"""RMSNorm and LayerNorm over the last dimension, each with an optional fused residual add.

RMSNorm matches transformers' LlamaRMSNorm (also Qwen2RMSNorm and MistralRMSNorm, which are the same
code; not Gemma's `1 + weight` variant):
    h = x.float(); h = h * rsqrt(mean(h^2) + eps); y = weight * h.to(x.dtype)
so the output dtype is promote(x.dtype, weight.dtype) and the normalised value is rounded to the
input dtype before the weight multiplies it. LayerNorm matches nn.LayerNorm (statistics in fp32,
output in x's dtype). Inputs in fp64 are computed in fp64 instead of fp32.

With `residual`, the decoder-layer pattern `s = x + residual` (rounded to the input dtype, as the
model's `residual + hidden_states` is) is normalised and both are returned: (norm(s), s).

Triton: one row per program in the forward (D up to 65536); the backward runs a fixed number of
programs over row ranges so dweight/dbias are summed in registers and only [programs, D] partials go
to memory (Liger's layout).
"""
import functools

import torch
import torch.nn.functional as F

from .dispatch import cdiv, guarded, head, jit, next_pow2, num_warps_for, resolve_impl, tl


def _acc_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- references


def rms_norm_reference(x, weight, eps=1e-6, residual=None):
    """LlamaRMSNorm. x [..., D], weight [D] -> y, or (y, x + residual) when residual is given."""
    if residual is not None:
        x = x + residual
    h = x.to(_acc_dtype(x))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * h.to(x.dtype)
    return y if residual is None else (y, x)


def layer_norm_reference(x, weight, bias=None, eps=1e-5, residual=None):
    """nn.LayerNorm. x [..., D], weight/bias [D] -> y, or (y, x + residual)."""
    if residual is not None:
        x = x + residual
    acc = _acc_dtype(x)
    y = F.layer_norm(x.to(acc), x.shape[-1:], weight.to(acc), None if bias is None else bias.to(acc), eps)
    y = y.to(x.dtype)
    return y if residual is None else (y, x)


# ----------------------------------------------------------------------------- Triton


@jit
def _norm_fwd_kernel(
    x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, s_ptr, rstd_ptr, mean_ptr,  # rows of [N, D]; rstd/mean [N]
    D, stride_x, stride_r, eps,
    RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64 offsets: N * D can pass 2**31
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:
        # the model rounds `residual + hidden` to its dtype before normalising it
        x = (x.to(ACC) + tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0).to(ACC)).to(x.dtype)
        tl.store(s_ptr + row * D + cols, x, mask=ok)
    xf = x.to(ACC)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(ACC)
    if RMS:
        rstd = tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)  # torch.rsqrt in LlamaRMSNorm
        y = w * (xf * rstd).to(x.dtype).to(ACC)  # LlamaRMSNorm: weight * h.to(input_dtype)
    else:
        mean = tl.sum(xf, 0) / D
        xc = tl.where(ok, xf - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, 0) / D + eps)
        y = xc * rstd * w
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=ok, other=0.0).to(ACC)
        tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@jit
def _norm_bwd_kernel(
    dy_ptr, ds_ptr, x_ptr, w_ptr, rstd_ptr, mean_ptr, dx_ptr, dw_ptr, db_ptr,  # dw/db: [programs, D]
    N, D, stride_dy, stride_ds, stride_x, rows_per_program,
    RMS: tl.constexpr, HAS_DS: tl.constexpr, HAS_BIAS: tl.constexpr, ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(ACC)
    dw = tl.zeros((BLOCK,), ACC)
    db = tl.zeros((BLOCK,), ACC)
    r0 = pid * rows_per_program
    for i in range(r0, tl.minimum(r0 + rows_per_program, N)):
        row = tl.cast(i, tl.int64)  # int64 offsets: N * D can pass 2**31
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=ok, other=0.0).to(ACC)
        rstd = tl.load(rstd_ptr + row)
        dn = dy * w  # 0 on padded columns
        if RMS:
            xh = x.to(ACC) * rstd
            dx = rstd * (dn - xh * (tl.sum(dn * xh, 0) / D))
            dw += dy * xh.to(x.dtype).to(ACC)  # the weight saw the rounded value
        else:
            xh = tl.where(ok, (x.to(ACC) - tl.load(mean_ptr + row)) * rstd, 0.0)
            dx = rstd * (dn - tl.sum(dn, 0) / D - xh * (tl.sum(dn * xh, 0) / D))
            dw += dy * xh
            db += dy
        if HAS_DS:  # gradient arriving through the returned residual sum
            dx += tl.load(ds_ptr + row * stride_ds + cols, mask=ok, other=0.0).to(ACC)
        tl.store(dx_ptr + row * D + cols, dx.to(dx_ptr.dtype.element_ty), mask=ok)
    tl.store(dw_ptr + pid * D + cols, dw, mask=ok)
    if HAS_BIAS:
        tl.store(db_ptr + pid * D + cols, db, mask=ok)


@functools.cache
def _programs(device_index):
    return 2 * torch.cuda.get_device_properties(device_index).multi_processor_count


def _rows(t, D):
    t = t.reshape(-1, D)
    return t if t.stride(-1) == 1 else t.contiguous()


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, rms):
        D = x.shape[-1]
        if D > 65536:
            raise ValueError(f"norm kernels hold a row in registers; D={D} > 65536")
        x2 = _rows(x, D)
        r2 = _rows(residual, D) if residual is not None else None
        N = x2.shape[0]
        out_dtype = torch.promote_types(x.dtype, weight.dtype) if rms else x.dtype
        y = torch.empty(N, D, dtype=out_dtype, device=x.device)
        s = torch.empty(N, D, dtype=x.dtype, device=x.device) if residual is not None else None
        acc = _acc_dtype(x)
        rstd = torch.empty(N, dtype=acc, device=x.device)
        mean = torch.empty(N, dtype=acc, device=x.device) if not rms else rstd
        BLOCK = next_pow2(D)
        _norm_fwd_kernel[(N,)](
            x2, r2 if r2 is not None else x2, weight, bias if bias is not None else weight, y,
            s if s is not None else y, rstd, mean, D, x2.stride(0), r2.stride(0) if r2 is not None else 0,
            eps, RMS=rms, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
            ACC=tl.float64 if acc == torch.float64 else tl.float32, BLOCK=BLOCK,
            num_warps=num_warps_for(BLOCK))
        ctx.save_for_backward(s if s is not None else x2, weight, bias, rstd, mean)
        ctx.rms, ctx.has_res, ctx.shape = rms, residual is not None, x.shape
        y = y.view(x.shape)
        return (y, s.view(x.shape)) if s is not None else y

    @staticmethod
    def backward(ctx, dy, ds=None):
        x2, weight, bias, rstd, mean = ctx.saved_tensors
        N, D = x2.shape
        dy2 = _rows(dy, D)
        ds2 = _rows(ds, D) if ds is not None else None
        G = min(N, _programs(x2.device.index or 0) if x2.is_cuda else 4)  # interpreter: a few programs
        rows_per = cdiv(N, max(G, 1))
        G = cdiv(N, rows_per)
        dx = torch.empty(N, D, dtype=x2.dtype, device=x2.device)
        acc = rstd.dtype
        dw = torch.empty(G, D, dtype=acc, device=x2.device)
        db = torch.empty(G, D, dtype=acc, device=x2.device) if bias is not None else dw
        BLOCK = next_pow2(D)
        _norm_bwd_kernel[(G,)](
            dy2, ds2 if ds2 is not None else dy2, x2, weight, rstd, mean, dx, dw, db,
            N, D, dy2.stride(0), ds2.stride(0) if ds2 is not None else 0, x2.stride(0), rows_per,
            RMS=ctx.rms, HAS_DS=ds2 is not None, HAS_BIAS=bias is not None,
            ACC=tl.float64 if acc == torch.float64 else tl.float32, BLOCK=BLOCK,
            num_warps=num_warps_for(BLOCK))
        dx = dx.view(ctx.shape)
        dweight = dw.sum(0).to(weight.dtype)
        dbias = db.sum(0).to(bias.dtype) if bias is not None else None
        # x and residual enter through the same sum, so they get the same gradient
        return dx, dweight, dbias, dx if ctx.has_res else None, None, None


def rms_norm(x, weight, eps=1e-6, residual=None, impl="auto"):
    """LlamaRMSNorm over the last dim. x [..., D], weight [D]; residual like x or None.
    Returns y (dtype promote(x, weight)), or (y, x + residual) when residual is given.
    impl: "auto" | "triton" | "reference" ("auto" checks its first Triton call: dispatch.guarded)."""
    auto, impl = impl == "auto", resolve_impl(impl, "reference", x, weight)
    if impl == "reference":
        return rms_norm_reference(x, weight, eps, residual)
    if impl != "triton":
        raise ValueError(f"impl must be auto|triton|reference, got {impl!r}")
    fast = lambda x, r: _Norm.apply(x, weight, None, r, eps, True)  # noqa: E731
    if not auto:
        return fast(x, residual)
    return guarded("rms_norm", fast, lambda x, r: rms_norm_reference(x, weight, eps, r), (x, residual),
                   (head(x), head(residual)), x.dtype, ("y", "x + residual"))


def layer_norm(x, weight, bias=None, eps=1e-5, residual=None, impl="auto"):
    """nn.LayerNorm over the last dim. x [..., D], weight [D], bias [D] or None; residual like x.
    Returns y (x's dtype), or (y, x + residual) when residual is given."""
    auto, impl = impl == "auto", resolve_impl(impl, "reference", x, weight)
    if impl == "reference":
        return layer_norm_reference(x, weight, bias, eps, residual)
    if impl != "triton":
        raise ValueError(f"impl must be auto|triton|reference, got {impl!r}")
    fast = lambda x, r: _Norm.apply(x, weight, bias, r, eps, False)  # noqa: E731
    if not auto:
        return fast(x, residual)
    return guarded("layer_norm", fast, lambda x, r: layer_norm_reference(x, weight, bias, eps, r), (x, residual),
                   (head(x), head(residual)), x.dtype, ("y", "x + residual"))
