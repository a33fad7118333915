"""kernels.logprobs: reference semantics, chunked PyTorch and Triton (interpreter / GPU) vs reference.

Interpreter cases (`_case_*`) run in a child Python started with TRITON_INTERPRET=1 (see
kernels.testing.run_in_interpreter). The interpreter runs fp64 and fp32 tl.dot; its bf16 tl.dot
gives garbage, so bf16 is covered by the GPU tests only.
"""
import math

import pytest
import torch

from conftest import gpu
from kernels import logprobs as L
from kernels.testing import outputs_and_grads, rel_err


def make(N, H, V, dtype=torch.float64, bias=True, ignore_every=4, seed=0, device="cpu", scale=1.0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * (scale / math.sqrt(H))
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.5 if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    t[::ignore_every] = L.IGNORE_INDEX
    cast = lambda x: None if x is None else x.to(device, dtype)  # noqa: E731
    return cast(h), cast(w), cast(b), t.to(device)


def compare(impl, h, w, b, t, temperature, entropy, tol, **kw):
    """Outputs and grads (h, W, b) of `impl` vs the reference; asserts rel error <= tol."""
    def run(which):
        def fn(h, w, b):
            return L.fused_logprobs_entropy(h, w, t, bias=b, temperature=temperature,
                                            compute_entropy=entropy, impl=which, **kw)
        return outputs_and_grads(fn, [h, w, b])
    (outs, grads), (ref_outs, ref_grads) = run(impl), run("reference")
    assert len(outs) == len(ref_outs) == (2 if entropy else 1)
    names = ["logp", "entropy"][:len(outs)] + ["dh", "dW", "db"]
    for name, a, r in zip(names, outs + grads, ref_outs + ref_grads):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        err = rel_err(a, r)
        assert err <= tol, f"{name}: rel err {err:.2e} > {tol:.0e}"


# ---------------------------------------------------------------------------- reference semantics


def test_reference_matches_explicit_softmax():
    h, w, b, t = make(6, 8, 11, ignore_every=3)
    logp, ent = L.logprobs_entropy_reference(h, w, t, b, temperature=0.5)
    for n in range(6):
        z = (w @ h[n] + b) / 0.5
        p = z.exp() / z.exp().sum()
        if t[n] == L.IGNORE_INDEX:
            assert logp[n] == 0 and ent[n] == 0
        else:
            assert logp[n].item() == pytest.approx(p[t[n]].log().item(), rel=1e-12)
            assert ent[n].item() == pytest.approx(-(p * p.log()).sum().item(), rel=1e-12)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_ignored_rows_get_zero_and_no_gradient(impl):
    h, w, b, t = make(9, 8, 50, ignore_every=2)
    h.requires_grad_(True)
    logp, ent = L.fused_logprobs_entropy(h, w, t, b, impl=impl, chunk_size=4)
    ignored = t == L.IGNORE_INDEX
    assert (logp[ignored] == 0).all() and (ent[ignored] == 0).all()
    assert (logp[~ignored] < 0).all() and (ent[~ignored] > 0).all()
    (logp.sum() + ent.sum()).backward()
    assert (h.grad[ignored] == 0).all() and (h.grad[~ignored].abs().sum(1) > 0).all()


def test_batched_shape_matches_flat():
    h, w, b, t = make(12, 8, 37)
    lp, ent = L.fused_logprobs_entropy(h.view(3, 4, 8), w, t.view(3, 4), b, impl="chunked", chunk_size=5)
    lp_flat, ent_flat = L.logprobs_entropy_reference(h, w, t, b)
    assert lp.shape == ent.shape == (3, 4)
    torch.testing.assert_close(lp.reshape(-1), lp_flat, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent.reshape(-1), ent_flat, rtol=1e-12, atol=1e-12)


def test_auto_picks_chunked_only_for_large_logits(monkeypatch):
    h, w, b, t = make(10, 8, 30)
    h.requires_grad_(True)
    lp, _ = L.fused_logprobs_entropy(h, w, t, b)
    assert "LogprobsEntropy" not in type(lp.grad_fn).__name__  # small: plain reference
    monkeypatch.setattr(L, "_CHUNK_BYTES", 64)
    lp2, _ = L.fused_logprobs_entropy(h, w, t, b)
    assert "LogprobsEntropy" in type(lp2.grad_fn).__name__
    torch.testing.assert_close(lp2, lp, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------- chunked PyTorch


@pytest.mark.parametrize("N,H,V", [(5, 16, 123), (37, 40, 300), (64, 8, 1000)])
@pytest.mark.parametrize("bias,temperature,entropy", [(True, 1.0, True), (False, 0.7, True), (True, 1.3, False)])
def test_chunked_matches_reference_fp64(N, H, V, bias, temperature, entropy):
    h, w, b, t = make(N, H, V, bias=bias, seed=N + V)
    compare("chunked", h, w, b, t, temperature, entropy, tol=1e-12, chunk_size=7)


def test_chunked_fp32():
    h, w, b, t = make(37, 40, 300, dtype=torch.float32, scale=3.0)
    compare("chunked", h, w, b, t, 0.8, True, tol=1e-5, chunk_size=16)


# ---------------------------------------------------------------------------- Triton interpreter


def _case_triton(N, H, V, dtype, bias, temperature, entropy, tol, chunk_size):
    h, w, b, t = make(N, H, V, dtype=dtype, bias=bias, seed=N * V, scale=3.0)
    compare("triton", h, w, b, t, temperature, entropy, tol=tol, chunk_size=chunk_size)


@pytest.mark.parametrize("N,H,V", [(5, 16, 123), (37, 40, 300)])
@pytest.mark.parametrize("bias,temperature,entropy", [(True, 0.7, True), (False, 1.0, False)])
def test_triton_interpreter_fp64(interp, N, H, V, bias, temperature, entropy):
    interp(_case_triton, N, H, V, torch.float64, bias, temperature, entropy, 1e-12, 16)


def test_triton_interpreter_fp32(interp):
    interp(_case_triton, 37, 40, 300, torch.float32, True, 0.8, True, 1e-5, None)


def _case_online_merge(n_split):
    h, w, b, t = make(20, 16, 300)
    logp, ent, lse, ez = L._triton_forward(h, w, b, t, 0.9, True, L.IGNORE_INDEX, chunk=20, n_split=n_split)
    ref_lp, ref_ent = L.logprobs_entropy_reference(h, w, t, b, temperature=0.9)
    z = (h @ w.T + b) / 0.9
    assert rel_err(lse, z.logsumexp(-1)) < 1e-13
    assert rel_err(logp, ref_lp) < 1e-13 and rel_err(ent, ref_ent) < 1e-13


@pytest.mark.parametrize("n_split", [1, 3])
def test_triton_forward_online_merge(interp, n_split):
    """One program walking the whole vocabulary (n_split=1) and uneven slices give the same stats."""
    interp(_case_online_merge, n_split)


def _case_auto_uses_triton():
    h, w, b, t = make(8, 16, 40)
    h.requires_grad_(True)
    lp, _ = L.fused_logprobs_entropy(h, w, t, b)
    assert "LogprobsEntropy" in type(lp.grad_fn).__name__, type(lp.grad_fn).__name__


def test_auto_uses_triton_under_interpreter(interp):
    interp(_case_auto_uses_triton)


# ---------------------------------------------------------------------------- GPU (real shapes, bf16)


def _exact_reference(h, w, t, b, temperature):
    """fp32 logits from the bf16 values (no bf16 rounding of the logits): what the kernel computes."""
    hf = h.float().requires_grad_(True)
    wf = w.float().requires_grad_(True)
    lp, ent = L.logprobs_entropy_reference(hf, wf, t, None if b is None else b.float(), temperature)
    return lp, ent, hf, wf


@pytest.mark.parametrize("N,H,V", [(8192, 2048, 128256), (1000, 896, 151936)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@gpu
def test_gpu_triton_bf16_real_shapes(N, H, V, temperature):
    torch.manual_seed(0)
    dev = "cuda"
    h = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(V, H, device=dev) * (2.0 / math.sqrt(H))).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device=dev)
    t[: N // 4] = L.IGNORE_INDEX  # prompt tokens
    g_lp, g_ent = torch.randn(N, device=dev), torch.randn(N, device=dev)

    hk, wk = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = L.fused_logprobs_entropy(hk, wk, t, temperature=temperature, impl="triton")
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    assert lp.dtype == ent.dtype == torch.float32

    ref_lp, ref_ent, hf, wf = _exact_reference(h, w, t, None, temperature)
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()
    assert rel_err(lp, ref_lp) < 1e-4 and rel_err(ent, ref_ent) < 1e-4
    # dlogits are rounded to bf16 before the cuBLAS matmuls, as autograd would round them
    assert rel_err(hk.grad, hf.grad) < 2e-2
    assert rel_err(wk.grad, wf.grad) < 2e-2


@gpu
def test_gpu_triton_memory_stays_below_logits():
    """fwd+bwd at 8192 x 128256 must not allocate anything like the 4.2 GB fp32 logits."""
    N, H, V = 8192, 2048, 128256
    h = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, H, device="cuda") * 0.04).to(torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, V, (N,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = L.fused_logprobs_entropy(h, w, t, impl="triton")
    (lp.sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # grads of h and W (~0.56 GB) + one [chunk, V] bf16 dlogits buffer (256 MiB) + small stats
    assert extra < 1.5 * 2**30, f"{extra / 2**30:.2f} GiB above inputs"


@gpu
def test_gpu_chunked_and_fp32_triton():
    h, w, b, t = make(777, 256, 5003, dtype=torch.float32, device="cuda", scale=3.0)
    compare("triton", h, w, b, t, 0.9, True, tol=1e-5, chunk_size=300)
    compare("chunked", h, w, b, t, 0.9, True, tol=1e-5, chunk_size=300)
