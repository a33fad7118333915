"""The per-token math of the inference model as small plain-PyTorch functions.

Each function is a swap point for a `kernels/` op (Triton on CUDA, this code as the reference
elsewhere); the numerics follow transformers exactly (e.g. RMSNorm in fp32, cast back before the
weight), so the CPU parity tests pin the references down. Shapes: B batch, S new tokens,
T cache slots attended, H / Hkv query / key-value heads, D head dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm. TODO(kernels): kernels.rms_norm (fused with the residual add before it)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """nn.LayerNorm (OPT). TODO(kernels): kernels.layer_norm (fused with the residual add)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rotary_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos, sin [B, S, D] for integer positions [B, S], as LlamaRotaryEmbedding.forward computes them
    (fp32 angles, cast to the activation dtype). Recomputed per forward: [B, S, D/2] is tiny, and it
    keeps no table sized by max_position_embeddings."""
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] rotated by cos/sin [B, S, D] (rotate-half convention of HF Llama checkpoints).
    TODO(kernels): kernels.rotary (q and k in one launch)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + _rotate_half(x) * sin


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from the fused [..., 2 * ffn] projection. TODO(kernels): kernels.swiglu."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


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
