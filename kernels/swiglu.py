"""SwiGLU activation of the Llama MLP: y = silu(gate) * up.

Backward, with s = sigmoid(gate):  d_up = dy * gate * s,  d_gate = dy * up * s * (1 + gate * (1 - s)).
The kernel computes in fp32 (fp64 for fp64 inputs) and rounds once; transformers rounds silu(gate)
to bf16 before the product, so bf16 results differ by about a bf16 ulp. gate/up may be row-strided
views (e.g. the two halves of a fused gate_up projection); the output is contiguous.
"""
import torch
import torch.nn.functional as F

from .dispatch import cdiv, guarded, head, jit, resolve_impl, tl

_BLOCK = 1024


def silu_mul_reference(gate, up):
    """gate, up [..., I] -> silu(gate) * up."""
    return F.silu(gate) * up


@jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, y_ptr, C, stride_g, stride_u,
                       ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # rows of [R, C]; axis 1 tiles the columns (int64: R * C > 2**31)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < C
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(ACC)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(ACC)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + row * C + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@jit
def _swiglu_bwd_kernel(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, C, stride_g, stride_u, stride_dy,
                       ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < C
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(ACC)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(ACC)
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=ok, other=0.0).to(ACC)
    s = 1.0 / (1.0 + tl.exp(-g))
    du = dy * g * s
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    tl.store(dg_ptr + row * C + cols, dg.to(dg_ptr.dtype.element_ty), mask=ok)
    tl.store(du_ptr + row * C + cols, du.to(du_ptr.dtype.element_ty), mask=ok)


def _rows(t):
    t = t.reshape(-1, t.shape[-1])  # a view for row-strided inputs
    return t if t.stride(-1) == 1 else t.contiguous()


def _acc(x):
    return tl.float64 if x.dtype == torch.float64 else tl.float32


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        g, u = _rows(gate), _rows(up)
        R, C = g.shape
        y = torch.empty(R, C, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
        _swiglu_fwd_kernel[(R, cdiv(C, _BLOCK))](g, u, y, C, g.stride(0), u.stride(0),
                                                 ACC=_acc(y), BLOCK=_BLOCK, num_warps=4)
        ctx.save_for_backward(g, u)
        ctx.shapes = gate.shape, gate.dtype, up.dtype
        return y.view(gate.shape)

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        shape, g_dtype, u_dtype = ctx.shapes
        dy2 = _rows(dy)
        R, C = g.shape
        dg = torch.empty(R, C, dtype=g_dtype, device=g.device)
        du = torch.empty(R, C, dtype=u_dtype, device=g.device)
        _swiglu_bwd_kernel[(R, cdiv(C, _BLOCK))](g, u, dy2, dg, du, C, g.stride(0), u.stride(0), dy2.stride(0),
                                                 ACC=_acc(dy2), BLOCK=_BLOCK, num_warps=4)
        return dg.view(shape), du.view(shape)


def silu_mul(gate, up, impl="auto"):
    """silu(gate) * up for gate, up [..., I] of the same shape. impl: "auto" | "triton" | "reference"."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must match")
    auto, impl = impl == "auto", resolve_impl(impl, "reference", gate, up)
    if impl == "reference":
        return silu_mul_reference(gate, up)
    if impl != "triton":
        raise ValueError(f"impl must be auto|triton|reference, got {impl!r}")
    if not auto:
        return _SwiGLU.apply(gate, up)
    return guarded("silu_mul", _SwiGLU.apply, silu_mul_reference, (gate, up), (head(gate), head(up)), gate.dtype, ("y",))
