"""kernels.norms: references vs transformers / nn.LayerNorm, Triton (interpreter / GPU) vs references.

Interpreter caveat: it converts fp32 -> bf16 by truncation (GPUs round to nearest), so bf16 cases
are off by up to a bf16 ulp and get a looser tolerance than fp32/fp64.
"""
import pytest
import torch

from conftest import gpu
from kernels import norms as N
from kernels.testing import outputs_and_grads, rel_err

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}
SHAPES = [(5, 123), (2, 3, 64), (7, 1000)]


def make(shape, dtype, residual, bias=True, w_dtype=None, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    D = shape[-1]
    x = torch.randn(shape, generator=g) * 2 + 0.5  # non-zero mean matters for LayerNorm
    r = torch.randn(shape, generator=g) if residual else None
    w = 1 + 0.3 * torch.randn(D, generator=g)
    b = 0.3 * torch.randn(D, generator=g) if bias else None
    cast = lambda t, dt=dtype: None if t is None else t.to(device, dt)  # noqa: E731
    return cast(x), cast(w, w_dtype or dtype), cast(b), cast(r)


def check(kind, shape, dtype, residual, bias=True, w_dtype=None, device="cpu", tol=None):
    """Triton vs reference: outputs (y, and the residual sum) and grads of x, weight, bias, residual."""
    x, w, b, r = make(shape, dtype, residual, bias, w_dtype, seed=sum(shape), device=device)
    if kind == "rms":
        fn = lambda impl: lambda x, w, r: N.rms_norm(x, w, 1e-6, r, impl=impl)  # noqa: E731
        inputs = [x, w, r]
    else:
        fn = lambda impl: lambda x, w, b, r: N.layer_norm(x, w, b, 1e-5, r, impl=impl)  # noqa: E731
        inputs = [x, w, b, r]
    outs, grads = outputs_and_grads(fn("triton"), inputs)
    ref_outs, ref_grads = outputs_and_grads(fn("reference"), inputs)
    assert len(outs) == (2 if residual else 1) and len(grads) == len(ref_grads)
    tol = tol or TOL[dtype]
    for i, (a, ref) in enumerate(zip(outs + grads, ref_outs + ref_grads)):
        assert a.shape == ref.shape and a.dtype == ref.dtype, i
        err = rel_err(a, ref)
        assert err <= tol, f"tensor {i}: rel err {err:.2e} > {tol:.0e}"


# ---------------------------------------------------------------------------- reference semantics


@pytest.mark.parametrize("dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.bfloat16, torch.float32)])
def test_rms_reference_is_transformers_rmsnorm_bit_for_bit(dtype, w_dtype):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    qwen2 = pytest.importorskip("transformers.models.qwen2.modeling_qwen2")
    mistral = pytest.importorskip("transformers.models.mistral.modeling_mistral")
    x, w, _, r = make((3, 5, 64), dtype, True, w_dtype=w_dtype)
    for cls in (llama.LlamaRMSNorm, qwen2.Qwen2RMSNorm, mistral.MistralRMSNorm):
        m = cls(64, eps=1e-5).to(w_dtype)
        m.weight.data.copy_(w)
        assert torch.equal(N.rms_norm_reference(x, w, 1e-5), m(x)), cls.__name__
        y, s = N.rms_norm_reference(x, w, 1e-5, residual=r)
        assert torch.equal(s, x + r) and torch.equal(y, m(x + r)), cls.__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layer_norm_reference_is_nn_layernorm(dtype):
    x, w, b, _ = make((4, 7, 96), dtype, False)
    m = torch.nn.LayerNorm(96, eps=1e-5).to(dtype)
    m.weight.data.copy_(w)
    m.bias.data.copy_(b)
    torch.testing.assert_close(N.layer_norm_reference(x, w, b), m(x), rtol=1e-6, atol=1e-6)


def test_auto_is_reference_on_cpu():
    x, w, _, _ = make((4, 32), torch.float32, False)
    y = N.rms_norm(x, w.requires_grad_(True))
    assert "_Norm" not in type(y.grad_fn).__name__ and torch.equal(y, N.rms_norm_reference(x, w))


# ---------------------------------------------------------------------------- Triton interpreter


def _case(kind, shape, dtype, residual, bias, w_dtype=None):
    check(kind, shape, dtype, residual, bias, w_dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_interpreter(interp, shape, dtype, residual):
    interp(_case, "rms", shape, dtype, residual, False)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual,bias", [(False, True), (True, True), (True, False)])
def test_layer_norm_interpreter(interp, shape, dtype, residual, bias):
    interp(_case, "ln", shape, dtype, residual, bias)


def test_rms_norm_fp32_weight_bf16_input_interpreter(interp):
    """Llama checkpoints loaded with an fp32 norm weight: output is fp32, as in LlamaRMSNorm."""
    interp(_case, "rms", (5, 123), torch.bfloat16, True, False, torch.float32)


def _case_residual_grads_accumulate():
    """x and residual are both leaves and get the same gradient; a second backward accumulates."""
    x, w, _, r = make((6, 40), torch.float64, True)
    grads = []
    for impl in ("triton", "reference"):
        xs, ws, rs = (t.clone().requires_grad_(True) for t in (x, w, r))
        for _ in range(2):
            y, s = N.rms_norm(xs, ws, residual=rs, impl=impl)
            ((y * torch.arange(40.0, dtype=y.dtype)).sum() + (s ** 2).sum()).backward()
        grads.append((xs.grad, ws.grad, rs.grad))
    for a, ref in zip(*grads):
        assert rel_err(a, ref) < 1e-12


def test_residual_grads_accumulate_interpreter(interp):
    interp(_case_residual_grads_accumulate)


# ---------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("shape", [(8192, 2048), (4096, 8192), (3, 517, 4096)])
@pytest.mark.parametrize("residual", [False, True])
def test_gpu_rms_norm_bf16(shape, residual):
    check("rms", shape, torch.bfloat16, residual, bias=False, device="cuda")


@gpu
@pytest.mark.parametrize("shape", [(8192, 2048), (1000, 5003)])
def test_gpu_layer_norm_bf16(shape):
    check("ln", shape, torch.bfloat16, True, bias=True, device="cuda")


@gpu
def test_gpu_fp32_tight():
    check("rms", (1000, 2048), torch.float32, True, bias=False, device="cuda", tol=1e-5)
    check("ln", (1000, 2048), torch.float32, True, bias=True, device="cuda", tol=1e-5)
