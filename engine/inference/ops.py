"""The per-token math of the inference model as small functions over `kernels/` ops.

Norms (with the residual add fused), rotary (q and k in one launch) and SwiGLU go to `kernels/`:
Triton on CUDA, checked against its reference on first use (kernels.dispatch.guarded), and the
PyTorch reference elsewhere, whose numerics follow transformers (e.g. RMSNorm in fp32, cast back
before the weight), so the CPU parity tests pin them down. Shapes: B batch, S new tokens,
T cache slots attended, H / Hkv query / key-value heads, D head dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """LlamaRMSNorm (kernels.rms_norm): y, or with `residual` the fused add before it, (norm(x + residual),
    x + residual), the sum rounded to x's dtype as the model's `residual + hidden_states` is."""
    return kernels.rms_norm(x, weight, eps, residual=residual)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
               residual: torch.Tensor | None = None):
    """nn.LayerNorm (OPT; kernels.layer_norm): y, or (norm(x + residual), x + residual)."""
    if weight is None:  # elementwise_affine=False: no kernel needed
        s = x if residual is None else x + residual
        y = F.layer_norm(s, (s.shape[-1],), None, bias, eps)
        return y if residual is None else (y, s)
    return kernels.layer_norm(x, weight, bias, eps, residual=residual)


def rotary_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos, sin [B, S, D] for integer positions [B, S], as LlamaRotaryEmbedding.forward computes them
    (fp32 angles, cast to the activation dtype). Recomputed per forward: [B, S, D/2] is tiny, and it
    keeps no table sized by max_position_embeddings."""
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [B, H, S, D] and k [B, Hkv, S, D] (strided views are fine) rotated by cos/sin [B, S, D] in one
    call (kernels.apply_rotary, rotate-half convention of HF Llama checkpoints)."""
    return kernels.apply_rotary(q, k, cos, sin)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from the fused [..., 2 * ffn] projection (kernels.silu_mul on its two halves)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return kernels.silu_mul(gate, up)


def activation(x: torch.Tensor, name: str) -> torch.Tensor:
    """OPT's MLP activation ("relu" or exact "gelu", as transformers' ACT2FN)."""
    return F.relu(x) if name == "relu" else F.gelu(x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, H, S, D] over cached k, v [B, Hkv, T, D] with a boolean keep-mask [B, 1, S, T].

    Prefill and decode both come here. On GPU, prefill is where a flash path would go (varlen over
    the unpadded prompts) and decode where kernels' decode attention reads only the live slots; SDPA
    with an explicit mask is the reference for both. Grouped-query heads are expanded by SDPA itself.
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
