"""`engine.kernels=true`: the fused kernels of `kernels/` injected into one model's modules.

    names = inject_kernels(model)      # norms, SwiGLU, rotary; returns what was replaced

What is replaced, per instance (weights, parameter names and state dicts are untouched; other
models in the process keep the plain transformers code):
- RMSNorm modules (Llama family: a `weight` and `variance_epsilon`) -> `kernels.rms_norm`;
  `nn.LayerNorm` (OPT) -> `kernels.layer_norm`;
- gated MLPs (`gate_proj`, `up_proj`, `down_proj`, SiLU) -> `down(silu_mul(gate(x), up(x)))`;
- rotary: the attention modules of the Llama/Mistral/Qwen2 modeling code call the module-level
  `apply_rotary_pos_emb`; that name points (once, process-wide) at a dispatcher that runs
  `kernels.apply_rotary` only while an injected attention module's forward is running (also in
  an activation-checkpointing recompute, which re-enters the module), and the original otherwise.
Log-probs and entropy from hidden states (no [B, T, vocab] logits) are not an injection: the
policy role computes them (rlhf/modeling/roles.py). Every op dispatches as `kernels/` does: Triton on
CUDA, the PyTorch reference elsewhere, so on CPU the results are the plain path's up to float
rounding order.
"""
from __future__ import annotations

import functools
import importlib
import threading
import types

from torch import nn


ROTARY_MODULES = ("llama", "mistral", "qwen2")


def inject_kernels(model: nn.Module) -> list[str]:
    """Replace supported submodule forwards in place; returns the kinds replaced (with counts)."""
    import kernels

    counts: dict[str, int] = {}

    def bump(kind: str) -> None:
        counts[kind] = counts.get(kind, 0) + 1

    for module in model.modules():
        if getattr(module, "_kernels_injected", False):
            continue
        if _is_rms_norm(module):
            module.forward = types.MethodType(lambda self, x: kernels.rms_norm(x, self.weight, self.variance_epsilon), module)
        elif isinstance(module, nn.LayerNorm) and len(module.normalized_shape) == 1:
            module.forward = types.MethodType(
                lambda self, x: kernels.layer_norm(x, self.weight, self.bias, self.eps), module)
        elif _is_swiglu(module):
            module.forward = types.MethodType(
                lambda self, x: self.down_proj(kernels.silu_mul(self.gate_proj(x), self.up_proj(x))), module)
        else:
            continue
        module._kernels_injected = True
        bump(type(module).__name__)
    if _patch_rotary():
        for module in model.modules():
            if _uses_patched_rotary(module) and not getattr(module, "_rotary_kernel", False):
                _run_with_rotary_kernel(module)
                bump("rotary")
    return [f"{k} x{v}" for k, v in counts.items()]


def _is_rms_norm(m: nn.Module) -> bool:
    return (type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), nn.Parameter)
            and m.weight.dim() == 1 and isinstance(getattr(m, "variance_epsilon", None), float)
            and not hasattr(m, "bias"))


def _is_swiglu(m: nn.Module) -> bool:
    act = getattr(m, "act_fn", None)
    return (all(isinstance(getattr(m, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
            and (isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")))


_rotary_depth = threading.local()  # > 0 while an injected attention module runs (this thread)


def _uses_patched_rotary(m: nn.Module) -> bool:
    """An attention module of a modeling file whose `apply_rotary_pos_emb` `_patch_rotary` replaced."""
    mod = type(m).__module__
    return (any(mod == f"transformers.models.{n}.modeling_{n}" for n in ROTARY_MODULES)
            and type(m).__name__.endswith("Attention"))


def _run_with_rotary_kernel(module: nn.Module) -> None:
    """Make the dispatcher pick the kernel for calls made inside this module's forward."""
    forward = module.forward

    def run(self, *args, **kwargs):
        _rotary_depth.n = getattr(_rotary_depth, "n", 0) + 1
        try:
            return forward(*args, **kwargs)
        finally:
            _rotary_depth.n -= 1

    module.forward = types.MethodType(run, module)
    module._rotary_kernel = True


@functools.cache
def _patch_rotary() -> bool:
    """Point the Llama-family modeling modules' `apply_rotary_pos_emb` at a dispatcher (once): the
    kernel inside injected attention modules, the original everywhere else."""
    import kernels

    patched = False
    for name in ROTARY_MODULES:
        try:
            mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:
            continue
        original = getattr(mod, "apply_rotary_pos_emb", None)
        if original is None:
            continue

        def rope(q, k, cos, sin, *args, _original=original, unsqueeze_dim: int = 1, **kwargs):
            if args or kwargs or unsqueeze_dim != 1 or not getattr(_rotary_depth, "n", 0):
                return _original(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
            return kernels.apply_rotary(q, k, cos, sin)

        mod.apply_rotary_pos_emb = rope
        patched = True
    return patched
