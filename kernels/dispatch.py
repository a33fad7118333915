"""When to run a Triton kernel instead of the PyTorch path.

Rule: `use_triton(t)` = Triton importable AND not disabled AND (t is on CUDA OR Triton runs in its
CPU interpreter). Disable globally with `set_enabled(False)` / `with disabled():`, or by starting
the process with `KERNELS_DISABLE_TRITON=1`.

The interpreter (`TRITON_INTERPRET=1`, NumPy-based, slow: tests only) must be switched on before
triton is first imported: `triton.jit` and Triton's own library functions pick compiled or
interpreted when they are decorated, at import. `transformers` imports triton, so in a test session
set it at process start; tests/test_kernels_*.py run their interpreter cases in a child process
(kernels.testing.run_in_interpreter).
"""
import contextlib
import functools
import os

import torch

try:  # guarded so that `import kernels` needs only torch
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

    class tl:  # noqa: N801 - stands in for triton.language so `BLOCK: tl.constexpr` annotations evaluate
        constexpr = float64 = float32 = None

    def jit(fn):  # never launched: use_triton() is False and resolve_impl refuses "triton"
        return fn

_enabled = os.environ.get("KERNELS_DISABLE_TRITON", "0").lower() in ("", "0", "false", "no")


def set_enabled(flag: bool) -> None:
    """Globally allow (True) or forbid (False) the Triton paths chosen by `impl="auto"`."""
    global _enabled
    _enabled = bool(flag)


def is_enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def disabled():
    """`with kernels.disabled():` forces the PyTorch paths inside the block."""
    old = _enabled
    set_enabled(False)
    try:
        yield
    finally:
        set_enabled(old)


def triton_available() -> bool:
    return triton is not None


@functools.cache
def interpret_mode() -> bool:
    """True when Triton was imported with TRITON_INTERPRET=1, so kernels run on CPU tensors."""
    if triton is None:
        return False
    try:  # the state that matters: were Triton's own jit functions built for the interpreter?
        from triton.runtime.interpreter import InterpretedFunction

        return isinstance(tl.standard.zeros, InterpretedFunction)
    except (ImportError, AttributeError):  # layout of another Triton version: trust the variable
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when `impl="auto"` should launch the Triton kernel for these tensors."""
    if not (_enabled and triton is not None):
        return False
    return all(t.is_cuda for t in tensors) or interpret_mode()


def resolve_impl(impl: str, fallback: str, *tensors: torch.Tensor) -> str:
    """Map `impl="auto"` to "triton" or `fallback`; check that an explicit "triton" can run."""
    if impl == "auto":
        return "triton" if use_triton(*tensors) else fallback
    if impl == "triton":
        if triton is None:
            raise RuntimeError("impl='triton' but triton is not installed")
        if not (all(t.is_cuda for t in tensors) or interpret_mode()):
            raise RuntimeError("impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                               "triton is first imported (for CPU tensors)")
    return impl


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def num_warps_for(block: int) -> int:
    """Warps for a one-row-per-program kernel of `block` elements (Liger's rule of thumb)."""
    return 4 if block < 2048 else 8 if block < 8192 else 16
