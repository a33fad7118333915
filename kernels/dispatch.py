"""When to run a Triton kernel, and the lazy `@jit` that lets `import kernels` work without Triton.

Rule: `use_triton(t)` = Triton importable AND not disabled AND (t is on CUDA OR TRITON_INTERPRET=1).
Otherwise every op runs its PyTorch path. Disable globally with `set_enabled(False)` or by
starting the process with `KERNELS_DISABLE_TRITON=1`.

`TRITON_INTERPRET=1` runs kernels in Triton's NumPy interpreter on CPU tensors (slow; tests only).
`triton.jit` decides compiled-vs-interpreted when it decorates, so our `@jit` decorates at first
launch and caches one object per mode: setting the variable in a test works whatever was
imported before, and a process can run both modes.
"""
import contextlib
import functools
import os

import torch

try:  # guarded so `import kernels` needs only torch; kernels are never launched without Triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    class tl:  # noqa: N801 - stands in for `triton.language` so `BLOCK: tl.constexpr` annotations evaluate
        constexpr = None

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


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when `impl="auto"` should launch the Triton kernel for these tensors."""
    if not (_enabled and triton_available()):
        return False
    return all(t.is_cuda for t in tensors) or interpret_mode()


def resolve_impl(impl: str, fallback: str, *tensors: torch.Tensor) -> str:
    """Map `impl="auto"` to "triton" or `fallback`; check an explicit "triton" can run at all."""
    if impl == "auto":
        return "triton" if use_triton(*tensors) else fallback
    if impl == "triton":
        if not triton_available():
            raise RuntimeError("impl='triton' but triton is not installed")
        if not (all(t.is_cuda for t in tensors) or interpret_mode()):
            raise RuntimeError("impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
    return impl


class jit:  # noqa: N801 - used as a decorator, like triton.jit
    """`triton.jit`, applied on first launch (once per interpret/compiled mode).

    Kernels decorated with it must not call other kernels: the compiled path resolves callees as
    `triton.jit` functions, and these wrappers are not. Launch as `kernel[grid](...)`.
    """

    def __init__(self, fn):
        self.fn = fn
        self._built = {}
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid):
        mode = interpret_mode()
        if mode not in self._built:
            import triton

            self._built[mode] = triton.jit(self.fn)
        return self._built[mode][grid]


def num_warps_for(block: int) -> int:
    """Warps for a one-row-per-program kernel of `block` elements (Liger's rule of thumb)."""
    return 4 if block < 2048 else 8 if block < 8192 else 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
