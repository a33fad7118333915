"""Helpers for comparing an op with its reference (tests/test_kernels_*.py, benchmarks, the first-use
self-check in dispatch.py and `python -m rlhf.env --check`, which share `mismatch` and its tolerances)."""
import atexit
import os
import pickle
import sys

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are zero)."""
    out, ref = out.detach().double(), ref.detach().double()
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


# ||out - ref|| / ||ref|| allowed per dtype of the op's inputs: bf16/fp16 kernels round once where the
# references round per op (a few ulps apart); fp32 kernels differ in summation order only.
TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def mismatch(out, ref, dtype: torch.dtype, names: tuple[str, ...] = ()) -> str | None:
    """Why `out` is not `ref` (tensors, or tuples of tensors / None), or None when it matches.

    Floating outputs: relative error (`rel_err`) within TOLERANCES[dtype], `dtype` being the op's input
    dtype (a bf16 op's fp32 log-probs get the bf16 tolerance). Integer outputs (sampled tokens): equal.
    The message names the output, the value and the tolerance.
    """
    outs, refs = (out, ref) if isinstance(out, (tuple, list)) else ((out,), (ref,))
    tol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    for i, (o, r) in enumerate(zip(outs, refs)):
        name = names[i] if i < len(names) else f"output {i}"
        if o is None or r is None:
            if (o is None) != (r is None):
                return f"{name}: {'missing' if o is None else 'unexpected'}"
            continue
        if o.shape != r.shape:
            return f"{name}: shape {tuple(o.shape)}, reference {tuple(r.shape)}"
        if not r.is_floating_point():
            diff = (o != r).nonzero()
            if len(diff):
                at = tuple(diff[0].tolist())
                return (f"{name}: {len(diff)} of {r.numel()} values differ (first at {at}: {o[at].item()} vs "
                        f"reference {r[at].item()}; tolerance: exact)")
            continue
        if not torch.isfinite(o).all() and torch.isfinite(r).all():
            return f"{name}: non-finite values where the reference has none"
        err = rel_err(o, r)
        if not err <= tol:
            return f"{name}: relative error {err:.2e} > tolerance {tol:.0e} ({str(dtype).replace('torch.', '')})"
    return None


def outputs_and_grads(fn, inputs, grad_outputs=None, seed=0):
    """Run fn(*inputs) on fresh leaf copies; return (outputs, grads of every float input).

    The loss is sum(out * g) with g random (seeded, same for every call with the same seed), so
    each output's gradient path is exercised with non-uniform weights. Outputs that are None are
    skipped.
    """
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
              for x in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    outs = [o for o in outs if o is not None]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if grad_outputs is None:
        grad_outputs = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype) for o in outs]
    loss = sum((o * g).sum() for o, g in zip(outs, grad_outputs))
    params = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [o.detach() for o in outs], [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


# ----------------------------------------------------------------------------- interpreter worker
# Triton's interpreter must be on before triton is first imported, and in a pytest session
# something (transformers, another test module) has usually imported it already. So interpreter
# cases run in one child Python started with TRITON_INTERPRET=1, fed (file, function, args) over a
# pipe; each test still passes, fails or skips on its own.

_WORKER = r"""
import importlib.util, os, pickle, sys, traceback
out = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)  # the cases' prints go to stderr; stdout carries only results
inp = sys.stdin.buffer
sys.path[:0] = pickle.load(inp)
while True:
    try:
        path, module, name, args = pickle.load(inp)
    except EOFError:
        break
    try:
        if module not in sys.modules:
            spec = importlib.util.spec_from_file_location(module, path)
            sys.modules[module] = mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        getattr(sys.modules[module], name)(*args)
        res = ("ok", "")
    except BaseException as e:  # pytest.skip raises a BaseException
        res = ("skip", str(e)) if type(e).__name__ == "Skipped" else ("fail", traceback.format_exc())
    pickle.dump(res, out)
    out.flush()
"""

_worker = None


def _start_worker():
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}  # keep CPU use modest
    proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    pickle.dump(sys.path, proc.stdin)
    proc.stdin.flush()
    atexit.register(lambda: proc.poll() is None and (proc.stdin.close(), proc.wait(timeout=30)))
    return proc


def run_in_interpreter(fn, *args):
    """Call module-level `fn(*args)` in the interpreter child; re-raise its failure or skip here."""
    import pytest

    global _worker
    if _worker is None or _worker.poll() is not None:
        _worker = _start_worker()
    module = sys.modules[fn.__module__]
    try:
        pickle.dump((module.__file__, fn.__module__, fn.__qualname__, args), _worker.stdin)
        _worker.stdin.flush()
        kind, msg = pickle.load(_worker.stdout)
    except (EOFError, BrokenPipeError):
        _worker = None
        pytest.fail("interpreter worker died (see captured stderr)", pytrace=False)
    if kind == "skip":
        pytest.skip(msg)
    if kind == "fail":
        pytest.fail(f"in the TRITON_INTERPRET=1 child:\n{msg}", pytrace=False)
