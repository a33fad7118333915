"""The fast paths checked on first use (engine.selfcheck), on CPU: a kernel or an injected decoder
made to return wrong values, or to raise, falls back to its reference for the rest of the run with
exactly one warning naming what differed; a correct one is kept.

The kernels' Triton paths cannot run on CPU without the interpreter, so `use_triton` is forced true
and each op's Triton entry point is replaced by its reference plus a perturbation (or an exception).
"""
from __future__ import annotations

import logging

import pytest
import torch

from engine import EngineConfig, validate_engine_config
from engine.config import selfcheck_enabled
from engine.generation import SamplingParams, hf_generate
import kernels
from kernels import dispatch, logprobs, norms, rotary, sampling, swiglu
from test_generation_mode import EOS, PAD, engine_for, prompts, tiny

G = torch.Generator().manual_seed(0)
X, W, B = torch.randn(6, 16, generator=G), torch.randn(16, generator=G), torch.randn(16, generator=G)
Q, K, COS, SIN = (torch.randn(2, 4, 5, 8, generator=G), torch.randn(2, 2, 5, 8, generator=G),
                  torch.randn(5, 8, generator=G), torch.randn(5, 8, generator=G))
Z, U = torch.randn(6, 30, generator=G), torch.rand(6, 30, generator=G)
H, V_W, T = torch.randn(7, 16, generator=G), torch.randn(30, 16, generator=G), torch.randint(0, 30, (7,), generator=G)


def plus_one(out):
    return tuple(plus_one(o) for o in out) if isinstance(out, tuple) else None if out is None else out + 1


def _logprobs_apply(h, w, b, t, temperature, entropy, ignore, impl, chunk, _orig=logprobs._LogprobsEntropy.apply):
    if impl != "triton":  # the chunked PyTorch path is the op's fallback: keep it real
        return _orig(h, w, b, t, temperature, entropy, ignore, impl, chunk)
    lp, ent = logprobs.logprobs_entropy_reference(h, w, t, b, temperature, True, ignore)
    return lp + 1, ent


# op: (the call with impl="auto", the reference's result, (object, attribute) of its Triton entry, a
# perturbed stand-in for that entry)
CASES = {
    "rms_norm": (lambda: kernels.rms_norm(X, W), lambda: kernels.rms_norm_reference(X, W),
                 (norms._Norm, "apply"), lambda x, w, b, r, eps, rms: plus_one(norms.rms_norm_reference(x, w, eps, r))),
    "layer_norm": (lambda: kernels.layer_norm(X, W, B), lambda: kernels.layer_norm_reference(X, W, B),
                   (norms._Norm, "apply"),
                   lambda x, w, b, r, eps, rms: plus_one(norms.layer_norm_reference(x, w, b, eps, r))),
    "silu_mul": (lambda: kernels.silu_mul(X, X * 2), lambda: kernels.silu_mul_reference(X, X * 2),
                 (swiglu._SwiGLU, "apply"), lambda g, u: plus_one(swiglu.silu_mul_reference(g, u))),
    "apply_rotary": (lambda: kernels.apply_rotary(Q, K, COS, SIN), lambda: kernels.apply_rotary_reference(Q, K, COS, SIN),
                     (rotary._Rotary, "apply"), lambda q, k, c, s: plus_one(rotary.apply_rotary_reference(q, k, c, s))),
    "sample": (lambda: kernels.sample(Z, 0.8, 5, 0.9, noise=U), lambda: kernels.sample_reference(Z, 0.8, 5, 0.9, U),
               (sampling, "_sample_triton"), lambda z, t, k, p, u: plus_one(sampling.sample_reference(z, t, k, p, u))),
    "fused_logprobs_entropy": (lambda: kernels.fused_logprobs_entropy(H, V_W, T),
                               lambda: kernels.logprobs_entropy_reference(H, V_W, T),
                               (logprobs._LogprobsEntropy, "apply"), _logprobs_apply),
}


@pytest.fixture
def forced_triton(monkeypatch):
    """`impl="auto"` resolves to Triton on CPU tensors; the self-check forced on; verdicts fresh."""
    monkeypatch.setattr(dispatch, "use_triton", lambda *tensors: True)
    dispatch.reset_selfcheck()
    dispatch.set_selfcheck(True)
    yield
    dispatch.reset_selfcheck()
    dispatch.set_selfcheck(None)


def warnings_of(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name and r.levelno == logging.WARNING]


def same(a, b) -> bool:
    a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
    return all((x is None and y is None) or torch.allclose(x, y, rtol=1e-6, atol=1e-6) and x.dtype == y.dtype
               for x, y in zip(a, b))


@pytest.mark.parametrize("op", list(CASES))
def test_wrong_kernel_falls_back_with_one_warning(op, forced_triton, monkeypatch, caplog):
    call, reference, (owner, attr), broken = CASES[op]
    monkeypatch.setattr(owner, attr, broken)
    caplog.set_level(logging.WARNING, logger="kernels")
    for _ in range(3):  # the first call is checked; later ones take the reference without a new check
        assert same(call(), reference())
    (msg,) = warnings_of(caplog, "kernels")
    assert f"the Triton {op} disagrees" in msg and "tolerance" in msg
    assert ("tolerance: exact" in msg) if op == "sample" else ("relative error" in msg and "> tolerance 1e-05" in msg)
    assert dispatch.selfcheck_verdicts()[op] in msg


@pytest.mark.parametrize("op", list(CASES))
def test_raising_kernel_falls_back(op, forced_triton, monkeypatch, caplog):
    call, reference, (owner, attr), broken = CASES[op]
    original = getattr(owner, attr)

    def boom(*args):
        if op == "fused_logprobs_entropy" and args[7] != "triton":
            return original(*args)
        raise RuntimeError("boom")

    monkeypatch.setattr(owner, attr, boom)
    caplog.set_level(logging.WARNING, logger="kernels")
    assert same(call(), reference()) and same(call(), reference())
    (msg,) = warnings_of(caplog, "kernels")
    assert f"the Triton {op} disagrees" in msg and "raised RuntimeError: boom" in msg


def test_correct_kernel_is_kept_and_check_off_trusts_it(forced_triton, monkeypatch, caplog):
    calls = []

    def exact(x, w, b, r, eps, rms):
        calls.append(x.shape[0])
        return norms.rms_norm_reference(x, w, eps, r)

    monkeypatch.setattr(norms._Norm, "apply", exact)
    caplog.set_level(logging.WARNING, logger="kernels")
    kernels.rms_norm(X, W)
    kernels.rms_norm(X, W)
    assert calls == [4, 6, 6] and dispatch.selfcheck_verdicts() == {"rms_norm": None}  # probe: 4 rows, once
    assert warnings_of(caplog, "kernels") == []
    dispatch.reset_selfcheck()
    dispatch.set_selfcheck(False)  # off: a wrong kernel is used as it is (what the check protects against)
    monkeypatch.setattr(norms._Norm, "apply", CASES["rms_norm"][3])
    assert torch.equal(kernels.rms_norm(X, W), kernels.rms_norm_reference(X, W) + 1)
    assert dispatch.selfcheck_verdicts() == {}


def test_selfcheck_config():
    assert selfcheck_enabled(EngineConfig(), "cuda") and not selfcheck_enabled(EngineConfig(), "cpu")
    assert selfcheck_enabled(EngineConfig(selfcheck="True"), "cpu")  # a YAML boolean in the string field
    assert not selfcheck_enabled(EngineConfig(selfcheck="false"), "cuda")
    from engine import init_distributed

    with pytest.raises(ValueError, match="engine.selfcheck must be one of"):
        validate_engine_config(EngineConfig(selfcheck="sometimes"), init_distributed())


# ----------------------------------------------------------------------------- the injected decoder

GREEDY = SamplingParams(max_new_tokens=6, greedy=True)


def _generate(engine):
    ids, mask = prompts()
    with engine.generation() as gen:
        out = gen.generate(ids, mask, GREEDY, eos_token_id=EOS, pad_token_id=PAD, return_logprobs=True)
    with engine.gathered_parameters():
        want = hf_generate(engine.unwrapped, ids, mask, GREEDY, eos_token_id=EOS, pad_token_id=PAD,
                           return_logprobs=True)
    return gen.name, out, want


@pytest.mark.parametrize("fault", ["wrong", "raises"])
def test_broken_decoder_falls_back_to_transformers(fault, monkeypatch, caplog):
    from engine.inference.model import InferenceModel

    forward = InferenceModel.forward

    def broken(self, *args, **kwargs):
        if fault == "raises":
            raise RuntimeError("decoder boom")
        logits = forward(self, *args, **kwargs)
        return logits + torch.arange(logits.shape[-1], dtype=logits.dtype) * 0.5  # favours high ids

    monkeypatch.setattr(InferenceModel, "forward", broken)
    caplog.set_level(logging.WARNING, logger="engine.train_engine")
    engine = engine_for(tiny(), generation="injected", selfcheck="true")
    for _ in range(2):  # the fallback holds for later generation phases, without a second check
        name, out, want = _generate(engine)
        assert name == "hf" and engine.generation_path == "hf"
        assert torch.equal(out.sequences, want.sequences) and torch.equal(out.logprobs, want.logprobs)
    (msg,) = warnings_of(caplog, "engine.train_engine")
    assert "the injected decoder disagrees with transformers on first use" in msg
    if fault == "wrong":
        assert "transformers' choice" in msg and "log-prob gap" in msg and "> tolerance 1e-05" in msg
    else:
        assert "raised RuntimeError: decoder boom" in msg


def test_correct_decoder_is_kept(caplog):
    caplog.set_level(logging.WARNING, logger="engine.train_engine")
    engine = engine_for(tiny(), generation="injected", selfcheck="true")
    name, out, want = _generate(engine)
    assert name == "injected" and torch.equal(out.sequences, want.sequences)
    torch.testing.assert_close(out.logprobs, want.logprobs, rtol=1e-4, atol=1e-5)
    assert warnings_of(caplog, "engine.train_engine") == []
