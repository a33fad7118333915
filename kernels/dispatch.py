"""When to run a Triton kernel instead of the PyTorch path.

Rule: `use_triton(t)` = Triton importable AND not disabled AND (t is on CUDA OR Triton runs in its
CPU interpreter). Disable globally with `set_enabled(False)` / `with disabled():`, or by starting
the process with `KERNELS_DISABLE_TRITON=1`.

Self-check on first use: an op called with `impl="auto"` that resolves to Triton goes through
`guarded`: the first call in the process also runs a small slice of its inputs (a few rows) through
the kernel and the PyTorch reference and compares them (`kernels.testing.mismatch`, the tolerances
that `python -m rlhf.env --check` uses). A mismatch beyond tolerance, or any exception, logs ONE
warning line (op, value, tolerance) and that op takes its reference path for the rest of the process.
On by default for CUDA tensors; `set_selfcheck(True | False | None)` forces it on / off / back to
auto (the engine sets it from `engine.selfcheck`). Only forward outputs are compared. A call made
while a CUDA graph is being captured is not checked (the comparison reads values on the host).

The interpreter (`TRITON_INTERPRET=1`, NumPy-based, slow: tests only) must be switched on before
triton is first imported: `triton.jit` and Triton's own library functions pick compiled or
interpreted when they are decorated, at import. `transformers` imports triton, so in a test session
set it at process start; tests/test_kernels_*.py run their interpreter cases in a child process
(kernels.testing.run_in_interpreter).
"""
import contextlib
import functools
import logging
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


# ----------------------------------------------------------------------------- self-check on first use

logger = logging.getLogger("kernels")
_selfcheck: bool | None = None  # None = auto: check when the inputs are on CUDA
_verdicts: dict[str, str | None] = {}  # op -> None (trusted) or why it fell back to its reference


def set_selfcheck(flag: bool | None) -> None:
    """True / False: check every op's first Triton call on any device / never; None: on CUDA only."""
    global _selfcheck
    _selfcheck = flag


def selfcheck_verdicts() -> dict[str, str | None]:
    """{op: None if its kernel matched its reference on first use, else the reason it fell back}."""
    return dict(_verdicts)


def reset_selfcheck() -> None:
    """Forget every verdict: the next call of each op is checked again (tests; a new run in-process)."""
    _verdicts.clear()


def head(t: torch.Tensor | None, n: int = 4) -> torch.Tensor | None:
    """The first `n` rows of `t` over its flattened leading dims (the probe of a row-wise op)."""
    return None if t is None else t.reshape(-1, t.shape[-1])[:n]


def guarded(op: str, fast, reference, args: tuple, probe: tuple, dtype: torch.dtype, names: tuple[str, ...] = ()):
    """`fast(*args)` (the Triton path), trusted after its first call matched `reference` on `probe`.

    `probe`: a small slice of `args` (e.g. `head` rows), compared under no_grad; `names`: the outputs'
    names for the message. A failed op returns `reference(*args)` from then on."""
    if op not in _verdicts:
        tensors = [t for t in probe if isinstance(t, torch.Tensor)]
        on = _selfcheck if _selfcheck is not None else all(t.is_cuda for t in tensors)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if not on or capturing:
            return fast(*args)
        _verdicts[op] = _check(op, fast, reference, probe, dtype, names)
    return reference(*args) if _verdicts[op] is not None else fast(*args)


def _check(op: str, fast, reference, probe: tuple, dtype: torch.dtype, names: tuple[str, ...]) -> str | None:
    from .testing import mismatch

    with torch.no_grad():
        want = reference(*probe)
        try:
            why = mismatch(fast(*probe), want, dtype, names)
        except Exception as e:  # noqa: BLE001 - any failure of the fast path means: do not use it
            why = f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if why is not None:
        logger.warning("kernels: the Triton %s disagrees with its PyTorch reference on first use (%s); using the "
                       "reference for the rest of the run", op, why)
    return why


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def num_warps_for(block: int) -> int:
    """Warps for a one-row-per-program kernel of `block` elements (Liger's rule of thumb)."""
    return 4 if block < 2048 else 8 if block < 8192 else 16
