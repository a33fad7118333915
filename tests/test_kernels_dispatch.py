"""kernels.dispatch: the use-Triton rule, the global switch, and `import kernels` without Triton."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kernels
from kernels import dispatch
from kernels.testing import run_in_interpreter

ROOT = Path(__file__).resolve().parents[1]
FAKE_CUDA = SimpleNamespace(is_cuda=True)  # use_triton only looks at .is_cuda


def run_python(code, **env):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_works_without_triton():
    """With triton unimportable every op runs its PyTorch path and impl='triton' says why not."""
    out = run_python("""
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch, kernels
        assert not kernels.triton_available() and not kernels.use_triton(torch.zeros(1))
        x, w = torch.randn(3, 8), torch.ones(8)
        assert torch.equal(kernels.rms_norm(x, w), kernels.rms_norm_reference(x, w))
        kernels.layer_norm(x, w)
        kernels.silu_mul(x, x)
        q = torch.randn(1, 2, 3, 8)
        kernels.apply_rotary(q, q, torch.ones(3, 8), torch.zeros(3, 8))
        lp, ent = kernels.fused_logprobs_entropy(x, torch.randn(11, 8), torch.tensor([1, -100, 3]))
        assert lp[1] == 0 and ent.shape == (3,)
        kernels.sample(torch.randn(2, 11), 0.8, 3, 0.9)
        try:
            kernels.rms_norm(x, w, impl="triton")
        except RuntimeError as e:
            print("refused:", e)
        """)
    assert "refused: impl='triton' but triton is not installed" in out


def test_env_var_disables_at_start():
    out = run_python("import kernels; print(kernels.is_enabled())", KERNELS_DISABLE_TRITON="1")
    assert out.strip() == "False"


def test_rule_and_switch():
    pytest.importorskip("triton")
    assert kernels.use_triton(FAKE_CUDA)
    with kernels.disabled():
        assert not kernels.is_enabled() and not kernels.use_triton(FAKE_CUDA)
        assert dispatch.resolve_impl("auto", "reference", FAKE_CUDA) == "reference"
    assert kernels.is_enabled() and dispatch.resolve_impl("auto", "reference", FAKE_CUDA) == "triton"
    kernels.set_enabled(False)
    try:
        assert not kernels.use_triton(FAKE_CUDA)
    finally:
        kernels.set_enabled(True)


def test_cpu_without_interpreter_uses_pytorch():
    if dispatch.interpret_mode():
        pytest.skip("this process was started with TRITON_INTERPRET=1")
    x = torch.randn(2, 4)
    assert not kernels.use_triton(x)
    assert dispatch.resolve_impl("auto", "reference", x) == "reference"
    if kernels.triton_available():
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            kernels.rms_norm(x, torch.ones(4), impl="triton")
    with pytest.raises(ValueError):
        kernels.rms_norm(x, torch.ones(4), impl="bogus")


def _case_interpreter_rule():
    x = torch.randn(2, 4)
    assert dispatch.interpret_mode() and kernels.use_triton(x)
    w = torch.ones(4, requires_grad=True)
    assert "_Norm" in type(kernels.rms_norm(x, w).grad_fn).__name__
    with kernels.disabled():
        assert "_Norm" not in type(kernels.rms_norm(x, w).grad_fn).__name__


def test_interpreter_counts_as_triton_device():
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    run_in_interpreter(_case_interpreter_rule)
