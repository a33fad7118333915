"""kernels.swiglu: Triton (interpreter / GPU) vs silu(gate) * up.

Interpreter caveat: fp32 -> bf16 conversion truncates there (GPUs round), hence the bf16 tolerance.
"""
import pytest
import torch

from conftest import gpu
from kernels import swiglu as S  # the module (the function is kernels.silu_mul)
from kernels.testing import outputs_and_grads, rel_err

TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2e-2}


def check(shape, dtype, fused=False, device="cpu", tol=None):
    g = torch.Generator().manual_seed(sum(shape))
    if fused:  # the two halves of a fused gate_up projection: row-strided views
        gu = (torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * 3).to(device, dtype)
        gate, up = gu.chunk(2, dim=-1)
    else:
        gate = (torch.randn(shape, generator=g) * 3).to(device, dtype)
        up = torch.randn(shape, generator=g).to(device, dtype)
    outs, grads = outputs_and_grads(lambda a, b: S.silu_mul(a, b, impl="triton"), [gate, up])
    ref_outs, ref_grads = outputs_and_grads(lambda a, b: S.silu_mul(a, b, impl="reference"), [gate, up])
    tol = tol or TOL[dtype]
    for name, a, ref in zip(["y", "dgate", "dup"], outs + grads, ref_outs + ref_grads):
        assert a.shape == ref.shape and a.dtype == ref.dtype, name
        err = rel_err(a, ref)
        assert err <= tol, f"{name}: rel err {err:.2e} > {tol:.0e}"


def test_reference_is_llama_mlp_activation():
    gate, up = torch.randn(4, 10, dtype=torch.float64), torch.randn(4, 10, dtype=torch.float64)
    torch.testing.assert_close(S.silu_mul_reference(gate, up), gate / (1 + torch.exp(-gate)) * up)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        S.silu_mul(torch.zeros(2, 3), torch.zeros(2, 4))


def _case(*args):
    check(*args)


@pytest.mark.parametrize("shape", [(5, 123), (3, 7, 1000), (2, 1500)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_swiglu_interpreter(interp, shape, dtype):
    interp(_case, shape, dtype)


def test_swiglu_interpreter_fused_halves(interp):
    interp(_case, (3, 5, 123), torch.float64, True)


@gpu
@pytest.mark.parametrize("shape", [(8192, 8192), (3, 517, 5632)])
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_swiglu_bf16(shape, fused):
    check(shape, torch.bfloat16, fused, device="cuda")


@gpu
def test_gpu_swiglu_fp32():
    check((1000, 4096), torch.float32, device="cuda")
