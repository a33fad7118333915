"""`ModelArgs`: what the injected inference model needs from a Hugging Face config, read once.

The config is duck-typed (no transformers import: `engine/` depends on torch only). Both config
generations are read: transformers 5 keeps RoPE settings in `config.rope_parameters`
(`{"rope_type", "rope_theta", "factor", ...}`), transformers 4 in `config.rope_theta` plus an
optional `config.rope_scaling` dict (`"type"` or `"rope_type"`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
SUPPORTED_MODEL_TYPES = (*LLAMA_FAMILY, "opt")
ROPE_TYPES = ("default", "linear", "llama3")  # static inverse frequencies, no attention scaling
OPT_ACTIVATIONS = ("relu", "gelu")


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeArgs:
    rope_type: str  # one of ROPE_TYPES
    theta: float
    factor: float = 1.0  # linear, llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_positions: int = 8192  # llama3


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelArgs:
    arch: str  # "llama" (llama, mistral, qwen2) or "opt"
    model_type: str
    vocab_size: int
    dim: int  # hidden size: the residual stream
    embed_dim: int  # token embedding / LM head width (OPT's word_embed_proj_dim, else dim)
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    tie_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    activation: str  # "silu" (SwiGLU, llama family) or OPT's "relu" / "gelu"
    rope: RopeArgs | None = None  # llama family
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    # OPT only
    norm_before: bool = True  # do_layer_norm_before (pre-LN); False = post-LN (opt-350m)
    final_norm: bool = True
    norm_affine: bool = True
    max_positions: int = 0  # learned position table rows, without OPT's offset of 2

    @classmethod
    def from_hf_config(cls, config) -> ModelArgs:
        """Raises NotImplementedError (with the reason) for anything the injected model cannot run."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"model_type {model_type!r} has no injected implementation "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if model_type == "opt":
            return cls._from_opt(config)
        return cls._from_llama_family(config, model_type)

    @classmethod
    def _from_llama_family(cls, config, model_type: str) -> ModelArgs:
        if config.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} (only 'silu' / SwiGLU is injected)")
        n_heads = config.num_attention_heads
        n_kv_heads = getattr(config, "num_key_value_heads", None) or n_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        if model_type == "qwen2":  # q/k/v always biased, o_proj and the MLP never
            qkv_bias, o_bias, mlp_bias = True, False, False
        elif model_type == "mistral":
            qkv_bias = o_bias = mlp_bias = False
        else:
            qkv_bias = o_bias = bool(getattr(config, "attention_bias", False))
            mlp_bias = bool(getattr(config, "mlp_bias", False))
        return cls(
            arch="llama",
            model_type=model_type,
            vocab_size=config.vocab_size,
            dim=config.hidden_size,
            embed_dim=config.hidden_size,
            n_layers=config.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            ffn_dim=config.intermediate_size,
            norm_eps=config.rms_norm_eps,
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            activation="silu",
            rope=_rope_args(config),
            sliding_windows=_sliding_windows(config, model_type),
        )

    @classmethod
    def _from_opt(cls, config) -> ModelArgs:
        if config.activation_function not in OPT_ACTIVATIONS:
            raise NotImplementedError(
                f"OPT activation_function {config.activation_function!r} (injected: {', '.join(OPT_ACTIVATIONS)})"
            )
        dim, n_heads = config.hidden_size, config.num_attention_heads
        bias = bool(getattr(config, "enable_bias", True))
        return cls(
            arch="opt",
            model_type="opt",
            vocab_size=config.vocab_size,
            dim=dim,
            embed_dim=getattr(config, "word_embed_proj_dim", None) or dim,
            n_layers=config.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=n_heads,
            head_dim=dim // n_heads,
            ffn_dim=config.ffn_dim,
            norm_eps=1e-5,  # nn.LayerNorm's default, which OPT uses
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bias,
            activation=config.activation_function,
            sliding_windows=(None,) * config.num_hidden_layers,
            norm_before=bool(config.do_layer_norm_before),
            final_norm=bool(config.do_layer_norm_before) and not getattr(config, "_remove_final_layer_norm", False),
            norm_affine=bool(getattr(config, "layer_norm_elementwise_affine", True)),
            max_positions=config.max_position_embeddings,
        )


def supports(config) -> tuple[bool, str]:
    """(True, "") when the injected model can run `config`; else (False, one-line reason)."""
    try:
        ModelArgs.from_hf_config(config)
    except NotImplementedError as e:
        return False, str(e)
    except AttributeError as e:  # a config lacking a field its model_type should have
        return False, f"config is missing a field the injected model reads: {e}"
    return True, ""


# ---------------------------------------------------------------- rotary


def _rope_args(config) -> RopeArgs:
    params = getattr(config, "rope_parameters", None)  # transformers 5
    if params is None:  # transformers 4: rope_theta + optional rope_scaling
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if any(isinstance(v, dict) for v in params.values()):
        raise NotImplementedError("per-layer-type rope_parameters are not injected")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise NotImplementedError(f"rope type {rope_type!r} (injected: {', '.join(ROPE_TYPES)})")
    prf = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if prf not in (None, 1.0):
        raise NotImplementedError(f"partial_rotary_factor {prf} (only full rotary is injected)")
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    if rope_type == "default":
        return RopeArgs(rope_type="default", theta=theta)
    if rope_type == "linear":
        return RopeArgs(rope_type="linear", theta=theta, factor=float(params["factor"]))
    return RopeArgs(
        rope_type="llama3",
        theta=theta,
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_positions=int(
            params.get("original_max_position_embeddings")
            or getattr(config, "original_max_position_embeddings", None)
            or config.max_position_embeddings
        ),
    )


def rope_inv_freq(rope: RopeArgs, head_dim: int, device=None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, computed as transformers' ROPE_INIT_FUNCTIONS do."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
        old_len = rope.original_max_positions
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def _sliding_windows(config, model_type: str) -> tuple[int | None, ...]:
    """Per-layer window as transformers applies it: Mistral on every layer when `sliding_window` is
    set; Qwen2 on the layers whose `layer_types` entry is "sliding_attention"."""
    n, window = config.num_hidden_layers, getattr(config, "sliding_window", None)
    if model_type == "mistral":
        return (window,) * n
    if model_type == "qwen2":
        types = getattr(config, "layer_types", None) or ["full_attention"] * n
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (None,) * n
