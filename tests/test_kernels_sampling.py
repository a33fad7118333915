"""kernels.sampling: reference semantics (vs transformers' warpers, frequencies), Triton vs reference.

Two ways to pin the Triton kernel to the reference: the same uniform noise must give the same token,
and "reversed" noise (Gumbel scores decreasing in z) makes the draw return the *least* likely kept
token, which exposes the top-k / top-p threshold exactly.
"""
import math

import pytest
import torch

from conftest import gpu
from kernels import sampling as S


CONFIGS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 20, 1.0), (0.7, 0, 0.9), (1.3, 50, 0.8), (1.0, 1, 0.5)]


def spaced_logits(B, V, seed=0, span=3.3):
    """Rows of distinct, evenly spaced logits in random order (no near-ties)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.linspace(-span / 2, span / 2, V)
    return torch.stack([base[torch.randperm(V, generator=g)] for _ in range(B)])


def reversed_noise(z, a=1.5):
    """u with -log(-log u) = -a (z - max z): score z + g = (1 - a) z + const, largest for the smallest z."""
    z = z.double()
    return torch.exp(-torch.exp(a * (z - z.amax(-1, keepdim=True)))).float()


# ---------------------------------------------------------------------------- reference semantics


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (10, 1.0), (10, 0.8), (50, 0.95), (1, 0.5), (0, 0.3)])
def test_keep_mask_matches_transformers_warpers(top_k, top_p):
    lp = pytest.importorskip("transformers.generation.logits_process")
    z = torch.randn(6, 200, generator=torch.Generator().manual_seed(top_k)) * 2
    scores = z.clone()
    if top_k:
        scores = lp.TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = lp.TopPLogitsWarper(top_p)(None, scores)
    assert torch.equal(S.keep_mask_reference(z, top_k, top_p), scores.isfinite())


def test_reference_greedy_and_logprob():
    logits = torch.randn(5, 50)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # tie: first index wins
    tok, lp = S.sample_reference(logits, temperature=0)
    assert torch.equal(tok, logits.argmax(-1)) and tok[2] == 7
    torch.testing.assert_close(lp, logits.log_softmax(-1).gather(1, tok[:, None]).squeeze(1))


def test_reference_frequencies_follow_filtered_distribution():
    z = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    T, k, p, n = 0.8, 5, 0.9, 40000
    logits = z.expand(n, -1)
    gen = torch.Generator().manual_seed(0)
    tok, lp = S.sample_reference(logits, T, k, p, generator=gen)
    keep = S.keep_mask_reference((z / T)[None], k, p)[0]
    probs = torch.where(keep, (z / T).softmax(-1), 0.0)
    probs /= probs.sum()
    freq = torch.bincount(tok, minlength=8).double() / n
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 5 * sigma + 1e-12).all(), (freq, probs)
    assert keep.sum() == 4  # top-5 then top-p 0.9 drops one more; hand-checked
    # the log-prob of the distribution drawn from: filtered, renormalised (hand-checked against `probs`)
    torch.testing.assert_close(lp, probs.log()[tok].float())
    torch.testing.assert_close(lp, (z / T).masked_fill(~keep, float("-inf")).log_softmax(-1)[tok])


def test_reference_logprob_without_filters_is_the_temperature_scaled_one():
    z = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)) * 2
    tok, lp = S.sample_reference(z, 0.7, 0, 1.0, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(lp, (z / 0.7).log_softmax(-1).gather(1, tok[:, None]).squeeze(1))


def test_generator_makes_it_reproducible():
    logits = torch.randn(8, 100)
    a = S.sample(logits, 1.0, 0, 0.9, generator=torch.Generator().manual_seed(1))[0]
    b = S.sample(logits, 1.0, 0, 0.9, generator=torch.Generator().manual_seed(1))[0]
    c = S.sample(logits[:1].expand(64, 100), 1.0, 0, 0.9, generator=torch.Generator().manual_seed(2))[0]
    assert torch.equal(a, b) and len(set(c.tolist())) > 1


def test_top_p_out_of_range_raises():
    with pytest.raises(ValueError):
        S.sample(torch.randn(2, 5), top_p=0.0)


def test_reversed_noise_exposes_threshold():
    """Check the trick itself on the reference: the draw is the smallest kept logit."""
    z = spaced_logits(4, 300)
    for k, p in [(20, 1.0), (0, 0.9), (50, 0.8)]:
        tok, _ = S.sample_reference(z, 1.0, k, p, noise=reversed_noise(z))
        keep = S.keep_mask_reference(z, k, p)
        assert torch.equal(tok, torch.where(keep, z, math.inf).argmin(-1))
        if k and p == 1.0:
            assert (keep.sum(-1) == k).all()


# ---------------------------------------------------------------------------- Triton interpreter


def _case_same_noise(dtype, temperature, top_k, top_p):
    g = torch.Generator().manual_seed(int(temperature * 10) + top_k)
    logits = (torch.randn(4, 300, generator=g) * 3).to(dtype)
    noise = torch.rand(4, 300, generator=g)
    tok, lp = S.sample(logits, temperature, top_k, top_p, noise=noise, impl="triton")
    ref_tok, ref_lp = S.sample(logits, temperature, top_k, top_p, noise=noise, impl="reference")
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32
    assert torch.equal(tok, ref_tok), (tok, ref_tok)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("temperature,top_k,top_p", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_noise_same_token_interpreter(interp, dtype, temperature, top_k, top_p):
    interp(_case_same_noise, dtype, temperature, top_k, top_p)


def _case_threshold(top_k, top_p, V):
    z = spaced_logits(3, V, seed=V)
    tok, _ = S.sample(z, 1.0, top_k, top_p, noise=reversed_noise(z), impl="triton")
    expected = torch.where(S.keep_mask_reference(z, top_k, top_p), z, math.inf).argmin(-1)
    assert torch.equal(tok, expected), (tok, expected)


@pytest.mark.parametrize("top_k,top_p,V", [(20, 1.0, 300), (0, 0.9, 300), (50, 0.8, 123), (0, 0.5, 5)])
def test_threshold_matches_reference_interpreter(interp, top_k, top_p, V):
    interp(_case_threshold, top_k, top_p, V)


def _case_zero_noise():
    """torch.rand can return 0: that token must still be drawable (here it is the only one kept)."""
    logits = torch.randn(3, 300)
    noise = torch.rand(3, 300)
    noise[torch.arange(3), logits.argmax(-1)] = 0.0
    for impl in ("triton", "reference"):
        tok, _ = S.sample(logits, 1.0, 1, 1.0, noise=noise, impl=impl)
        assert torch.equal(tok, logits.argmax(-1)), impl


def test_zero_noise_interpreter(interp):
    interp(_case_zero_noise)


def _case_greedy_ties():
    logits = torch.randn(3, 300)
    logits[0, 5] = logits[0, 200] = 50.0  # across blocks: first wins
    logits[1, 130] = logits[1, 131] = 50.0  # within a block
    tok, _ = S.sample(logits, 0.0, impl="triton")
    assert tok[:2].tolist() == [5, 130] and tok[2] == logits[2].argmax()


def test_greedy_ties_interpreter(interp):
    interp(_case_greedy_ties)


# ---------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("temperature,top_k,top_p", CONFIGS)
def test_gpu_sampling_bf16_vocab_128k(temperature, top_k, top_p):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(64, 128256, device="cuda", generator=g) * 3).to(torch.bfloat16)
    noise = torch.rand(64, 128256, device="cuda", generator=g)
    S.sample(logits, temperature, top_k, top_p, noise=noise, impl="triton")  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside raises
    try:
        tok, lp = S.sample(logits, temperature, top_k, top_p, noise=noise, impl="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref_tok, ref_lp = S.sample(logits, temperature, top_k, top_p, noise=noise, impl="reference")
    keep = S.keep_mask_reference(logits.float() / (temperature or 1.0), top_k, top_p)
    # the GPU's log() differs from torch's in the last bits, which can flip a near-tie draw
    assert (tok == ref_tok).float().mean() >= 62 / 64
    assert keep.gather(1, tok[:, None]).all() or temperature == 0
    z = logits.float() / (temperature or 1.0)
    if temperature:  # the filtered, renormalised distribution the token was drawn from
        z = z.masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(lp, z.log_softmax(-1).gather(1, tok[:, None]).squeeze(1), rtol=1e-5, atol=1e-4)


@gpu
@pytest.mark.parametrize("top_k,top_p", [(50, 1.0), (0, 0.9), (1000, 0.8)])
def test_gpu_threshold_matches_reference(top_k, top_p):
    z = spaced_logits(8, 4096).cuda()
    tok, _ = S.sample(z, 1.0, top_k, top_p, noise=reversed_noise(z), impl="triton")
    expected = torch.where(S.keep_mask_reference(z, top_k, top_p), z, math.inf).argmin(-1)
    assert torch.equal(tok, expected)
