"""`engine.kernels=true`: the fused kernels of `kernels/` injected into transformers modules.

    names = inject_kernels(model)      # norms, SwiGLU, rotary; returns what was replaced
    model(input_ids=..., attention_mask=..., position_ids=...,
          logprob_targets=targets, logprob_start=P - 1, temperature=0.7, with_entropy=True)
        -> (logp [B, T], entropy [B, T] or None)   # no [B, T, vocab] logits

What is replaced, per instance (weights, parameter names and state dicts are untouched):
- RMSNorm modules (Llama family: a `weight` and `variance_epsilon`) -> `kernels.rms_norm`;
  `nn.LayerNorm` (OPT) -> `kernels.layer_norm`;
- gated MLPs (`gate_proj`, `up_proj`, `down_proj`, SiLU) -> `down(silu_mul(gate(x), up(x)))`;
- rotary: `apply_rotary_pos_emb` of the Llama/Mistral/Qwen2 modeling modules -> `kernels.apply_rotary`
  (a module-level function in transformers, so this one is process-wide; same meaning either way);
- causal LMs get the `logprob_targets` forward above: the backbone's last hidden states at columns
  [start, start + T) go through `kernels.fused_logprobs_entropy` with the output embedding, chunked
  over the vocabulary, forward and backward. Without `logprob_targets` the forward is the original.
Every op dispatches as `kernels/` does: Triton on CUDA, the PyTorch reference elsewhere, so on CPU
the results are the plain path's up to float rounding order.
"""
from __future__ import annotations

import functools
import importlib
import types
from typing import Any

import torch
from torch import nn

from .parallelize import hf_base_model

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
        bump("rotary")
    base = hf_base_model(model)
    if hasattr(base, "get_output_embeddings") and base.get_output_embeddings() is not None:
        fused_logprobs_forward(model)
        bump("fused_logprobs")
    return [f"{k} x{v}" for k, v in counts.items()]


def fused_logprobs_forward(model: nn.Module) -> nn.Module:
    """Give a causal LM (peft-wrapped or not) the `logprob_targets=` forward of the module doc."""
    if getattr(model, "_fused_logprobs", False):
        return model
    original = model.forward

    def forward(self, *args: Any, logprob_targets: torch.Tensor | None = None, logprob_start: int = 0,
                temperature: float = 1.0, with_entropy: bool = False, **kwargs: Any):
        if logprob_targets is None:
            return original(*args, **kwargs)
        from kernels import fused_logprobs_entropy

        base = hf_base_model(self)
        backbone = getattr(base, base.base_model_prefix)
        kwargs.pop("use_cache", None)
        hidden = backbone(*args, use_cache=False, **kwargs).last_hidden_state
        T = logprob_targets.shape[1]
        hidden = hidden[:, logprob_start : logprob_start + T]
        head = base.get_output_embeddings()
        logp, entropy = fused_logprobs_entropy(hidden, head.weight.to(hidden.dtype), logprob_targets, bias=head.bias,
                                               temperature=temperature, compute_entropy=with_entropy)
        # NOTE: the op returns its flat [B*T] results `.view`ed to [B, T]; FSDP2 warns when a module
        # returns a view (an in-place op on it would skip the pre-backward hook), so [B, T] copies leave.
        return logp.clone(), None if entropy is None else entropy.clone()

    model.forward = types.MethodType(forward, model)
    model._fused_logprobs = True
    return model


def _is_rms_norm(m: nn.Module) -> bool:
    return (type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), nn.Parameter)
            and m.weight.dim() == 1 and isinstance(getattr(m, "variance_epsilon", None), float)
            and not hasattr(m, "bias"))


def _is_swiglu(m: nn.Module) -> bool:
    act = getattr(m, "act_fn", None)
    return (all(isinstance(getattr(m, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
            and (isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")))


@functools.cache
def _patch_rotary() -> bool:
    """Point the Llama-family modeling modules' `apply_rotary_pos_emb` at the kernel (once)."""
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
            if args or kwargs or unsqueeze_dim != 1:
                return _original(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)
            return kernels.apply_rotary(q, k, cos, sin)

        mod.apply_rotary_pos_emb = rope
        patched = True
    return patched


def has_fused_logprobs(model: nn.Module) -> bool:
    """Whether `model` (or the module a DDP wrapper holds) takes `logprob_targets=` (see above)."""
    return bool(getattr(model, "_fused_logprobs", False) or getattr(getattr(model, "module", None), "_fused_logprobs", False))
