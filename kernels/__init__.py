"""Triton kernels with PyTorch references beside them (one file per op, Liger style).

Every public op takes `impl="auto"`: the Triton kernel when `use_triton(...)` holds (Triton
installed, tensors on CUDA or TRITON_INTERPRET=1, not disabled), else the PyTorch path. `impl` can
force "triton" or "reference" (and "chunked" for log-probs). Needs only torch: Triton is imported
too when it is installed (the import in dispatch.py is guarded), and without it every op takes the
PyTorch path.
"""
from .dispatch import disabled, is_enabled, set_enabled, triton_available, use_triton
from .logprobs import fused_logprobs_entropy, logprobs_entropy_reference
from .norms import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from .rotary import apply_rotary, apply_rotary_reference
from .sampling import keep_mask_reference, sample, sample_reference
from .swiglu import silu_mul, silu_mul_reference

__all__ = [
    "apply_rotary", "apply_rotary_reference", "disabled", "fused_logprobs_entropy", "is_enabled",
    "keep_mask_reference", "layer_norm", "layer_norm_reference", "logprobs_entropy_reference", "rms_norm",
    "rms_norm_reference", "sample", "sample_reference", "set_enabled", "silu_mul", "silu_mul_reference",
    "triton_available", "use_triton",
]
