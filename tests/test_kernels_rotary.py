"""kernels.rotary: reference vs transformers' Llama rotary, Triton (interpreter / GPU) vs reference.

Interpreter caveat: fp32 -> bf16 conversion truncates there (GPUs round), hence the bf16 tolerance.
"""
import pytest
import torch

from conftest import gpu
from kernels import rotary as R
from kernels.testing import outputs_and_grads, rel_err

TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2e-2}


def make(B, Hq, Hk, T, D, dtype, cos_batch=True, strided=False, seed=0, device="cpu"):
    """q/k as a model makes them; cos/sin with *unequal* halves (the kernel must not assume equal)."""
    g = torch.Generator().manual_seed(seed)
    if strided:  # proj(x).view(B, T, H, D).transpose(1, 2): last dim contiguous, heads/time strided
        q = torch.randn(B, T, Hq, D, generator=g).transpose(1, 2)
        k = torch.randn(B, T, Hk, D, generator=g).transpose(1, 2)
    else:
        q, k = torch.randn(B, Hq, T, D, generator=g), torch.randn(B, Hk, T, D, generator=g)
    angle = torch.rand(B if cos_batch else 1, T, D, generator=g) * 6.3
    cos, sin = angle.cos(), angle.sin()
    if not cos_batch:
        cos, sin = cos[0], sin[0]  # [T, D]
    return [t.to(device, dtype) for t in (q, k, cos, sin)]


def check(B, Hq, Hk, T, D, dtype, cos_batch=True, strided=False, device="cpu", tol=None):
    q, k, cos, sin = make(B, Hq, Hk, T, D, dtype, cos_batch, strided, seed=B * T + D, device=device)
    fn = lambda impl: lambda q, k: R.apply_rotary(q, k, cos, sin, impl=impl)  # noqa: E731
    outs, grads = outputs_and_grads(fn("triton"), [q, k])
    ref_outs, ref_grads = outputs_and_grads(fn("reference"), [q, k])
    tol = tol or TOL[dtype]
    for name, a, ref in zip(["q", "k", "dq", "dk"], outs + grads, ref_outs + ref_grads):
        assert a.shape == ref.shape and a.dtype == ref.dtype, name
        err = rel_err(a, ref)
        assert err <= tol, f"{name}: rel err {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_transformers_llama_rotary_bit_for_bit(dtype):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    rope = llama.LlamaRotaryEmbedding(cfg)
    B, T, D = 2, 9, 64
    x = torch.randn(B, T, 256, dtype=dtype)
    pos = torch.arange(3, 3 + T).expand(B, T)
    cos, sin = rope(x, pos)
    q, k = torch.randn(B, 4, T, D, dtype=dtype), torch.randn(B, 2, T, D, dtype=dtype)
    for ours, theirs in zip(R.apply_rotary_reference(q, k, cos, sin), llama.apply_rotary_pos_emb(q, k, cos, sin)):
        assert torch.equal(ours, theirs)


def test_reference_is_a_rotation():
    """Equal-halves cos/sin (as models build them) preserve the norm of each head vector."""
    q, k, _, _ = make(2, 3, 1, 5, 16, torch.float64)
    angle = torch.rand(5, 8, dtype=torch.float64).repeat(1, 2)
    qe, ke = R.apply_rotary_reference(q, k, angle.cos(), angle.sin())
    torch.testing.assert_close(qe.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(ke.norm(dim=-1), k.norm(dim=-1))


def _case(*args):
    check(*args)


@pytest.mark.parametrize("B,Hq,Hk,T,D", [(1, 4, 2, 5, 16), (2, 3, 1, 7, 64), (1, 5, 5, 3, 12)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rotary_interpreter(interp, B, Hq, Hk, T, D, dtype):
    interp(_case, B, Hq, Hk, T, D, dtype)


@pytest.mark.parametrize("cos_batch,strided", [(False, False), (True, True), (False, True)])
def test_rotary_interpreter_layouts(interp, cos_batch, strided):
    interp(_case, 2, 4, 2, 6, 32, torch.float64, cos_batch, strided)


@gpu
@pytest.mark.parametrize("B,Hq,Hk,T,D", [(4, 32, 8, 512, 64), (2, 14, 2, 1000, 64), (1, 32, 8, 7, 128)])
def test_gpu_rotary_bf16(B, Hq, Hk, T, D):
    check(B, Hq, Hk, T, D, torch.bfloat16, strided=True, device="cuda")


@gpu
def test_gpu_rotary_fp32():
    check(2, 32, 8, 256, 64, torch.float32, device="cuda")
